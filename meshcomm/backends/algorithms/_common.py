"""Shared pieces of the collective algorithms: block boundaries, binomial trees, scratch memory,
and the reduction kernels.

Nothing here does I/O. Everything is small integer arithmetic that every rank computes the
same way, which is what keeps the two ends of every message agreeing on its size.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from meshcomm.reduction import ReduceOp

__all__ = [
    "block_bounds",
    "combine_into",
    "rel_pieces",
    "scratch",
    "subtree_size",
    "tree_children",
    "tree_parent",
    "ufunc_of",
    "wrap_ranges",
]

#: Scratch buffers larger than this are not kept between calls (they would pin memory).
SCRATCH_CACHE_MAX_BYTES = 64 << 20
#: Scratch buffers up to this size are plain allocations: malloc serves them from the heap
#: (no fresh pages) faster than the per-link cache is looked up.
SCRATCH_SMALL_BYTES = 64 << 10

_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

# Offsets of carved scratch arrays are rounded up to a cache line, which also satisfies the
# alignment of every numpy dtype (complex128 needs 16).
_ALIGN = 64

_cache_lock = threading.Lock()
_cache: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()


def block_bounds(count: int, parts: int) -> list[int]:
    """Return the ``parts + 1`` boundaries of ``count`` elements split ``np.array_split`` style.

    The first ``count % parts`` blocks hold one element more than the rest, so block 0 is
    always a largest one.

    Example:
        >>> block_bounds(7, 3)
        [0, 3, 5, 7]
    """
    q, rem = divmod(count, parts)
    return [i * q + min(i, rem) for i in range(parts + 1)]


def wrap_ranges(start: int, count: int, size: int) -> list[tuple[int, int]]:
    """Split the cyclic block range ``start, start + 1, ... (mod size)`` into linear ranges.

    Example:
        >>> wrap_ranges(3, 3, 4)
        [(3, 4), (0, 2)]
    """
    end = start + count
    if end <= size:
        return [(start, end)]
    return [(start, size), (0, end - size)]


def rel_pieces(lo: int, hi: int, root: int, size: int) -> list[tuple[int, int]]:
    """Split relative ranks ``[lo, hi)`` where their absolute ranks wrap from ``size - 1`` to 0.

    A relative rank ``v`` is the absolute rank ``(v + root) % size``. A message carrying the
    blocks of ``[lo, hi)`` travels as one message per piece, so a root can receive straight
    into its rank-ordered buffer; both ends compute the same pieces.

    Example:
        >>> rel_pieces(1, 4, root=2, size=4)
        [(1, 2), (2, 4)]
    """
    cut = size - root
    if lo < cut < hi:
        return [(lo, cut), (cut, hi)]
    return [(lo, hi)]


def tree_parent(v: int) -> int:
    """Return the parent of relative rank ``v > 0`` in the binomial tree rooted at 0."""
    return v - (v & -v)


def subtree_size(v: int, size: int) -> int:
    """Return how many relative ranks the binomial subtree of ``v`` covers: ``[v, v + n)``."""
    if v == 0:
        return size
    return min(v & -v, size - v)


def tree_children(v: int, size: int) -> list[int]:
    """Return the children of relative rank ``v``, nearest (smallest subtree) first.

    Example:
        >>> tree_children(0, 6), tree_children(4, 6), tree_children(3, 6)
        ([1, 2, 4], [5], [])
    """
    limit = size if v == 0 else (v & -v)
    children = []
    mask = 1
    while mask < limit and v + mask < size:
        children.append(v + mask)
        mask <<= 1
    return children


def combine_into(op: ReduceOp, first: np.ndarray, second: np.ndarray, out: np.ndarray) -> None:
    """``out = op(first, second)``, elementwise, with no temporary; ``out`` may be either input.

    The operand order is kept (it decides which NaN payload survives), so ranks that combine
    the same operands in the same order get the same bytes. ``op`` is a primitive op; on bool,
    numpy's add and multiply are logical or and and: what sum and prod mean there.

    Example:
        >>> a, b = np.array([1, 5]), np.array([3, 2])
        >>> combine_into(ReduceOp.MAX, a, b, out=b); b
        array([3, 5])
    """
    _UFUNCS[op](first, second, out=out)


def ufunc_of(op: ReduceOp) -> np.ufunc:
    """The numpy ufunc of primitive op ``op``: :func:`combine_into` without its call, for a
    caller that combines several operands (one dict lookup per call, not per operand).

    Example:
        >>> ufunc_of(ReduceOp.MAX)(np.array([1, 5]), np.array([3, 2]))
        array([3, 5])
    """
    return _UFUNCS[op]


def scratch(link: object, dtype: np.dtype, *counts: int) -> list[np.ndarray]:
    """Return one uninitialized array of ``dtype`` per count, carved from a per-link buffer.

    The buffer is kept between calls (up to ``SCRATCH_CACHE_MAX_BYTES``), so steady-state
    collectives allocate nothing. A link is used by one thread at a time, and every algorithm
    takes its scratch once per call, so two live carvings never overlap.
    """
    itemsize = dtype.itemsize
    if len(counts) == 1 and counts[0] * itemsize <= SCRATCH_SMALL_BYTES:
        return [np.empty(counts[0], dtype)]
    offsets = []
    total = 0
    for count in counts:
        offsets.append(total)
        total += -(-count * itemsize // _ALIGN) * _ALIGN
    raw = _raw_buffer(link, total)
    return [
        raw[off : off + count * itemsize].view(dtype)
        for off, count in zip(offsets, counts, strict=True)
    ]


def _raw_buffer(link: object, nbytes: int) -> np.ndarray:
    if nbytes > SCRATCH_CACHE_MAX_BYTES or nbytes <= SCRATCH_SMALL_BYTES:
        return np.empty(max(nbytes, _ALIGN), np.uint8)
    try:
        with _cache_lock:
            cached = _cache.get(link)
            if cached is not None and cached.nbytes >= nbytes:
                return cached
            fresh = np.empty(max(nbytes, _ALIGN), np.uint8)
            _cache[link] = fresh
            return fresh
    except TypeError:
        # The link is not hashable or not weakly referenceable: no cache, just allocate.
        return np.empty(nbytes, np.uint8)
