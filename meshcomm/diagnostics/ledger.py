"""The collective ledger: every group remembers its last collectives, always.

Each :class:`~meshcomm.group.ProcessGroup` keeps a ring of its last ``MESHCOMM_LEDGER``
collectives (default 2048; 0 turns it off): sequence number, operation, dtype, shape, reduce
op or root (whichever the operation has), the caller's ``file:line`` outside meshcomm, the
name the user called it by (``psum`` through :mod:`meshcomm.ops`), when it was issued and
when it ended (or that it is still in flight, or failed). ``group.ledger()`` returns them;
the hang report a rank prints on ``SIGUSR1`` starts from them. Memory is bounded by the ring
(about 200 bytes a record, 400 KiB a group at the default); a record costs about 0.7 us per
call (docs/benchmarks.md).

Example:
    >>> book = Ledger(2)
    >>> first = book.add(1, "all_reduce", None, (4,))
    >>> book.end(first, failed=False)
    >>> _ = book.add(2, "all_gather", None, (4,))
    >>> [(r["seq"], r["op"], r["state"]) for r in book.records()]
    [(1, 'all_reduce', 'done'), (2, 'all_gather', 'in flight')]
"""

from __future__ import annotations

import collections
import os
import sys
import time
from typing import Any

import numpy as np

from meshcomm.errors import InvalidArgument

__all__ = [
    "DEFAULT_LENGTH",
    "ENDED",
    "LEDGER_ENV",
    "PACKAGE",
    "Entry",
    "Ledger",
    "ledger_length",
    "named",
    "arguments",
    "record",
]

#: The environment variable that sets how many collectives a group remembers.
LEDGER_ENV = "MESHCOMM_LEDGER"
#: Collectives a group remembers when ``MESHCOMM_LEDGER`` is unset.
DEFAULT_LENGTH = 2048


def ledger_length() -> int:
    """``MESHCOMM_LEDGER`` (0: off), else :data:`DEFAULT_LENGTH`.

    Raises:
        InvalidArgument: not a non-negative integer.
    """
    raw = os.environ.get(LEDGER_ENV, "").strip()
    if not raw:
        return DEFAULT_LENGTH
    if not raw.isdigit():
        raise InvalidArgument(f"{LEDGER_ENV} must be a non-negative integer, got {raw!r}")
    return int(raw)


# A record is a list, not an object: it is made on every collective, and a list literal
# costs a fraction of an instance. Its slots (the caller's site is its code object and the
# offset of its call instruction: the line number is looked up only when a report shows it,
# since ``frame.f_lineno`` walks the line table on every call):
_SEQ, _OP, _DTYPE, _SHAPE, _CODE, _LASTI, _ISSUED, _ENDED, _FAILED, _API, _EXTRA = range(11)
#: The slot of a record's end time (:meth:`Ledger.end`), for the issuer's inline path.
ENDED = _ENDED
# Operations whose record's extra is a root (the others': a reduce op), when it is not the
# general path's fingerprint fields (a dict with both).
#: meshcomm's own folder: frames of files under it are the library's, not the caller's.
PACKAGE = _PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_OPS = os.path.join(_PACKAGE, "ops") + os.sep
# How far back head() looks for the last completed collective (async ones may still run).
_HEAD_SCAN = 64


def _name(entry: Entry) -> str:
    """The collective in the user's words: the public ``meshcomm.ops`` function the user
    called (``psum``), else the group method (``all_reduce``)."""
    api = entry[_API]
    if api is not None and api.co_filename.startswith(_OPS) and not api.co_name.startswith("_"):
        return str(api.co_name)
    return str(entry[_OP])


def _line(code: Any, lasti: int) -> int:
    """The source line of instruction offset ``lasti`` in ``code`` (``frame.f_lineno``'s
    answer, found when asked)."""
    for start, end, line in code.co_lines():
        if start <= lasti < end:
            return line or 0
    return 0


def _site(entry: Entry) -> str:
    code = entry[_CODE]
    if code is None:
        return "?:0"
    return f"{os.path.basename(code.co_filename)}:{_line(code, entry[_LASTI])}"


