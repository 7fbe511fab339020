"""Asynchronous operations: :class:`Work` handles and the per-group progress engine.

Every operation of a process group runs through the group's :class:`ProgressEngine`,
strictly in issue order, one at a time (a communicator is used by one thread at a time,
and every rank must run a group's collectives in the same order). Each group has its own
engine, so operations of different groups progress independently. A
synchronous call that finds nothing queued runs inline on the caller's thread; anything
else is queued for the engine's progress thread, which starts on first need.

The engine also holds the group's fate: the first communication failure poisons it, and
every later operation of the group (already queued, or issued later) raises
:class:`~meshcomm.errors.CommError` at once, naming that first failure.

Example:
    >>> engine = ProgressEngine("rank 0 in group 'demo'")
    >>> work = engine.submit(lambda: 41 + 1, "answer", async_op=True)
    >>> work.wait(timeout=10)
    42
    >>> engine.close()
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from meshcomm.common import dynamo_skip as _dynamo_skip
from meshcomm.common.timeout import Timeout, to_seconds
from meshcomm.errors import CommError, CommTimeout
from meshcomm.group.arrays import ResultPool, ScratchPool

__all__ = ["ProgressEngine", "Work"]

T = TypeVar("T")

# torch.compile must break the graph at a call into a group rather than trace into it, or a
# failure of its tracing would surface mid-collective and fail the group (see the module).
_dynamo_skip.arm()


class Work(Generic[T]):
    """The handle of an operation issued with ``async_op=True``.

    The operation's input was copied when it was issued, so the caller may reuse its
    arrays at once. Results come back in issue order.

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group import ProcessGroup
        >>> g = ProcessGroup(SelfCommunicator(), name="world")
        >>> work = g.all_reduce([1.0, 2.0], async_op=True)
        >>> work.wait(timeout=10), work.is_completed(), work.exception()
        (array([1., 2.]), True, None)
        >>> g.close()
    """

    def __init__(self, label: str) -> None:
        self._label = label
        # The group's hang verdict for the operation's own CommTimeout
        # (meshcomm.diagnostics.hang_verdict),
        # applied once, in the first wait() that sees it.
        self._judge: Callable[[CommTimeout], CommTimeout] | None = None
        self._judged: BaseException | None = None
        self._future: concurrent.futures.Future[T] = concurrent.futures.Future()
        # Running from the start: cancel() then returns False, as an issued op cannot be
        # taken back from the other ranks.
        self._future.set_running_or_notify_cancel()
        # A device call's: whether its GPU work has finished (is_completed asks it).
        self._device_done: Callable[[], bool] | None = None

    @classmethod
    def completed(
        cls, label: str, value: T, device_done: Callable[[], bool] | None = None
    ) -> Work[T]:
        """A Work whose operation has already finished with ``value`` (a device call only
        queues its GPU work, ordered on the caller's stream, so it is done when issued).

        ``device_done``: for a device call, whether its GPU work has finished (an event's
        query): :meth:`is_completed` answers with it, as torch's NCCL work does; ``wait``
        returns at once, the result being ordered on the caller's stream already.

        Example:
            >>> Work.completed("psum over 'tp'", 3).wait()
            3
            >>> Work.completed("psum over 'tp'", 3, device_done=lambda: False).is_completed()
            False
        """
        work: Work[T] = cls(label)
        work._finish(lambda: value)
        work._device_done = device_done
        return work

    def wait(self, timeout: Timeout | None = None) -> T:
        """Block until the operation finishes and return its result.

        Args:
            timeout: seconds or ``timedelta`` to wait; None waits until the operation ends,
                which every operation does within its communicator's timeout once it runs.

        Returns:
            What the synchronous call would have returned.

        Raises:
            CommTimeout: not finished within ``timeout`` (the operation carries on).
            Exception: whatever the operation raised.
        """
        seconds = None if timeout is None else to_seconds(timeout)
        try:
            return self._future.result(timeout=seconds)
        except CommTimeout as exc:
            if self._judge is None:
                raise
            if self._judged is None:
                self._judged = self._judge(exc)
            if self._judged is exc:
                raise
            raise self._judged from exc
        except concurrent.futures.TimeoutError:
            # On Python < 3.11 futures' TimeoutError is not the builtin one.
            if self._future.done():
                return self._future.result()
            raise CommTimeout(f"{self._label}: not completed within {seconds} s") from None

    result = wait

    def is_completed(self) -> bool:
        """Return True once the operation has finished (successfully or not); for a device
        call, once its GPU work has."""
        if not self._future.done():
            return False
        return self._device_done is None or self._device_done()

    def exception(self) -> BaseException | None:
        """Return the exception the operation raised, or None (also while it still runs)."""
        if not self._future.done():
            return None
        return self._future.exception()

    def get_future(self) -> concurrent.futures.Future[T]:
        """Return a ``concurrent.futures.Future`` that completes with the operation.

        Callbacks added with ``add_done_callback`` run on the progress thread; they must not
        wait on other operations of the same group.
        """
        return self._future

    def __repr__(self) -> str:
        state = "completed" if self._future.done() else "pending"
        return f"<Work {self._label} {state}>"

    # -- engine side ---------------------------------------------------------------------
    def _finish(self, fn: Callable[[], T]) -> None:
        try:
            value = fn()
        except BaseException as exc:
            self._future.set_exception(exc)
        else:
            self._future.set_result(value)


class ProgressEngine:
    """Runs one group's operations in issue order, inline or on a progress thread.

    Args:
        where: names this rank and group in error messages (``"rank 2 in group 'world'"``).
        pools: the scratch and result pools to use, shared with other engines (both are
            thread-safe): a world's groups share one pair, so memory cached for reuse does
            not grow with the number of groups. None: pools of its own.

    Attributes:
        pool: scratch buffers (shared by the world's groups).
        results: the result buffers the group hands out, recycled once dropped (shared by
            the world's groups).
        healthy: False once the group failed or was closed (a one-attribute check for the
            hot path; :meth:`check` says why).
    """

    def __init__(self, where: str, pools: tuple[ScratchPool, ResultPool] | None = None) -> None:
        self._where = where
        # A plain lock under the condition: the inline path takes it directly (C code),
        # and notifies only when someone waits (``_waiting``).
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._waiting = 0
        self._draining = 0  # of those waiting, the drain() calls
        self._queue: deque[tuple[Callable[[], Any], Work[Any]]] = deque()
        # The engine's one token: whoever runs an operation (an inline caller or the progress
        # thread) pops it, and puts it back after. A list's pop and append are each atomic,
        # so the inline path claims the engine without a lock; see claim() and release() for
        # why no wake-up is lost.
        self._idle: list[bool] = [True]
        self._stop = False
        self._closed_reason: str | None = None
        self._failure: BaseException | None = None
        self._failure_label = ""
        self._thread: threading.Thread | None = None
        self._thread_id: int | None = None
        self.pool, self.results = pools or (ScratchPool(), ResultPool())
        self.healthy = True

    # -- state ---------------------------------------------------------------------------
    @property
    def failure(self) -> BaseException | None:
        """The exception that poisoned the group, or None."""
        return self._failure

    def check(self, label: str) -> None:
        """Raise CommError if the group has failed or was closed."""
        error = self._refusal(label)
        if error is not None:
            raise error from self._failure

    def _refusal(self, label: str, closed: bool = True) -> CommError | None:
        if self._failure is not None:
            first = self._failure
            return CommError(
                f"{label}: the group failed earlier, so no operation can run in it any more; "
                f"the first failure was in {self._failure_label}: {type(first).__name__}: {first}"
            )
        if closed and self._closed_reason is not None:
            return CommError(f"{label}: {self._closed_reason}")
        return None

    def poison(self, exc: BaseException, label: str) -> None:
        """Record the group's first failure; later operations refuse to run."""
        with self._cv:
            if self._failure is None:
                self._failure, self._failure_label = exc, label
                self.healthy = False

    # -- running operations --------------------------------------------------------------
    def submit(self, fn: Callable[[], T], label: str, async_op: bool) -> Any:
        """Run ``fn`` in issue order; return its result, or a :class:`Work` if ``async_op``.

        Raises:
            CommError: the group failed or was closed (nothing is queued then).
            Exception: a synchronous ``fn`` raised (and the group is poisoned).
        """
        if not async_op and self.claim():
            return self.run_claimed(fn, label)
        with self._lock:
            if not self.healthy:
                self.check(label)
            if not async_op and self._thread_id == threading.get_ident():
                raise CommError(
                    f"{label}: a synchronous call from the progress thread (a Future callback) "
                    "would wait on itself; use async_op=True there"
                )
            work: Work[T] = Work(label)
            self._queue.append((fn, work))
            self._ensure_thread()
            if self._waiting:
                self._cv.notify_all()
        return work if async_op else work.wait()

    def claim(self) -> bool:
        """Take the engine for one synchronous operation that the caller runs itself.

        True when the group is healthy, nothing is queued or running, and the caller is not
        the progress thread: the operation may run now, in the caller's thread, and the
        caller must :meth:`release` the engine after it (:meth:`run_claimed` does both).
        False: go through :meth:`submit`.
        """
        # No lock (two lock round trips were a sixth of an 8-byte all_reduce's group layer):
        # the token's pop is atomic, and health is read again after it, so a close() that
        # marks the group unhealthy either is seen here or sees the token gone and waits for
        # release() (the GIL orders the two threads' reads and writes).
        idle = self._idle
        if self._queue or not idle or not self.healthy:
            return False
        if self._thread_id is not None and self._thread_id == threading.get_ident():
            return False
        try:
            idle.pop()
        except IndexError:  # another thread took it first
            return False
        if not self.healthy:
            self.release()
            return False
        return True

    def release(self) -> None:
        """Give back the engine taken with :meth:`claim`."""
        self._idle.append(True)
        # Whoever waits for the token does so under the condition's lock with work queued
        # (the progress thread) or with a drain counted: both read after the token is back,
        # so one of them holds, and the notify below comes after the waiter's check. The idle
        # progress thread waits for work, not for this: waking it on every inline call cost
        # the caller the GIL (an 8-byte all_reduce 3x slower once a thread ran).
        if self._queue or self._draining:
            with self._cv:
                self._cv.notify_all()

    def on_progress_thread(self) -> bool:
        """Whether the caller is the engine's progress thread (a Future callback)."""
        return self._thread_id == threading.get_ident()

    def run_claimed(self, fn: Callable[[], T], label: str) -> T:
        """Run ``fn`` on the engine taken with :meth:`claim`, then release it.

        Raises:
            Exception: whatever ``fn`` raised (the group is poisoned then).
        """
        try:
            return self._run(fn, label)
        finally:
            self.release()

    def _wait(self) -> None:
        """``self._cv.wait()``, counted so that the inline path knows whether to notify."""
        self._waiting += 1
        try:
            self._cv.wait()
        finally:
            self._waiting -= 1

    def _run(self, fn: Callable[[], T], label: str) -> T:
        try:
            return fn()
        except BaseException as exc:
            # Whatever escaped mid-operation leaves the ranks' streams in an unknown state.
            self.poison(exc, label)
            raise

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._loop, name=f"meshcomm-progress ({self._where})", daemon=True
            )
            self._thread.start()
            self._thread_id = self._thread.ident

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._queue and self._take()):
                    if self._stop and not self._queue:
                        self._thread_id = None  # idents are reused once a thread has ended
                        return
                    self._wait()  # for work, or for the token an inline caller holds
                fn, work = self._queue.popleft()
                abandoned = self._stop
            try:
                refusal = self._refusal(work._label, closed=abandoned)
                if refusal is not None:
                    refusal.__cause__ = self._failure
                    work._future.set_exception(refusal)
                else:
                    work._finish(functools.partial(self._run, fn, work._label))
            finally:
                with self._cv:
                    self._idle.append(True)
                    self._cv.notify_all()

    def _take(self) -> bool:
        """Pop the token for the progress thread, under the condition's lock; whether it
        was there (an inline caller may hold it)."""
        try:
            self._idle.pop()
        except IndexError:
            return False
        return True

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for queued operations to finish; True if they did."""
        with self._cv:
            self._waiting += 1
            self._draining += 1
            try:
                return self._cv.wait_for(lambda: not self._queue and bool(self._idle), timeout)
            finally:
                self._waiting -= 1
                self._draining -= 1

    def close(self, reason: str = "the group was closed", timeout: float = 10.0) -> None:
        """Refuse new operations, let queued ones finish (up to ``timeout``), stop the thread.

        Operations still queued after ``timeout`` fail with CommError. Idempotent.
        """
        with self._cv:
            if self._closed_reason is None:
                self._closed_reason = f"{self._where}: {reason}"
                self.healthy = False
        self.drain(timeout)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self.results.clear()
