"""The device's buffers for the shared lowering, and the device ``all_reduce``'s own entries.

A group with a device backend (nccl) lowers a call on a device array (cupy) with the one
lowering of each collective (:mod:`meshcomm.group.lower`) over :class:`DeviceBuffers`: the
result is a new array of the input's module on the same device, every other buffer too (no
host copy is ever made), the input is read where it lies when C-contiguous (the body runs
at once, on the caller's stream), and the device communicator
(:class:`~meshcomm.backends.nccl.NcclCommunicator`) runs the call, refusing a reduction its
table lacks with the words of :meth:`~meshcomm.backends.base.Communicator.check_reduction`.
The argument checks are :mod:`meshcomm.group.signatures`', so every error is raised before
any I/O, with the same words as on host. Nothing here names cupy: the same lowering runs on
numpy arrays over a host communicator, which is how CI tests its layouts at every world size.

The body only queues work on the device (the nccl communicator orders it after the
caller's current stream and the caller's stream after it), so it returns at once; the
group runs it on the caller's thread.

Example:
    >>> import numpy as np
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group.arrays import ScratchPool
    >>> from meshcomm.group.lower import Call, all_gather
    >>> comm = SelfCommunicator()
    >>> call = Call(comm, ScratchPool(), "all_gather: rank 0")
    >>> body, _ = all_gather(call, np.arange(3.0), 1, False, on=DeviceBuffers(comm, np))
    >>> body()
    array([[0.],
           [1.],
           [2.]])
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from meshcomm.backends.base import Communicator
from meshcomm.errors import InvalidArgument
from meshcomm.group import lower as _lower
from meshcomm.group import signatures as _sig
from meshcomm.group.arrays import blocks_view, check_dtype, unstack
from meshcomm.group.plans import ReturningPlan
from meshcomm.group.signatures import Call, primitive, rank_arg
from meshcomm.reduction import ReduceOp

__all__ = [
    "DeviceBuffers",
    "all_reduce_into",
    "plan_all_gather",
    "plan_all_reduce",
    "plan_all_to_all",
    "plan_broadcast",
    "plan_gather",
    "plan_reduce",
    "plan_reduce_scatter",
    "plan_scatter",
]


class DeviceBuffers:
    """The :class:`~meshcomm.group.lower.Buffers` of a device: arrays of ``xp`` (cupy) over
    the device communicator ``comm``.

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> on = DeviceBuffers(SelfCommunicator(), np)
        >>> on.take(np.dtype(np.float32), 3).shape, on.broadcasts_out
        ((3,), False)
    """

    __slots__ = ("comm", "xp")

    #: nccl has no out-of-place broadcast: the root copies its input into the result.
    broadcasts_out = False

    def __init__(self, comm: Communicator, xp: ModuleType) -> None:
        self.comm = comm
        self.xp = xp

    def array(self, c: Call, x: Any) -> tuple[Any, np.dtype]:
        return x, check_dtype(x.dtype, c.where)

    def reads(self, arr: Any, dt: np.dtype) -> bool:
        # The body runs at once on the caller's stream: the input cannot change under it.
        return bool(arr.flags.c_contiguous)

    def prim(self, c: Call, fields: dict[str, Any]) -> ReduceOp:
        """The primitive op (``avg`` and ``premul_sum`` are sums), refused where the device
        cannot reduce the dtype with it.

        Raises:
            TypeError: the device cannot reduce the dtype with that op.
        """
        prim = primitive(fields["reduce"])
        self.comm.check_reduction(fields["dtype"], prim, c.where)
        return prim

    def take(self, dt: np.dtype, n: int) -> Any:
        return self.xp.empty(n, dtype=dt)

    def scratch(self, dt: np.dtype, n: int) -> tuple[None, Any]:
        return None, self.xp.empty(n, dtype=dt)

    def give(self, base: Any) -> None:
        """Nothing to give back: device scratch is a new array."""


def all_reduce_into(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, op: Any, factor: Any, out: Any
) -> _lower.Lowered:
    """Lower ``all_reduce`` of a device array into the caller's ``out`` (``x`` itself: in
    place), checked first: ``out`` a C-contiguous array of ``x``'s module, shape and dtype.

    Example:
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
    return _lower.all_reduce(c, x, op, factor, on=DeviceBuffers(dev, xp), out=out)


