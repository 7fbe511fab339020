"""``Work`` and ``Future``: torch's handles of asynchronous operations.

An in-place call with ``async_op=True`` issues one or more meshcomm operations (each a
:class:`meshcomm.work.Work` that completes on the world's progress thread) and returns a
:class:`Work`. When the last of them completes, a *finish* step runs once, on the progress
thread: it copies the results into the caller's buffers and produces the value of
``result()`` (the output tensors, as a list). ``wait()`` returns only after that copy, so
the caller's tensors hold the results once ``wait()`` returns, as in torch.

A :class:`Work` may also be *deferred*: an ``irecv`` is issued to the world when it is first
needed (see :mod:`meshcomm.distributed._p2p`); ``start`` does that.

Example:
    >>> work = Work.completed("barrier", [])
    >>> work.wait(), work.is_completed(), work.is_success(), work.result()
    (True, True, True, [])
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from meshcomm.common.timeout import to_seconds
from meshcomm.distributed._errors import DistBackendError, translate
from meshcomm.errors import CommTimeout
from meshcomm.work import Work as MeshWork

__all__ = ["Future", "Work"]


class Future:
    """The value of an asynchronous operation (``torch.futures.Future``'s common methods).

    Example:
        >>> fut = Future.done_with([1])
        >>> fut.done(), fut.wait(), fut.value()
        (True, [1], [1])
        >>> fut.then(lambda f: len(f.value())).wait()
        1
    """

    def __init__(self, inner: concurrent.futures.Future[Any] | None = None) -> None:
        self._inner: concurrent.futures.Future[Any] = inner or concurrent.futures.Future()

    @classmethod
    def done_with(cls, value: Any) -> Future:
        """Return a completed future holding ``value``."""
        fut = cls()
        fut._inner.set_result(value)
        return fut

    def done(self) -> bool:
        """Return True once the value (or an exception) is set."""
        return self._inner.done()

    def wait(self, timeout: float | timedelta | None = None) -> Any:
        """Block until done and return the value (or raise the operation's exception).

        ``timeout`` None or zero (torch's default ``timedelta(0)``) waits without a limit.
        """
        if timeout is not None and not (
            timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        ):
            timeout = None
        seconds = None if timeout is None else to_seconds(timeout)
        try:
            return self._inner.result(seconds)
        except concurrent.futures.TimeoutError:
            if self._inner.done():
                return self._inner.result()
            raise translate(CommTimeout(f"future not completed within {seconds} s")) from None

    def value(self) -> Any:
        """Return the value of a completed future (raise its exception)."""
        return self._inner.result(0) if self._inner.done() else self.wait()

    def set_result(self, value: Any) -> None:
        """Complete the future with ``value``."""
        self._inner.set_result(value)

    def set_exception(self, exc: BaseException) -> None:
        """Complete the future with an exception."""
        self._inner.set_exception(exc)

    def add_done_callback(self, callback: Callable[[Future], None]) -> None:
        """Call ``callback(self)`` when done (at once if already done).

        Callbacks of pending futures run on meshcomm's progress thread: they must not wait on
        other operations of the same world.
        """
        self._inner.add_done_callback(lambda _f: callback(self))

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """Return a future of ``callback(self)``, run when this one is done."""
        out = Future()

        def run(_f: Future) -> None:
            try:
                out.set_result(callback(self))
            except BaseException as exc:
                out.set_exception(exc)

        self.add_done_callback(run)
        return out

    def __repr__(self) -> str:
        return f"<Future {'done' if self.done() else 'pending'}>"


class Work:
    """The handle an ``async_op=True`` call returns (``wait``, ``is_completed``, ...).

    Args:
        label: names the operation in messages.
        outputs: what ``result()`` returns (the output tensors, usually).
        finish: called once with the meshcomm results, in order, after the last inner
            operation completed; it writes into the caller's buffers and may return a value
            that replaces ``outputs``; None keeps ``outputs``.
    """

    def __init__(
        self,
        label: str,
        outputs: Any,
        finish: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self._label = label
        self._outputs = outputs
        self._finish = finish
        self._future = Future()
        self._lock = threading.Lock()
        self._starter: Callable[[], Sequence[MeshWork[Any] | Any]] | None = None
        self._started = False
        self._source: int | None = None

    # -- construction --------------------------------------------------------------------
    @classmethod
    def completed(cls, label: str, outputs: Any) -> Work:
        """Return a Work that is already done (a no-op, or a result computed inline)."""
        work = cls(label, outputs)
        work._started = True
        work._future.set_result(outputs)
        return work

    def attach(self, inner: Sequence[MeshWork[Any] | Any]) -> Work:
        """Wait on ``inner`` (meshcomm Works, or plain values that are already results)."""
        self._started = True
        items = list(inner)
        results: list[Any] = [None] * len(items)
        pending = [i for i, item in enumerate(items) if isinstance(item, MeshWork)]
        for i, item in enumerate(items):
            if not isinstance(item, MeshWork):
                results[i] = item
        if not pending:
            self._complete(results, None)
            return self
        left = [len(pending)]
        failed: list[BaseException] = []
        lock = threading.Lock()

        def done(index: int, fut: concurrent.futures.Future[Any]) -> None:
            exc = fut.exception()
            with lock:
                if exc is not None:
                    failed.append(exc)
                else:
                    results[index] = fut.result()
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._complete(results, failed[0] if failed else None)

        for i in pending:
            items[i].get_future().add_done_callback(functools.partial(done, i))
        return self

    def defer(self, starter: Callable[[], Sequence[MeshWork[Any] | Any]]) -> Work:
        """Issue the operation later: ``starter()`` issues it and returns what to attach."""
        self._starter = starter
        return self

    def start(self) -> None:
        """Issue a deferred operation now (no-op if it was issued)."""
        with self._lock:
            if self._started:
                return
            self._started = True
            starter = self._starter
        if starter is not None:
            try:
                self.attach(starter())
            except BaseException as exc:
                self._future.set_exception(translate(exc))

    def _complete(self, results: list[Any], exc: BaseException | None) -> None:
        if exc is None and self._finish is not None:
            try:
                value = self._finish(results)
                if value is not None:
                    self._outputs = value
            except BaseException as err:
                exc = err
        if exc is not None:
            self._future.set_exception(translate(exc))
        else:
            self._future.set_result(self._outputs)

    # -- torch's Work API ----------------------------------------------------------------
    def wait(self, timeout: float | timedelta | None = None) -> bool:
        """Block until the operation and the copy into the caller's buffers are done.

        Args:
            timeout: seconds or ``timedelta``; None waits for the operation, which ends
                within the group's timeout once it runs.

        Returns:
            True, as torch.

        Raises:
            DistBackendError: the operation failed, or ``timeout`` passed first.
        """
        self.start()
        self._future.wait(timeout)
        return True

    def is_completed(self) -> bool:
        """Return True once the operation finished (successfully or not)."""
        self.start()
        return self._future.done()

    def is_success(self) -> bool:
        """Return True if the operation completed without error.

        Raises:
            DistBackendError: the operation has not completed yet (as torch).
        """
        if not self.is_completed():
            raise DistBackendError(f"{self._label}: is_success() called before completion")
        return self._future._inner.exception() is None

    def exception(self) -> BaseException | None:
        """Return the operation's exception, or None (also while it runs)."""
        self.start()
        if not self._future.done():
            return None
        return self._future._inner.exception()

    def result(self) -> Any:
        """Wait, then return the output tensors (a list, as torch)."""
        self.start()
        return self._future.wait()

    def get_future(self) -> Future:
        """Return a :class:`Future` completed with ``result()``'s value."""
        self.start()
        return self._future

    def source_rank(self) -> int:
        """For a receive from any source: the sender's group rank (once completed)."""
        self.wait()
        if self._source is None:
            raise DistBackendError(f"{self._label}: source_rank() is only for receives")
        return self._source

    _source_rank = source_rank

    def synchronize(self) -> None:
        """Wait (torch synchronizes CUDA streams here; meshcomm's copies are synchronous)."""
        self.wait()

    def __repr__(self) -> str:
        state = "completed" if self._future.done() else "pending"
        return f"<Work {self._label} {state}>"
