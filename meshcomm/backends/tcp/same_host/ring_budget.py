"""The process's budget for shared-memory rings: many groups cannot multiply memory unbounded.

Every tcp transport (the world's, and one per sub-group) makes an inbound ring for each
same-host peer it talks to (``MESHCOMM_SHM_BYTES``, 4 MiB by default). The rings of one
process together may hold at most ``MESHCOMM_SHM_BUDGET`` bytes (default 512 MiB: the world
of a 64-rank host plus a few mesh axes). A pair whose ring would pass the budget is not
offered shared memory and uses its socket instead (``Transport.shm_fallbacks`` says why);
closing a group gives its rings' bytes back.

Example:
    >>> budget = RingBudget(10)
    >>> budget.reserve(6), budget.reserve(6), budget.in_use
    (True, False, 6)
    >>> budget.release(6); budget.in_use
    0
"""

from __future__ import annotations

import os
import threading

from meshcomm.errors import InvalidArgument

__all__ = ["BUDGET_ENV", "DEFAULT_BUDGET", "RingBudget", "budget_bytes", "rings"]

#: The environment variable that sets the budget, in bytes.
BUDGET_ENV = "MESHCOMM_SHM_BUDGET"
#: The budget when ``MESHCOMM_SHM_BUDGET`` is unset.
DEFAULT_BUDGET = 512 << 20


def budget_bytes() -> int:
    """``MESHCOMM_SHM_BUDGET`` in bytes, else :data:`DEFAULT_BUDGET`.

    Raises:
        InvalidArgument: the value is not a non-negative integer (0: no rings at all).

    Example:
        >>> budget_bytes() > 0
        True
    """
    raw = os.environ.get(BUDGET_ENV, "").strip()
    if not raw:
        return DEFAULT_BUDGET
    if not raw.isdigit():
        raise InvalidArgument(
            f"{BUDGET_ENV} must be a non-negative integer number of bytes, got {raw!r}"
        )
    return int(raw)


class RingBudget:
    """Bytes of rings this process may hold; thread-safe (transports of several groups).

    Args:
        limit: the budget in bytes; None reads :func:`budget_bytes` at each reservation.
    """

    def __init__(self, limit: int | None = None) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self.in_use = 0

    @property
    def limit(self) -> int:
        """The budget in bytes."""
        return budget_bytes() if self._limit is None else self._limit

    def reserve(self, nbytes: int) -> bool:
        """Take ``nbytes`` of the budget; False (and nothing taken) if they do not fit."""
        limit = self.limit
        with self._lock:
            if self.in_use + nbytes > limit:
                return False
            self.in_use += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """Give back bytes taken with :meth:`reserve`."""
        with self._lock:
            self.in_use = max(0, self.in_use - nbytes)


#: The budget every ring of this process is charged to.
rings = RingBudget()
