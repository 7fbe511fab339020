"""Argument checks (before any I/O, JAX-style messages stating both values) and the block
layouts the gather / scatter / all-to-all kernels pack leaves into.

The int check and the layouts are the group's (:mod:`meshcomm.group.signatures`,
:mod:`meshcomm.group.arrays`, over any array module): the ops layer words positions for
its own users (mesh axis sizes, not group sizes).

Example:
    >>> axis_arg("all_gather over 'x' (size 2) on rank 0", 3, 2, "axis")
    Traceback (most recent call last):
    ...
    meshcomm.errors.InvalidArgument: all_gather over 'x' (size 2) on rank 0: axis=3 is out of \
range for 2 positions (valid: -2..1)
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from meshcomm.errors import InvalidArgument
from meshcomm.group import arrays as _arrays
from meshcomm.group.signatures import int_arg

__all__ = ["axis_arg", "block_shape", "index_arg", "to_blocks", "unstack"]


def axis_arg(where: str, value: Any, n: int, name: str) -> int:
    """Return ``value`` as a position in ``[0, n)`` (negative counts from the end).

    Raises:
        TypeError: not an int.
        InvalidArgument: out of range.
    """
    a = int_arg(where, value, name)
    if not -n <= a < n:
        raise InvalidArgument(
            f"{where}: {name}={a} is out of range for {n} positions (valid: {-n}..{n - 1})"
        )
    return a % n


def index_arg(where: str, value: Any, size: int, name: str) -> int:
    """Return ``value`` as an axis index in ``[0, size)`` (no wrap-around).

    Raises:
        TypeError: not an int.
        InvalidArgument: out of range.
    """
    i = int_arg(where, value, name)
    if not 0 <= i < size:
        raise InvalidArgument(f"{where}: {name} must be an axis index in [0, {size}), got {i}")
    return i


def block_shape(
    where: str, shape: tuple[int, ...], ax: int, size: int, tiled: bool, name: str
) -> tuple[int, ...]:
    """Check ``shape`` splits into ``size`` blocks along ``ax``; return one block's shape.

    Raises:
        InvalidArgument: not tiled and ``shape[ax] != size``; tiled and not divisible.
    """
    n = shape[ax]
    if not tiled and n != size:
        raise InvalidArgument(
            f"{where}: with tiled=False, x.shape[{name}] must equal the axis size, but they "
            f"are {n} and {size} ({name}={ax}, x.shape={shape})"
        )
    if tiled and n % size:
        raise InvalidArgument(
            f"{where}: with tiled=True, x.shape[{name}] must be divisible by the axis size, "
            f"but they are {n} and {size} ({name}={ax}, x.shape={shape})"
        )
    return shape[:ax] + ((n // size,) if tiled else ()) + shape[ax + 1 :]


def to_blocks(xp: ModuleType, arr: Any, ax: int, size: int, tiled: bool) -> Any:
    """Return ``arr`` as ``(size, k)``: row ``r`` is block ``r`` along ``ax``, flattened.

    Example:
        >>> import numpy as np
        >>> to_blocks(np, np.arange(6).reshape(2, 3).T, ax=1, size=2, tiled=False)
        array([[0, 1, 2],
               [3, 4, 5]])
    """
    return _arrays.rank_major(arr, ax, size, tiled, xp).reshape(size, -1)


def unstack(
    xp: ModuleType, flat: Any, block: tuple[int, ...], ax: int, size: int, tiled: bool
) -> Any:
    """Put ``size`` rank-major blocks together: stacked at ``ax``, or concatenated if tiled.

    Example:
        >>> import numpy as np
        >>> unstack(np, np.arange(4), (2,), ax=0, size=2, tiled=True)
        array([0, 1, 2, 3])
    """
    return _arrays.unstack(flat, block, ax, size, tiled, xp=xp)
