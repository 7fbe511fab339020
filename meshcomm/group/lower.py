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

The argument checks and fingerprint fields of every collective are
:mod:`meshcomm.group.signatures`' (the names below re-export its checks). Plans
(:mod:`meshcomm.group.plans`) lower a call *signature* once with the same checks; a
group's calls on numpy arrays take them, and the functions here serve the rest
(``premul_sum``, lists, host copies of device arrays); which serves a call is decided
in one place, :mod:`meshcomm.group.collectives`.

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

from collections.abc import Callable
from typing import Any

import numpy as np

from meshcomm.errors import InvalidArgument
from meshcomm.group import signatures as _sig
from meshcomm.group.arrays import blocks_view, copy_into, unstack
from meshcomm.group.signatures import (
    COMPOSED,
    Call,
    agree,
    axis_arg,
    check_out,
    input_array,
    int64_arg,
    int_arg,
    perm_pairs,
    primitive,
    rank_arg,
    reduce_op,
    reduce_op_and_factor,
    spec,
    split_blocks,
    tag_arg,
)
from meshcomm.reduction import ReduceOp

__all__ = [
    "COMPOSED",
    "Call",
    "Lowered",
    "agree",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "axis_arg",
    "barrier",
    "broadcast",
    "check_out",
    "gather",
    "input_array",
    "int64_arg",
    "int_arg",
    "perm_pairs",
    "permute",
    "rank_arg",
    "recv",
    "reduce",
    "reduce_op",
    "reduce_op_and_factor",
    "reduce_scatter",
    "scatter",
    "send",
    "split_blocks",
    "tag_arg",
]

#: What a lowering returns: the body to run in order, and the debug fingerprint fields.
Lowered = tuple[Callable[[], Any], dict[str, Any] | None]


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
    shape = arr.shape
    fields, f = _sig.all_reduce(c, dt, shape, op, factor)
    rop = fields["reduce"]
    buf = c.results.take(dt, arr.size)
    out = buf if len(shape) == 1 else buf.reshape(shape)
    prim = primitive(rop)
    comm, size = c.comm, c.size
    if not snapshot and f is None and arr.flags.c_contiguous and arr.dtype == dt:
        send = arr.reshape(-1)

        def body_out_of_place() -> np.ndarray:
            comm.all_reduce_out(send, buf, prim)
            if rop is ReduceOp.AVG:
                np.true_divide(buf, size, out=buf)
            return out

        return body_out_of_place, fields

    if f is None:
        np.copyto(out, arr)  # the snapshot becomes the result
    else:
        np.multiply(arr, f, out=out)  # snapshot and scale in one pass

    def body() -> np.ndarray:
        comm.all_reduce(buf, prim)
        if rop is ReduceOp.AVG:
            np.true_divide(buf, size, out=buf)
        return out

    return body, fields


def all_gather(c: Call, x: Any, axis: Any, tiled: bool, snapshot: bool = True) -> Lowered:
    """Lower ``all_gather``: received rank-major, then unstacked at ``axis``."""
    arr, dt = input_array(c, x)
    fields = _sig.all_gather(c, dt, arr.shape, axis, tiled)
    ax, tile = fields["axis"], fields["tiled"]
    comm, pool, size, shape = c.comm, c.pool, c.size, arr.shape
    base, send = _send_side(c, arr, dt, snapshot)
    results = c.results
    recv = results.take(dt, size * arr.size)

    def body() -> np.ndarray:
        comm.all_gather(send.reshape(-1), recv)
        if base is not None:
            pool.give(base)
        return unstack(recv, shape, ax, size, tile, results.take)

    return body, fields


def reduce_scatter(
    c: Call, x: Any, op: Any, axis: Any, tiled: bool, factor: Any, snapshot: bool = True
) -> Lowered:
    """Lower ``reduce_scatter``: this rank's block of the reduction."""
    arr, dt = input_array(c, x)
    fields, f, block = _sig.reduce_scatter(c, dt, arr.shape, op, axis, tiled, factor)
    rop = fields["reduce"]
    comm, pool, size = c.comm, c.pool, c.size
    # Block r (this rank's share) is contiguous in the snapshot and comes back in the
    # result's own layout, so nothing is copied after the communication.
    view = blocks_view(arr, fields["axis"], size, tiled)
    base, send = _send_side(c, view, dt, snapshot or f is not None)
    if f is not None:
        np.multiply(send, f, out=send)
    recv = c.results.take(dt, _prod(block))
    prim = primitive(rop)

    def body() -> np.ndarray:
        comm.reduce_scatter(send.reshape(-1), recv, prim)
        if base is not None:
            pool.give(base)
        if rop is ReduceOp.AVG:
            np.true_divide(recv, size, out=recv)
        return recv.reshape(block)

    return body, fields


