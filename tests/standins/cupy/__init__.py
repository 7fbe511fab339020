"""numpy dressed as cupy, for the group's routes of device arrays on a CPU.

A package named ``cupy`` that a test's rank process puts first on ``sys.path`` (never the
test runner's own process): its arrays are numpy arrays of a subclass whose module is
``cupy``, so the group sends them down the device route (``routes.device_module``) onto a
device communicator whose memory is numpy (the CUDA IPC protocol over
``SharedMemoryStandIn``), and stages them (``get``/``set``, pinned memory, events) where
the host route takes them. What it checks is the group's choice of route on every rank,
which a GPU run checks again with cupy itself (tests/test_gpu_ipc.py).
"""

from __future__ import annotations

from typing import Any

import numpy as _np

__version__ = "0.0-standin"


class ndarray(_np.ndarray):
    """A numpy array that reads as cupy's."""

    def get(self, out: _np.ndarray | None = None) -> _np.ndarray:
        host = _np.asarray(self).view(_np.ndarray)
        if out is None:
            return host.copy()
        _np.copyto(out, host)
        return out

    def set(self, host: _np.ndarray) -> None:
        _np.copyto(self.view(_np.ndarray), host)


ndarray.__module__ = "cupy"


def _dressed(value: Any) -> Any:
    if isinstance(value, _np.ndarray) and not isinstance(value, ndarray):
        return value.view(ndarray)
    return value


def asnumpy(x: Any) -> _np.ndarray:
    return _np.asarray(x).view(_np.ndarray).copy()


def __getattr__(name: str) -> Any:
    found = getattr(_np, name)
    if not callable(found) or isinstance(found, type):
        return found

    def dressed(*args: Any, **kwargs: Any) -> Any:
        result = found(*args, **kwargs)
        return result if kwargs.get("out") is not None else _dressed(result)

    return dressed


class _Event:
    done = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Stream:
    ptr = 0

    def synchronize(self) -> None:
        pass


class cuda:
    """The few ``cupy.cuda`` names the staging path uses."""

    Event = _Event

    @staticmethod
    def alloc_pinned_memory(nbytes: int) -> bytearray:
        return bytearray(nbytes)

    @staticmethod
    def get_current_stream() -> _Stream:
        return _Stream()
