"""How each collective lowers onto a device communicator, for arrays that stay on the GPU.

The twin of :mod:`meshcomm.group.lower` for a group with a device backend (nccl): the input is
a device array (cupy), the result is a new array of the same module on the same device,
and the communicator (:class:`~meshcomm.backends.nccl.NcclCommunicator`) takes device
buffers. The argument checks are :mod:`._lower`'s, so every error is raised before any
I/O, with the same words. Layout work (rank-major blocks, unstacking) is done with the
array's own module (``xp``), so nothing here names cupy: the same functions run on numpy
arrays over a host communicator, which is how CI tests their layouts at every world size.

Each function returns ``(body, fingerprint)`` as :mod:`._lower` does. The body only
queues work on the device (the nccl communicator orders it after the caller's current
stream and the caller's stream after it), so it returns at once; the group runs it on the
caller's thread.

Example:
    >>> import numpy as np
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group.arrays import ScratchPool
    >>> from meshcomm.group.lower import Call
    >>> comm = SelfCommunicator()
    >>> call = Call(comm, ScratchPool(), "all_gather: rank 0")
    >>> body, _ = all_gather(call, comm, np, np.arange(3.0), axis=1, tiled=False)
    >>> body()
    array([[0.],
           [1.],
           [2.]])
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from meshcomm.backends.base import Communicator
from meshcomm.diagnostics import fingerprint as _fingerprint
from meshcomm.errors import InvalidArgument
from meshcomm.group import signatures as _sig
from meshcomm.group.arrays import check_dtype, rank_major, unstack
from meshcomm.group.lower import Lowered
from meshcomm.group.signatures import Call, agree, perm_pairs, primitive, rank_arg
from meshcomm.reduction import ReduceOp

__all__ = [
    "DevicePlan",
    "all_gather",
    "all_reduce",
    "all_reduce_into",
    "all_to_all",
    "broadcast",
    "gather",
    "permute",
    "plan_all_reduce",
    "reduce",
    "reduce_scatter",
    "scatter",
]


def _flat(xp: ModuleType, x: Any) -> Any:
    """``x`` as a flat C-contiguous array (itself where it already is one)."""
    if x.ndim == 1 and x.flags.c_contiguous:
        return x  # a cupy view costs about 2 us: none where none is needed
    # ascontiguousarray turns a 0-d array into a new 1-d one; reshape keeps it a view.
    return (x if x.flags.c_contiguous else xp.ascontiguousarray(x)).reshape(-1)


def _scale(xp: ModuleType, x: Any, factor: Any) -> Any:
    """``x * factor`` in a new C-contiguous array of ``x``'s shape (0-d stays 0-d)."""
    out = xp.empty(x.shape, dtype=x.dtype)
    xp.multiply(x, xp.asarray(factor, dtype=x.dtype), out=out)
    return out


def all_reduce(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, op: Any, factor: Any, snapshot: bool = False
) -> Lowered:
    """Lower ``all_reduce`` of a device array: reduced into a new array (out of place).

    ``snapshot`` is the host lowerings' (every device lowering takes it and ignores it:
    its body runs at once on the caller's stream, so the input cannot change under it).
    """
    return _reducing(c, dev, xp, x, op, factor, xp.empty(x.shape, dtype=x.dtype))


def _reduces(c: Call, dev: Communicator, fields: dict[str, Any]) -> ReduceOp:
    """The primitive op the device runs for the checked ``fields`` of a reducing call
    (``avg`` and ``premul_sum`` are sums), refused where the device cannot reduce the
    dtype with it.

    Raises:
        TypeError: the device cannot reduce the dtype with that op.
    """
    prim = primitive(fields["reduce"])
    dev.check_reduction(fields["dtype"], prim, c.where)
    return prim


def _reducing(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, op: Any, factor: Any, out: Any
) -> Lowered:
    """The lowering that reduces ``x`` (times the factor where given) into C-contiguous
    ``out`` (``avg``: then divides) and returns ``out``."""
    dt = check_dtype(x.dtype, c.where)
    fields, f = _sig.all_reduce(c, dt, tuple(x.shape), op, factor)
    prim, rop = _reduces(c, dev, fields), fields["reduce"]
    send = _flat(xp, x if f is None else _scale(xp, x, f))
    flat_out, size = _flat(xp, out), c.size

    def body() -> Any:
        dev.all_reduce_out(send, flat_out, prim)
        if rop is ReduceOp.AVG:
            xp.true_divide(out, size, out=out)
        return out

    return body, fields


