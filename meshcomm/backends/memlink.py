"""An in-memory :class:`~meshcomm.backends.link.Link` between threads of one process.

:func:`make_memlinks` wires ``size`` links together through per-pair FIFO queues; each link is
driven by its own thread, with real concurrency, so the collective algorithms can be tested
(and later run as a "threads" backend) without sockets. :func:`run_threads` is the harness:
it runs ``fn(link)`` on ``size`` threads and returns the results in rank order.

Sends copy their bytes when posted, so a send never waits for its receiver and its buffer may
be reused as soon as ``exchange`` returns. Receives wait, at most the link's timeout each.

Example:
    >>> import numpy as np
    >>> def ring(link):
    ...     out = np.empty(1, np.int64)
    ...     right, left = (link.rank + 1) % link.size, (link.rank - 1) % link.size
    ...     link.exchange([(right, np.array([link.rank]))], [(left, out)])
    ...     return int(out[0])
    >>> run_threads(3, ring)
    [2, 0, 1]
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import numpy as np

from meshcomm.common.timeout import Timeout, to_seconds
from meshcomm.errors import CommError, CommTimeout, InvalidArgument, PeerError, ProtocolError

__all__ = ["MemLink", "make_memlinks", "run_threads"]

T = TypeVar("T")

#: Seconds :func:`run_threads` gives each link when no timeout is passed.
DEFAULT_THREADS_TIMEOUT = 30.0


class _Hub:
    """The shared state of one set of links: a FIFO per (sender, receiver) pair."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.timeout = timeout
        # One condition per receiving rank: senders notify it, only its owner waits on it.
        self.conds = [threading.Condition() for _ in range(size)]
        # queues[dst][src]: byte copies posted by src for dst, oldest first.
        self.queues: list[list[deque[np.ndarray]]] = [
            [deque() for _ in range(size)] for _ in range(size)
        ]
        self.closed = [False] * size


def _byte_view(array: np.ndarray, rank: int, what: str) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"rank {rank}: {what} must be a numpy array, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise InvalidArgument(f"rank {rank}: {what} must be C-contiguous")
    return array.reshape(-1).view(np.uint8)


def _arrived(hub: _Hub, queue: deque[np.ndarray], peer: int) -> Callable[[], bool]:
    def predicate() -> bool:
        return bool(queue) or hub.closed[peer]

    return predicate


class MemLink:
    """One rank's end of an in-memory link set made by :func:`make_memlinks`.

    Attributes:
        rank: this link's rank.
        size: the number of linked ranks.
        timeout: seconds a receive waits for its message.
    """

    def __init__(self, hub: _Hub, rank: int) -> None:
        self._hub = hub
        self.rank = rank
        self.size = hub.size
        self.timeout = hub.timeout

    def __repr__(self) -> str:
        return f"MemLink(rank={self.rank}, size={self.size})"

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self.size:
            raise InvalidArgument(f"rank {self.rank}: peer must be in [0, {self.size}), got {peer}")

    def exchange(
        self,
        sends: Sequence[tuple[int, np.ndarray]],
        recvs: Sequence[tuple[int, np.ndarray]],
    ) -> None:
        """Post every send (copying its bytes), then fill every receive in posted order.

        Raises:
            CommTimeout: a receive saw no message within the timeout.
            PeerError: the sending peer closed its link before sending.
            ProtocolError: a message's byte size differs from its receive buffer's.
            CommError: this link is closed.
        """
        hub, me = self._hub, self.rank
        out = [(peer, _byte_view(a, me, "send buffer")) for peer, a in sends]
        into = [(peer, _byte_view(a, me, "receive buffer")) for peer, a in recvs]
        for peer, _ in out + into:
            self._check_peer(peer)
        if hub.closed[me]:
            raise CommError(f"rank {me}: link is closed")
        for peer, data in out:
            copy = data.copy()
            with hub.conds[peer]:
                if hub.closed[peer]:
                    raise PeerError(f"rank {me}: cannot send to rank {peer}: it is gone", peer)
                hub.queues[peer][me].append(copy)
                hub.conds[peer].notify_all()
        cond = hub.conds[me]
        for peer, target in into:
            queue = hub.queues[me][peer]
            with cond:
                if not cond.wait_for(_arrived(hub, queue, peer), self.timeout):
                    raise CommTimeout(
                        f"rank {me}: no message from rank {peer} within {self.timeout:g} s"
                    )
                if not queue:
                    raise PeerError(f"rank {me}: rank {peer} closed its link", peer)
                data = queue.popleft()
            if data.size != target.size:
                raise ProtocolError(
                    f"rank {me}: message from rank {peer} has {data.size} bytes, "
                    f"receive buffer has {target.size}"
                )
            np.copyto(target, data)

    def close(self) -> None:
        """Mark this rank gone: peers waiting on it raise PeerError. Idempotent."""
        hub = self._hub
        hub.closed[self.rank] = True
        for cond in hub.conds:
            with cond:
                cond.notify_all()


def make_memlinks(size: int, timeout: Timeout | None = None) -> list[MemLink]:
    """Return ``size`` connected in-memory links, one per rank, each for one thread.

    Args:
        size: number of ranks, at least 1.
        timeout: seconds (or a timedelta) a receive waits; None means the default timeout.

    Raises:
        InvalidArgument: ``size`` is not a positive integer, or the timeout is invalid.

    Example:
        >>> [link.rank for link in make_memlinks(3, timeout=5)]
        [0, 1, 2]
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidArgument(f"size must be a positive integer, got {size!r}")
    hub = _Hub(size, to_seconds(timeout))
    return [MemLink(hub, rank) for rank in range(size)]


def run_threads(size: int, fn: Callable[[MemLink], T], timeout: Timeout | None = None) -> list[T]:
    """Run ``fn(link)`` for every rank of fresh memlinks on ``size`` threads; return results.

    A rank that raises closes its link, so peers waiting on it fail fast with PeerError
    instead of timing out. The first error that is not such a consequence is re-raised.

    Args:
        size: number of ranks (threads).
        fn: called once per rank with that rank's link.
        timeout: per-receive timeout of the links (default 30 s); the whole run gets
            ``2 * timeout + 5`` seconds before it is declared hung.

    Raises:
        CommTimeout: some thread did not finish in time.
        Exception: whatever ``fn`` raised on some rank (the root cause, when there are many).

    Example:
        >>> run_threads(2, lambda link: link.rank * 10)
        [0, 10]
    """
    seconds = to_seconds(timeout, DEFAULT_THREADS_TIMEOUT)
    links = make_memlinks(size, seconds)
    results: list[T | None] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(link: MemLink) -> None:
        try:
            results[link.rank] = fn(link)
        except BaseException as exc:  # handed to the caller's thread below
            errors[link.rank] = exc
            link.close()

    threads = [
        threading.Thread(target=body, args=(link,), name=f"memlink-rank-{link.rank}", daemon=True)
        for link in links
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 2 * seconds + 5
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, thread in enumerate(threads) if thread.is_alive()]
    for link in links:
        link.close()
    if hung:
        raise CommTimeout(f"ranks {hung} did not finish within {2 * seconds + 5:g} s")
    failed = [e for e in errors if e is not None]
    if failed:
        primary = [e for e in failed if not isinstance(e, PeerError)] or failed
        raise primary[0]
    return cast("list[T]", results)
