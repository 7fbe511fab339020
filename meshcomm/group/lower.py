"""How each collective lowers onto a communicator's flat buffers, on host and on a device.

Each collective's lowering is written once, over a :class:`Buffers`: the array module
(``xp``: numpy, or cupy for a device array), the communicator that runs the call, and how
the call gets its buffers. :class:`HostBuffers` is a group's host path (numpy arrays over
the host communicator); :class:`~meshcomm.group.device_lower.DeviceBuffers` is a device's
(cupy arrays over the device communicator, nccl: no host copy is ever made). A lowering
checks its arguments, takes the send side (which is also the layout transform), allocates
the result, and returns ``(body, fingerprint)``: ``body`` does the communication and
finishing touches when the group runs it; ``fingerprint`` describes the call for debug
checks (None for point-to-point). Nothing here does I/O, so every argument error is
raised before any byte leaves the process.

Buffers on host: the result belongs to the caller and, where it can, is the very buffer
the communicator writes (``all_reduce``, ``broadcast``, ``reduce`` on root,
``reduce_scatter``, ``scatter``, ``gather``, ``all_gather`` at axis 0). Results come from
the world's :class:`~meshcomm.group.arrays.ResultPool`, which recycles large result buffers
the caller has dropped (no fresh page-faulted memory per call in a loop). Send-side
copies that never escape (an asynchronous call's snapshot, a transposing layout, a
``premul_sum``'s scaled input) come from the world's
:class:`~meshcomm.group.arrays.ScratchPool`. A synchronous call reads a C-contiguous input
where it lies. On a device every buffer is a new array of the input's module, and the
input is read where it lies (the body runs at once, on the caller's stream).

The argument checks and fingerprint fields of every collective are
:mod:`meshcomm.group.signatures`' (the names below re-export its checks). Plans
(:mod:`meshcomm.group.plans`) lower a call *signature* once with the same checks; a
group's calls on numpy arrays take them, and the functions here serve the rest
(``premul_sum``, lists, host copies of device arrays, device arrays); which serves a call
is decided in one place, :mod:`meshcomm.group.collectives`.

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
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from meshcomm.backends.base import Communicator
from meshcomm.errors import InvalidArgument
from meshcomm.group import signatures as _sig
from meshcomm.group.arrays import blocks_view, unstack
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
    "Buffers",
    "Call",
    "HostBuffers",
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


class Buffers(Protocol):
    """What a lowering needs beyond the call: where its arrays live and who moves them.

    Attributes:
        xp: the arrays' module (numpy; cupy for a device array).
        comm: the communicator the call runs on.
        broadcasts_out: whether a root reading its input where it lies may hand it to
            ``comm.broadcast_out`` (else it copies it into the result, broadcast in place).
    """

    @property
    def xp(self) -> ModuleType: ...
    @property
    def comm(self) -> Communicator: ...
    @property
    def broadcasts_out(self) -> bool: ...

    def array(self, c: Call, x: Any) -> tuple[Any, np.dtype]:
        """``x`` as an array of ``xp`` and its native dtype, checked."""

    def reads(self, arr: Any, dt: np.dtype) -> bool:
        """Whether the communicator may read ``arr`` where it lies (no copy first)."""

    def prim(self, c: Call, fields: dict[str, Any]) -> ReduceOp:
        """The op the communicator reduces with for a reducing call's checked ``fields``."""

    def take(self, dt: np.dtype, n: int) -> Any:
        """A flat C-contiguous result buffer of ``n`` elements (it may escape)."""

    def scratch(self, dt: np.dtype, n: int) -> tuple[Any, Any]:
        """``(base, flat)``: a buffer that never escapes; ``base`` goes to :meth:`give`
        once the call is done, unless it is None."""

    def give(self, base: Any) -> None:
        """Give back a :meth:`scratch` buffer's ``base``."""


