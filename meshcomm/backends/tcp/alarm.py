"""The world's alarm: a mismatch seen on any group stops every group of every rank.

A rooted collective (broadcast, reduce, gather, scatter) has no barrier: a root, or a leaf
that only sends, returns as soon as its frames are out, before any receiver compares their
stamps. The rank that does compare raises in the call and publishes the mismatch (the
group's abort record, :mod:`~meshcomm.backends.tcp.faults`); the ranks that returned learn of
it through this alarm, at their next call on *any* group of the world, not only on the group
where the ranks disagreed. Each rank raises a mismatch once (then the calls of other
groups work again, as after a mismatch seen in the call).

One :class:`WorldAlarm` per process and world, shared by the world's transport and the
transports of its sub-groups. The rank that publishes a mismatch first :meth:`announces
<WorldAlarm.announce>` it to every other rank through the job's store: one request to each
rank's responder (:mod:`meshcomm.diagnostics.responder`), the daemon thread that answers hang
verdicts,
which :meth:`sounds <WorldAlarm.sound>` the alarm of its world. The next call of that rank
raises the mismatch in its first line (one attribute read while all is well), and a call
already waiting raises it within its next abort check (about a second).

Example:
    >>> from meshcomm.store import HashStore
    >>> alarm = WorldAlarm(HashStore(), rank=0, size=1)
    >>> alarm.check()  # nothing seen: nothing to raise
    >>> alarm.sound("meshcomm/group/1/", "ranks disagree on the collective on group 'world': ...")
    >>> alarm.check()
    Traceback (most recent call last):
    ...
    meshcomm.errors.MismatchError: ranks disagree on the collective on group 'world': ...
    >>> alarm.check()  # raised once: the caller knows
"""

from __future__ import annotations

import contextlib
import json

from meshcomm.errors import MeshCommError, MismatchError
from meshcomm.store.base import Store

__all__ = ["ALARM_KEY", "ALARM_REQUEST", "MAX_REASON", "WorldAlarm", "parse_request"]

#: The world's mismatches in the job's store, one JSON line ``[group, words]`` each, appended
#: before the announcements, so a rank that sees the announcer leave finds them there.
ALARM_KEY = "meshcomm/tcp/alarm"

#: What an announcement's request to a responder starts with (the words follow).
ALARM_REQUEST = b"mismatch\n"
#: The longest words an announcement carries (the words of two calls fit many times over).
MAX_REASON = 8192
# Bounds on what a rank keeps (a job that keeps catching mismatches cannot grow them).
_MAX_OWED = 64
_MAX_RAISED = 1024
_MAX_GROUP = 256


class WorldAlarm:
    """The mismatches this rank owes its caller, if any (see the module docstring).

    Each rank raises a group's mismatch once: in the call where it saw it, or, when it
    returned before anyone compared (a root), in its next call on any group. A group is
    named by its transport's key prefix in the store (the same on every rank); a group whose
    mismatch this rank raised already (:meth:`raised`) is owed no more.

    Args:
        store: the job's store (where the responders' requests go); None: no announcements.
        rank: this process's world rank.
        size: the world size.

    Attributes:
        reason: the words of the oldest mismatch still to raise here, or None.
    """

    def __init__(self, store: Store | None, rank: int, size: int) -> None:
        self.reason: str | None = None
        self._owed: dict[str, str] = {}  # group -> words, oldest first
        self._raised: set[str] = set()
        self._announced = 0
        self._store = store
        self._rank = rank
        self._size = size

    def sound(self, group: str, reason: str) -> None:
        """Owe ``group``'s mismatch ``reason``: a later :meth:`check` raises it, unless this
        rank raised that group's mismatch already."""
        if group in self._raised or group in self._owed or len(self._owed) >= _MAX_OWED:
            return
        self._owed[group] = reason[:MAX_REASON]
        self.reason = next(iter(self._owed.values()))

    def raised(self, group: str) -> None:
        """This rank raised ``group``'s mismatch: it owes it no more."""
        if len(self._raised) < _MAX_RAISED:
            self._raised.add(group)
        if self._owed.pop(group, None) is not None:
            self.reason = next(iter(self._owed.values()), None)

    def check(self) -> None:
        """Raise the oldest mismatch this rank owes, once.

        Raises:
            MismatchError: the words of the mismatch, the same on every rank.
        """
        if self.reason is not None:
            group, words = next(iter(self._owed.items()))
            self.raised(group)
            raise MismatchError(words)

    def announce(self, group: str, reason: str) -> None:
        """Write ``reason``, ``group``'s mismatch, in the store (:data:`ALARM_KEY`) and
        announce it to every other rank of the world (through their responders); this rank
        raises it in its call. A store that does not answer ends the announcement quietly:
        the ranks then learn of the mismatch at their next call on the group, or at their
        timeout."""
        self.raised(group)
        if self._store is None or self._size < 2:
            return
        from meshcomm.store import mailbox  # the responders' request keys; on failure only

        group = group[:_MAX_GROUP]
        words = reason[:MAX_REASON]
        request = ALARM_REQUEST + group.encode() + b"\n" + words.encode()
        with contextlib.suppress(MeshCommError, OSError):
            if self._announced < _MAX_OWED:  # the log stays small whatever a job does
                self._announced += 1
                self._store.append(ALARM_KEY, json.dumps([group, words]).encode() + b"\n")
            for peer in range(self._size):
                if peer != self._rank:
                    mailbox.ask(self._store, peer, request)

    def recall(self) -> str | None:
        """The oldest mismatch this rank owes, asking the store when it has heard of none
        (the failure path: a peer left, maybe after it announced one that has not reached
        this rank's responder yet); None if there is none."""
        if self.reason is None and self._store is not None:
            with contextlib.suppress(MeshCommError, OSError):
                if self._store.check([ALARM_KEY]):
                    for group, words in _parse_log(bytes(self._store.get(ALARM_KEY))):
                        self.sound(group, words)
        return self.reason


def _parse_log(raw: bytes) -> list[tuple[str, str]]:
    """The ``[group, words]`` entries of the store's log (malformed lines skipped)."""
    entries = []
    for line in raw[: 4 * _MAX_OWED * MAX_REASON].splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
            entries.append((value[0][:_MAX_GROUP], value[1][:MAX_REASON]))
    return entries


def parse_request(request: bytes) -> tuple[str, str] | None:
    r"""The group and the words of an announcement's request (any bytes: None if it is not
    one).

    Example:
        >>> parse_request(ALARM_REQUEST + b"meshcomm/group/1/\nranks disagree ...")
        ('meshcomm/group/1/', 'ranks disagree ...')
        >>> parse_request(b"?") is None
        True
    """
    if not request.startswith(ALARM_REQUEST):
        return None
    group, sep, words = request[len(ALARM_REQUEST) :].partition(b"\n")
    if not sep or len(group) > _MAX_GROUP:
        return None
    return group.decode(errors="replace"), words[:MAX_REASON].decode(errors="replace")