def all_reduce_into(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, op: Any, factor: Any, out: Any
) -> Lowered:
    """Lower ``all_reduce`` of a device array into the caller's ``out`` (``x`` itself: in
    place), checked first: ``out`` a C-contiguous array of ``x``'s module, shape and dtype.

    Example:
        >>> import numpy as np
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group.arrays import ScratchPool
        >>> comm, x = SelfCommunicator(), np.arange(3.0)
        >>> c = Call(comm, ScratchPool(), "rank 0")
        >>> body, _ = all_reduce_into(c, comm, np, x, "avg", None, x)
        >>> body() is x
        True
    """
    check_dtype(x.dtype, c.where)
    if (
        type(out) is not type(x)
        or not out.flags.c_contiguous
        or tuple(out.shape) != tuple(x.shape)
        or out.dtype != x.dtype
    ):
        raise InvalidArgument(
            f"{c.where}: out must be a C-contiguous {type(x).__name__} of x's shape "
            f"{tuple(x.shape)} and dtype {x.dtype}; got {type(out).__name__} of shape "
            f"{tuple(getattr(out, 'shape', ()))} and dtype {getattr(out, 'dtype', None)}"
        )
    return _reducing(c, dev, xp, x, op, factor, out)


class DevicePlan:
    """One device call signature lowered once: the checks of :func:`all_reduce` made on its
    first call, and the runner its later calls take (the numpy calls' :class:`~meshcomm.
    _plans.Plan`, for device arrays: no layout work, no snapshot, nothing to stamp).

    Attributes:
        collective: the operation name.
        run: ``run(x)`` for a C-contiguous device array of the signature: queues the call
            on the device communicator and returns the new result.
        fields: the call's fingerprint fields, as the lowering gives them.
        ledger_fields: ``fields`` marked as a device call (what the ledger keeps).
        sig: the call's signature (:func:`~meshcomm.diagnostics.fingerprint.signature_of` on
        device).
        dtype: the array's dtype.
        in_shape: the array's shape.
        stamp_base: None (stamps ride on host messages; a host plan's has one).
    """

    __slots__ = (
        "collective",
        "dtype",
        "fields",
        "in_shape",
        "ledger_fields",
        "run",
        "sig",
        "stamp_base",
    )

    #: Runs on the device communicator.
    on_device = True
    #: Its runner returns the result (a host :class:`~meshcomm.group.plans.Plan`'s fills one).
    fills = False

    def __init__(self, collective: str, fields: dict[str, Any], run: Callable[[Any], Any]):
        self.collective = collective
        self.fields = fields
        self.ledger_fields = {**fields, "device": True}
        self.sig = _fingerprint.signature_of(collective, fields, True)
        self.run = run
        self.dtype = fields["dtype"]
        self.in_shape: tuple[int, ...] = fields["shape"]
        self.stamp_base = None  # device calls carry no stamp


def plan_all_reduce(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, op: Any, factor: None = None
) -> DevicePlan:
    """The plan of an ``all_reduce`` of a C-contiguous device array ``x`` (no factor): a
    new result of ``x``'s shape, reduced into out of place, ``avg`` divided after.

    Example:
        >>> import numpy as np
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group.arrays import ScratchPool
        >>> comm = SelfCommunicator()
        >>> plan = plan_all_reduce(Call(comm, ScratchPool(), "rank 0"), comm, np, np.ones(2), "avg")
        >>> plan.run(np.arange(2.0)), plan.fields["reduce"]
        (array([0., 1.]), <ReduceOp.AVG: 'avg'>)
    """
    dt, shape, size = check_dtype(x.dtype, c.where), tuple(x.shape), c.size
    fields, _ = _sig.all_reduce(c, dt, shape, op, factor)
    prim, rop = _reduces(c, dev, fields), fields["reduce"]
    # The ndarray constructor: what xp.empty calls, minus 0.5 us of Python on cupy.
    empty, reduce_out, divide = xp.ndarray, dev.all_reduce_out, xp.true_divide
    if rop is ReduceOp.AVG:

        def run(x: Any) -> Any:
            out = empty(shape, dtype=dt)
            reduce_out(x, out, prim)
            divide(out, size, out=out)
            return out

    else:

        def run(x: Any) -> Any:
            out = empty(shape, dtype=dt)
            reduce_out(x, out, prim)
            return out

    return DevicePlan("all_reduce", fields, run)


def all_gather(
    c: Call,
    dev: Communicator,
    xp: ModuleType,
    x: Any,
    axis: Any,
    tiled: bool,
    snapshot: bool = False,
) -> Lowered:
    """Lower ``all_gather`` of a device array."""
    shape = tuple(x.shape)
    fields = _sig.all_gather(c, check_dtype(x.dtype, c.where), shape, axis, tiled)
    ax, tile = fields["axis"], fields["tiled"]
    send = _flat(xp, x)
    size = c.size
    recv = xp.empty(size * send.size, dtype=x.dtype)

    def body() -> Any:
        dev.all_gather(send, recv)
        return unstack(recv, shape, ax, size, tile, xp=xp)

    return body, fields


