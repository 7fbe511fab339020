"""torch ``Work`` handles over the in-place layer's works.

The ``"meshcomm"`` backend runs every call through :mod:`meshcomm.distributed`'s in-place
functions, which return that layer's :class:`meshcomm.distributed._work.Work`. torch needs
its own ``Work`` type back (C++ callers such as the DDP reducer and the functional
collectives hold it), so :class:`TorchWork` subclasses ``torch.distributed.Work`` and
forwards to the inner work: ``wait`` also issues a deferred receive, errors leave as torch's
``DistError`` family (:mod:`meshcomm.c10d._errors`), and ``get_future`` gives a
``torch.futures.Future`` completed with the output tensors (what DDP's comm hooks read).

Example:
    >>> from meshcomm.distributed._work import Work
    >>> work = TorchWork(Work.completed("barrier", []))
    >>> work.wait(), work.is_completed(), work.is_success(), work.get_future().wait()
    (True, True, True, [])
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshcomm.c10d._errors import as_torch_error
from meshcomm.distributed._work import Work as InnerWork

__all__ = ["TorchWork", "completed"]


_TorchWorkBase: Any = dist.Work


class TorchWork(_TorchWorkBase):
    """A ``torch.distributed.Work`` that forwards to an in-place layer work.

    Args:
        inner: the work of :mod:`meshcomm.distributed` (None: already done).
        outputs: what the future holds when ``inner`` is None.
        source: for a receive from any rank, a callable giving the sender's group rank.
    """

    def __init__(self, inner: InnerWork | None, outputs: Any = None, source: Any = None) -> None:
        super().__init__()
        self._inner = inner
        self._outputs = [] if outputs is None else outputs
        self._source = source
        self._future: torch.futures.Future[Any] | None = None
        self._lock = threading.Lock()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until done (``timeout`` zero or None: the operation's own timeout)."""
        if self._inner is None:
            return True
        seconds = None
        if timeout is not None and timeout.total_seconds() > 0:
            seconds = timeout.total_seconds()
        try:
            self._inner.wait(seconds)
        except BaseException as exc:
            raise as_torch_error(exc) from None
        return True

    def is_completed(self) -> bool:
        """Return True once the operation finished, well or not."""
        return self._inner is None or self._inner.is_completed()

    def is_success(self) -> bool:
        """Return True if it finished without error."""
        return self._inner is None or self._inner.is_success()

    def exception(self) -> BaseException | None:
        """The operation's error (torch's family), or None."""
        if self._inner is None:
            return None
        exc = self._inner.exception()
        return None if exc is None else as_torch_error(exc)

    def result(self) -> Any:
        """Wait, then return the output tensors."""
        self.wait()
        return self._outputs if self._inner is None else self._inner.result()

    def synchronize(self) -> None:
        """Wait (results are already in the caller's tensors once it returns)."""
        self.wait()

    def _source_rank(self) -> int:
        """The sender's group rank, for a receive from any rank."""
        self.wait()
        if self._source is None:
            raise ValueError("_source_rank() is only defined for receives from any rank")
        return int(self._source())

    def get_future(self) -> torch.futures.Future[Any]:
        """A ``torch.futures.Future`` completed with the output tensors (or the error)."""
        with self._lock:
            if self._future is not None:
                return self._future
            fut: torch.futures.Future[Any] = torch.futures.Future()
            self._future = fut
        if self._inner is None:
            fut.set_result(self._outputs)
            return fut
        self._inner.start()

        def settle(inner_future: Any) -> None:
            exc = inner_future._inner.exception()
            if exc is not None:
                fut.set_exception(as_torch_error(exc))
            else:
                fut.set_result(inner_future._inner.result())

        self._inner.get_future().add_done_callback(settle)
        return fut


def completed(outputs: Any = None) -> TorchWork:
    """A work that is already done, whose future holds ``outputs``.

    Example:
        >>> completed([1]).get_future().wait()
        [1]
    """
    return TorchWork(None, outputs)