def named(entry: Entry) -> tuple[str, str]:
    """A record's collective in the user's words (``psum``) and its ``file:line``."""
    return _name(entry), _site(entry)


#: One ledger record (see :meth:`Ledger.records` for what it holds).
Entry = list


def _extra(entry: Entry) -> tuple[Any, Any, bool]:
    """A record's reduce op (its name), root and device flag."""
    extra = entry[_EXTRA] or {}
    reduce, root = extra.get("reduce"), extra.get("root")
    device = bool(extra.get("device", False))
    if reduce is not None:
        reduce = str(getattr(reduce, "value", reduce)).lower()
    return reduce, root, device


#: A group call's own arguments that its words show, by collective: (field, name shown).
_ARG_NAMES = {
    "all_gather": (("axis", "axis"), ("tiled", "tiled")),
    "reduce_scatter": (("axis", "axis"), ("tiled", "tiled")),
    "all_to_all": (("axis", "split_axis"), ("axis2", "concat_axis"), ("tiled", "tiled")),
    "permute": (("args", "perm"),),
}


def _args(entry: Entry) -> dict[str, str]:
    """A record's other arguments in words, by name (``{"tiled": "True"}``): the ops layer's
    (``uargs``: the user's, where a pytree was packed into one buffer), else the group's."""
    extra = entry[_EXTRA]
    if not extra:
        return {}
    uargs = extra.get("uargs")
    if uargs is not None:
        return {str(k): str(v) for k, v in uargs}
    out = {}
    for field, shown in _ARG_NAMES.get(entry[_OP], ()):
        value = extra.get(field)
        if value is not None:
            out[shown] = _word(value)
    return out


def _word(value: Any) -> str:
    """A field's value as the user would write it (a perm as a list of pairs)."""
    if isinstance(value, tuple) and all(isinstance(v, tuple) for v in value):
        return repr(list(value))
    return repr(value)


def arguments(entry: Entry) -> str:
    """A record's arguments in words: ``float32[4], sum``, ``int64[2, 3], root=1`` ("" if
    it has none: a barrier); a pytree's structure in place of the buffer it was packed into."""
    reduce, root, device = _extra(entry)
    parts = []
    tree = (entry[_EXTRA] or {}).get("tree")
    if tree is not None:
        parts.append(str(tree))
    elif entry[_DTYPE] is not None:
        dims = "" if entry[_SHAPE] is None else ", ".join(str(int(d)) for d in entry[_SHAPE])
        parts.append(f"{np.dtype(entry[_DTYPE]).name}[{dims}]")
    if reduce is not None:
        parts.append(reduce)
    if root is not None and root != -1:
        parts.append(f"root={root}")
    parts.extend(f"{k}={v}" for k, v in _args(entry).items())
    if device:
        parts.append("on a GPU")
    return ", ".join(parts)


def record(entry: Entry, now: float) -> dict[str, Any]:
    """One record as a plain dict (see :meth:`Ledger.records`)."""
    ended = entry[_ENDED]
    state = "in flight" if ended is None else ("failed" if entry[_FAILED] else "done")
    reduce, root, device = _extra(entry)
    extra = entry[_EXTRA] or {}
    return {
        "seq": entry[_SEQ],
        "op": entry[_OP],
        "name": _name(entry),
        "dtype": None if entry[_DTYPE] is None else np.dtype(entry[_DTYPE]).name,
        "shape": None if entry[_SHAPE] is None else tuple(int(d) for d in entry[_SHAPE]),
        "reduce": reduce,
        "root": root,
        "device": device,
        "args": _args(entry),
        "over": extra.get("over"),
        "tree": extra.get("tree"),
        "site": _site(entry),
        "state": state,
        "seconds": (now if ended is None else ended) - entry[_ISSUED],
    }