def reduce_scatter(
    c: Call,
    dev: Communicator,
    xp: ModuleType,
    x: Any,
    op: Any,
    axis: Any,
    tiled: bool,
    factor: Any,
    snapshot: bool = False,
) -> Lowered:
    """Lower ``reduce_scatter`` of a device array: this rank's block of the reduction."""
    dt = check_dtype(x.dtype, c.where)
    fields, f, block = _sig.reduce_scatter(c, dt, tuple(x.shape), op, axis, tiled, factor)
    prim, rop = _reduces(c, dev, fields), fields["reduce"]
    size, scaled = c.size, x if f is None else _scale(xp, x, f)
    send = rank_major(scaled, fields["axis"], size, tiled, xp).reshape(-1)
    recv = xp.empty(block, dtype=x.dtype)

    def body() -> Any:
        dev.reduce_scatter(send, recv.reshape(-1), prim)
        if rop is ReduceOp.AVG:
            xp.true_divide(recv, size, out=recv)
        return recv

    return body, fields


def all_to_all(
    c: Call,
    dev: Communicator,
    xp: ModuleType,
    x: Any,
    split_axis: Any,
    concat_axis: Any,
    tiled: bool,
    snapshot: bool = False,
) -> Lowered:
    """Lower ``all_to_all`` of a device array."""
    dt = check_dtype(x.dtype, c.where)
    fields, block = _sig.all_to_all(c, dt, tuple(x.shape), split_axis, concat_axis, tiled)
    concat, tile, size = fields["axis2"], fields["tiled"], c.size
    send = rank_major(x, fields["axis"], size, tiled, xp).reshape(-1)
    recv = xp.empty(send.size, dtype=x.dtype)

    def body() -> Any:
        dev.all_to_all(send, recv)
        return unstack(recv, block, concat, size, tile, xp=xp)

    return body, fields


def broadcast(
    c: Call,
    dev: Communicator,
    xp: ModuleType,
    x: Any,
    root: Any,
    shape: Any,
    dtype: Any,
    snapshot: bool = False,
) -> Lowered:
    """Lower ``broadcast`` of a device array (every rank passes one: its shape and dtype
    say what arrives; the root's contents are sent)."""
    r = rank_arg(c, root, "root")
    dt = check_dtype(x.dtype, c.where)
    agree(c, tuple(x.shape), dt, shape, dtype)
    buf = xp.array(x, copy=True, order="C") if r == c.rank else xp.empty(x.shape, x.dtype)

    def body() -> Any:
        dev.broadcast(buf.reshape(-1), r)
        return buf

    return body, _sig.broadcast(c, dt, tuple(x.shape), r)


def reduce(
    c: Call,
    dev: Communicator,
    xp: ModuleType,
    x: Any,
    root: Any,
    op: Any,
    factor: Any,
    snapshot: bool = False,
) -> Lowered:
    """Lower ``reduce`` of a device array: the reduction on root, None elsewhere."""
    r = rank_arg(c, root, "root")
    fields, f = _sig.reduce(c, check_dtype(x.dtype, c.where), tuple(x.shape), r, op, factor)
    prim, rop = _reduces(c, dev, fields), fields["reduce"]
    buf = xp.array(x, copy=True, order="C") if f is None else _scale(xp, x, f)
    is_root, size = r == c.rank, c.size

    def body() -> Any:
        dev.reduce(buf.reshape(-1), r, prim)
        if not is_root:
            return None
        if rop is ReduceOp.AVG:
            xp.true_divide(buf, size, out=buf)
        return buf

    return body, fields


def gather(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, root: Any, snapshot: bool = False
) -> Lowered:
    """Lower ``gather`` of a device array: every rank's array stacked on root."""
    r = rank_arg(c, root, "root")
    shape = tuple(x.shape)
    fields = _sig.gather(c, check_dtype(x.dtype, c.where), shape, r)
    send = _flat(xp, x)
    recv = xp.empty((c.size, *shape), dtype=x.dtype) if r == c.rank else None

    def body() -> Any:
        dev.gather(send, None if recv is None else recv.reshape(-1), r)
        return recv

    return body, fields


def scatter(
    c: Call,
    dev: Communicator,
    xp: ModuleType,
    x: Any,
    root: Any,
    shape: Any,
    dtype: Any,
    snapshot: bool = False,
) -> Lowered:
    """Lower ``scatter`` of a device array: root's block ``r`` to rank ``r`` (every rank
    passes an array of shape ``(size, *block)``; off the root only its shape counts)."""
    r = rank_arg(c, root, "root")
    dt = check_dtype(x.dtype, c.where)
    fields, block = _sig.scatter(c, dt, tuple(x.shape), r, shape, dtype)
    send = _flat(xp, x) if r == c.rank else None
    recv = xp.empty(block, dtype=x.dtype)

    def body() -> Any:
        dev.scatter(send, recv.reshape(-1), r)
        return recv

    return body, fields


def permute(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, perm: Any, snapshot: bool = False
) -> Lowered:
    """Lower ``permute`` (``ppermute``) of a device array; a rank nobody sends to gets zeros."""
    pairs = perm_pairs(c, perm)
    dt = check_dtype(x.dtype, c.where)
    fields, dst, src = _sig.permute(c, dt, tuple(x.shape), pairs)
    send = _flat(xp, x)
    recv = (xp.zeros if src is None else xp.empty)(x.shape, dtype=x.dtype)

    def body() -> Any:
        dev.permute(send, dst, recv.reshape(-1), src)
        return recv

    return body, fields
