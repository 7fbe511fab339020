"""How each collective lowers onto a communicator's flat buffers.

Each function checks its arguments, takes the input snapshot (which is also the layout
transform), allocates the result, and returns ``(body, fingerprint)``: ``body`` does the
communication and finishing touches when the progress engine runs it; ``fingerprint``
describes the call for debug checks (None for point-to-point). Nothing here does I/O, so
every argument error is raised before any byte leaves the process.

Allocations: the result array belongs to the caller and, where it can, is the very buffer
the communicator writes (``all_reduce``, ``broadcast``, ``reduce`` on root,
``reduce_scatter``, ``scatter``, ``gather``, ``all_gather`` at axis 0). Results come from
the world's :class:`~meshcomm.group.arrays.ResultPool`, which recycles large result buffers the
caller has dropped (no fresh page-faulted memory per call in a loop). Send-side snapshots
that never escape come from the world's :class:`~meshcomm.group.arrays.ScratchPool`.

Plans (:mod:`meshcomm.group.plans`) lower a call *signature* once with the checks of this
module; a group's calls on numpy arrays take them, and the functions here serve the rest
(``premul_sum``, lists, GPU arrays).

Cost: the per-call functions run on every call, so the common case is kept to plain
attribute, tuple and dict operations: dtypes and (op, dtype) pairs already accepted once
are found in small caches (:func:`meshcomm.group.arrays.check_dtype`, :func:`reduce_op`);
everything else, and every error, takes the full checking path.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group.arrays import ResultPool, ScratchPool
    >>> call = Call(SelfCommunicator(), ScratchPool(), "all_reduce: rank 0", ResultPool())
    >>> body, fingerprint = all_reduce(call, [1.0, 2.0], "avg", None)
    >>> body(), fingerprint["reduce"]
    (array([1., 2.]), <ReduceOp.AVG: 'avg'>)
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from meshcomm.backends.base import Communicator, Runner
from meshcomm.errors import InvalidArgument
from meshcomm.group.arrays import (
    ResultPool,
    ScratchPool,
    as_array,
    blocks_view,
    check_dtype,
    copy_into,
    dtype_name,
    normalize_shape,
    unstack,
)
from meshcomm.reduction import ReduceOp, check_op_dtype, parse_op

__all__ = [
    "COMPOSED",
    "Call",
    "Lowered",
    "agree",
    "all_gather",
    "all_reduce",
    "axis_arg",
    "all_to_all",
    "barrier",
    "broadcast",
    "check_out",
    "gather",
    "input_array",
    "int64_arg",
    "perm_pairs",
    "permute",
    "rank_arg",
    "reduce_op",
    "reduce_op_and_factor",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "split_blocks",
    "tag_arg",
]

#: What a lowering returns: the body to run in order, and the debug fingerprint fields.
Lowered = tuple[Callable[[], Any], dict[str, Any] | None]

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
    """

    __slots__ = ("comm", "pool", "rank", "results", "runners", "size", "where")

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


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- argument checks -----------------------------------------------------------------------
def int_arg(where: str, value: Any, name: str) -> int:
    """Return ``value`` as an int (bool is refused), or raise TypeError."""
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
        >>> from meshcomm.group.arrays import ScratchPool
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


def _spec(c: Call, shape: Any, dtype: Any) -> tuple[tuple[int, ...], np.dtype]:
    if shape is None or dtype is None:
        raise InvalidArgument(
            f"{c.where}: pass an array, or shape= and dtype= (got shape={shape!r}, dtype={dtype!r})"
        )
    return normalize_shape(shape, c.where), check_dtype(dtype, c.where)


def agree(c: Call, arr_shape: tuple[int, ...], dt: np.dtype, shape: Any, dtype: Any) -> None:
    if shape is not None and normalize_shape(shape, c.where) != arr_shape:
        raise InvalidArgument(f"{c.where}: shape={shape!r} disagrees with the array's {arr_shape}")
    if dtype is not None and check_dtype(dtype, c.where) != dt:
        raise InvalidArgument(
            f"{c.where}: dtype={dtype!r} disagrees with the array's {dtype_name(dt)}"
        )


