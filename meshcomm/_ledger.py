"""The collective ledger: every group remembers its last collectives, always.

Each :class:`~meshcomm.group.ProcessGroup` keeps a ring of its last ``MESHCOMM_LEDGER``
collectives (default 2048; 0 turns it off): sequence number, operation, dtype, shape, the
caller's ``file:line`` outside meshcomm, when it was issued and when it ended (or that it is
still in flight, or failed). ``group.ledger()`` returns them; the hang report a rank prints on
``SIGUSR1`` starts from them. Memory is bounded by the ring (about 200 bytes a record, 400
KiB a group at the default); a record costs about 0.7 us per call (docs/benchmarks.md).

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

__all__ = ["DEFAULT_LENGTH", "LEDGER_ENV", "Entry", "Ledger", "ledger_length"]

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
# costs a fraction of an instance. Its slots:
_SEQ, _OP, _DTYPE, _SHAPE, _FILE, _LINE, _ISSUED, _ENDED, _FAILED = range(9)
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep

#: One ledger record (see :meth:`Ledger.records` for what it holds).
Entry = list


class Ledger:
    """A group's ring of its last collectives.

    Args:
        length: how many it keeps (0: none; :meth:`add` then returns None).
    """

    def __init__(self, length: int) -> None:
        self._ring: collections.deque[Entry] = collections.deque(maxlen=max(0, length))
        self.enabled = length > 0

    def add(self, seq: int, op: str, dtype: Any, shape: Any) -> Entry | None:
        """Record a collective as issued now, called from the innermost frame outside
        meshcomm; None when the ledger is off.

        Called by the group layer only: the two frames above this one are meshcomm's (the
        group's issue and its public method), so the search for the caller starts above.
        """
        if not self.enabled:
            return None
        try:
            frame: Any = sys._getframe(3)
        except ValueError:  # a shallower caller than the group layer (a doctest, a test)
            frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
            frame = frame.f_back
        where = ("?", 0) if frame is None else (frame.f_code.co_filename, frame.f_lineno)
        entry = [seq, op, dtype, shape, where[0], where[1], time.monotonic(), None, False]
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

    def records(self) -> list[dict[str, Any]]:
        """The records, oldest first, as plain dicts (``state``: done, failed, in flight;
        ``seconds``: how long it took, or has been in flight)."""
        now = time.monotonic()
        out = []
        for e in list(self._ring):
            ended = e[_ENDED]
            state = "in flight" if ended is None else ("failed" if e[_FAILED] else "done")
            out.append(
                {
                    "seq": e[_SEQ],
                    "op": e[_OP],
                    "dtype": None if e[_DTYPE] is None else np.dtype(e[_DTYPE]).name,
                    "shape": None if e[_SHAPE] is None else tuple(e[_SHAPE]),
                    "site": f"{os.path.basename(e[_FILE])}:{e[_LINE]}",
                    "state": state,
                    "seconds": (now if ended is None else ended) - e[_ISSUED],
                }
            )
        return out

    def __len__(self) -> int:
        return len(self._ring)