def all_to_all(
    c: Call, x: Any, split_axis: Any, concat_axis: Any, tiled: bool, snapshot: bool = True
) -> Lowered:
    """Lower ``all_to_all``: sent rank-major along the split axis, unstacked at the concat
    axis."""
    arr, dt = input_array(c, x)
    fields, block = _sig.all_to_all(c, dt, arr.shape, split_axis, concat_axis, tiled)
    concat, tile = fields["axis2"], fields["tiled"]
    comm, pool, size = c.comm, c.pool, c.size
    view = blocks_view(arr, fields["axis"], size, tiled)
    base, send = _send_side(c, view, dt, snapshot)
    results = c.results
    recv = results.take(dt, size * _prod(block))

    def body() -> np.ndarray:
        comm.all_to_all(send.reshape(-1), recv)
        if base is not None:
            pool.give(base)
        return unstack(recv, block, concat, size, tile, results.take)

    return body, fields


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
        out_shape, dt = spec(c, shape, dtype)
    fields = _sig.broadcast(c, dt, out_shape, r)
    result = c.results.take(dt, _prod(out_shape)) if buf is None else buf
    comm = c.comm
    if send is not None:

        def body_out_of_place() -> np.ndarray:
            comm.broadcast_out(send, result, r)
            return result.reshape(out_shape)

        return body_out_of_place, fields

    def body() -> np.ndarray:
        comm.broadcast(result, r)
        return result.reshape(out_shape)

    return body, fields


def reduce(c: Call, x: Any, root: Any, op: Any, factor: Any, snapshot: bool = True) -> Lowered:
    """Lower ``reduce``: the reduction on root, None elsewhere (the input is always copied:
    the wire reduces in place)."""
    r = rank_arg(c, root, "root")
    arr, dt = input_array(c, x)
    fields, f = _sig.reduce(c, dt, arr.shape, r, op, factor)
    rop = fields["reduce"]
    comm, pool, size, shape = c.comm, c.pool, c.size, arr.shape
    base: np.ndarray | None = None
    if r == c.rank:
        buf = c.results.take(dt, arr.size)
    else:  # clobbered and not returned off root: scratch will do
        base, buf = pool.take(dt, (arr.size,))
    copy_into(buf, arr)
    if f is not None:
        np.multiply(buf, f, out=buf)
    prim = primitive(rop)

    def body() -> np.ndarray | None:
        comm.reduce(buf, r, prim)
        if base is not None:
            pool.give(base)
            return None
        if rop is ReduceOp.AVG:
            np.true_divide(buf, size, out=buf)
        return buf.reshape(shape)

    return body, fields


def gather(c: Call, x: Any, root: Any, snapshot: bool = True) -> Lowered:
    """Lower ``gather``: every rank's array stacked on root, None elsewhere."""
    r = rank_arg(c, root, "root")
    arr, dt = input_array(c, x)
    fields = _sig.gather(c, dt, arr.shape, r)
    comm, pool, size, shape = c.comm, c.pool, c.size, arr.shape
    base, send = _send_side(c, arr, dt, snapshot)
    recv = c.results.take(dt, size * arr.size) if r == c.rank else None

    def body() -> np.ndarray | None:
        comm.gather(send.reshape(-1), recv, r)
        if base is not None:
            pool.give(base)
        return None if recv is None else recv.reshape((size, *shape))

    return body, fields


def scatter(c: Call, x: Any, root: Any, shape: Any, dtype: Any, snapshot: bool = True) -> Lowered:
    """Lower ``scatter``: root's block ``r`` to rank ``r``."""
    r = rank_arg(c, root, "root")
    comm, pool = c.comm, c.pool
    base: np.ndarray | None = None
    send: np.ndarray | None = None
    if x is not None:
        arr, dt = input_array(c, x)
        fields, block = _sig.scatter(c, dt, arr.shape, r, shape, dtype)
        if r == c.rank:
            base, send = _send_side(c, arr, dt, snapshot)
    elif r == c.rank:
        raise InvalidArgument(f"{c.where}: the root (rank {r}) must pass the array, got None")
    else:
        block, dt = spec(c, shape, dtype)
        fields = _sig.rooted(c, dt, block, r)
    recv = c.results.take(dt, _prod(block))

    def body() -> np.ndarray:
        comm.scatter(None if send is None else send.reshape(-1), recv, r)
        if base is not None:
            pool.give(base)
        return recv.reshape(block)

    return body, fields


def permute(c: Call, x: Any, perm: Any, snapshot: bool = True) -> Lowered:
    """Lower ``permute`` (``ppermute``); a rank nobody sends to gets zeros."""
    pairs = perm_pairs(c, perm)
    arr, dt = input_array(c, x)
    fields, dst, src = _sig.permute(c, dt, arr.shape, pairs)
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

    return body, fields


def barrier(c: Call) -> Lowered:
    """Lower ``barrier``: the communicator's, no fields beyond the name."""
    return c.comm.barrier, {}


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