def plan_all_reduce(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, op: Any, factor: None = None
) -> ReturningPlan:
    """The plan of an ``all_reduce`` of a C-contiguous device array ``x`` (no factor): a
    new result of ``x``'s shape, reduced into out of place, ``avg`` divided after (the
    checks of :func:`~meshcomm.group.lower.all_reduce` on its first call; no layout work,
    no snapshot, nothing to stamp on its later ones).

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group.arrays import ScratchPool
        >>> comm = SelfCommunicator()
        >>> plan = plan_all_reduce(Call(comm, ScratchPool(), "rank 0"), comm, np, np.ones(2), "avg")
        >>> plan.run(np.arange(2.0)), plan.fields["reduce"], plan.on_device
        (array([0., 1.]), <ReduceOp.AVG: 'avg'>, True)
    """
    dt, shape, size = check_dtype(x.dtype, c.where), tuple(x.shape), c.size
    fields, _ = _sig.all_reduce(c, dt, shape, op, factor)
    prim, rop = DeviceBuffers(dev, xp).prim(c, fields), fields["reduce"]
    fresh, reduce_out = results(xp, shape, dt), dev.all_reduce_out_of(dt, prim)

    def run(x: Any) -> Any:
        out = fresh()
        reduce_out(x, out)
        return out

    return _device_plan("all_reduce", fields, _averaging(xp, rop, size, run))


# -- the other collectives' plans ------------------------------------------------------------
# Each checks its call as the lowering does (so every error is raised before any I/O, with
# the same words) and returns a runner that does only the call's device work: a new result,
# the layout copies the signature needs, the device communicator's primitive. The keys
# (meshcomm.group.collectives) admit C-contiguous inputs only: the runners read them flat.
#: Results up to this many bytes are kept by their plan and given out again once nothing
#: else holds them: a cupy allocation and its release cost 2-4 us, a third of what the group
#: path adds to an 8-byte NCCL call (H100); larger calls spend their time moving bytes.
KEPT_RESULT_BYTES = 1 << 20


def results(xp: ModuleType, shape: tuple[int, ...], dt: np.dtype) -> Callable[[], Any]:
    """What gives a plan's runner each call's new array of ``shape`` and ``dt``: for a
    small one, the last one again where the plan is all that holds it any more (the caller
    let it and every view of it go) and the caller's current stream is the one it was made
    on (cupy's pool, too, gives freed memory out again on its stream only); else a new one.

    Example:
        >>> take = results(np, (2,), np.dtype(np.float32))
        >>> first = take(); second = take()     # the first is still held: a new one
        >>> second is first
        False
        >>> last = id(second); del first, second
        >>> id(take()) == last                  # nothing holds the last one: given out again
        True
    """
    empty = xp.ndarray
    if _lower._prod(shape) * dt.itemsize > KEPT_RESULT_BYTES:
        return lambda: empty(shape, dtype=dt)
    cuda = getattr(xp, "cuda", None)
    current = None if cuda is None else cuda.get_current_stream
    refs = sys.getrefcount

    def count(slot: list[Any]) -> int:  # the same code measures the baseline below
        return refs(slot[0])

    alone = count([object()])  # what count() says of an array only the plan holds
    kept: list[Any] = [None]
    made_on = [0]

    def take() -> Any:
        stream = 0 if current is None else current().ptr
        if kept[0] is not None and made_on[0] == stream and count(kept) == alone:
            return kept[0]
        out = kept[0] = empty(shape, dtype=dt)
        made_on[0] = stream
        return out

    return take


def _device_plan(name: str, fields: dict[str, Any], run: Callable[[Any], Any]) -> ReturningPlan:
    return ReturningPlan(name, fields, run, on_device=True)


def _averaging(
    xp: ModuleType, rop: ReduceOp, size: int, make: Callable[[Any], Any]
) -> Callable[[Any], Any]:
    """``make`` (a runner returning its new result), then divided by ``size`` for avg."""
    if rop is not ReduceOp.AVG:
        return make
    divide = xp.true_divide

    def run(x: Any) -> Any:
        out = make(x)
        divide(out, size, out=out)
        return out

    return run


def _rank_major(xp: ModuleType, axis: int, size: int, tiled: bool) -> Callable[[Any], Any]:
    """The flat rank-major send buffer of an input split into rank blocks at ``axis``:
    the input itself at axis 0 (C-contiguous, so rank-major already), else one copy."""
    if axis == 0:
        return _lower._flat

    def send(x: Any) -> Any:
        return xp.ascontiguousarray(blocks_view(x, axis, size, tiled, xp)).reshape(-1)

    return send


