"""A collective call's checked signature, written once for every route it may take.

Every collective checks its arguments before any I/O and describes itself by its
fingerprint fields (dtype, shape, reduce op, root, axes, ``tiled``: what the ledger keeps,
what :mod:`meshcomm.diagnostics.fingerprint` compares across ranks). Those checks and fields
are the same whether the call is lowered per call (:mod:`meshcomm.group.lower`, onto host
buffers or a device communicator's) or once for a cached plan (:mod:`meshcomm.group.plans`,
:func:`meshcomm.group.device_lower.plan_all_reduce`): they live here, one function per
collective taking the input's native dtype and shape, so every route raises the same errors
in the same words and describes a call alike.

A :class:`Call` is what checking and lowering one operation needs (the communicator, the
world's pools, the words naming this rank and group); a group keeps one per operation.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group.arrays import ScratchPool
    >>> c = Call(SelfCommunicator(), ScratchPool(), "all_gather: rank 0")
    >>> all_gather(c, np.dtype(np.float32), (2, 3), -1, False)
    {'dtype': dtype('float32'), 'shape': (2, 3), 'axis': 2, 'tiled': False}
    >>> reduce_scatter(c, np.dtype(np.float32), (2, 3), "avg", 1, True, None)[2]
    (2, 3)
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from meshcomm.backends.base import Communicator, Runner
from meshcomm.errors import InvalidArgument
from meshcomm.group.arrays import (
    ResultPool,
    ScratchPool,
    as_array,
    check_dtype,
    dtype_name,
    normalize_shape,
)
from meshcomm.reduction import ReduceOp, check_op_dtype, parse_op

__all__ = [
    "COMPOSED",
    "Call",
    "agree",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "axis_arg",
    "broadcast",
    "check_out",
    "gather",
    "input_array",
    "int64_arg",
    "int_arg",
    "perm_pairs",
    "permute",
    "primitive",
    "rank_arg",
    "reduce",
    "reduce_op",
    "reduce_op_and_factor",
    "reduce_scatter",
    "rooted",
    "scatter",
    "spec",
    "split_blocks",
    "tag_arg",
]

#: Reduce ops made of a primitive one (SUM) and arithmetic around it.
COMPOSED = (ReduceOp.AVG, ReduceOp.PREMUL_SUM)


class Call:
    """What lowering one call needs: the communicator, the world's pools, and ``where``.

    ``where`` prefixes every error message, e.g. ``"all_reduce: rank 3 in group 'world'
    (size 4)"``. A group makes one Call per operation name and reuses it.

    Attributes:
        comm: the group's communicator.
        pool: scratch for send-side snapshots.
        results: where result buffers come from.
        where: the error-message prefix.
        rank: ``comm.rank``.
        size: ``comm.size``.
        runners: the runners its plans made, by (dtype, op or root): a signature that
            differs only in shape reuses one.
        buffers: the host buffers its lowerings take (synchronous, asynchronous), made on
            first use (:class:`meshcomm.group.lower.HostBuffers`), or None.
    """

    __slots__ = ("buffers", "comm", "pool", "rank", "results", "runners", "size", "where")

    def __init__(
        self,
        comm: Communicator,
        pool: ScratchPool,
        where: str,
        results: ResultPool | None = None,
    ) -> None:
        self.comm = comm
        self.pool = pool
        self.where = where
        self.results = ResultPool() if results is None else results
        self.rank = comm.rank
        self.size = comm.size
        self.runners: dict[tuple[np.dtype, Any], Runner] = {}
        self.buffers: Any = None


# -- single arguments ------------------------------------------------------------------------
def int_arg(where: str, value: Any, name: str) -> int:
    """Return ``value`` as an int (anything with ``__index__``; bool is refused).

    Raises:
        TypeError: not an int, naming ``where`` and ``name``.

    Example:
        >>> int_arg("rank 0", np.int8(3), "root")
        3
    """
    if isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__}") from None


def int64_arg(where: str, value: Any, name: str) -> int:
    """Return ``value`` as an int that fits int64 (split colors and keys)."""
    v = int_arg(where, value, name)
    if not -(2**63) <= v < 2**63:
        raise InvalidArgument(f"{where}: {name} must fit in int64, got {value!r}")
    return v


def rank_arg(c: Call, value: Any, name: str) -> int:
    """Return a group rank (root, dst, src) in ``[0, size)``."""
    r = int_arg(c.where, value, name)
    if not 0 <= r < c.size:
        raise InvalidArgument(f"{c.where}: {name} must be in [0, {c.size}), got {value!r}")
    return r


def axis_arg(where: str, axis: Any, ndim: int, name: str) -> int:
    """Return ``axis`` as an axis in ``[0, ndim)`` (negative counts from the end)."""
    a = int_arg(where, axis, name)
    if not -ndim <= a < ndim:
        raise InvalidArgument(
            f"{where}: {name}={axis} is out of range for {ndim} axes (valid: {-ndim}..{ndim - 1})"
        )
    return a % ndim


def tag_arg(where: str, tag: Any) -> int:
    """``tag`` as an int in ``[0, 2**31)``; InvalidArgument otherwise."""
    t = int_arg(where, tag, "tag")
    if not 0 <= t < 2**31:
        raise InvalidArgument(f"{where}: tag must be in [0, 2**31), got {tag!r}")
    return t


def input_array(c: Call, x: Any) -> tuple[np.ndarray, np.dtype]:
    """``x`` as a numpy array and its native dtype, checked."""
    arr = as_array(x, c.where)
    return arr, check_dtype(arr.dtype, c.where)


def check_out(c: Call, x: Any, out: Any) -> None:
    """Check a result buffer ``out`` for input ``x``: both numpy arrays of one shape and
    dtype (native byte order), ``out`` writeable and C-contiguous, and either ``x`` itself
    (in place) or apart from it.

    Raises:
        InvalidArgument: naming this rank and group, and both values.

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> c = Call(SelfCommunicator(), ScratchPool(), "all_reduce: rank 0")
        >>> try:
        ...     check_out(c, np.ones(3), np.empty(2))
        ... except InvalidArgument as exc:
        ...     print(str(exc).split("; ")[0])
        all_reduce: rank 0: out has shape (2,) and dtype float64
    """
    # Exactly ndarray: the runner views ``out`` flat and writes through it, which a
    # subclass can redefine (np.matrix stays 2-D) or make a lie (a masked array's mask).
    if type(x) is not np.ndarray or type(out) is not np.ndarray:
        raise InvalidArgument(
            f"{c.where}: out= takes plain numpy arrays (x and out); got x of type "
            f"{type(x).__name__} and out of type {type(out).__name__}; a masked array is "
            "not supported, any other ndarray subclass passes as np.asarray(...)"
        )
    if out.shape != x.shape or out.dtype != x.dtype:
        raise InvalidArgument(
            f"{c.where}: out has shape {out.shape} and dtype {out.dtype}; x has shape "
            f"{x.shape} and dtype {x.dtype}"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise InvalidArgument(
            f"{c.where}: out must be writeable and C-contiguous; got strides {out.strides}, "
            f"writeable={out.flags.writeable}"
        )
    if not out.dtype.isnative:
        raise InvalidArgument(f"{c.where}: out= takes native byte order, got dtype {out.dtype.str}")
    if out is not x and np.may_share_memory(x, out):
        same = x.ctypes.data == out.ctypes.data and x.strides == out.strides
        if not same:
            raise InvalidArgument(
                f"{c.where}: out overlaps x without being the same memory (x strides "
                f"{x.strides}, out strides {out.strides})"
            )


# (op as the caller spelled it, dtype) -> ReduceOp, for pairs already accepted (no factor).
# Bounded: a few spellings of a dozen ops times the supported dtypes.
_OP_CACHE: dict[tuple[Any, np.dtype], ReduceOp] = {}
_OP_CACHE_MAX = 1024


def reduce_op(where: str, op: Any, dtype: np.dtype) -> ReduceOp:
    """Parse ``op`` and check it is defined for ``dtype``; cached once accepted.

    Raises:
        InvalidArgument: not a reduce op.
        TypeError: the op is undefined for ``dtype``.

    Example:
        >>> reduce_op("rank 0", "SUM", np.dtype(np.float32))
        <ReduceOp.SUM: 'sum'>
    """
    hashable = True
    try:
        hit = _OP_CACHE.get((op, dtype))
    except TypeError:  # an unhashable op: the slow path says what is wrong with it
        hit, hashable = None, False
    if hit is not None:
        return hit
    try:
        rop = parse_op(op)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
    try:
        check_op_dtype(rop, dtype)
    except TypeError as exc:
        raise TypeError(f"{where}: {exc}") from None
    if hashable and len(_OP_CACHE) < _OP_CACHE_MAX:
        _OP_CACHE[(op, dtype)] = rop
    return rop


def reduce_op_and_factor(c: Call, op: Any, dtype: np.dtype, factor: Any) -> tuple[ReduceOp, Any]:
    """Parse ``op``, check it against ``dtype``, and return ``factor`` in ``dtype``."""
    rop = reduce_op(c.where, op, dtype)
    if rop is not ReduceOp.PREMUL_SUM:
        if factor is not None:
            raise InvalidArgument(
                f"{c.where}: factor= is only for 'premul_sum', not for {rop.value!r}"
            )
        return rop, None
    if factor is None:
        raise InvalidArgument(f"{c.where}: 'premul_sum' needs factor=")
    f = np.asarray(factor)
    if f.ndim != 0 or f.dtype.kind not in "biufc":
        raise InvalidArgument(f"{c.where}: factor must be a number, got {factor!r}")
    if f.dtype.kind == "c" and dtype.kind != "c":
        raise TypeError(f"{c.where}: complex factor {factor!r} for {dtype_name(dtype)} data")
    return rop, f.astype(dtype)


def primitive(rop: ReduceOp) -> ReduceOp:
    """The op the wire reduces with: ``avg`` and ``premul_sum`` are sums with arithmetic
    around them."""
    return ReduceOp.SUM if rop in COMPOSED else rop


def spec(c: Call, shape: Any, dtype: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype a rank without the array passes (broadcast, scatter off root)."""
    if shape is None or dtype is None:
        raise InvalidArgument(
            f"{c.where}: pass an array, or shape= and dtype= (got shape={shape!r}, dtype={dtype!r})"
        )
    return normalize_shape(shape, c.where), check_dtype(dtype, c.where)


