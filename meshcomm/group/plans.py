"""Plans: a call signature lowered once, and the runner its calls take.

A group keeps one :class:`Plan` per call signature of its collectives on numpy arrays
(collective, dtype, shape, reduce op or root, axes, ``tiled``; the backend is the group's),
made on the signature's first call by the ``plan_*`` functions here with every check of
:mod:`meshcomm.group.signatures` (the lowering's), so a call that finds its plan skips no
check. Its runner ``run(x, result)`` is the backend's prepared one
(:meth:`~meshcomm.backends.base.Communicator.runner`), else the backend's primitive on flat
views, wrapped where the signature needs more than the wire's layout:

- ``avg``: the sum, then divided by the group's size (in the dtype, as JAX's ``pmean``);
- an axis other than 0 (``all_gather``'s stacking axis, ``reduce_scatter``'s split axis,
  ``all_to_all``'s two axes): the rank blocks copied rank-major before, and the received
  blocks put in place after (:func:`~meshcomm.group.arrays.blocks_view`,
  :func:`~meshcomm.group.arrays.unstack`);
- a byte-swapped input: read in native order first.

A call whose runner returns its result (a rooted collective's here, a device
``all_reduce``'s in :mod:`meshcomm.group.device_lower`) has a :class:`ReturningPlan`. Calls
with a ``premul_sum`` factor (a new scalar each call), lists and the other device calls take
the per-call lowering of :mod:`meshcomm.group.lower` instead: a plan used once.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group.arrays import ScratchPool
    >>> c = Call(SelfCommunicator(), ScratchPool(), "all_gather: rank 0")
    >>> plan = plan_all_gather(c, np.ones((2, 3)), 1, False)
    >>> out = np.empty(plan.shape)
    >>> plan.run(np.ones((2, 3)), out)
    >>> out.shape
    (2, 1, 3)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from meshcomm.backends.base import Communicator, Runner
from meshcomm.diagnostics import fingerprint as _fingerprint
from meshcomm.group import signatures as _sig
from meshcomm.group.arrays import ScratchPool, blocks_view, copy_into, joined_shape, unstack
from meshcomm.group.signatures import COMPOSED, Call, input_array, primitive, rank_arg
from meshcomm.reduction import ReduceOp

__all__ = [
    "Plan",
    "ReturningPlan",
    "noted",
    "plan_all_gather",
    "plan_all_reduce",
    "plan_all_to_all",
    "plan_broadcast",
    "plan_gather",
    "plan_reduce",
    "plan_reduce_scatter",
    "plan_scatter",
]


class Plan:
    """One call signature lowered once: the checked result shape and the runner to use.

    See the module docstring: one per call signature a group has seen, made by the
    ``plan_*`` functions below.

    Attributes:
        collective: the operation name (``"all_reduce"``).
        run: ``run(x, result)`` for a C-contiguous input of the signature and a fresh
            C-contiguous result: the backend's runner, wrapped as the signature needs (see
            the module docstring).
        run_in_place: ``run_in_place(result)`` for a result that already holds this rank's
            input (an all_reduce's asynchronous call, which copies its input anyway: reduced
            in place, one pass over memory fewer than reading the copy into a second
            buffer), or None.
        shape: the result's shape.
        count: the result's number of elements.
        nbytes: the result's bytes.
        dtype: the arrays' dtype.
        in_shape: the input's shape (the key's: read here, not off each call's array).
        fields: the call's fingerprint fields (the ledger, the mismatch checks).
        ledger_fields: ``fields`` (what the ledger keeps; a device plan's says "device").
        sig: the call's signature (:func:`~meshcomm.diagnostics.fingerprint.signature_of` of
            ``fields``), the same :mod:`meshcomm.group.lower`'s route computes.
        stamp_base: ``sig`` in a stamp's high bits: a call's stamp is ``stamp_base | seq``
            (the sequence number's low bits).

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group.arrays import ScratchPool
        >>> c = Call(SelfCommunicator(), ScratchPool(), "all_gather: rank 0")
        >>> plan = plan_all_gather(c, np.ones((2, 3)), 0, True)
        >>> plan.shape, plan.nbytes
        ((2, 3), 48)
    """

    __slots__ = (
        "collective",
        "count",
        "dtype",
        "fields",
        "in_shape",
        "ledger_fields",
        "nbytes",
        "run",
        "run_in_place",
        "shape",
        "sig",
        "stamp_base",
    )

    #: Its runner fills a fresh result (a :class:`ReturningPlan`'s returns its own).
    fills = True

    def __init__(
        self,
        collective: str,
        fields: dict[str, Any],
        run: Runner,
        shape: tuple[int, ...],
        run_in_place: Callable[[np.ndarray], None] | None = None,
    ) -> None:
        self.collective = collective
        self.fields = self.ledger_fields = fields
        self.run = run
        self.run_in_place = run_in_place
        self.shape = shape
        self.count = math.prod(shape)
        self.dtype: np.dtype = fields["dtype"]
        self.nbytes = self.count * self.dtype.itemsize
        self.in_shape: tuple[int, ...] = fields["shape"]
        self.sig = _fingerprint.signature_of(collective, fields, False)
        self.stamp_base = self.sig << _fingerprint.SEQ_BITS


def noted(c: Call, make: Callable[..., Any], note: tuple[tuple[str, Any], ...], *args: Any) -> Any:
    """``make(c, *args)``'s plan with ``note`` added to its fingerprint fields: what the ops
    layer knows of the call beyond the group's arguments (the axes the user named, a packed
    pytree's structure: :mod:`meshcomm.ops._calls`), for the ledger's words and, where
    :func:`~meshcomm.diagnostics.fingerprint.signature_of` reads them, the signature.

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.group.arrays import ScratchPool
        >>> c = Call(SelfCommunicator(), ScratchPool(), "all_reduce: rank 0")
        >>> plain = plan_all_reduce(c, np.ones(2), "sum")
        >>> over = noted(c, plan_all_reduce, (("over", "'x'"),), np.ones(2), "sum")
        >>> over.fields["over"], over.sig == plain.sig  # words only
        ("'x'", True)
        >>> note = (("tree", "[float64[1], float64[1]]"),)
        >>> noted(c, plan_all_reduce, note, np.ones(2), "sum").sig == plain.sig  # checked
        False
    """
    plan = make(c, *args)
    fields = {**plan.fields, **dict(note)}
    if isinstance(plan, ReturningPlan):
        return ReturningPlan(plan.collective, fields, plan.run, plan.on_device)
    return Plan(plan.collective, fields, plan.run, plan.shape, plan.run_in_place)


def _runner(c: Call, collective: str, dtype: np.dtype, arg: Any) -> Runner:
    """The runner of ``collective`` (the name of ``c``'s operation) for ``dtype`` and
    ``arg`` (reduce op or root), made once per call context."""
    run = c.runners.get((dtype, arg))
    if run is None:
        run = c.runners[(dtype, arg)] = _new_runner(c.comm, collective, dtype, arg)
    return run


def _new_runner(comm: Communicator, collective: str, dtype: np.dtype, arg: Any) -> Runner:
    """The backend's runner for the signature, else its primitive on flat views."""
    run = comm.runner(collective, dtype, arg)
    if run is not None:
        return run
    with_arg: Callable[[np.ndarray, np.ndarray, Any], None]
    if collective == "all_reduce":
        with_arg = comm.all_reduce_out
    elif collective == "reduce_scatter":
        with_arg = comm.reduce_scatter
    elif collective == "broadcast":
        with_arg = comm.broadcast_out
    else:
        moving = comm.all_gather if collective == "all_gather" else comm.all_to_all

        def run_flat(send: np.ndarray, recv: np.ndarray) -> None:
            moving(send.reshape(-1), recv.reshape(-1))

        return run_flat

    def run_flat_with(send: np.ndarray, recv: np.ndarray) -> None:
        with_arg(send.reshape(-1), recv.reshape(-1), arg)

    return run_flat_with


def plan_all_reduce(c: Call, x: np.ndarray, op: Any, factor: None = None) -> Plan:
    """The plan of an ``all_reduce`` of ``x`` (no factor: a call with one is lowered)."""
    arr, dt = input_array(c, x)
    fields, _ = _sig.all_reduce(c, dt, arr.shape, op, factor)
    rop = fields["reduce"]
    run = _reducing(c, "all_reduce", dt, rop)
    in_place = _reducing_in_place(c.comm, rop, c.size)
    return Plan("all_reduce", fields, _native(run, arr.dtype, dt), arr.shape, in_place)


def _reducing_in_place(
    comm: Communicator, rop: ReduceOp, size: int
) -> Callable[[np.ndarray], None]:
    """An all_reduce of a buffer in place (the communicator's primitive; ``avg`` divides)."""
    prim = primitive(rop)
    average = rop is ReduceOp.AVG

    def run(buf: np.ndarray) -> None:
        comm.all_reduce(buf.reshape(-1), prim)
        if average:
            np.true_divide(buf, size, out=buf)

    return run


def plan_reduce_scatter(
    c: Call, x: np.ndarray, op: Any, axis: Any, tiled: Any, factor: None = None
) -> Plan:
    """The plan of a ``reduce_scatter`` of ``x`` (no factor)."""
    arr, dt = input_array(c, x)
    fields, _, block = _sig.reduce_scatter(c, dt, arr.shape, op, axis, tiled, factor)
    ax = fields["axis"]
    run = _reducing(c, "reduce_scatter", dt, fields["reduce"])
    if ax != 0:  # at axis 0 a C-contiguous input is rank-major already, tiled or not
        run = _sending_blocks(run, c.pool, ax, c.size, bool(tiled), dt)
    return Plan("reduce_scatter", fields, _native(run, arr.dtype, dt), block)


def plan_all_gather(c: Call, x: np.ndarray, axis: Any, tiled: Any) -> Plan:
    """The plan of an ``all_gather`` of ``x``."""
    arr, dt = input_array(c, x)
    fields = _sig.all_gather(c, dt, arr.shape, axis, tiled)
    ax = fields["axis"]
    run = _runner(c, "all_gather", dt, None)
    if ax != 0:
        run = _placing_blocks(run, c.pool, arr.shape, ax, c.size, bool(tiled), dt)
    shape = joined_shape(arr.shape, ax, c.size, tiled)
    return Plan("all_gather", fields, _native(run, arr.dtype, dt), shape)


def plan_all_to_all(c: Call, x: np.ndarray, split_axis: Any, concat_axis: Any, tiled: Any) -> Plan:
    """The plan of an ``all_to_all`` of ``x``."""
    arr, dt = input_array(c, x)
    fields, block = _sig.all_to_all(c, dt, arr.shape, split_axis, concat_axis, tiled)
    split, concat = fields["axis"], fields["axis2"]
    run = _runner(c, "all_to_all", dt, None)
    if concat != 0:
        run = _placing_blocks(run, c.pool, block, concat, c.size, bool(tiled), dt)
    if split != 0:
        run = _sending_blocks(run, c.pool, split, c.size, bool(tiled), dt)
    shape = joined_shape(block, concat, c.size, tiled)
    return Plan("all_to_all", fields, _native(run, arr.dtype, dt), shape)


def plan_broadcast(
    c: Call, x: np.ndarray, root: Any, shape: None = None, dtype: None = None
) -> Plan:
    """The plan of a ``broadcast`` with an array ``x`` on every rank (no ``shape=`` or
    ``dtype=``: a call with them is lowered)."""
    r = rank_arg(c, root, "root")
    arr, dt = input_array(c, x)
    fields = _sig.broadcast(c, dt, arr.shape, r)
    run = _native(_runner(c, "broadcast", dt, r), arr.dtype, dt)
    return Plan("broadcast", fields, run, arr.shape)


# -- wrappers for signatures beyond the wire's layout ------------------------------------
def _reducing(c: Call, collective: str, dt: np.dtype, rop: ReduceOp) -> Runner:
    """The runner of a reduction: the backend's for a primitive op; for ``avg``, the sum's
    followed by the division by the group's size."""
    if rop not in COMPOSED:
        return _runner(c, collective, dt, rop)
    run_sum, size = _runner(c, collective, dt, ReduceOp.SUM), c.size

    def run_avg(send: np.ndarray, recv: np.ndarray) -> None:
        run_sum(send, recv)
        np.true_divide(recv, size, out=recv)

    return run_avg


def _native(run: Runner, given: np.dtype, dt: np.dtype) -> Runner:
    """``run`` for inputs of dtype ``given``: as it is when that is ``dt``, else reading a
    native-order copy first (a byte-swapped input)."""
    if given == dt:
        return run

    def run_native(send: np.ndarray, recv: np.ndarray) -> None:
        run(send.astype(dt), recv)

    return run_native


def _sending_blocks(
    run: Runner, pool: ScratchPool, axis: int, size: int, tiled: bool, dt: np.dtype
) -> Runner:
    """``run`` for an input split into rank blocks along ``axis``: the blocks are copied
    rank-major (block ``r`` for rank ``r``) first, the layout the wire sends, into scratch
    memory reused from call to call (no fresh pages for a large input)."""

    def run_blocks(send: np.ndarray, recv: np.ndarray) -> None:
        view = blocks_view(send, axis, size, tiled)
        base, rank_major = pool.take(dt, view.shape)
        np.copyto(rank_major, view)
        run(rank_major, recv)
        pool.give(base)  # not after a failure: the transport may still read it

    return run_blocks


def _placing_blocks(
    run: Runner,
    pool: ScratchPool,
    block: tuple[int, ...],
    axis: int,
    size: int,
    tiled: bool,
    dt: np.dtype,
) -> Runner:
    """``run`` for a result that puts the received rank blocks (each of shape ``block``)
    together at ``axis``: they arrive rank-major in scratch memory and are then moved into
    place."""
    count = size * math.prod(block)

    def run_placing(send: np.ndarray, recv: np.ndarray) -> None:
        base, rank_major = pool.take(dt, (count,))
        run(send, rank_major)
        flat = recv.reshape(-1)
        placed = unstack(rank_major, block, axis, size, tiled, lambda _dt, _n: flat)
        if not np.may_share_memory(placed, recv):
            np.copyto(recv, placed)  # the blocks were in place already: a view of rank_major
        pool.give(base)  # not after a failure: the transport may still write it

    return run_placing


# -- rooted collectives --------------------------------------------------------------------
class ReturningPlan:
    """A call signature lowered once whose runner returns this rank's result: a rooted
    collective's (``reduce``, ``gather``, ``scatter`` of a numpy array on every rank; None
    off the root of a ``reduce`` or a ``gather``) or a device call's
    (:func:`meshcomm.group.device_lower.plan_all_reduce`). The issuer runs both with
    :meth:`~meshcomm.group.issuing.Issuer.run_returning`.

    Attributes:
        collective: the operation name.
        run: ``run(x)`` for a C-contiguous input of the signature: the call, its result.
        fields: the call's fingerprint fields (``shape`` is a ``scatter``'s block, as the
            lowering's).
        on_device: whether it runs on the group's device communicator.
        ledger_fields: ``fields``, marked ``device`` on a device (what the ledger keeps).
        sig: the call's signature (:func:`~meshcomm.diagnostics.fingerprint.signature_of`),
            as the lowered call's.
        stamp_base: ``sig`` in a stamp's high bits; None on a device (stamps ride on host
            messages).
        dtype: the arrays' dtype.
        in_shape: ``fields["shape"]`` (what the ledger keeps).

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> c = Call(SelfCommunicator(), ScratchPool(), "gather: rank 0")
        >>> plan_gather(c, np.arange(2), 0).run(np.arange(2))
        array([[0, 1]])
    """

    __slots__ = (
        "collective",
        "dtype",
        "fields",
        "in_shape",
        "ledger_fields",
        "on_device",
        "run",
        "sig",
        "stamp_base",
    )

    #: Its runner returns the result (a :class:`Plan`'s fills one).
    fills = False

    def __init__(
        self,
        collective: str,
        fields: dict[str, Any],
        run: Callable[[Any], Any],
        on_device: bool = False,
    ) -> None:
        self.collective = collective
        self.fields = fields
        self.ledger_fields = {**fields, "device": True} if on_device else fields
        self.on_device = on_device
        self.run = run
        self.dtype: np.dtype = fields["dtype"]
        self.in_shape: tuple[int, ...] = fields["shape"]
        self.sig = _fingerprint.signature_of(collective, fields, on_device)
        self.stamp_base = None if on_device else self.sig << _fingerprint.SEQ_BITS


def _native_input(run: Callable[[Any], Any], given: np.dtype, dt: np.dtype) -> Callable[[Any], Any]:
    """``run`` reading a native-order copy of a byte-swapped input (as :func:`_native`)."""
    if given == dt:
        return run

    def run_native(x: np.ndarray) -> Any:
        return run(x.astype(dt))

    return run_native


def plan_reduce(c: Call, x: np.ndarray, root: Any, op: Any, factor: None = None) -> ReturningPlan:
    """The plan of a ``reduce`` of ``x`` (no factor): the input copied into the buffer the
    wire reduces in place (the result on the root, scratch elsewhere)."""
    r = rank_arg(c, root, "root")
    arr, dt = input_array(c, x)
    fields, _ = _sig.reduce(c, dt, arr.shape, r, op, factor)
    rop = fields["reduce"]
    comm, pool, results, size, shape = c.comm, c.pool, c.results, c.size, arr.shape
    prim, count, average = primitive(rop), arr.size, rop is ReduceOp.AVG
    run: Callable[[Any], Any]
    if r == c.rank:

        def run(x: np.ndarray) -> np.ndarray:
            buf = results.take(dt, count)
            copy_into(buf, x)
            comm.reduce(buf, r, prim)
            if average:
                np.true_divide(buf, size, out=buf)
            return buf.reshape(shape)

    else:

        def run(x: np.ndarray) -> None:
            base, buf = pool.take(dt, (count,))
            copy_into(buf, x)
            comm.reduce(buf, r, prim)
            pool.give(base)  # not after a failure: the transport may still read it

    return ReturningPlan("reduce", fields, run)


def plan_gather(c: Call, x: np.ndarray, root: Any) -> ReturningPlan:
    """The plan of a ``gather`` of ``x``: sent where it lies, stacked on the root."""
    r = rank_arg(c, root, "root")
    arr, dt = input_array(c, x)
    fields = _sig.gather(c, dt, arr.shape, r)
    comm, results, size, shape = c.comm, c.results, c.size, arr.shape
    run: Callable[[Any], Any]
    if r == c.rank:
        count = size * arr.size

        def run(x: np.ndarray) -> np.ndarray:
            recv = results.take(dt, count)
            comm.gather(x.reshape(-1), recv, r)
            return recv.reshape((size, *shape))

    else:

        def run(x: np.ndarray) -> None:
            comm.gather(x.reshape(-1), None, r)

    return ReturningPlan("gather", fields, _native_input(run, arr.dtype, dt))


def plan_scatter(
    c: Call, x: np.ndarray, root: Any, shape: None = None, dtype: None = None
) -> ReturningPlan:
    """The plan of a ``scatter`` with a stacked array ``x`` on every rank (no ``shape=``
    or ``dtype=``): the root sends from its ``x`` where it lies."""
    r = rank_arg(c, root, "root")
    arr, dt = input_array(c, x)
    fields, block = _sig.scatter(c, dt, arr.shape, r, shape, dtype)
    comm, results, count, is_root = c.comm, c.results, math.prod(block), r == c.rank

    def run(x: np.ndarray) -> np.ndarray:
        recv = results.take(dt, count)
        comm.scatter(x.reshape(-1) if is_root else None, recv, r)
        return recv.reshape(block)

    return ReturningPlan("scatter", fields, _native_input(run, arr.dtype, dt))
