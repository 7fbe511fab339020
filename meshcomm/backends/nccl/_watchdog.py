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
from typing import Any, Protocol

__all__ = ["POLL_SECONDS", "WATCHDOG", "Watched", "Watchdog"]

#: How often the thread looks at the events.
POLL_SECONDS = 0.005


class Watched(Protocol):
    """What the watchdog needs of a communicator."""

    def async_error(self) -> str | None:
        """NCCL's asynchronous error of the communicator, in words, or None."""

    def fail(self, reason: str, timed_out: bool) -> None:
        """Abort the NCCL communicator and remember ``reason`` for the next call."""


class Watchdog:
    """Events of queued NCCL operations, each with a deadline; a thread that checks them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[Watched, Any, float, str]] = []
        self._thread: threading.Thread | None = None

    def watch(self, owner: Watched, event: Any, timeout: float, what: str) -> None:
        """Fail ``owner`` with a timeout naming ``what`` unless ``event`` completes in time."""
        with self._lock:
            self._entries.append((owner, event, time.monotonic() + timeout, what))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="meshcomm-nccl-watchdog", daemon=True
                )
                self._thread.start()

    def forget(self, owner: Watched) -> None:
        """Stop watching ``owner``'s operations (it is closing)."""
        with self._lock:
            self._entries = [e for e in self._entries if e[0] is not owner]

    def pending(self) -> int:
        """Operations still watched."""
        with self._lock:
            return len(self._entries)

    def _run(self) -> None:
        while True:
            time.sleep(POLL_SECONDS)
            with self._lock:
                if not self._entries:  # nothing queued: the next watch() starts a thread
                    self._thread = None
                    return
                entries = list(self._entries)
            failed: dict[int, tuple[Watched, str, bool]] = {}
            finished = set()
            now = time.monotonic()
            for index, (owner, event, deadline, what) in enumerate(entries):
                if id(owner) in failed or event.done:
                    finished.add(index)
                else:
                    error = owner.async_error()
                    if error is not None:
                        failed[id(owner)] = (owner, f"{what}: NCCL reported {error}", False)
                    elif now > deadline:
                        failed[id(owner)] = (owner, f"{what}: not completed in time", True)
            for owner, reason, timed_out in failed.values():
                owner.fail(reason, timed_out)
            gone = {id(entries[i]) for i in finished}
            with self._lock:  # entries added or forgotten meanwhile stay as they are
                self._entries = [
                    e for e in self._entries if id(e) not in gone and id(e[0]) not in failed
                ]


#: The process's one watchdog.
WATCHDOG = Watchdog()
