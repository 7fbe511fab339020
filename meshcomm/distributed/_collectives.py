"""The in-place collectives: each computes meshcomm's functional result and copies it into
the caller's tensors.

Every function checks its arguments (types, dtypes, list lengths, sizes) before anything is
sent, then issues one meshcomm operation on the group (``all_to_all`` and
``all_to_all_single`` are in :mod:`meshcomm.distributed._alltoall`). With
``async_op=True`` it returns a :class:`~meshcomm.distributed._work.Work` whose ``wait()``
returns once the results are in the caller's tensors; otherwise it returns None after
that. A rank that is not a member of ``group`` warns and returns None, as in torch.

Tensors may have any strides; only the number of elements must match where torch requires
it (a ``(2, 3)`` tensor may receive a broadcast of a ``(6,)`` one).

Example:
    >>> import numpy as np
    >>> import meshcomm.distributed as dist
    >>> dist.init_process_group(world_size=1, rank=0)
    >>> t = np.array([1.0, 2.0])
    >>> dist.all_reduce(t, op=dist.ReduceOp.SUM); t
    array([1., 2.])
    >>> out = [np.zeros(2)]
    >>> dist.all_gather(out, t); out
    [array([1., 2.])]
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from meshcomm.distributed._coalescing import Queued, queue
from meshcomm.distributed._common import (
    Route,
    counts_equal,
    flat,
    member,
    reduce_op_for,
    run,
    same_count,
    writable,
)
from meshcomm.distributed._errors import public
from meshcomm.distributed._groups import canonical_rank
from meshcomm.distributed._reduce_op import ReduceOp
from meshcomm.distributed._state import STATE, resolve, warn_not_in_group
from meshcomm.distributed._tensors import (
    Buffer,
    as_buffer,
    as_buffer_list,
    device_stream,
    same_dtype,
)
from meshcomm.distributed._work import Work

__all__ = [
    "_all_gather_base",
    "_reduce_scatter_base",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
]


# -- one-to-all and all-to-one ---------------------------------------------------------------
@public
def broadcast(
    tensor: Any,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Copy the source rank's ``tensor`` into ``tensor`` on every rank of the group.

    Args:
        tensor: the data on the source rank; the buffer to fill elsewhere (same number of
            elements and dtype).
        src: source rank in the world (whatever ``group`` is).
        group: the group (default: the default group).
        async_op: return a Work.
        group_src: source rank in ``group`` (instead of ``src``).

    Returns:
        A Work if ``async_op``, else None.

    Raises:
        ValueError: neither or both of ``src``/``group_src``, a rank outside the group.
        TypeError: ``tensor`` is not an array or tensor.
        DistBackendError: the operation failed.
    """
    buf = as_buffer(tensor, "tensor")
    buf.check_writable()
    pg = resolve(group)
    if pg is None:
        warn_not_in_group("broadcast")
        return None
    root = canonical_rank(pg, src, group_src, "src")
    STATE.flush()
    mine = root == pg.rank()
    g = pg.mesh_group
    on_device = buf.device_view(g)
    if on_device is not None:  # over the device backend: every rank passes its tensor

        def broadcast_on_device(a: bool) -> Any:
            with device_stream(buf):
                return g.broadcast(on_device, root, async_op=a)

        def written_unless_root(res: Any) -> None:
            if not mine:
                buf.write(res)

        return run("broadcast", broadcast_on_device, [tensor], written_unless_root, async_op)
    x = flat(buf) if mine else None

    def issue(a: bool) -> Any:
        return g.broadcast(x, root, shape=(buf.numel,), dtype=buf.dtype, async_op=a)

    def finish(res: np.ndarray) -> None:
        if not mine:
            buf.write(res)

    return run("broadcast", issue, [tensor], finish, async_op)


