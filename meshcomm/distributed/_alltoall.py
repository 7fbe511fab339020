"""``all_to_all`` and ``all_to_all_single``.

Equal pieces run as one meshcomm ``all_to_all``. Pieces whose sizes differ (lists with
different sizes, or split sizes) run as one send and one receive per peer on a private
sibling group of the caller's group (made by one split at the first such call), so they never
mix with the caller's own messages; every rank issues its sends before its receives.

Example:
    >>> import numpy as np
    >>> import meshcomm.distributed as dist
    >>> dist.init_process_group(world_size=1, rank=0)
    >>> out = np.zeros(4)
    >>> dist.all_to_all_single(out, np.arange(4.0), [4], [4]); out
    array([0., 1., 2., 3.])
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshcomm.distributed._common import Route, member, run, same_count, writable
from meshcomm.distributed._errors import DistBackendError, public
from meshcomm.distributed._pg import ProcessGroup
from meshcomm.distributed._tensors import as_buffer, as_buffer_list, same_dtype
from meshcomm.distributed._work import Work
from meshcomm.group import ProcessGroup as MeshGroup

__all__ = ["all_to_all", "all_to_all_single"]


def _shadow(pg: ProcessGroup) -> MeshGroup:
    """The group's private sibling for meshcomm's own messages (made on first use: every rank
    of the group reaches this in the same collective call)."""
    if pg.shadow is None:
        made = pg.mesh_group.split(0)
        if made is None:  # pragma: no cover - color 0 always gives a group
            raise DistBackendError(f"{pg}: could not make the private sibling group")
        pg.shadow = made
    return pg.shadow


def _exchange(
    pg: ProcessGroup,
    label: str,
    blocks: list[np.ndarray],
    counts: list[int],
    dtype: np.dtype,
    outputs: Any,
    finish: Callable[[list[np.ndarray]], None],
    async_op: bool,
    route: Route,
) -> Work | None:
    """Send ``blocks[j]`` to group rank ``j`` and receive ``counts[i]`` elements from each
    rank ``i`` (point to point on the private sibling group); ``finish`` gets the received
    blocks by source rank. Device blocks (``route`` on the device) go as device messages,
    their bytes over the device backend, queued on ``route``'s stream."""
    me, size = pg.rank(), pg.size()
    if blocks[me].size != counts[me]:
        raise ValueError(
            f"{label}: this rank sends itself {blocks[me].size} elements but expects "
            f"{counts[me]} from itself"
        )
    shadow = _shadow(pg)
    issued: list[Any] = []
    sources = [(me - k) % size for k in range(1, size)]
    with route.stream():
        own = blocks[me].copy()  # the caller may reuse its input once the call is issued
        for k in range(1, size):  # staggered, so rank j is not everyone's first destination
            j = (me + k) % size
            issued.append(shadow.send(blocks[j], j, 0, async_op=True))
        for i in sources:
            issued.append(shadow.recv(i, 0, async_op=True))

    def done(results: list[Any]) -> None:
        got: list[np.ndarray] = [np.empty(0, dtype)] * size
        got[me] = own
        for i, arr in zip(sources, results[size - 1 :], strict=True):
            if arr.dtype != dtype or arr.size != counts[i]:
                raise DistBackendError(
                    f"{label}: rank {pg.global_rank_of(me)} expected {counts[i]} elements of "
                    f"{dtype} from rank {pg.global_rank_of(i)}, got {arr.size} of {arr.dtype}; "
                    "the split sizes of the two ranks disagree"
                )
            got[i] = arr.reshape(-1)
        finish(got)

    work = Work(label, outputs, done).attach(issued)
    if async_op:
        return work
    work.wait()
    return None