class HostBuffers:
    """A group's host path: numpy arrays over the host communicator (``c.comm``), results
    from the world's result pool, copies that never escape from its scratch pool.

    ``snapshot``: the call is asynchronous (the caller may change its input once it is
    issued), so every input is read through a copy made now.
    """

    __slots__ = ("comm", "pool", "snapshot", "take")

    xp = np
    broadcasts_out = True

    def __init__(self, c: Call, snapshot: bool) -> None:
        self.comm = c.comm
        self.pool = c.pool
        self.take = c.results.take
        self.snapshot = snapshot

    def array(self, c: Call, x: Any) -> tuple[np.ndarray, np.dtype]:
        return input_array(c, x)

    def reads(self, arr: np.ndarray, dt: np.dtype) -> bool:
        # A synchronous call waits for the call, so the input cannot change under it, and
        # the communicator only reads send buffers; another byte order is copied.
        return not self.snapshot and arr.dtype == dt and arr.flags.c_contiguous

    def prim(self, c: Call, fields: dict[str, Any]) -> ReduceOp:
        return primitive(fields["reduce"])

    def scratch(self, dt: np.dtype, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self.pool.take(dt, (n,))

    def give(self, base: np.ndarray) -> None:
        self.pool.give(base)


def _buffers(c: Call, snapshot: bool, on: Buffers | None) -> Buffers:
    """``on``, else ``c``'s host buffers for a call that snapshots its input or not (made
    once per call context)."""
    if on is not None:
        return on
    host = c.buffers
    if host is None:
        host = c.buffers = (HostBuffers(c, False), HostBuffers(c, True))
    return host[1] if snapshot else host[0]


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _flat(x: Any) -> Any:
    """C-contiguous ``x`` viewed flat (itself where it is: a cupy view costs about 2 us)."""
    return x if x.ndim == 1 else x.reshape(-1)


def _fill(xp: ModuleType, dst: Any, src: Any, factor: Any) -> None:
    """Copy ``src`` (any strides, byte order) into ``dst`` of its shape, times ``factor``
    (a 0-d array in the dtype) where it is not None: one pass either way."""
    if factor is None:
        xp.copyto(dst, src)
    else:  # a numpy factor is one already; a device takes its own module's
        xp.multiply(src, factor if xp is np else xp.asarray(factor, dtype=dst.dtype), out=dst)


def _send(t: Buffers, view: Any, dt: np.dtype, factor: Any = None) -> tuple[Any, Any]:
    """The flat send buffer of ``view``: ``view`` itself where ``t`` may read it there (and
    nothing scales it), else a scratch copy (scaled on the way). Returns ``(base, send)``:
    give ``base`` back to ``t`` unless it is None."""
    if factor is None and t.reads(view, dt):
        return None, _flat(view)
    base, send = t.scratch(dt, view.size)
    _fill(t.xp, send.reshape(view.shape), view, factor)
    return base, send


def _moving(
    t: Buffers,
    move: Callable[[Any, Any], None],
    view: Any,
    dt: np.dtype,
    block: tuple[int, ...],
    axis: int,
    size: int,
    tiled: bool,
) -> Callable[[], Any]:
    """The body of a call that moves rank blocks (``all_gather``, ``all_to_all``): ``view``
    sent rank-major by ``move(send, recv)``, the ``size`` blocks of shape ``block`` received
    put together at ``axis`` (:func:`~meshcomm.group.arrays.unstack`)."""
    base, send = _send(t, view, dt)
    take, xp = t.take, t.xp
    recv = take(dt, size * _prod(block))

    def body() -> Any:
        move(send, recv)
        if base is not None:
            t.give(base)
        return unstack(recv, block, axis, size, tiled, take, xp)

    return body


# -- collectives ---------------------------------------------------------------------------
def all_reduce(
    c: Call,
    x: Any,
    op: Any,
    factor: Any,
    snapshot: bool = True,
    on: Buffers | None = None,
    out: Any = None,
) -> Lowered:
    """Lower ``all_reduce``; ``snapshot=False`` (a synchronous call) may read ``x`` in place.

    ``on``: the buffers (None: :class:`HostBuffers` of ``c``). ``out``: the C-contiguous
    result buffer, checked by the caller (None: a new one). The result buffer is the
    communicator's buffer. An input the communicator may read where it lies (synchronous,
    C-contiguous, native byte order) is handed over as is to ``all_reduce_out``, which
    writes the reduction into the result (on most backends straight from the input: one
    pass over memory fewer than copying it first). Otherwise the input is copied into the
    result buffer (scaled on the way for premul_sum) and reduced in place.
    """
    t = _buffers(c, snapshot, on)
    arr, dt = t.array(c, x)
    shape = arr.shape
    fields, f = _sig.all_reduce(c, dt, shape, op, factor)
    rop = fields["reduce"]
    prim = t.prim(c, fields)
    if out is None:
        buf = t.take(dt, arr.size)
        out = buf if len(shape) == 1 else buf.reshape(shape)
    else:
        buf = _flat(out)
    result, comm, size, xp = out, t.comm, c.size, t.xp
    if f is None and t.reads(arr, dt):
        send = _flat(arr)

        def body_out_of_place() -> Any:
            comm.all_reduce_out(send, buf, prim)
            if rop is ReduceOp.AVG:
                xp.true_divide(buf, size, out=buf)
            return result

        return body_out_of_place, fields

    _fill(xp, out, arr, f)  # the snapshot becomes the result

    def body() -> Any:
        comm.all_reduce(buf, prim)
        if rop is ReduceOp.AVG:
            xp.true_divide(buf, size, out=buf)
        return result

    return body, fields


def all_gather(
    c: Call, x: Any, axis: Any, tiled: bool, snapshot: bool = True, on: Buffers | None = None
) -> Lowered:
    """Lower ``all_gather``: received rank-major, then unstacked at ``axis``."""
    t = _buffers(c, snapshot, on)
    arr, dt = t.array(c, x)
    fields = _sig.all_gather(c, dt, arr.shape, axis, tiled)
    ax, tile = fields["axis"], fields["tiled"]
    return _moving(t, t.comm.all_gather, arr, dt, arr.shape, ax, c.size, tile), fields


def reduce_scatter(
    c: Call,
    x: Any,
    op: Any,
    axis: Any,
    tiled: bool,
    factor: Any,
    snapshot: bool = True,
    on: Buffers | None = None,
) -> Lowered:
    """Lower ``reduce_scatter``: this rank's block of the reduction."""
    t = _buffers(c, snapshot, on)
    arr, dt = t.array(c, x)
    fields, f, block = _sig.reduce_scatter(c, dt, arr.shape, op, axis, tiled, factor)
    rop = fields["reduce"]
    prim = t.prim(c, fields)
    comm, size, xp = t.comm, c.size, t.xp
    # Block r (this rank's share) is contiguous in the send side and comes back in the
    # result's own layout, so nothing is copied after the communication.
    base, send = _send(t, blocks_view(arr, fields["axis"], size, tiled, xp), dt, f)
    recv = t.take(dt, _prod(block))

    def body() -> Any:
        comm.reduce_scatter(send, recv, prim)
        if base is not None:
            t.give(base)
        if rop is ReduceOp.AVG:
            xp.true_divide(recv, size, out=recv)
        return recv.reshape(block)

    return body, fields


def all_to_all(
    c: Call,
    x: Any,
    split_axis: Any,
    concat_axis: Any,
    tiled: bool,
    snapshot: bool = True,
    on: Buffers | None = None,
) -> Lowered:
    """Lower ``all_to_all``: sent rank-major along the split axis, unstacked at the concat
    axis."""
    t = _buffers(c, snapshot, on)
    arr, dt = t.array(c, x)
    fields, block = _sig.all_to_all(c, dt, arr.shape, split_axis, concat_axis, tiled)
    concat, tile = fields["axis2"], fields["tiled"]
    view = blocks_view(arr, fields["axis"], c.size, tiled, t.xp)
    return _moving(t, t.comm.all_to_all, view, dt, block, concat, c.size, tile), fields


def broadcast(
    c: Call,
    x: Any,
    root: Any,
    shape: Any,
    dtype: Any,
    snapshot: bool = True,
    on: Buffers | None = None,
) -> Lowered:
    """Lower ``broadcast``; ``snapshot=False`` (a synchronous call) may read root's ``x`` in place.

    A root whose input the communicator may read where it lies hands it over as is to
    ``broadcast_out`` where the buffers allow it: on most host backends it sends from it and
    fills root's result at the same time, instead of copying it into the result before
    anything moves. Off the root, without the array, ``shape`` and ``dtype`` say what arrives.
    """
    t = _buffers(c, snapshot, on)
    r = rank_arg(c, root, "root")
    buf: Any = None
    send: Any = None
    if x is not None:
        arr, dt = t.array(c, x)
        agree(c, arr.shape, dt, shape, dtype)
        out_shape = arr.shape
        if r == c.rank:
            if t.broadcasts_out and t.reads(arr, dt):
                send = _flat(arr)
            else:
                buf = t.take(dt, arr.size)
                _fill(t.xp, buf.reshape(out_shape), arr, None)
    elif r == c.rank:
        raise InvalidArgument(f"{c.where}: the root (rank {r}) must pass the array, got None")
    else:
        out_shape, dt = spec(c, shape, dtype)
    fields = _sig.broadcast(c, dt, out_shape, r)
    result = t.take(dt, _prod(out_shape)) if buf is None else buf
    comm = t.comm
    if send is not None:

        def body_out_of_place() -> Any:
            comm.broadcast_out(send, result, r)
            return result.reshape(out_shape)

        return body_out_of_place, fields

    def body() -> Any:
        comm.broadcast(result, r)
        return result.reshape(out_shape)

    return body, fields


def reduce(
    c: Call,
    x: Any,
    root: Any,
    op: Any,
    factor: Any,
    snapshot: bool = True,
    on: Buffers | None = None,
) -> Lowered:
    """Lower ``reduce``: the reduction on root, None elsewhere (the input is always copied:
    the wire reduces in place; off the root into scratch)."""
    t = _buffers(c, snapshot, on)
    r = rank_arg(c, root, "root")
    arr, dt = t.array(c, x)
    fields, f = _sig.reduce(c, dt, arr.shape, r, op, factor)
    rop = fields["reduce"]
    prim = t.prim(c, fields)
    comm, size, shape, is_root = t.comm, c.size, arr.shape, r == c.rank
    base: Any = None
    if is_root:
        buf = t.take(dt, arr.size)
    else:  # clobbered and not returned off root: scratch will do
        base, buf = t.scratch(dt, arr.size)
    _fill(t.xp, buf.reshape(shape), arr, f)

    def body() -> Any:
        comm.reduce(buf, r, prim)
        if not is_root:
            if base is not None:
                t.give(base)
            return None
        if rop is ReduceOp.AVG:
            t.xp.true_divide(buf, size, out=buf)
        return buf.reshape(shape)

    return body, fields


def gather(c: Call, x: Any, root: Any, snapshot: bool = True, on: Buffers | None = None) -> Lowered:
    """Lower ``gather``: every rank's array stacked on root, None elsewhere."""
    t = _buffers(c, snapshot, on)
    r = rank_arg(c, root, "root")
    arr, dt = t.array(c, x)
    fields = _sig.gather(c, dt, arr.shape, r)
    comm, size, shape = t.comm, c.size, arr.shape
    base, send = _send(t, arr, dt)
    recv = t.take(dt, size * arr.size) if r == c.rank else None

    def body() -> Any:
        comm.gather(send, recv, r)
        if base is not None:
            t.give(base)
        return None if recv is None else recv.reshape((size, *shape))

    return body, fields


def scatter(
    c: Call,
    x: Any,
    root: Any,
    shape: Any,
    dtype: Any,
    snapshot: bool = True,
    on: Buffers | None = None,
) -> Lowered:
    """Lower ``scatter``: root's block ``r`` to rank ``r`` (off the root, ``x``'s shape, or
    ``shape`` and ``dtype`` without it, say what arrives)."""
    t = _buffers(c, snapshot, on)
    r = rank_arg(c, root, "root")
    base: Any = None
    send: Any = None
    if x is not None:
        arr, dt = t.array(c, x)
        fields, block = _sig.scatter(c, dt, arr.shape, r, shape, dtype)
        if r == c.rank:
            base, send = _send(t, arr, dt)
    elif r == c.rank:
        raise InvalidArgument(f"{c.where}: the root (rank {r}) must pass the array, got None")
    else:
        block, dt = spec(c, shape, dtype)
        fields = _sig.rooted(c, dt, block, r)
    comm = t.comm
    recv = t.take(dt, _prod(block))

    def body() -> Any:
        comm.scatter(send, recv, r)
        if base is not None:
            t.give(base)
        return recv.reshape(block)

    return body, fields


def permute(
    c: Call, x: Any, perm: Any, snapshot: bool = True, on: Buffers | None = None
) -> Lowered:
    """Lower ``permute`` (``ppermute``); a rank nobody sends to gets zeros."""
    t = _buffers(c, snapshot, on)
    pairs = perm_pairs(c, perm)
    arr, dt = t.array(c, x)
    fields, dst, src = _sig.permute(c, dt, arr.shape, pairs)
    comm, shape, xp = t.comm, arr.shape, t.xp
    base: Any = None
    send = xp.empty(0, dtype=dt)
    if dst is not None:
        base, send = _send(t, arr, dt)
    # As jax.lax.ppermute: a rank nobody sends to gets zeros.
    recv = xp.zeros(arr.size, dtype=dt) if src is None else t.take(dt, arr.size)

    def body() -> Any:
        comm.permute(send, dst, recv, src)
        if base is not None:
            t.give(base)
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
    comm, on = c.comm, _buffers(c, snapshot, None)
    base, flat = _send(on, arr, dt)
    buf = flat.reshape(arr.shape)  # sent with its shape

    def body() -> None:
        comm.send(buf, d, t)
        if base is not None:
            on.give(base)

    return body, None


def recv(c: Call, src: Any, tag: Any, return_source: bool) -> Lowered:
    s = None if src is None else rank_arg(c, src, "src")
    t = tag_arg(c.where, tag)
    comm = c.comm

    def body() -> Any:
        arr, source = comm.recv(s, t)
        return (arr, source) if return_source else arr

    return body, None