class Ledger:
    """A group's ring of its last collectives.

    Args:
        length: how many it keeps (0: none; :meth:`add` then returns None).
    """

    def __init__(self, length: int) -> None:
        self._ring: collections.deque[Entry] = collections.deque(maxlen=max(0, length))
        self.enabled = length > 0
        #: The records (None when the ledger is off), for the issuer's inline path, which
        #: appends what :meth:`add` would, written out (a call's frame is a tenth of it).
        self.ring = self._ring if self.enabled else None

    def add(
        self, seq: int, op: str, dtype: Any, shape: Any, extra: dict[str, Any] | None = None
    ) -> Entry | None:
        """Record a collective as issued now, called from the innermost frame outside
        meshcomm; None when the ledger is off.

        ``extra``: the call's fingerprint fields (a dict: ``reduce``, ``root``,
        ``device``...; a plan's call gives its plan's fields).

        Called by the group layer only: the two frames above this one are meshcomm's (the
        group's issue and its public method), so the search for the caller starts above.
        """
        if not self.enabled:
            return None
        try:
            frame: Any = sys._getframe(3)
        except ValueError:  # a shallower caller than the group layer (a doctest, a test)
            frame = sys._getframe(1)
        api = None  # the outermost meshcomm frame: the API the user called (psum)
        while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
            api = frame
            frame = frame.f_back
        if frame is None:
            site, lasti = None, 0
        else:
            site, lasti = frame.f_code, frame.f_lasti
        entry = [
            seq, op, dtype, shape, site, lasti, time.monotonic(), None, False,
            None if api is None else api.f_code, extra,
        ]  # fmt: skip
        self._ring.append(entry)
        return entry

    @staticmethod
    def end(entry: Entry | None, failed: bool) -> None:
        """Mark ``entry`` ended now (``failed``: with an error)."""
        if entry is not None:
            entry[_ENDED] = time.monotonic()
            entry[_FAILED] = failed

    def last(self) -> Entry | None:
        """The most recent record, or None."""
        return self._ring[-1] if self._ring else None

    def head(self) -> dict[str, Any]:
        """Where this group is now, safe to call from another thread: ``seq`` (the last
        issued), ``done`` (the last completed collective: ``name``, ``seq``, ``site``, or
        None), ``now`` (the oldest one still in flight, with ``for``: seconds, or None) and
        ``issued`` (``time.monotonic()`` of the last call, or None). ``now`` also has
        ``args``: its arguments in words (:func:`arguments`)."""
        for _ in range(3):
            try:
                tail = list(self._ring)[-_HEAD_SCAN:]
                break
            except RuntimeError:  # appended to meanwhile (another thread's collective)
                continue
        else:
            tail = []
        now = time.monotonic()
        done = flying = None
        for e in reversed(tail):
            if e[_ENDED] is None:
                flying = e
            elif not e[_FAILED] and done is None:
                done = e
                break
        head: dict[str, Any] = {
            "seq": tail[-1][_SEQ] if tail else 0,
            "done": None,
            "now": None,
            "issued": tail[-1][_ISSUED] if tail else None,
        }
        if done is not None:
            head["done"] = {"name": _name(done), "seq": done[_SEQ], "site": _site(done)}
        if flying is not None:
            head["now"] = {
                "name": _name(flying),
                "seq": flying[_SEQ],
                "site": _site(flying),
                "for": now - flying[_ISSUED],
                "args": arguments(flying),
            }
        return head

    def records(self) -> list[dict[str, Any]]:
        """The records, oldest first, as plain dicts (``state``: done, failed, in flight;
        ``seconds``: how long it took, or has been in flight; ``reduce``: the reduce op's
        name and ``root``: the root, each None where the operation has none; ``device``:
        whether the array was on a GPU; ``args``: its other arguments in words, by name;
        ``over``: the mesh axes named through ``meshcomm.ops``; ``tree``: the pytree the
        user passed, where it was packed into one buffer; each None where not known)."""
        now = time.monotonic()
        return [record(e, now) for e in list(self._ring)]

    def find(self, seq: int) -> dict[str, Any] | None:
        """The record of call ``seq`` (as :meth:`records` gives it), or None if it is not
        in the ring (safe to call from another thread)."""
        for _ in range(3):
            try:
                ring = list(self._ring)
                break
            except RuntimeError:  # appended to meanwhile (another thread's collective)
                continue
        else:
            return None
        for e in reversed(ring):
            if e[_SEQ] == seq:
                return record(e, time.monotonic())
        return None

    def __len__(self) -> int:
        return len(self._ring)