@public
def all_to_all(
    output_tensor_list: list[Any],
    input_tensor_list: list[Any],
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """Send ``input_tensor_list[j]`` to group rank ``j``; ``output_tensor_list[i]`` receives
    from rank ``i``. Sizes may differ per pair (matching on both sides).

    Raises:
        ValueError: lists of the wrong length, dtypes differ.
        TypeError: arguments that are not lists of tensors.
        DistBackendError: a received block does not fit its tensor.
    """
    outs = as_buffer_list(output_tensor_list, "output_tensor_list")
    ins = as_buffer_list(input_tensor_list, "input_tensor_list")
    same_dtype([*outs, *ins])
    writable(*outs)
    pg = member(group, "all_to_all")
    if pg is None:
        return None
    same_count(pg.size(), outs, "output_tensor_list")
    same_count(pg.size(), ins, "input_tensor_list")
    dtype = outs[0].dtype

    def finish(got: list[np.ndarray]) -> None:
        for out, arr in zip(outs, got, strict=True):
            out.write(arr)

    route = Route(pg.mesh_group, ins)
    blocks = [route.flat(b) for b in ins]
    counts = [o.numel for o in outs]
    return _exchange(
        pg, "all_to_all", blocks, counts, dtype, output_tensor_list, finish, async_op, route
    )


def _splits(sizes: Any, rows: int, size: int, name: str) -> list[int] | None:
    """Return split sizes (None for "equal"), checked against ``rows`` along dim 0."""
    if sizes is None or len(sizes) == 0:
        if rows % size:
            raise ValueError(
                f"{name}: dim 0 ({rows}) must divide equally by the group size ({size}) when no "
                "split sizes are given"
            )
        return None
    out = [int(s) for s in sizes]
    if len(out) != size or any(s < 0 for s in out) or sum(out) != rows:
        raise ValueError(
            f"{name}: split sizes {out} must be {size} non-negative ints summing to dim 0 ({rows})"
        )
    return out


@public
def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """Split ``input`` along dim 0, send piece ``j`` to group rank ``j``, and concatenate
    what arrives into ``output`` by source rank.

    Args:
        output: the output; dim 0 is split by ``output_split_sizes``.
        input: the input; dim 0 is split by ``input_split_sizes``.
        output_split_sizes: rows received from each rank; None/empty: equal pieces.
        input_split_sizes: rows sent to each rank; None/empty: equal pieces.
        group: the group.
        async_op: return a Work.

    Every rank passes split sizes, or none does.

    Raises:
        ValueError: split sizes that do not add up, rows of different sizes, dtypes.
        DistBackendError: the ranks' split sizes disagree.
    """
    out = as_buffer(output, "output")
    inp = as_buffer(input, "input")
    same_dtype([out, inp])
    out.check_writable()
    pg = member(group, "all_to_all_single")
    if pg is None:
        return None
    size = pg.size()
    if not inp.shape or not out.shape:
        raise ValueError("all_to_all_single needs tensors with at least one dimension")
    row_in = inp.numel // inp.shape[0] if inp.shape[0] else int(np.prod(inp.shape[1:]))
    row_out = out.numel // out.shape[0] if out.shape[0] else int(np.prod(out.shape[1:]))
    if row_in != row_out:
        raise ValueError(
            f"input rows have {row_in} elements but output rows have {row_out}; the dims after "
            "dim 0 must hold the same number of elements"
        )
    in_splits = _splits(input_split_sizes, inp.shape[0], size, "input")
    out_splits = _splits(output_split_sizes, out.shape[0], size, "output")
    if in_splits is None and out_splits is None:
        if out.numel != inp.numel:
            raise ValueError(
                f"output has {out.numel} elements but input has {inp.numel}; with equal splits "
                "they must match"
            )
        g = pg.mesh_group
        route = Route(g, [inp])  # over the device backend where the input is on the GPU

        def issue(a: bool) -> Any:
            with route.stream():
                return g.all_to_all(route.flat(inp).reshape(size, -1), 0, 0, async_op=a)

        return run("all_to_all_single", issue, [output], out.write, async_op)
    route = Route(pg.mesh_group, [inp])
    values = route.flat(inp)
    ins = in_splits or [inp.shape[0] // size] * size
    outs = out_splits or [out.shape[0] // size] * size
    edges = np.cumsum([0, *ins]) * row_in
    blocks = [values[edges[j] : edges[j + 1]] for j in range(size)]
    counts = [n * row_out for n in outs]

    def finish(got: list[np.ndarray]) -> None:
        out.write(_joined(got, out.dtype))

    return _exchange(
        pg, "all_to_all_single", blocks, counts, out.dtype, [output], finish, async_op, route
    )


def _joined(pieces: list[Any], dtype: np.dtype) -> Any:
    """The pieces end to end: on the device if any piece is a device array, else numpy.

    Example:
        >>> _joined([np.arange(2), np.arange(1)], np.dtype(np.int64))
        array([0, 1, 0])
    """
    if not pieces:
        return np.empty(0, dtype)
    if all(type(p) is np.ndarray for p in pieces):
        return np.concatenate(pieces)
    import cupy

    return cupy.concatenate([cupy.asarray(p) for p in pieces])
