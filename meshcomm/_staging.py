"""Device (GPU) arrays at the group boundary: cupy in, cupy out, through host memory.

The tcp and mpi backends compute on host buffers. A process group that is handed a cupy
array copies it to host memory when the call is issued (``cupy.asnumpy`` waits for the
current stream, so every kernel that produced the data has finished), runs the collective
on the host copy, and hands the result back as a new cupy array on the current device. So
``ops.psum(x, "tp")`` with a cupy ``x`` returns a cupy array on every backend, as JAX users
expect, at the price of one device-to-host and one host-to-device copy per call.

cupy is never imported here: a cupy array can only arrive if the caller imported cupy.

Example:
    >>> import numpy as np
    >>> x = np.arange(3)
    >>> to_host(x) == (x, None)
    True
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["family", "to_device", "to_host"]


def family(x: Any) -> ModuleType | None:
    """The array module of a device array (``cupy``), or None for anything else.

    Example:
        >>> family(np.zeros(2)) is None
        True
    """
    if type(x).__module__.partition(".")[0] != "cupy":
        return None
    return sys.modules.get("cupy")


def to_host(x: Any) -> tuple[Any, ModuleType | None]:
    """Return ``(host_x, family)``: ``x`` itself and None unless ``x`` is a device array.

    For a cupy array: a numpy copy of it (made now, so the caller may overwrite ``x`` at once)
    and the ``cupy`` module, to turn the result back into a cupy array.

    Example:
        >>> to_host([1, 2])
        ([1, 2], None)
    """
    if type(x) is np.ndarray:  # the hot path
        return x, None
    xp = family(x)
    if xp is None:
        return x, None
    return xp.asnumpy(x), xp


def to_device(xp: ModuleType, result: Any) -> Any:
    """Return ``result`` (an array, or None off the root) as an array of ``xp``.

    Example:
        >>> to_device(np, None) is None
        True
    """
    return None if result is None else xp.asarray(result)
