"""Parked requests: a GET / WAIT / MULTI_GET on a missing key waits here for the key or for
its deadline.

Each :class:`~meshcomm.store._conn.Waiter` is filed under one of its missing keys; a write
to that key re-files it under the next missing one, or hands it back to be answered
(:meth:`Waiters.notify`).
Deadlines sit in a heap; an answered waiter stays there (stale) until its deadline, and the
heap is rebuilt when stale entries dominate. What parked requests cost is counted in the
server's :class:`~meshcomm.store._budget.MemoryBudget`.

Example:
    >>> import math, socket
    >>> from meshcomm.store._budget import MemoryBudget
    >>> from meshcomm.store._conn import Conn, Waiter
    >>> a, b = socket.socketpair()
    >>> budget = MemoryBudget(2**20)
    >>> waiters = Waiters(budget)
    >>> waiters.park(Waiter(Conn(a, "peer"), 7, 2, [b"k"], b"k", math.inf))
    >>> budget.parked  # the overhead of a waiter, and of its one key
    385
    >>> answered = []
    >>> waiters.notify(b"k", lambda keys: [], answered.append)
    >>> [w.rid for w in answered], budget.parked
    ([7], 0)
    >>> a.close(); b.close()
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
from collections.abc import Callable

from meshcomm.store._budget import MemoryBudget
from meshcomm.store._conn import Waiter

__all__ = ["Waiters"]


class Waiters:
    """Every parked request of one server, by key and by deadline.

    Args:
        budget: the server's budget; parked requests are counted in its ``parked``.
    """

    __slots__ = ("_budget", "_by_key", "_deadlines", "_seq", "_stale")

    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget
        self._by_key: dict[bytes, list[Waiter]] = {}
        # (deadline, sequence, waiter): the sequence keeps equal deadlines in parking order.
        self._deadlines: list[tuple[float, int, Waiter]] = []
        self._stale = 0
        self._seq = itertools.count()

    def __bool__(self) -> bool:
        """Whether any request is filed under a key."""
        return bool(self._by_key)

    @property
    def next_deadline(self) -> float | None:
        """The earliest deadline in the heap (perhaps a stale one), or None."""
        return self._deadlines[0][0] if self._deadlines else None

    def park(self, waiter: Waiter) -> None:
        """File ``waiter`` under its key, on its connection, and by its deadline (if any)."""
        self._budget.parked += waiter.cost
        self._by_key.setdefault(waiter.key, []).append(waiter)
        waiter.conn.parked.add(waiter)
        if waiter.deadline != math.inf:  # no deadline: never in the heap, nor in select()
            heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), waiter))

    def notify(
        self,
        key: bytes,
        missing: Callable[[list[bytes]], list[bytes]],
        answer: Callable[[Waiter], None],
    ) -> None:
        """``key`` now exists: re-file the requests parked under it, or ``answer`` them.

        Args:
            key: the key just written.
            missing: the keys of a list that are still missing.
            answer: called for each waiter whose keys all exist, once it is withdrawn; it
                may drop a connection (and so unpark that connection's other waiters).
        """
        waiters = self._by_key.pop(key, None)
        if not waiters:
            return
        for waiter in waiters:
            if waiter.done:
                continue
            still = missing(waiter.keys)
            if still:
                waiter.key = still[0]
                self._by_key.setdefault(waiter.key, []).append(waiter)
                continue
            waiter.done = True
            if waiter.deadline != math.inf:  # only waiters with a deadline sit in the heap
                self._stale += 1
            self._budget.parked -= waiter.cost
            waiter.conn.parked.discard(waiter)
            answer(waiter)
        self.compact()

    def unpark(self, waiter: Waiter, stale: bool) -> None:
        """Withdraw a waiter (timed out, or its connection dropped)."""
        waiter.done = True
        self._budget.parked -= waiter.cost
        if stale and waiter.deadline != math.inf:
            self._stale += 1
        waiter.conn.parked.discard(waiter)
        filed = self._by_key.get(waiter.key)
        if filed is not None:
            with contextlib.suppress(ValueError):  # filed under a list being notified right now
                filed.remove(waiter)
            if not filed:
                del self._by_key[waiter.key]

    def expire(self, now: float, timed_out: Callable[[Waiter], None]) -> None:
        """Withdraw every waiter whose deadline is at or before ``now``, then ``timed_out`` it."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            waiter = heapq.heappop(deadlines)[2]
            if waiter.done:
                self._stale -= 1
                continue
            self.unpark(waiter, stale=False)
            timed_out(waiter)

    def compact(self) -> None:
        """Rebuild the heap when answered waiters (left until their deadline) dominate it."""
        if self._stale > 1024 and self._stale * 2 > len(self._deadlines):
            self._deadlines = [entry for entry in self._deadlines if not entry[2].done]
            heapq.heapify(self._deadlines)
            self._stale = 0