@public
def all_reduce(
    tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """Reduce ``tensor`` across the group, in place on every rank.

    Args:
        tensor: input and output.
        op: a :class:`ReduceOp` (``SUM``, ``AVG``, ``PRODUCT``, ``MIN``, ``MAX``, ``BAND``,
            ``BOR``, ``BXOR``, ``PREMUL_SUM`` with a factor).
        group: the group (default: the default group).
        async_op: return a Work.

    Raises:
        ValueError: an op undefined for complex tensors.
        DistTypeError: an op undefined for the dtype (a RuntimeError and a TypeError).
        DistBackendError: the operation failed.
    """
    buf = as_buffer(tensor, "tensor")
    buf.check_writable()
    mop, factor = reduce_op_for(op, buf, "all_reduce")
    pg = member(group, "all_reduce")
    if pg is None:
        return None
    if pg in STATE.coalescing:
        return queue(pg, Queued("all_reduce", buf, buf, tensor, op, mop, factor), async_op)
    g = pg.mesh_group
    mine = buf.in_place
    on_device = buf.device_view(g)
    if on_device is not None:  # over the device backend: in place (NCCL's own) where dense
        dense = on_device.flags.c_contiguous

        def reduce_on_device(a: bool) -> Any:
            into = on_device if dense else None  # a strided tensor gets the result copied in
            with device_stream(buf):
                return g.all_reduce(on_device, mop, factor=factor, async_op=a, out=into)

        return run(
            "all_reduce", reduce_on_device, [tensor], _written if dense else buf.write, async_op
        )
    if mine is not None:  # reduced where it lies: no copy in or out, async included

        def reduce_in_place(a: bool) -> Any:
            return g.all_reduce(mine, mop, factor=factor, async_op=a, out=mine)

        return run("all_reduce", reduce_in_place, [tensor], _written, async_op)

    def issue(a: bool) -> Any:
        return g.all_reduce(buf.host, mop, factor=factor, async_op=a)

    return run("all_reduce", issue, [tensor], buf.write, async_op)


def _written(result: Any) -> None:
    """The finish of a collective that wrote its result into the caller's memory itself."""


@public
def reduce(
    tensor: Any,
    dst: int | None = None,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Reduce ``tensor`` across the group into ``tensor`` on the destination rank.

    Other ranks' tensors are left as they were.

    Raises:
        ValueError: bad ``dst``/``group_dst``, an op undefined for complex tensors.
        DistTypeError: an op undefined for the dtype.
    """
    buf = as_buffer(tensor, "tensor")
    buf.check_writable()
    mop, factor = reduce_op_for(op, buf, "reduce")
    pg = resolve(group)
    if pg is None:
        warn_not_in_group("reduce")
        return None
    root = canonical_rank(pg, dst, group_dst, "dst")
    STATE.flush()
    g = pg.mesh_group
    route = Route(g, [buf])

    def issue(a: bool) -> Any:
        with route.stream():
            return g.reduce(route.flat(buf), root, mop, factor=factor, async_op=a)

    def finish(res: np.ndarray | None) -> None:
        if res is not None:
            buf.write(res)

    return run("reduce", issue, [tensor], finish, async_op)


def _root_list(
    pg: Any, root: int, tensors: list[Any] | None, name: str, mine: Buffer, role: str
) -> list[Buffer]:
    """Check the per-rank list that only the root passes (gather's outputs, scatter's inputs).

    Returns the list's buffers on the root (one per group rank, each with ``mine``'s dtype and
    number of elements) and an empty list elsewhere. The messages are torch's.
    """
    if root != pg.rank():
        if tensors:
            raise ValueError(f"Argument ``{name}`` must NOT be specified on non-{role} ranks.")
        return []
    if not tensors:
        raise ValueError(f"Argument ``{name}`` must be specified on {role} rank.")
    bufs = as_buffer_list(tensors, name)
    same_dtype([mine, *bufs])
    same_count(pg.size(), bufs, name)
    counts_equal(bufs, mine.numel, "tensor")
    return bufs


@public
def gather(
    tensor: Any,
    gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Gather every rank's ``tensor`` into ``gather_list`` on the destination rank.

    Args:
        tensor: this rank's input.
        gather_list: on the destination, one tensor per group rank (same number of elements
            and dtype as ``tensor``); None or empty elsewhere.
        dst: destination rank in the world.
        group: the group.
        async_op: return a Work.
        group_dst: destination rank in ``group``.

    Raises:
        ValueError: ``gather_list`` missing on the destination or given elsewhere, wrong
            length, sizes or dtypes.
    """
    inp = as_buffer(tensor, "tensor")
    pg = resolve(group)
    if pg is None:
        warn_not_in_group("gather")
        return None
    root = canonical_rank(pg, dst, group_dst, "dst")
    outs = _root_list(pg, root, gather_list, "gather_list", inp, "destination")
    writable(*outs)
    STATE.flush()
    g = pg.mesh_group
    route = Route(g, [inp])

    def issue(a: bool) -> Any:
        with route.stream():
            return g.gather(route.flat(inp), root, async_op=a)

    def finish(res: np.ndarray | None) -> None:
        if res is not None:
            for r, out in enumerate(outs):
                out.write(res[r])

    return run("gather", issue, gather_list or [], finish, async_op)


@public
def scatter(
    tensor: Any,
    scatter_list: list[Any] | None = None,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Give group rank ``r`` the source rank's ``scatter_list[r]``, in ``tensor``.

    Args:
        tensor: the output.
        scatter_list: on the source, one tensor per group rank (same number of elements and
            dtype as ``tensor``); None or empty elsewhere.
        src: source rank in the world.
        group: the group.
        async_op: return a Work.
        group_src: source rank in ``group``.

    Raises:
        ValueError: ``scatter_list`` missing on the source or given elsewhere, wrong length,
            sizes or dtypes.
    """
    out = as_buffer(tensor, "tensor")
    out.check_writable()
    pg = resolve(group)
    if pg is None:
        warn_not_in_group("scatter")
        return None
    root = canonical_rank(pg, src, group_src, "src")
    ins = _root_list(pg, root, scatter_list, "scatter_list", out, "source")
    STATE.flush()
    g = pg.mesh_group
    # Every rank's output decides (the device scatter wants an array on every rank: off the
    # root, only its shape counts, so a broadcast view of the output serves).
    route = Route(g, [out, *ins])
    with route.stream():
        if ins:
            x = route.xp.stack([route.flat(b) for b in ins])
        elif route.on_device:
            x = route.xp.broadcast_to(route.flat(out)[None], (pg.size(), out.numel))
        else:
            x = None

    def issue(a: bool) -> Any:
        with route.stream():
            return g.scatter(x, root, shape=(out.numel,), dtype=out.dtype, async_op=a)

    return run("scatter", issue, [tensor], out.write, async_op)


# -- all to all --------------------------------------------------------------------------------
@public
def all_gather(
    tensor_list: list[Any], tensor: Any, group: Any = None, async_op: bool = False
) -> Work | None:
    """Fill ``tensor_list[r]`` with group rank ``r``'s ``tensor``, on every rank.

    ``tensor_list[r]`` must have as many elements as rank ``r``'s ``tensor``; the sizes may
    differ between ranks (every rank passes the same sizes).

    Raises:
        ValueError: wrong list length, dtypes differ, this rank's entry has the wrong size.
    """
    outs = as_buffer_list(tensor_list, "tensor_list")
    inp = as_buffer(tensor, "tensor")
    same_dtype([*outs, inp])
    writable(*outs)
    pg = member(group, "all_gather")
    if pg is None:
        return None
    same_count(pg.size(), outs, "tensor_list")
    counts = [o.numel for o in outs]
    me = pg.rank()
    if counts[me] != inp.numel:
        raise ValueError(
            f"tensor has {inp.numel} elements but tensor_list[{me}] (this rank's entry) has "
            f"{counts[me]}"
        )
    width = max(counts, default=0)
    g = pg.mesh_group
    route = Route(g, [inp])
    with route.stream():
        if width == inp.numel:
            x = route.flat(inp)
        else:  # uneven sizes: pad to the widest, which every rank knows from its tensor_list
            x = route.xp.zeros(width, dtype=inp.dtype)
            x[: inp.numel] = route.flat(inp)

    def issue(a: bool) -> Any:
        with route.stream():
            return g.all_gather(x, axis=0, async_op=a)

    def finish(res: np.ndarray) -> None:
        for r, out in enumerate(outs):
            out.write(res[r, : counts[r]])

    return run("all_gather", issue, tensor_list, finish, async_op)


@public
def all_gather_single(
    output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False
) -> Work | None:
    """Gather every rank's ``input_tensor`` into ``output_tensor``, concatenated by rank.

    ``output_tensor`` has ``group size`` times the elements of ``input_tensor`` (either the
    concatenation or the stack along dim 0: the memory layout is the same).

    Raises:
        ValueError: sizes or dtypes do not match.
    """
    out = as_buffer(output_tensor, "output_tensor")
    inp = as_buffer(input_tensor, "input_tensor")
    same_dtype([out, inp])
    out.check_writable()
    pg = member(group, "all_gather_single")
    if pg is None:
        return None
    if out.numel != pg.size() * inp.numel:
        raise ValueError(
            f"output_tensor must have group size ({pg.size()}) x {inp.numel} = "
            f"{pg.size() * inp.numel} elements, got {out.numel}"
        )
    if pg in STATE.coalescing:
        return queue(pg, Queued("all_gather_single", inp, out, output_tensor), async_op)
    g = pg.mesh_group
    route = Route(g, [inp])

    def issue(a: bool) -> Any:
        with route.stream():
            return g.all_gather(route.flat(inp), axis=0, tiled=True, async_op=a)

    return run("all_gather_single", issue, [output_tensor], out.write, async_op)


@public
def all_gather_into_tensor(
    output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False
) -> Work | None:
    """Deprecated in torch 2.13 (warns as torch); use :func:`all_gather_single`."""
    warnings.warn(
        "`meshcomm.distributed.all_gather_into_tensor` is deprecated (as in torch). Please use "
        "`meshcomm.distributed.all_gather_single` instead.",
        FutureWarning,
        stacklevel=3,  # past the @public wrapper, to the caller
    )
    return all_gather_single(output_tensor, input_tensor, group, async_op)


@public
def _all_gather_base(
    output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False
) -> Work | None:
    """Torch's private, deprecated name of :func:`all_gather_single` (warns as torch).

    Example:
        >>> import numpy as np
        >>> import meshcomm.distributed as dist
        >>> dist.init_process_group("gloo", world_size=1, rank=0)
        >>> out = np.zeros(2)
        >>> with warnings.catch_warnings(record=True):
        ...     dist._all_gather_base(out, np.array([1.0, 2.0]))
        >>> out
        array([1., 2.])
        >>> dist.destroy_process_group()
    """
    warnings.warn(
        "`meshcomm.distributed._all_gather_base` is a private function and will be deprecated "
        "(as in torch). Please use `meshcomm.distributed.all_gather_single` instead.",
        FutureWarning,
        stacklevel=3,  # past the @public wrapper, to the caller
    )
    return all_gather_single(output_tensor, input_tensor, group, async_op)


@public
def reduce_scatter(
    output: Any,
    input_list: list[Any],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``input_list[r]`` across ranks into ``output`` on group rank ``r``.

    Raises:
        ValueError: wrong list length, sizes or dtypes.
        DistTypeError: an op undefined for the dtype.
    """
    out = as_buffer(output, "output")
    ins = as_buffer_list(input_list, "input_list")
    same_dtype([out, *ins])
    out.check_writable()
    mop, factor = reduce_op_for(op, out, "reduce_scatter")
    pg = member(group, "reduce_scatter")
    if pg is None:
        return None
    same_count(pg.size(), ins, "input_list")
    counts_equal(ins, out.numel, "output")
    g = pg.mesh_group
    route = Route(g, ins)
    with route.stream():
        x = route.xp.stack([route.flat(b) for b in ins])

    def issue(a: bool) -> Any:
        with route.stream():
            return g.reduce_scatter(x, mop, axis=0, factor=factor, async_op=a)

    return run("reduce_scatter", issue, [output], out.write, async_op)


@public
def reduce_scatter_single(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """Reduce ``input`` across ranks; group rank ``r`` gets the ``r``-th equal chunk.

    Raises:
        ValueError: ``input`` does not have group size x ``output``'s elements, dtypes.
        DistTypeError: an op undefined for the dtype.
    """
    out = as_buffer(output, "output")
    inp = as_buffer(input, "input")
    same_dtype([out, inp])
    out.check_writable()
    mop, factor = reduce_op_for(op, out, "reduce_scatter_single")
    pg = member(group, "reduce_scatter_single")
    if pg is None:
        return None
    size = pg.size()
    if inp.numel != size * out.numel:
        raise ValueError(
            f"input must have group size ({size}) x {out.numel} = {size * out.numel} elements, "
            f"got {inp.numel}"
        )
    if pg in STATE.coalescing:
        call = Queued("reduce_scatter_single", inp, out, output, op, mop, factor)
        return queue(pg, call, async_op)
    g = pg.mesh_group
    route = Route(g, [inp])

    def issue(a: bool) -> Any:
        with route.stream():
            x = route.flat(inp).reshape(size, -1)
            return g.reduce_scatter(x, mop, axis=0, factor=factor, async_op=a)

    return run("reduce_scatter_single", issue, [output], out.write, async_op)


@public
def reduce_scatter_tensor(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """Deprecated in torch 2.13 (warns as torch); use :func:`reduce_scatter_single`."""
    warnings.warn(
        "`meshcomm.distributed.reduce_scatter_tensor` is deprecated (as in torch). Please use "
        "`meshcomm.distributed.reduce_scatter_single` instead.",
        FutureWarning,
        stacklevel=3,  # past the @public wrapper, to the caller
    )
    return reduce_scatter_single(output, input, op, group, async_op)


@public
def _reduce_scatter_base(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """Torch's private, deprecated name of :func:`reduce_scatter_single` (warns as torch).

    Example:
        >>> import numpy as np
        >>> import meshcomm.distributed as dist
        >>> dist.init_process_group("gloo", world_size=1, rank=0)
        >>> out = np.zeros(2)
        >>> with warnings.catch_warnings(record=True):
        ...     dist._reduce_scatter_base(out, np.array([1.0, 2.0]))
        >>> out
        array([1., 2.])
        >>> dist.destroy_process_group()
    """
    warnings.warn(
        "`meshcomm.distributed._reduce_scatter_base` is a private function and will be "
        "deprecated (as in torch). Please use `meshcomm.distributed.reduce_scatter_single` "
        "instead.",
        FutureWarning,
        stacklevel=3,  # past the @public wrapper, to the caller
    )
    return reduce_scatter_single(output, input, op, group, async_op)


# -- coalesced (deprecated in torch) ------------------------------------------------------------
@public
def all_reduce_coalesced(
    tensors: list[Any], op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """All-reduce several tensors of one dtype in one operation (deprecated in torch)."""
    warnings.warn(
        "`meshcomm.distributed.all_reduce_coalesced` will be deprecated (as in torch)",
        FutureWarning,
        stacklevel=3,  # past the @public wrapper, to the caller
    )
    bufs = as_buffer_list(tensors, "tensors")
    same_dtype(bufs)
    writable(*bufs)
    if not bufs:
        return Work.completed("all_reduce_coalesced", []) if async_op else None
    mop, factor = reduce_op_for(op, bufs[0], "all_reduce_coalesced")
    pg = member(group, "all_reduce_coalesced")
    if pg is None:
        return None
    g = pg.mesh_group
    route = Route(g, bufs)
    with route.stream():
        x = route.xp.concatenate([route.flat(b) for b in bufs])
    edges = np.cumsum([0, *[b.numel for b in bufs]])

    def issue(a: bool) -> Any:
        with route.stream():
            return g.all_reduce(x, mop, factor=factor, async_op=a)

    def finish(res: np.ndarray) -> None:
        for i, b in enumerate(bufs):
            b.write(res[edges[i] : edges[i + 1]])

    return run("all_reduce_coalesced", issue, tensors, finish, async_op)


@public
def all_gather_coalesced(
    output_tensor_lists: list[list[Any]],
    input_tensor_list: list[Any],
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """All-gather several tensors (deprecated in torch): ``output_tensor_lists[r][i]``
    receives rank ``r``'s ``input_tensor_list[i]``."""
    warnings.warn(
        "`meshcomm.distributed.all_gather_coalesced` will be deprecated (as in torch)",
        FutureWarning,
        stacklevel=3,  # past the @public wrapper, to the caller
    )
    if not isinstance(output_tensor_lists, list):
        raise TypeError("output_tensor_lists must be a list of lists of tensors")
    ins = as_buffer_list(input_tensor_list, "input_tensor_list")
    outs = [
        as_buffer_list(row, f"output_tensor_lists[{r}]")
        for r, row in enumerate(output_tensor_lists)
    ]
    same_dtype([*ins, *(b for row in outs for b in row)])
    pg = member(group, "all_gather_coalesced")
    if pg is None:
        return None
    same_count(pg.size(), outs, "output_tensor_lists")
    for row in outs:
        same_count(len(ins), row, "each output list")
        writable(*row)
        for b, i in zip(row, ins, strict=True):
            counts_equal([b], i.numel, i.name)
    if not ins:
        return Work.completed("all_gather_coalesced", output_tensor_lists) if async_op else None
    g = pg.mesh_group
    route = Route(g, ins)
    with route.stream():
        x = route.xp.concatenate([route.flat(b) for b in ins])
    edges = np.cumsum([0, *[b.numel for b in ins]])

    def issue(a: bool) -> Any:
        with route.stream():
            return g.all_gather(x, axis=0, async_op=a)

    def finish(res: np.ndarray) -> None:
        for r, row in enumerate(outs):
            for i, b in enumerate(row):
                b.write(res[r, edges[i] : edges[i + 1]])

    return run("all_gather_coalesced", issue, output_tensor_lists, finish, async_op)


# -- synchronization ---------------------------------------------------------------------------
@public
def barrier(
    group: Any = None, async_op: bool = False, device_ids: Any = None, timeout: Any = None
) -> Work | None:
    """Return once every rank of the group has entered the barrier.

    Args:
        group: the group.
        async_op: return a Work.
        device_ids: ignored (torch uses it for NCCL).
        timeout: wait at most this long (seconds or ``timedelta``); the group's timeout
            applies anyway.

    Raises:
        DistBackendError: a rank did not arrive in time, or the operation failed.
    """
    pg = member(group, "barrier")
    if pg is None:
        return None
    g = pg.mesh_group
    if async_op:
        return Work("barrier", []).attach([g.barrier(async_op=True)])
    if timeout is None:
        g.barrier()
    else:
        Work("barrier", []).attach([g.barrier(async_op=True)]).wait(timeout)
    return None
