"""One description per collective, registered once: how a group resolves a call to a plan.

A :class:`Collective` says everything the group needs to know of one collective, the way
JAX registers a primitive with its rules: its name, its **plan key** (the call signature a
plan is cached under, or None where the call is lowered per call: a ``premul_sum``
factor, ``shape=`` off a root), its **plan** (made once per key, with every argument check:
:mod:`meshcomm.group.plans`), its one **lowering** per call (:mod:`meshcomm.group.lower`),
written once over the buffers it runs on: host buffers, or a device communicator's
(:class:`~meshcomm.group.device_lower.DeviceBuffers`), and the plan key and plan of device
arrays (``device_key``, ``device_plan``). Every one of them checks the call with
:mod:`meshcomm.group.signatures`, so every route raises the same errors in the same words
before any I/O.

:data:`COLLECTIVES` holds them by name; :meth:`meshcomm.group.ProcessGroup` methods hand
their arguments, as they are, to the group's one resolver with the description
(``call -> route -> plan, cached or used once -> run``): a lowered call is a plan used
once, run through the same issuer.

Example:
    >>> COLLECTIVES["all_reduce"].key(np.ones(2), "sum", None)[:2]
    ('all_reduce', dtype('float64'))
    >>> COLLECTIVES["all_reduce"].key(np.ones(2), "premul_sum", 2.0) is None  # lowered
    True
    >>> sorted(name for name, c in COLLECTIVES.items() if c.key is _unplanned)
    ['barrier', 'permute']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np  # noqa: F401 - the doctests use it

from meshcomm.group import device_lower as _device_lower
from meshcomm.group import lower as _lower
from meshcomm.group import plans as _plans

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "BARRIER",
    "BROADCAST",
    "COLLECTIVES",
    "GATHER",
    "PERMUTE",
    "REDUCE",
    "REDUCE_SCATTER",
    "SCATTER",
    "Collective",
]

#: ``key(x, *args)``: the plan key of a call on the numpy (or device) array ``x``, or None.
Key = Callable[..., "tuple[Any, ...] | None"]


def _unplanned(x: Any, *args: Any) -> None:
    """The key of a collective that is never planned: every call is lowered."""
    return None


def _no_plan(c: _lower.Call, *args: Any) -> Any:
    raise NotImplementedError("this collective has no plan: its key is always None")


class Collective:
    """The description of one collective (see the module docstring).

    Every callable takes the method's own arguments after ``x``, in the method's order.

    Attributes:
        name: the operation's name (``"all_reduce"``; the ledger's, the fingerprint's).
        lower: ``lower(call, x, *args, snapshot=..., on=...)``: the per-call lowering, on
            host buffers (``on`` left out) or a device's (``on`` a
            :class:`~meshcomm.group.device_lower.DeviceBuffers`).
        on_device: whether a device array's call runs on the device communicator (False
            where the collective moves no array: ``barrier``).
        key: the plan key of a call on a numpy ``x``, or None: lowered per call (always,
            for a collective without a plan).
        plan: ``plan(call, x, *args)``: the plan of a key (a
            :class:`~meshcomm.group.plans.Plan`, or a rooted collective's
            :class:`~meshcomm.group.plans.ReturningPlan`).
        device_key: the plan key of a call on a device ``x``, or None.
        device_plan: ``device_plan(call, device_comm, xp, x, *args)``.
    """

    __slots__ = ("device_key", "device_plan", "key", "lower", "name", "on_device", "plan")

    def __init__(
        self,
        name: str,
        lower: Callable[..., _lower.Lowered],
        key: Key = _unplanned,
        plan: Callable[..., Any] = _no_plan,
        device_key: Key = _unplanned,
        device_plan: Callable[..., _plans.ReturningPlan] = _no_plan,
        on_device: bool = True,
    ) -> None:
        self.name = name
        self.lower = lower
        self.on_device = on_device
        self.key = key
        self.plan = plan
        self.device_key = device_key
        self.device_plan = device_plan

    def __repr__(self) -> str:
        return f"<Collective {self.name}>"


# Keys: the collective's name first (the issuer names a new plan's call by it), then what
# the plan's checks read. Ints only where an argument is an axis or a root: a key compares
# equal for 0, False and 0.0, and the checks differ.
def _all_reduce_key(x: Any, op: Any, factor: Any) -> tuple[Any, ...] | None:
    return ("all_reduce", x.dtype, x.shape, op) if factor is None else None


def _all_gather_key(x: Any, axis: Any, tiled: Any) -> tuple[Any, ...] | None:
    return ("all_gather", x.dtype, x.shape, axis, tiled) if type(axis) is int else None


def _reduce_scatter_key(
    x: Any, op: Any, axis: Any, tiled: Any, factor: Any
) -> tuple[Any, ...] | None:
    if factor is None and type(axis) is int:
        return ("reduce_scatter", x.dtype, x.shape, op, axis, tiled)
    return None


def _all_to_all_key(x: Any, split: Any, concat: Any, tiled: Any) -> tuple[Any, ...] | None:
    if type(split) is int and type(concat) is int:
        return ("all_to_all", x.dtype, x.shape, split, concat, tiled)
    return None


def _broadcast_key(x: Any, root: Any, shape: Any, dtype: Any) -> tuple[Any, ...] | None:
    if type(root) is int and shape is None and dtype is None:
        return ("broadcast", x.dtype, x.shape, root)
    return None


def _reduce_key(x: Any, root: Any, op: Any, factor: Any) -> tuple[Any, ...] | None:
    return ("reduce", x.dtype, x.shape, root, op) if factor is None and type(root) is int else None


def _gather_key(x: Any, root: Any) -> tuple[Any, ...] | None:
    return ("gather", x.dtype, x.shape, root) if type(root) is int else None


def _scatter_key(x: Any, root: Any, shape: Any, dtype: Any) -> tuple[Any, ...] | None:
    if type(root) is int and shape is None and dtype is None:
        return ("scatter", x.dtype, x.shape, root)
    return None


def _on_device(key: Callable[..., tuple[Any, ...] | None]) -> Callable[..., tuple[Any, ...] | None]:
    """The device plan's key of a collective whose host key is ``key``: the same signature,
    for a C-contiguous input only (the device runners read it flat). The group keeps device
    plans apart from host plans (``Issuer.device_plans``), so the key needs no mark."""

    def device_key(x: Any, *args: Any) -> tuple[Any, ...] | None:
        # cupy's own flag: x.flags builds a flags object, 0.5 us of an 8-byte call.
        contiguous = getattr(x, "_c_contiguous", None)
        if contiguous is None:
            contiguous = x.flags.c_contiguous
        return key(x, *args) if contiguous else None

    return device_key


ALL_REDUCE = Collective(
    "all_reduce",
    _lower.all_reduce,
    _all_reduce_key,
    _plans.plan_all_reduce,
    _on_device(_all_reduce_key),
    _device_lower.plan_all_reduce,
)
ALL_GATHER = Collective(
    "all_gather",
    _lower.all_gather,
    _all_gather_key,
    _plans.plan_all_gather,
    _on_device(_all_gather_key),
    _device_lower.plan_all_gather,
)
REDUCE_SCATTER = Collective(
    "reduce_scatter",
    _lower.reduce_scatter,
    _reduce_scatter_key,
    _plans.plan_reduce_scatter,
    _on_device(_reduce_scatter_key),
    _device_lower.plan_reduce_scatter,
)
ALL_TO_ALL = Collective(
    "all_to_all",
    _lower.all_to_all,
    _all_to_all_key,
    _plans.plan_all_to_all,
    _on_device(_all_to_all_key),
    _device_lower.plan_all_to_all,
)
BROADCAST = Collective(
    "broadcast",
    _lower.broadcast,
    _broadcast_key,
    _plans.plan_broadcast,
    _on_device(_broadcast_key),
    _device_lower.plan_broadcast,
)
REDUCE = Collective(
    "reduce",
    _lower.reduce,
    _reduce_key,
    _plans.plan_reduce,
    _on_device(_reduce_key),
    _device_lower.plan_reduce,
)
GATHER = Collective(
    "gather",
    _lower.gather,
    _gather_key,
    _plans.plan_gather,
    _on_device(_gather_key),
    _device_lower.plan_gather,
)
SCATTER = Collective(
    "scatter",
    _lower.scatter,
    _scatter_key,
    _plans.plan_scatter,
    _on_device(_scatter_key),
    _device_lower.plan_scatter,
)
PERMUTE = Collective("permute", _lower.permute)


def _barrier(c: _lower.Call, x: None, snapshot: bool = True) -> _lower.Lowered:
    return _lower.barrier(c)


#: A barrier moves no array: it always takes the host communicator.
BARRIER = Collective("barrier", _barrier, on_device=False)

#: Every collective a group runs, by name.
COLLECTIVES: dict[str, Collective] = {
    c.name: c
    for c in (
        ALL_REDUCE,
        ALL_GATHER,
        REDUCE_SCATTER,
        ALL_TO_ALL,
        BROADCAST,
        REDUCE,
        GATHER,
        SCATTER,
        PERMUTE,
        BARRIER,
    )
}
