"""The NCCL watchdog: one thread that fails what did not finish in time.

An NCCL call returns as soon as its kernel is queued; a peer that never joins leaves that
kernel spinning on the GPU and the caller's stream behind it, with no error anywhere. So
every queued operation is handed here with its CUDA event and deadline. A daemon thread
polls the events (and NCCL's asynchronous error) every few milliseconds; past the deadline,
or on an asynchronous error, it aborts that NCCL communicator (``ncclCommAbort``, which
also frees the spinning kernel) and records the reason, which the communicator's next call
raises, naming the operation and the group.

Example:
    >>> dog = Watchdog()
    >>> dog.pending()
    0
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Protocol

__all__ = ["POLL_SECONDS", "WATCHDOG", "Watched", "Watchdog"]

#: How often the thread looks at the events.
POLL_SECONDS = 0.005


#: A watched operation: its event, deadline, name, and the spare list its event goes to.
_Entry = tuple[Any, float, str, "list[Any] | None"]


class Watched(Protocol):
    """What the watchdog needs of a communicator."""

    def async_error(self) -> str | None:
        """NCCL's asynchronous error of the communicator, in words, or None."""

    def fail(self, reason: str, timed_out: bool) -> None:
        """Abort the NCCL communicator and remember ``reason`` for the next call."""


class Watchdog:
    """Events of queued NCCL operations, each with a deadline; a thread that checks them.

    A communicator's operations complete in the order queued (one stream, or, where its
    stream changes, a wait for the last one's event: ``NcclCommunicator._queue``), so the
    completed ones are a prefix of its queue. Per owner, the thread asks the
    newest event first (done: the whole queue is), else finds the first operation not done
    by bisection and fails the owner if that one is past its deadline. A poll costs a few
    event queries per owner, however many operations are queued (a query takes the GIL
    from the calling thread for about 2 us, so one per operation would tax every call).
    Completed events go back to the ``spare`` list they were watched with, for reuse.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[int, tuple[Watched, deque[_Entry]]] = {}
        self._thread: threading.Thread | None = None

    def watch(
        self, owner: Watched, event: Any, timeout: float, what: str, spare: list[Any] | None = None
    ) -> None:
        """Fail ``owner`` with a timeout naming ``what`` unless ``event`` completes in time.

        ``owner``'s operations must complete in the order they are watched.
        ``spare``: where ``event`` goes once it completed (None: nowhere).
        """
        entry = (event, time.monotonic() + timeout, what, spare)
        queued = self._queues.get(id(owner))
        if queued is not None:
            # The common case, without the lock (a deque's append is atomic): the thread
            # drops an owner's queue only when it is empty, under the lock, so the entry
            # stands unless the queue was dropped before it went in; then it is put back.
            queued[1].append(entry)
            if self._queues.get(id(owner)) is queued:
                return
            queued[1].remove(entry)
        with self._lock:
            queued = self._queues.get(id(owner))
            if queued is None:
                self._queues[id(owner)] = (owner, deque([entry]))
            else:
                queued[1].append(entry)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="meshcomm-nccl-watchdog", daemon=True
                )
                self._thread.start()

    def forget(self, owner: Watched) -> None:
        """Stop watching ``owner``'s operations (it is closing)."""
        with self._lock:
            self._queues.pop(id(owner), None)

    def pending(self) -> int:
        """Operations still watched."""
        with self._lock:
            return sum(len(queue) for _, queue in self._queues.values())

    def _run(self) -> None:
        while True:
            time.sleep(POLL_SECONDS)
            with self._lock:
                if not self._queues:  # nothing queued: the next watch() starts a thread
                    self._thread = None
                    return
                owners = list(self._queues.values())
            now = time.monotonic()
            for owner, queue in owners:
                reason = self._verdict(owner, queue, now)
                if reason is not None:
                    with self._lock:
                        self._queues.pop(id(owner), None)
                    owner.fail(*reason)
            with self._lock:
                for key in [k for k, (_, queue) in self._queues.items() if not queue]:
                    del self._queues[key]

    @staticmethod
    def _verdict(owner: Watched, queue: deque[_Entry], now: float) -> tuple[str, bool] | None:
        """Drop ``owner``'s completed operations; the reason it fails now, or None."""
        if not queue:
            return None
        if queue[-1][0].done:
            done = len(queue)
        else:  # the completed ones are a prefix: find its end
            low, high = 0, len(queue) - 1  # queue[high] is not done
            while low < high:
                middle = (low + high) // 2
                if queue[middle][0].done:
                    low = middle + 1
                else:
                    high = middle
            done = low
        for _ in range(done):
            event, _, _, spare = queue.popleft()
            if spare is not None:
                spare.append(event)
        if not queue:
            return None
        _, deadline, what, _ = queue[0]
        error = owner.async_error()
        if error is not None:
            return f"{what}: NCCL reported {error}", False
        if now > deadline:
            return f"{what}: not completed in time", True
        return None


#: The process's one watchdog.
WATCHDOG = Watchdog()
