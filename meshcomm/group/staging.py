"""Device (GPU) arrays at the group boundary: cupy in, cupy out, through host memory.

The tcp and mpi backends compute on host buffers. A process group that is handed a cupy
array copies it to host memory when the call is issued (``cupy.asnumpy`` waits for the
current stream, so every kernel that produced the data has finished), runs the collective
on the host copy, and hands the result back as a new cupy array on the current device. So
``ops.psum(x, "tp")`` with a cupy ``x`` returns a cupy array on every backend, as JAX users
expect, at the price of one device-to-host and one host-to-device copy per call. (A group
with a device backend, nccl, sends them over it instead: :mod:`meshcomm.group.device_lower`.)

**Pinned buffers.** Both copies go through page-locked host memory, which the GPU's copy
engines read and write directly, 5-10x faster than pageable memory for a MiB and more
(docs/gpu.md). Each thread keeps one download and one upload buffer, grown to the largest
array it staged up to ``MESHCOMM_PINNED_STAGING_MAX`` bytes (default 256 MiB; 0: pageable
copies only, as before), read when first needed. The download buffer is the host copy the
collective reads: a synchronous call has finished with it before its thread stages again,
and an asynchronous one snapshots it at issue. The upload buffer is reused once the copy
out of it has completed (an event).

cupy is never imported here: a cupy array can only arrive if the caller imported cupy.

Which arrays are staged, and how a result goes back, is decided in
:mod:`meshcomm.group.routes`; this module only makes the copies.

Example:
    >>> pinned_limit() >= 0
    True
"""

from __future__ import annotations

import functools
import os
import threading
from types import ModuleType
from typing import Any

import numpy as np

__all__ = [
    "PINNED_MAX_ENV",
    "download",
    "pinned_limit",
    "upload",
]

#: Names the largest array (bytes) staged through pinned buffers; 0 turns them off.
PINNED_MAX_ENV = "MESHCOMM_PINNED_STAGING_MAX"
_PINNED_MAX_DEFAULT = 256 << 20


@functools.cache
def pinned_limit() -> int:
    """The largest array staged through pinned buffers, from :data:`PINNED_MAX_ENV` (read
    once, on the first staged call).

    Example:
        >>> pinned_limit() >= 0
        True
    """
    raw = os.environ.get(PINNED_MAX_ENV, "").strip()
    try:
        return max(0, int(raw)) if raw else _PINNED_MAX_DEFAULT
    except ValueError:
        return _PINNED_MAX_DEFAULT


class _Pinned(threading.local):
    """This thread's page-locked buffers: ``(memory, bytes, event of its last upload)``."""

    def __init__(self) -> None:
        self.down: tuple[Any, int] | None = None
        self.up: tuple[Any, int, Any] | None = None


_PINNED = _Pinned()


def _host_view(memory: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(memory, dtype, count).reshape(shape)


def _grown(xp: ModuleType, held: Any, nbytes: int) -> tuple[Any, int]:
    """Pinned memory of at least ``nbytes`` (the held one if large enough)."""
    if held is not None and held[1] >= nbytes:
        return held[0], held[1]
    size = 1 << max(12, (nbytes - 1).bit_length())  # powers of two: few regrowths
    return xp.cuda.alloc_pinned_memory(size), size


def download(xp: ModuleType, x: Any) -> np.ndarray:
    """A host copy of device array ``x`` of module ``xp``, made now (in this thread's pinned
    buffer up to :func:`pinned_limit` bytes); the caller may overwrite ``x`` at once.

    Which arrays take this way is decided in :mod:`meshcomm.group.routes`.

    Example:
        >>> from types import SimpleNamespace
        >>> fake_cupy = SimpleNamespace(asnumpy=np.asarray)  # an empty array: no pinned copy
        >>> download(fake_cupy, np.zeros((0, 2))).shape
        (0, 2)
    """
    nbytes = int(x.nbytes)
    if not 0 < nbytes <= pinned_limit():
        return xp.asnumpy(x)
    _PINNED.down = memory, _ = _grown(xp, _PINNED.down, nbytes)
    host = _host_view(memory, np.dtype(x.dtype), tuple(x.shape))
    # ascontiguousarray would make a 0-d array 1-d; get() waits for the current stream.
    (x if x.flags.c_contiguous else xp.ascontiguousarray(x)).get(out=host)
    return host


def upload(xp: ModuleType, result: Any) -> Any:
    """Return host array ``result`` as a new array of ``xp`` on the current device.

    Example:
        >>> upload(np, np.zeros(0))  # empty: a plain xp.asarray
        array([], dtype=float64)
    """
    result = np.asarray(result)
    nbytes = result.nbytes
    if not 0 < nbytes <= pinned_limit():
        return xp.asarray(result)
    held = _PINNED.up
    if held is not None:
        held[2].synchronize()  # its last upload has left it
    memory, size = _grown(xp, held, nbytes)
    staged = _host_view(memory, result.dtype, result.shape)
    np.copyto(staged, result)
    out = xp.empty(result.shape, dtype=result.dtype)
    out.set(staged)
    done = xp.cuda.Event(block=False, disable_timing=True)
    done.record()
    _PINNED.up = (memory, size, done)
    return out