def agree(c: Call, arr_shape: tuple[int, ...], dt: np.dtype, shape: Any, dtype: Any) -> None:
    """Check ``shape=`` and ``dtype=``, where given, describe the array passed too."""
    if shape is not None and normalize_shape(shape, c.where) != arr_shape:
        raise InvalidArgument(f"{c.where}: shape={shape!r} disagrees with the array's {arr_shape}")
    if dtype is not None and check_dtype(dtype, c.where) != dt:
        raise InvalidArgument(
            f"{c.where}: dtype={dtype!r} disagrees with the array's {dtype_name(dt)}"
        )


def split_blocks(
    c: Call, shape: tuple[int, ...], axis: Any, tiled: Any, name: str
) -> tuple[int, tuple[int, ...]]:
    """Check ``shape`` splits into ``size`` blocks along ``axis``; return it and the block
    shape."""
    if not shape:
        raise InvalidArgument(f"{c.where}: needs an array with at least 1 axis, got a 0-d array")
    ax = axis_arg(c.where, axis, len(shape), name)
    n = shape[ax]
    if not tiled and n != c.size:
        raise InvalidArgument(
            f"{c.where}: not tiled, x.shape[{name}={ax}] must equal the group size {c.size}, "
            f"got {n} (x.shape={shape})"
        )
    if tiled and n % c.size:
        raise InvalidArgument(
            f"{c.where}: tiled, x.shape[{name}={ax}] must be divisible by the group size "
            f"{c.size}, got {n} (x.shape={shape})"
        )
    block = shape[:ax] + ((n // c.size,) if tiled else ()) + shape[ax + 1 :]
    return ax, block


def perm_pairs(c: Call, perm: Any) -> tuple[tuple[int, int], ...]:
    """``perm`` as ``(src, dst)`` group-rank pairs, each rank at most once on each side."""
    try:
        pairs = tuple((operator.index(s), operator.index(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"{c.where}: perm must be a sequence of (src, dst) int pairs, got {perm!r}"
        ) from None
    sources: set[int] = set()
    dests: set[int] = set()
    for s, d in pairs:
        for name, v in (("source", s), ("destination", d)):
            if not 0 <= v < c.size:
                raise InvalidArgument(f"{c.where}: perm {name} {v} is out of range [0, {c.size})")
        if s in sources:
            raise InvalidArgument(f"{c.where}: rank {s} appears twice as a source in {perm!r}")
        if d in dests:
            raise InvalidArgument(f"{c.where}: rank {d} appears twice as a destination in {perm!r}")
        sources.add(s)
        dests.add(d)
    return pairs


# -- one signature per collective ------------------------------------------------------------
# Each takes the input's native dtype ``dt`` and ``shape`` and the call's own arguments,
# checks them, and returns the fingerprint fields (plus what the lowering needs beyond them).
def all_reduce(
    c: Call, dt: np.dtype, shape: tuple[int, ...], op: Any, factor: Any
) -> tuple[dict[str, Any], Any]:
    """``(fields, factor in dt or None)`` of an ``all_reduce``."""
    rop, f = reduce_op_and_factor(c, op, dt, factor)
    return {"dtype": dt, "shape": shape, "reduce": rop}, f


def all_gather(
    c: Call, dt: np.dtype, shape: tuple[int, ...], axis: Any, tiled: Any
) -> dict[str, Any]:
    """The fields of an ``all_gather`` (``axis`` normalized)."""
    if tiled and not shape:
        raise InvalidArgument(f"{c.where}: tiled all_gather needs at least 1 axis, got a 0-d array")
    ax = axis_arg(c.where, axis, len(shape) if tiled else len(shape) + 1, "axis")
    return {"dtype": dt, "shape": shape, "axis": ax, "tiled": bool(tiled)}


def reduce_scatter(
    c: Call, dt: np.dtype, shape: tuple[int, ...], op: Any, axis: Any, tiled: Any, factor: Any
) -> tuple[dict[str, Any], Any, tuple[int, ...]]:
    """``(fields, factor, block shape)`` of a ``reduce_scatter``."""
    rop, f = reduce_op_and_factor(c, op, dt, factor)
    ax, block = split_blocks(c, shape, axis, tiled, "axis")
    fields = {"dtype": dt, "shape": shape, "reduce": rop, "axis": ax, "tiled": bool(tiled)}
    return fields, f, block


def all_to_all(
    c: Call, dt: np.dtype, shape: tuple[int, ...], split_axis: Any, concat_axis: Any, tiled: Any
) -> tuple[dict[str, Any], tuple[int, ...]]:
    """``(fields, block shape)`` of an ``all_to_all``."""
    split, block = split_blocks(c, shape, split_axis, tiled, "split_axis")
    concat = axis_arg(c.where, concat_axis, len(shape), "concat_axis")
    fields = {"dtype": dt, "shape": shape, "axis": split, "axis2": concat, "tiled": bool(tiled)}
    return fields, block


def rooted(c: Call, dt: np.dtype, shape: tuple[int, ...], root: int) -> dict[str, Any]:
    """The fields of a rooted call that moves ``shape`` (``broadcast``, ``gather``, a
    ``scatter``'s block; ``root`` checked by :func:`rank_arg` first)."""
    return {"dtype": dt, "shape": shape, "root": root}


broadcast = gather = rooted


def reduce(
    c: Call, dt: np.dtype, shape: tuple[int, ...], root: int, op: Any, factor: Any
) -> tuple[dict[str, Any], Any]:
    """``(fields, factor)`` of a ``reduce`` (``root`` checked first)."""
    rop, f = reduce_op_and_factor(c, op, dt, factor)
    return {"dtype": dt, "shape": shape, "root": root, "reduce": rop}, f


def scatter(
    c: Call, dt: np.dtype, shape: tuple[int, ...], root: int, block: Any, dtype: Any
) -> tuple[dict[str, Any], tuple[int, ...]]:
    """``(fields, block shape)`` of a ``scatter`` of a stacked array of ``shape`` (one
    block per rank along axis 0), ``block=`` and ``dtype=`` agreeing where given."""
    if not shape or shape[0] != c.size:
        raise InvalidArgument(
            f"{c.where}: x must have shape (group size {c.size}, ...), got {shape}"
        )
    one = shape[1:]
    agree(c, one, dt, block, dtype)
    return rooted(c, dt, one, root), one


def permute(
    c: Call, dt: np.dtype, shape: tuple[int, ...], pairs: tuple[tuple[int, int], ...]
) -> tuple[dict[str, Any], int | None, int | None]:
    """``(fields, destination, source)`` of this rank in a ``permute`` over ``pairs``
    (checked by :func:`perm_pairs` first); None where it sends or receives nothing."""
    dst = next((d for s, d in pairs if s == c.rank), None)
    src = next((s for s, d in pairs if d == c.rank), None)
    return {"dtype": dt, "shape": shape, "args": pairs}, dst, src
