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

from types import ModuleType
from typing import Any

import numpy as np

from meshcomm.backends.base import Communicator
from meshcomm.errors import InvalidArgument
from meshcomm.group import lower as _lower
from meshcomm.group import signatures as _sig
from meshcomm.group.arrays import check_dtype
from meshcomm.group.plans import ReturningPlan
from meshcomm.group.signatures import Call, primitive
from meshcomm.reduction import ReduceOp

__all__ = ["DeviceBuffers", "all_reduce_into", "plan_all_reduce"]


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

    return ReturningPlan("all_reduce", fields, run, on_device=True)