def plan_all_gather(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, axis: Any, tiled: Any
) -> ReturningPlan:
    """The plan of an ``all_gather`` of a C-contiguous device array: received rank-major
    into a new array, put together at ``axis`` (a view at axis 0, one copy elsewhere).

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group.arrays import ScratchPool
        >>> comm = SelfCommunicator()
        >>> c = Call(comm, ScratchPool(), "rank 0")
        >>> plan = plan_all_gather(c, comm, np, np.ones(2), 1, False)
        >>> plan.run(np.arange(2.0)), plan.on_device
        (array([[0.],
               [1.]]), True)
    """
    dt, shape, size = check_dtype(x.dtype, c.where), tuple(x.shape), c.size
    fields = _sig.all_gather(c, dt, shape, axis, tiled)
    ax, tile, count = fields["axis"], fields["tiled"], size * _lower._prod(shape)
    fresh, gather, take = results(xp, (count,), dt), dev.all_gather, DeviceBuffers(dev, xp).take

    def run(x: Any) -> Any:
        recv = fresh()
        gather(_lower._flat(x), recv)
        return unstack(recv, shape, ax, size, tile, take, xp)

    return _device_plan("all_gather", fields, run)


def plan_reduce_scatter(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, op: Any, axis: Any, tiled: Any,
    factor: None = None,
) -> ReturningPlan:  # fmt: skip
    """The plan of a ``reduce_scatter`` of a C-contiguous device array (no factor): sent
    rank-major (the input itself at axis 0), this rank's block reduced into a new array.

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group.arrays import ScratchPool
        >>> comm = SelfCommunicator()
        >>> c = Call(comm, ScratchPool(), "rank 0")
        >>> plan_reduce_scatter(c, comm, np, np.ones((1, 2)), "avg", 0, False).run(np.ones((1, 2)))
        array([1., 1.])
    """
    dt, shape, size = check_dtype(x.dtype, c.where), tuple(x.shape), c.size
    fields, _, block = _sig.reduce_scatter(c, dt, shape, op, axis, tiled, factor)
    prim, rop = DeviceBuffers(dev, xp).prim(c, fields), fields["reduce"]
    send, count = _rank_major(xp, fields["axis"], size, fields["tiled"]), _lower._prod(block)
    fresh, scatter = results(xp, (count,), dt), dev.reduce_scatter

    def reduced(x: Any) -> Any:
        recv = fresh()
        scatter(send(x), recv, prim)
        return recv

    average = _averaging(xp, rop, size, reduced)

    def run(x: Any) -> Any:
        return average(x).reshape(block)

    return _device_plan("reduce_scatter", fields, run)


def plan_all_to_all(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, split_axis: Any, concat_axis: Any,
    tiled: Any,
) -> ReturningPlan:  # fmt: skip
    """The plan of an ``all_to_all`` of a C-contiguous device array: sent rank-major along
    the split axis, the blocks received put together at the concat axis.

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group.arrays import ScratchPool
        >>> comm = SelfCommunicator()
        >>> c = Call(comm, ScratchPool(), "rank 0")
        >>> plan_all_to_all(c, comm, np, np.ones((1, 2)), 0, 1, True).run(np.arange(2.0)[None])
        array([[0., 1.]])
    """
    dt, shape, size = check_dtype(x.dtype, c.where), tuple(x.shape), c.size
    fields, block = _sig.all_to_all(c, dt, shape, split_axis, concat_axis, tiled)
    tile, concat = fields["tiled"], fields["axis2"]
    send, count = _rank_major(xp, fields["axis"], size, tile), size * _lower._prod(block)
    fresh, exchange, take = results(xp, (count,), dt), dev.all_to_all, DeviceBuffers(dev, xp).take

    def run(x: Any) -> Any:
        recv = fresh()
        exchange(send(x), recv)
        return unstack(recv, block, concat, size, tile, take, xp)

    return _device_plan("all_to_all", fields, run)


