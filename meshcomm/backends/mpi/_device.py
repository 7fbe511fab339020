"""Device (CUDA) buffers for the mpi backend: pass them to a CUDA-aware MPI, or stage them.

A buffer is a device buffer when it exposes ``__cuda_array_interface__`` (cupy, and torch or
numba arrays through it). A CUDA-aware MPI reads and writes device memory itself: meshcomm
synchronizes the current stream first, so MPI sees every kernel that produced the data.
Otherwise the data goes through a host copy, and results are copied back after completion.
User-defined reduction ops (bfloat16) run numpy on the bytes, so they always stage.

cupy is never imported here unless a device buffer arrives (it is then already imported).

Example:
    >>> import numpy as np
    >>> is_device(np.zeros(3))
    False
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["is_device", "stage"]


def is_device(x: Any) -> bool:
    """True for an array in GPU memory (``__cuda_array_interface__``), False for numpy."""
    return type(x) is not np.ndarray and hasattr(x, "__cuda_array_interface__")


def _cupy() -> Any:
    # A device array arrived, so cupy is there (and usually imported already).
    return sys.modules.get("cupy") or importlib.import_module("cupy")


def synchronize() -> None:
    """Wait for the current CUDA stream, so MPI reads finished data."""
    _cupy().cuda.get_current_stream().synchronize()


def stage(
    x: Any, cuda_aware: bool, copy_in: bool, copy_back: bool
) -> tuple[Any, Callable[[], None] | None]:
    """Return the buffer to hand MPI for ``x`` and what to run once the operation completed.

    Args:
        x: a host (numpy) or device array.
        cuda_aware: pass device memory straight to MPI (after a stream synchronize).
        copy_in: the operation reads ``x`` (a staged copy must carry its values).
        copy_back: the operation writes ``x`` (a staged copy must be copied back).

    Example:
        >>> import numpy as np
        >>> a = np.ones(2)
        >>> buf, back = stage(a, cuda_aware=False, copy_in=True, copy_back=True)
        >>> buf is a, back is None
        (True, True)
    """
    if not is_device(x):
        return x, None
    if cuda_aware:
        synchronize()
        return x, None
    cupy = _cupy()
    host = cupy.asnumpy(x) if copy_in else np.empty(x.shape, dtype=x.dtype)
    if not copy_back:
        return host, None

    def back() -> None:
        x.set(host)  # cupy: host -> device copy on the current stream
        synchronize()

    return host, back
