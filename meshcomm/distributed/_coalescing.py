"""``_coalescing_manager``: torch's private context manager that batches collectives.

Inside ``with _coalescing_manager(group) as cm:``, ``all_reduce``, ``all_gather_single`` and
``reduce_scatter_single`` on ``group`` (and their aliases ``all_gather_into_tensor``,
``_all_gather_base``, ``reduce_scatter_tensor``, ``_reduce_scatter_base``) are checked and
queued instead of issued; at the end of the block the queue goes out as one fused operation
per dtype (the tensors concatenated, as ``all_reduce_coalesced`` does). Megatron-LM reduces
its gradient buckets this way. With ``async_ops=True`` the fused operations' handle is in
``cm.works`` and ``cm.wait()`` waits for it; otherwise the block's end waits.

As in torch 2.13, one block holds one kind of collective (a second kind raises
``RuntimeError``), other collectives and other groups are issued at once, and a queued call
made with ``async_op=True`` returns a Work whose methods refuse to run (its results arrive
through the block). Stricter than torch: mixing reduce ops in one block raises
``ValueError`` when the second op is queued (torch reduces every tensor with the first op),
and a second block on the same group inside the first raises ``ValueError`` at once.

Example:
    >>> import numpy as np
    >>> import meshcomm.distributed as dist
    >>> dist.init_process_group("gloo", world_size=1, rank=0)
    >>> a, b = np.ones(2), np.arange(3.0)
    >>> with dist._coalescing_manager(async_ops=True) as cm:
    ...     dist.all_reduce(a)
    ...     dist.all_reduce(b)
    >>> cm.wait(); len(cm.works), b
    (1, array([0., 1., 2.]))
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshcomm.distributed._common import Route
from meshcomm.distributed._errors import translate
from meshcomm.distributed._pg import ProcessGroup
from meshcomm.distributed._state import STATE, resolve
from meshcomm.distributed._tensors import Buffer
from meshcomm.distributed._work import Work
from meshcomm.errors import MeshCommError
from meshcomm.reduction import ReduceOp as MeshOp

__all__ = ["Queued", "_CoalescingManager", "_IllegalWork", "_coalescing_manager", "queue"]


@dataclass
class Queued:
    """One collective waiting for the end of a coalescing block.

    Attributes:
        kind: ``"all_reduce"``, ``"all_gather_single"`` or ``"reduce_scatter_single"``.
        inp: the values sent.
        out: the buffer written (``inp`` itself for ``all_reduce``).
        output: the caller's output object (what ``Work.result()`` lists).
        op: the public reduce op as given (for messages), None for gathers.
        mop: meshcomm's reduce op, None for gathers.
        factor: the ``PREMUL_SUM`` factor, if any.
    """

    kind: str
    inp: Buffer
    out: Buffer
    output: Any
    op: Any = None
    mop: MeshOp | None = None
    factor: Any = None


class _CoalescingManager:
    """What ``_coalescing_manager`` yields: ``works`` (the block's handles with
    ``async_ops=True``) and ``wait()``.

    Example:
        >>> cm = _CoalescingManager()
        >>> cm.append(None); cm.append(Work.completed("all_reduce", [])); len(cm.works)
        1
        >>> cm.wait()
    """

    def __init__(self) -> None:
        self.works: list[Work] = []

    def append(self, work: Work | None = None) -> None:
        """Keep ``work`` (None is skipped)."""
        if work is not None:
            self.works.append(work)

    def wait(self) -> None:
        """Wait for every handle, in order (the results are in the caller's tensors then)."""
        for work in self.works:
            work.wait()


_ILLEGAL = frozenset(
    {"is_success", "exception", "wait", "source_rank", "_source_rank", "result", "synchronize"}
)


class _IllegalWork(Work):
    """What a call queued in a coalescing block returns with ``async_op=True``: its result
    arrives through the block, so waiting on it is refused (torch's message).

    Example:
        >>> w = _IllegalWork()
        >>> try:
        ...     w.wait()
        ... except ValueError as exc:
        ...     print(exc)
        Illegal to call wait on IllegalWork object
    """

    def __init__(self) -> None:
        super().__init__("coalesced", [])

    def __getattribute__(self, name: str) -> Any:
        if name in _ILLEGAL:
            raise ValueError(f"Illegal to call {name} on IllegalWork object")
        return super().__getattribute__(name)


def queue(pg: ProcessGroup, call: Queued, async_op: bool) -> Work | None:
    """Queue ``call`` in ``pg``'s open block; return what the call returns there.

    Raises:
        RuntimeError: the block already holds another kind of collective (as torch, but at
            this call rather than at the block's end; nothing is issued either way).
        ValueError: a reduce op other than the block's first.
    """
    calls = STATE.coalescing[pg]
    if calls:
        first = calls[0]
        where = f"rank {pg.rank()}, group {pg.group_name!r}"
        if call.kind != first.kind:
            raise RuntimeError(
                "Coalescing manager requires all collectives to be the same type, but got "
                f"mixed types: {first.kind} then {call.kind} ({where})"
            )
        if (call.mop, call.factor) != (first.mop, first.factor):
            raise ValueError(
                f"_coalescing_manager: {call.kind} with op {call.op} after op {first.op} in "
                f"one block ({where}); every reduction of a block uses one op (torch would "
                "apply the first to all): use one block per op"
            )
    calls.append(call)
    return _IllegalWork() if async_op else None


@contextlib.contextmanager
def _coalescing_manager(
    group: Any = None, device: Any = None, async_ops: bool = False
) -> Iterator[_CoalescingManager]:
    """Queue ``all_reduce``/``all_gather_single``/``reduce_scatter_single`` calls on
    ``group`` and issue them together when the block ends (torch's private API).

    Args:
        group: the group whose calls are batched (default: the default group).
        device: accepted for torch's signature; meshcomm batches every backend the same way.
        async_ops: keep the handle in ``cm.works`` (``cm.wait()`` waits) instead of waiting
            when the block ends.

    Yields:
        The :class:`_CoalescingManager`.

    Raises:
        ValueError: a block is already open on ``group``; mixed reduce ops in one block.
        RuntimeError: two kinds of collective in one block.

    Example:
        >>> import numpy as np
        >>> import meshcomm.distributed as dist
        >>> dist.init_process_group("gloo", world_size=1, rank=0)
        >>> out = np.zeros(2)
        >>> with dist._coalescing_manager():
        ...     dist.all_gather_single(out, np.array([4.0, 5.0]))
        >>> out
        array([4., 5.])
        >>> dist.destroy_process_group()
    """
    pg = resolve(group)
    cm = _CoalescingManager()
    if pg is None:  # not a member: its calls return at once, so there is nothing to batch
        yield cm
        return
    if pg in STATE.coalescing:
        raise ValueError(
            f"rank {pg.rank()}: a coalescing block is already open on group "
            f"{pg.group_name!r}; end it before opening another on the same group"
        )
    STATE.coalescing[pg] = []
    try:
        yield cm
    finally:
        # Also on an exception in the block: the queue is dropped, nothing was issued.
        calls = STATE.coalescing.pop(pg, [])
    if not calls:
        return
    try:
        work = _issue(pg, calls)
    except MeshCommError as exc:
        raise translate(exc) from None
    if async_ops:
        cm.append(work)
    else:
        work.wait()


def _issue(pg: ProcessGroup, calls: list[Queued]) -> Work:
    """Issue the block's calls: one fused meshcomm operation per dtype, in first-use order."""
    g = pg.mesh_group
    by_dtype: dict[Any, list[Queued]] = {}
    for call in calls:
        by_dtype.setdefault(call.inp.dtype, []).append(call)
    inner: list[Any] = []
    writers = []
    for chunk in by_dtype.values():
        issue, write = _FUSED[chunk[0].kind](g, chunk)
        inner.append(issue())
        writers.append(write)

    def finish(results: list[Any]) -> None:
        for write, res in zip(writers, results, strict=True):
            write(res)

    return Work(calls[0].kind, [c.output for c in calls], finish).attach(inner)


def _edges(sizes: list[int]) -> np.ndarray:
    return np.cumsum([0, *sizes])


def _fused_all_reduce(g: Any, calls: list[Queued]) -> tuple[Any, Any]:
    bufs = [c.inp for c in calls]
    route = Route(g, bufs)
    with route.stream():
        x = route.xp.concatenate([route.flat(b) for b in bufs])
    edges = _edges([b.numel for b in bufs])
    first = calls[0]

    def issue() -> Any:
        with route.stream():
            return g.all_reduce(x, first.mop, factor=first.factor, async_op=True)

    def write(res: Any) -> None:
        for i, b in enumerate(bufs):
            b.write(res[edges[i] : edges[i + 1]])

    return issue, write


def _fused_all_gather(g: Any, calls: list[Queued]) -> tuple[Any, Any]:
    ins = [c.inp for c in calls]
    route = Route(g, ins)
    with route.stream():
        x = route.xp.concatenate([route.flat(b) for b in ins])
    edges = _edges([b.numel for b in ins])

    def issue() -> Any:
        with route.stream():
            return g.all_gather(x, axis=0, async_op=True)

    def write(res: Any) -> None:
        # res[r] is rank r's concatenation; output i takes column block i, rank by rank.
        for i, c in enumerate(calls):
            c.out.write(res[:, edges[i] : edges[i + 1]])

    return issue, write


def _fused_reduce_scatter(g: Any, calls: list[Queued]) -> tuple[Any, Any]:
    size = g.size
    ins = [c.inp for c in calls]
    route = Route(g, ins)
    with route.stream():
        # Row r holds rank r's chunk of every input, so one reduce-scatter gives each rank
        # its chunks of all of them, side by side.
        x = route.xp.concatenate([route.flat(b).reshape(size, -1) for b in ins], axis=1)
    edges = _edges([c.out.numel for c in calls])
    first = calls[0]

    def issue() -> Any:
        with route.stream():
            return g.reduce_scatter(x, first.mop, axis=0, factor=first.factor, async_op=True)

    def write(res: Any) -> None:
        flat = res.reshape(-1)
        for i, c in enumerate(calls):
            c.out.write(flat[edges[i] : edges[i + 1]])

    return issue, write


_FUSED = {
    "all_reduce": _fused_all_reduce,
    "all_gather_single": _fused_all_gather,
    "reduce_scatter_single": _fused_reduce_scatter,
}