def plan_broadcast(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, root: Any, shape: None = None,
    dtype: None = None,
) -> ReturningPlan:  # fmt: skip
    """The plan of a ``broadcast`` with a C-contiguous device array on every rank (no
    ``shape=`` or ``dtype=``): the root copies its input into the result (nccl broadcasts
    in place), every rank receives into a new array.

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group.arrays import ScratchPool
        >>> comm = SelfCommunicator()
        >>> c = Call(comm, ScratchPool(), "rank 0")
        >>> plan_broadcast(c, comm, np, np.ones(2), 0).run(np.ones(2))
        array([1., 1.])
    """
    r = rank_arg(c, root, "root")
    dt, shape_, is_root = check_dtype(x.dtype, c.where), tuple(x.shape), r == c.rank
    fields = _sig.broadcast(c, dt, shape_, r)
    fresh, copyto, broadcast = results(xp, shape_, dt), xp.copyto, dev.broadcast

    def run(x: Any) -> Any:
        out = fresh()
        if is_root:
            copyto(out, x)
        broadcast(_lower._flat(out), r)
        return out

    return _device_plan("broadcast", fields, run)


def plan_reduce(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, root: Any, op: Any, factor: None = None
) -> ReturningPlan:
    """The plan of a ``reduce`` of a C-contiguous device array (no factor): the input copied
    into the buffer the device reduces in place; the result on the root, None elsewhere.

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group.arrays import ScratchPool
        >>> comm = SelfCommunicator()
        >>> c = Call(comm, ScratchPool(), "rank 0")
        >>> plan_reduce(c, comm, np, np.ones(2), 0, "max").run(np.ones(2))
        array([1., 1.])
    """
    r = rank_arg(c, root, "root")
    dt, shape, size = check_dtype(x.dtype, c.where), tuple(x.shape), c.size
    fields, _ = _sig.reduce(c, dt, shape, r, op, factor)
    prim, rop = DeviceBuffers(dev, xp).prim(c, fields), fields["reduce"]
    fresh, copyto, reduce = results(xp, shape, dt), xp.copyto, dev.reduce

    def reduced(x: Any) -> Any:
        buf = fresh()
        copyto(buf, x)
        reduce(_lower._flat(buf), r, prim)
        return buf

    if r == c.rank:
        return _device_plan("reduce", fields, _averaging(xp, rop, size, reduced))

    def off_root(x: Any) -> None:
        reduced(x)

    return _device_plan("reduce", fields, off_root)


def plan_gather(c: Call, dev: Communicator, xp: ModuleType, x: Any, root: Any) -> ReturningPlan:
    """The plan of a ``gather`` of a C-contiguous device array: sent where it lies, stacked
    into a new array on the root (None elsewhere).

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group.arrays import ScratchPool
        >>> comm = SelfCommunicator()
        >>> c = Call(comm, ScratchPool(), "rank 0")
        >>> plan_gather(c, comm, np, np.ones(2), 0).run(np.ones(2))
        array([[1., 1.]])
    """
    r = rank_arg(c, root, "root")
    dt, shape, size = check_dtype(x.dtype, c.where), tuple(x.shape), c.size
    fields = _sig.gather(c, dt, shape, r)
    gather, stacked = dev.gather, (size, *shape)

    if r != c.rank:

        def off_root(x: Any) -> None:
            gather(_lower._flat(x), None, r)

        return _device_plan("gather", fields, off_root)

    fresh = results(xp, stacked, dt)

    def run(x: Any) -> Any:
        out = fresh()
        gather(_lower._flat(x), out.reshape(-1), r)
        return out

    return _device_plan("gather", fields, run)


def plan_scatter(
    c: Call, dev: Communicator, xp: ModuleType, x: Any, root: Any, shape: None = None,
    dtype: None = None,
) -> ReturningPlan:  # fmt: skip
    """The plan of a ``scatter`` with a stacked C-contiguous device array on every rank (no
    ``shape=`` or ``dtype=``): the root sends from its input where it lies, every rank
    receives its block into a new array.

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group.arrays import ScratchPool
        >>> comm = SelfCommunicator()
        >>> c = Call(comm, ScratchPool(), "rank 0")
        >>> plan_scatter(c, comm, np, np.ones((1, 2)), 0).run(np.ones((1, 2)))
        array([1., 1.])
    """
    r = rank_arg(c, root, "root")
    dt, is_root = check_dtype(x.dtype, c.where), r == c.rank
    fields, block = _sig.scatter(c, dt, tuple(x.shape), r, shape, dtype)
    fresh, scatter = results(xp, block, dt), dev.scatter

    def run(x: Any) -> Any:
        out = fresh()
        scatter(_lower._flat(x) if is_root else None, out.reshape(-1), r)
        return out

    return _device_plan("scatter", fields, run)
