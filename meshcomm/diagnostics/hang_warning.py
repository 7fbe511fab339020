"""The early hang warning: a collective still waiting after ``MESHCOMM_HANG_WARN`` seconds.

With the default timeout (300 s) a stuck job would print nothing for five minutes. So a
daemon thread per rank (started by ``meshcomm.init()`` in a world of more than one rank)
looks, every few seconds, at the oldest call in flight of each of the rank's groups (their
ledgers, :mod:`meshcomm.diagnostics.ledger`); once one has waited ``MESHCOMM_HANG_WARN`` seconds
(default 30; 0 turns the warning off) it prints, to stderr, what the timeout's verdict would
say now (:mod:`meshcomm.diagnostics.hang_verdict`: which rank is behind and where, or that the
ranks are in
different calls) and when the call will fail, naming ``MESHCOMM_TIMEOUT``. The call goes
on waiting. Printed once per job when the world has a store (the first rank to warn takes
the job's one turn through it, so meshrun shows one warning, not one per rank), else once
per rank.

Nothing runs per collective: the thread sleeps between looks (a quarter of the warning
time, at most 5 s), and reads only the ledgers' heads when it wakes.

Example:
    >>> warn_after({"MESHCOMM_HANG_WARN": "2.5"}), warn_after({"MESHCOMM_HANG_WARN": "0"})
    (2.5, 0.0)
    >>> warn_after({})
    30.0
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from meshcomm.diagnostics import hang_verdict as _verdict
from meshcomm.diagnostics import position as _heads
from meshcomm.errors import InvalidArgument, MeshCommError

if TYPE_CHECKING:
    from meshcomm.diagnostics.group_view import GroupView
    from meshcomm.store.base import Store

__all__ = ["HANG_WARN_ENV", "HangWarning", "warn_after"]

#: Seconds a collective waits before the warning is printed (0: never).
HANG_WARN_ENV = "MESHCOMM_HANG_WARN"

_DEFAULT = 30.0
_MAX_LOOK = 5.0
_MIN_LOOK = 0.1
# The job's one turn to warn, in the world's store view.
_TURN_KEY = "meshcomm/hang_warning"


def warn_after(env: Mapping[str, str]) -> float:
    """Seconds from ``MESHCOMM_HANG_WARN`` (default 30; 0 or less: off).

    Raises:
        InvalidArgument: the value is not a number.
    """
    raw = env.get(HANG_WARN_ENV, "").strip()
    if not raw:
        return _DEFAULT
    try:
        seconds = float(raw)
    except ValueError:
        raise InvalidArgument(
            f"{HANG_WARN_ENV}={raw!r} is not a number of seconds (0 turns the warning off)"
        ) from None
    if not math.isfinite(seconds) or seconds <= 0:
        return 0.0
    return seconds


class HangWarning:
    """The thread of one rank (see the module docstring); :meth:`start` makes it."""

    def __init__(self, world: GroupView, store: Store | None, after: float) -> None:
        self._world = world
        self._store = store
        self._after = after
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name=f"meshcomm-hang-warning-{world.rank}", daemon=True
        )

    @classmethod
    def start(cls, world: GroupView, store: Store | None, after: float) -> HangWarning | None:
        """Start watching ``world`` and its groups, warning after ``after`` seconds
        (:func:`warn_after`); None when the warning is off, the world has one rank, or its
        timeout comes first."""
        if after <= 0 or world.size == 1 or after >= world.timeout:
            return None
        watcher = cls(world, store, after)
        watcher._thread.start()
        return watcher

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread and join it (it may be printing a warning: bounded)."""
        self._stop.set()
        self._thread.join(timeout)

    def _watch(self) -> None:
        look = min(_MAX_LOOK, max(_MIN_LOOK, self._after / 4))
        while not self._stop.wait(look):
            found = self._stuck()
            if found is not None:
                group, now = found
                if self._my_turn():
                    self._warn(group, now)
                return  # once per rank; the job's other ranks left it to the first

    def _stuck(self) -> tuple[GroupView, dict[str, Any]] | None:
        for group in _heads.groups_of(self._world):
            if group.closed:
                continue
            now = group._book.head()["now"]
            if now is not None and now["for"] >= self._after:
                return group, now
        return None

    def _my_turn(self) -> bool:
        if self._store is None:
            return True
        try:
            return self._store.add(_TURN_KEY, 1) == 1
        except (MeshCommError, OSError):
            return True  # the store is gone: say what this rank knows

    def _warn(self, group: GroupView, now: dict[str, Any]) -> None:
        me = group.ranks[group.rank]
        call = f"{now['name']} #{now['seq']} {group.label} (called at {now['site']})"
        text = (
            f"meshcomm: warning: rank {me} has waited {now['for']:.0f} s in {call}; it "
            f"fails after {group.timeout:g} s (MESHCOMM_TIMEOUT, or timeout= at init; "
            f"this warning: {HANG_WARN_ENV}, 0 turns it off)"
        )
        store = group.store
        if store is not None and group.size > 1:
            verdict = ""
            with contextlib.suppress(MeshCommError, OSError):
                verdict = _verdict.report(
                    store,
                    group.name,
                    group.ranks,
                    me,
                    now["name"],
                    now["seq"],
                    now["site"],
                    _verdict.grace_seconds(group.timeout),
                    group.label,
                    now.get("args"),
                )
            if verdict:
                text += f"\n  so far: {verdict}"
        with contextlib.suppress(OSError, ValueError):  # a closed stderr: nothing to tell
            print(text, file=sys.stderr, flush=True)