def split_blocks(
    c: Call, arr: np.ndarray, axis: Any, tiled: bool, name: str
) -> tuple[int, tuple[int, ...]]:
    """Check ``arr`` splits into ``size`` blocks along ``axis``; return it and the block shape."""
    if arr.ndim == 0:
        raise InvalidArgument(f"{c.where}: needs an array with at least 1 axis, got a 0-d array")
    ax = axis_arg(c.where, axis, arr.ndim, name)
    n = arr.shape[ax]
    if not tiled and n != c.size:
        raise InvalidArgument(
            f"{c.where}: not tiled, x.shape[{name}={ax}] must equal the group size {c.size}, "
            f"got {n} (x.shape={arr.shape})"
        )
    if tiled and n % c.size:
        raise InvalidArgument(
            f"{c.where}: tiled, x.shape[{name}={ax}] must be divisible by the group size "
            f"{c.size}, got {n} (x.shape={arr.shape})"
        )
    block = arr.shape[:ax] + ((n // c.size,) if tiled else ()) + arr.shape[ax + 1 :]
    return ax, block


def _send_side(
    c: Call, view: np.ndarray, dt: np.dtype, snapshot: bool
) -> tuple[np.ndarray | None, np.ndarray]:
    """The send buffer: ``view`` itself, or a pooled snapshot copy of it.

    A synchronous call (``snapshot=False``) whose send side is already C-contiguous in
    native byte order is read where it lies: the caller waits for the call, so the input
    cannot change under it, and the communicator only reads send buffers. Otherwise (an
    asynchronous call, a transposing view, another byte order) the input is copied into
    scratch. Returns ``(base, send)``: give ``base`` back to ``c.pool`` unless it is None.
    """
    if not snapshot and view.dtype == dt and view.flags.c_contiguous:
        return None, view
    base, send = c.pool.take(dt, view.shape)
    copy_into(send, view)
    return base, send


def perm_pairs(c: Call, perm: Any) -> tuple[tuple[int, int], ...]:
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


# -- collectives ---------------------------------------------------------------------------
def all_reduce(c: Call, x: Any, op: Any, factor: Any, snapshot: bool = True) -> Lowered:
    """Lower ``all_reduce``; ``snapshot=False`` (a synchronous call) may read ``x`` in place.

    The result buffer is the communicator's buffer. A synchronous call whose input is already
    flat-able (C-contiguous, native byte order) hands the input over as is to the
    communicator's ``all_reduce_out``, which writes the reduction into the result (on most
    backends straight from the input: one pass over memory fewer than copying it first).
    Otherwise the input is copied into the result buffer (scaled on the way for premul_sum)
    and reduced in place.
    """
    arr, dt = input_array(c, x)
    rop, f = reduce_op_and_factor(c, op, dt, factor)
    shape = arr.shape
    buf = c.results.take(dt, arr.size)
    out = buf if len(shape) == 1 else buf.reshape(shape)
    prim = ReduceOp.SUM if rop in COMPOSED else rop
    comm, size = c.comm, c.size
    if not snapshot and f is None and arr.flags.c_contiguous and arr.dtype == dt:
        send = arr.reshape(-1)

        def body_out_of_place() -> np.ndarray:
            comm.all_reduce_out(send, buf, prim)
            if rop is ReduceOp.AVG:
                np.true_divide(buf, size, out=buf)
            return out

        return body_out_of_place, {"dtype": dt, "shape": shape, "reduce": rop}

    if f is None:
        np.copyto(out, arr)  # the snapshot becomes the result
    else:
        np.multiply(arr, f, out=out)  # snapshot and scale in one pass

    def body() -> np.ndarray:
        comm.all_reduce(buf, prim)
        if rop is ReduceOp.AVG:
            np.true_divide(buf, size, out=buf)
        return out

    return body, {"dtype": dt, "shape": shape, "reduce": rop}


def all_gather(c: Call, x: Any, axis: Any, tiled: bool, snapshot: bool = True) -> Lowered:
    arr, dt = input_array(c, x)
    if tiled and arr.ndim == 0:
        raise InvalidArgument(f"{c.where}: tiled all_gather needs at least 1 axis, got a 0-d array")
    ax = axis_arg(c.where, axis, arr.ndim if tiled else arr.ndim + 1, "axis")
    comm, pool, size, shape = c.comm, c.pool, c.size, arr.shape
    base, send = _send_side(c, arr, dt, snapshot)
    results = c.results
    recv = results.take(dt, size * arr.size)

    def body() -> np.ndarray:
        comm.all_gather(send.reshape(-1), recv)
        if base is not None:
            pool.give(base)
        return unstack(recv, shape, ax, size, bool(tiled), results.take)

    return body, {"dtype": dt, "shape": shape, "axis": ax, "tiled": bool(tiled)}


def reduce_scatter(
    c: Call, x: Any, op: Any, axis: Any, tiled: bool, factor: Any, snapshot: bool = True
) -> Lowered:
    arr, dt = input_array(c, x)
    rop, f = reduce_op_and_factor(c, op, dt, factor)
    ax, block = split_blocks(c, arr, axis, tiled, "axis")
    comm, pool, size = c.comm, c.pool, c.size
    # Block r (this rank's share) is contiguous in the snapshot and comes back in the
    # result's own layout, so nothing is copied after the communication.
    view = blocks_view(arr, ax, size, tiled)
    base, send = _send_side(c, view, dt, snapshot or f is not None)
    if f is not None:
        np.multiply(send, f, out=send)
    recv = c.results.take(dt, _prod(block))
    prim = ReduceOp.SUM if rop in COMPOSED else rop

    def body() -> np.ndarray:
        comm.reduce_scatter(send.reshape(-1), recv, prim)
        if base is not None:
            pool.give(base)
        if rop is ReduceOp.AVG:
            np.true_divide(recv, size, out=recv)
        return recv.reshape(block)

    fp = {"dtype": dt, "shape": arr.shape, "reduce": rop, "axis": ax, "tiled": bool(tiled)}
    return body, fp


def all_to_all(
    c: Call, x: Any, split_axis: Any, concat_axis: Any, tiled: bool, snapshot: bool = True
) -> Lowered:
    arr, dt = input_array(c, x)
    split, block = split_blocks(c, arr, split_axis, tiled, "split_axis")
    concat = axis_arg(c.where, concat_axis, arr.ndim, "concat_axis")
    comm, pool, size = c.comm, c.pool, c.size
    view = blocks_view(arr, split, size, tiled)
    base, send = _send_side(c, view, dt, snapshot)
    results = c.results
    recv = results.take(dt, size * _prod(block))

    def body() -> np.ndarray:
        comm.all_to_all(send.reshape(-1), recv)
        if base is not None:
            pool.give(base)
        return unstack(recv, block, concat, size, bool(tiled), results.take)

    fp = {"dtype": dt, "shape": arr.shape, "axis": split, "axis2": concat, "tiled": bool(tiled)}
    return body, fp


def broadcast(c: Call, x: Any, root: Any, shape: Any, dtype: Any, snapshot: bool = True) -> Lowered:
    """Lower ``broadcast``; ``snapshot=False`` (a synchronous call) may read root's ``x`` in place.

    A synchronous root whose input is flat-able hands it over as is to the communicator's
    ``broadcast_out``: on most backends it sends from it and fills root's result at the same
    time, instead of copying it into the result before anything moves.
    """
    r = rank_arg(c, root, "root")
    buf: np.ndarray | None = None
    send: np.ndarray | None = None
    if x is not None:
        arr, dt = input_array(c, x)
        agree(c, arr.shape, dt, shape, dtype)
        out_shape = arr.shape
        if r == c.rank:
            if not snapshot and arr.flags.c_contiguous and arr.dtype == dt:
                send = arr.reshape(-1)
            else:
                buf = copy_into(c.results.take(dt, arr.size), arr)
    elif r == c.rank:
        raise InvalidArgument(f"{c.where}: the root (rank {r}) must pass the array, got None")
    else:
        out_shape, dt = _spec(c, shape, dtype)
    result = c.results.take(dt, _prod(out_shape)) if buf is None else buf
    comm = c.comm
    if send is not None:

        def body_out_of_place() -> np.ndarray:
            comm.broadcast_out(send, result, r)
            return result.reshape(out_shape)

        return body_out_of_place, {"dtype": dt, "shape": out_shape, "root": r}

    def body() -> np.ndarray:
        comm.broadcast(result, r)
        return result.reshape(out_shape)

    return body, {"dtype": dt, "shape": out_shape, "root": r}


def reduce(c: Call, x: Any, root: Any, op: Any, factor: Any) -> Lowered:
    r = rank_arg(c, root, "root")
    arr, dt = input_array(c, x)
    rop, f = reduce_op_and_factor(c, op, dt, factor)
    comm, pool, size, shape = c.comm, c.pool, c.size, arr.shape
    base: np.ndarray | None = None
    if r == c.rank:
        buf = c.results.take(dt, arr.size)
    else:  # clobbered and not returned off root: scratch will do
        base, buf = pool.take(dt, (arr.size,))
    copy_into(buf, arr)
    if f is not None:
        np.multiply(buf, f, out=buf)
    prim = ReduceOp.SUM if rop in COMPOSED else rop

    def body() -> np.ndarray | None:
        comm.reduce(buf, r, prim)
        if base is not None:
            pool.give(base)
            return None
        if rop is ReduceOp.AVG:
            np.true_divide(buf, size, out=buf)
        return buf.reshape(shape)

    return body, {"dtype": dt, "shape": shape, "root": r, "reduce": rop}


def gather(c: Call, x: Any, root: Any, snapshot: bool = True) -> Lowered:
    r = rank_arg(c, root, "root")
    arr, dt = input_array(c, x)
    comm, pool, size, shape = c.comm, c.pool, c.size, arr.shape
    base, send = _send_side(c, arr, dt, snapshot)
    recv = c.results.take(dt, size * arr.size) if r == c.rank else None

    def body() -> np.ndarray | None:
        comm.gather(send.reshape(-1), recv, r)
        if base is not None:
            pool.give(base)
        return None if recv is None else recv.reshape((size, *shape))

    return body, {"dtype": dt, "shape": shape, "root": r}


def scatter(c: Call, x: Any, root: Any, shape: Any, dtype: Any, snapshot: bool = True) -> Lowered:
    r = rank_arg(c, root, "root")
    comm, pool = c.comm, c.pool
    base: np.ndarray | None = None
    send: np.ndarray | None = None
    if x is not None:
        arr, dt = input_array(c, x)
        if arr.ndim == 0 or arr.shape[0] != c.size:
            raise InvalidArgument(
                f"{c.where}: x must have shape (group size {c.size}, ...), got {arr.shape}"
            )
        block = arr.shape[1:]
        agree(c, block, dt, shape, dtype)
        if r == c.rank:
            base, send = _send_side(c, arr, dt, snapshot)
    elif r == c.rank:
        raise InvalidArgument(f"{c.where}: the root (rank {r}) must pass the array, got None")
    else:
        block, dt = _spec(c, shape, dtype)
    recv = c.results.take(dt, _prod(block))

    def body() -> np.ndarray:
        comm.scatter(None if send is None else send.reshape(-1), recv, r)
        if base is not None:
            pool.give(base)
        return recv.reshape(block)

    return body, {"dtype": dt, "shape": block, "root": r}


def permute(c: Call, x: Any, perm: Any, snapshot: bool = True) -> Lowered:
    pairs = perm_pairs(c, perm)
    arr, dt = input_array(c, x)
    dst = next((d for s, d in pairs if s == c.rank), None)
    src = next((s for s, d in pairs if d == c.rank), None)
    comm, pool, shape = c.comm, c.pool, arr.shape
    base: np.ndarray | None = None
    send = np.empty(0, dtype=dt)
    if dst is not None:
        base, send = _send_side(c, arr, dt, snapshot)
        send = send.reshape(-1)
    # As jax.lax.ppermute: a rank nobody sends to gets zeros.
    recv = np.zeros(arr.size, dtype=dt) if src is None else c.results.take(dt, arr.size)

    def body() -> np.ndarray:
        comm.permute(send, dst, recv, src)
        if base is not None:
            pool.give(base)
        return recv.reshape(shape)

    return body, {"dtype": dt, "shape": shape, "args": pairs}


def barrier(c: Call) -> Lowered:
    return c.comm.barrier, {}


# -- plans ---------------------------------------------------------------------------------
# -- point to point ------------------------------------------------------------------------
def send(c: Call, x: Any, dst: Any, tag: Any, snapshot: bool = True) -> Lowered:
    d = rank_arg(c, dst, "dst")
    t = tag_arg(c.where, tag)
    arr, dt = input_array(c, x)
    comm, pool = c.comm, c.pool
    base, buf = _send_side(c, arr, dt, snapshot)

    def body() -> None:
        comm.send(buf, d, t)
        if base is not None:
            pool.give(base)

    return body, None


def recv(c: Call, src: Any, tag: Any, return_source: bool) -> Lowered:
    s = None if src is None else rank_arg(c, src, "src")
    t = tag_arg(c.where, tag)
    comm = c.comm

    def body() -> Any:
        arr, source = comm.recv(s, t)
        return (arr, source) if return_source else arr

    return body, None
