"""``MeshcommProcessGroup``: a ``torch.distributed.ProcessGroup`` whose traffic is meshcomm's.

torch lets a Python class stand in for a process group (its backend plugins' creator may
return a ``ProcessGroup`` subclass, and C++ callers reach the Python methods through
torch's trampoline). Every method torch's classes call on a backend is here, under the name
torch looks up: ``allreduce``, ``allgather``, ``_allgather_base``, ``reduce_scatter``,
``alltoall_base`` and the rest. Each one checks what meshcomm cannot do (before any I/O),
then runs the matching function of :mod:`meshcomm.distributed` (the in-place layer, which
already writes torch tensors in place, host tensors zero-copy and CUDA tensors over the
group's device communicator) on the meshcomm group underneath, and hands torch a
:class:`~meshcomm.c10d._work.TorchWork`. Calls torch makes with ``asyncOp`` false run
inline and return a completed work.

Example:
    >>> import torch
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> pg = MeshcommProcessGroup(ProcessGroup(SelfCommunicator()))
    >>> t = torch.ones(2)
    >>> pg.allreduce([t]).wait(), t.tolist(), pg.getBackendName()
    (True, [1.0, 1.0], 'meshcomm')
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from meshcomm import distributed as inplace
from meshcomm.c10d._errors import as_torch_error
from meshcomm.c10d._names import GroupNames
from meshcomm.c10d._work import TorchWork, completed
from meshcomm.distributed._pg import ProcessGroup as Handle
from meshcomm.distributed._state import STATE as _STATE
from meshcomm.group import ProcessGroup as MeshGroup
from meshcomm.group import routes
from meshcomm.reduction import ReduceOp as MeshOp

__all__ = ["BACKEND_NAME", "MeshcommProcessGroup", "Unsupported"]

#: The name torch knows the backend by (``init_process_group("meshcomm")``).
BACKEND_NAME = "meshcomm"

P = ParamSpec("P")
R = TypeVar("R")

# torch's "no per-call timeout" (``kUnsetTimeout``, -1 ms).
_UNSET = timedelta(milliseconds=-1)

# What the inline all-reduce takes: numpy views torch hands out without a copy, and the ops
# meshcomm reduces natively (AVG and PREMUL_SUM take the general route's wrapping).
_INLINE_DTYPES = frozenset(
    {
        torch.float16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
    }
)
# Indexed by torch's RedOpType value (hashing torch's enum costs more than the lookup).
_INLINE_OPS: tuple[MeshOp | None, ...] = (
    MeshOp.SUM,  # SUM = 0
    None,  # AVG
    MeshOp.PROD,  # PRODUCT
    MeshOp.MIN,
    MeshOp.MAX,
    None,  # BAND, BOR, BXOR, PREMUL_SUM, ... take the general route
)


class Unsupported(NotImplementedError):
    """A torch feature the meshcomm backend does not offer (raised before any I/O)."""


def _translated(fn: Callable[P, R]) -> Callable[P, R]:
    """Let meshcomm's errors leave as torch's ``DistError`` family."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            new = as_torch_error(exc)
            if new is exc:
                raise
            raise new from None

    return wrapper


# torch's stubs type the methods by their C++ overloads; the Python names torch calls differ.
_TorchProcessGroup: Any = dist.ProcessGroup


class MeshcommProcessGroup(GroupNames, _TorchProcessGroup):
    """A torch process group over a meshcomm :class:`~meshcomm.group.ProcessGroup`.

    Made by ``torch.distributed.init_process_group("meshcomm")`` and ``new_group`` (see
    :mod:`meshcomm.c10d`), or around an existing meshcomm group by
    :func:`meshcomm.c10d.torch_group`.

    Args:
        group: the meshcomm group.
        timeout: the timeout torch was given for the group (reported, not enforced here:
            the meshcomm group's own timeout bounds every call).
        on_close: called once when torch shuts the group down.

    Attributes:
        mesh_group: the meshcomm group, for :mod:`meshcomm.ops` or its functional methods.
    """

    def __init__(
        self,
        group: MeshGroup,
        timeout: timedelta | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(group.rank, group.size)
        self.mesh_group = group
        self._handle = Handle(group, BACKEND_NAME, "", "undefined", timeout)
        self._group_name = ""
        self._group_desc = "undefined"
        self._on_close = on_close
        self._sequence = 0

    # -- identity ------------------------------------------------------------------------
    def getBackendName(self) -> str:
        """``"meshcomm"``."""
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        """Set by torch once the group is made."""
        self._group_name = name
        self._handle.group_name = name

    def setGroupDesc(self, desc: str) -> None:
        """Set by torch once the group is made."""
        self._group_desc = desc
        self._handle.group_desc = desc

    def _get_backend(self, device: Any = None) -> MeshcommProcessGroup:
        """torch asks a group for its backend per device; this group is its own, for both."""
        return self

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices this group takes: the CPU, and CUDA where torch sees a GPU.

        torch's own groups list the devices of their registered backends; this group is its
        own backend for every device (:meth:`_get_backend`), so it answers for itself.
        torch's helpers ask: ``_get_pg_default_device`` (``set_model_state_dict`` with
        ``broadcast_from_rank0``, DCP's meta-device init), ``_broadcast_tensors`` and
        ``dcp.async_save`` (which wants the CPU among them).
        """
        devices = [torch.device("cpu")]
        if torch.cuda.is_available():
            devices.append(torch.device("cuda"))
        return devices

    @property
    def supports_splitting(self) -> bool:
        """False: torch's ``split_group`` is for NCCL's communicator split (use ``new_group``)."""
        return False

    def _get_sequence_number_for_group(self) -> int:
        """How many collectives this group has issued (torch's debugging aid)."""
        return self._sequence

    def _set_sequence_number_for_group(self) -> None:
        """Sequence numbers start at zero on every rank; nothing to agree."""

    def __repr__(self) -> str:
        return (
            f"<MeshcommProcessGroup {self._group_name!r} ({self._group_desc}) "
            f"rank={self.mesh_group.rank} size={self.mesh_group.size}>"
        )

    # -- helpers -------------------------------------------------------------------------
    def _issue(self, opts: Any, call: Callable[[bool], Any], outputs: Any) -> TorchWork:
        """Run ``call(async_op)``: inline when torch asked for a blocking call."""
        _check_timeout(opts, self)
        self._sequence += 1
        asynchronous = True if opts is None else bool(opts.asyncOp)
        if not asynchronous:
            call(False)
            return completed(outputs)
        return TorchWork(call(True), outputs)

    def _one(self, tensors: Sequence[Any], what: str) -> Any:
        if len(tensors) != 1:
            raise Unsupported(
                f"{what}: the meshcomm backend takes one tensor per process "
                f"(group {self._group_name!r}, rank {self.mesh_group.rank}), got {len(tensors)}"
            )
        return tensors[0]

    # -- collectives ---------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:
        """All-reduce one tensor in place (``dist.all_reduce``, the DDP reducer, funcol)."""
        opts = dist.AllreduceOptions() if opts is None else opts
        if len(tensors) == 1 and not opts.asyncOp:
            # Not through _translated: at 8 bytes its frame costs a fifth of the route.
            try:
                done = self._allreduce_inline(tensors, opts)
            except BaseException as exc:
                new = as_torch_error(exc)
                if new is exc:
                    raise
                raise new from None
            if done is not None:
                return done
        return self._allreduce(tensors, opts)

    @_translated
    def _allreduce(self, tensors: list[torch.Tensor], opts: Any) -> TorchWork:
        t = self._one(tensors, "allreduce")
        op = _reduce_op(opts.reduceOp, "allreduce", self)
        return self._issue(
            opts, lambda a: inplace.all_reduce(t, op, group=self._handle, async_op=a), tensors
        )

    def _allreduce_inline(self, tensors: list[torch.Tensor], opts: Any) -> TorchWork | None:
        """The blocking all-reduce of one dense host tensor, straight on the meshcomm group.

        Small all-reduces are latency: this skips the in-place layer's general checks
        (the group still checks the op against the dtype) and reduces the tensor's own
        memory in place. None: not that case, take the general route.
        """
        t = tensors[0]
        kind = opts.reduceOp.op.value
        mop = _INLINE_OPS[kind] if kind < len(_INLINE_OPS) else None
        if (
            mop is None
            or t.dtype not in _INLINE_DTYPES
            or routes.torch_kind(t) != "torch"  # a host tensor: its memory is reduced in place
            or not t.is_contiguous()
            or opts.timeout != _UNSET
        ):
            return None
        mine = t.detach().numpy() if t.requires_grad else t.numpy()
        if _STATE.pending:  # deferred receives keep their place before this call
            _STATE.flush()
        self._sequence += 1
        self.mesh_group.all_reduce(mine, mop, out=mine)
        return completed(tensors)

    @_translated
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:
        """All-reduce several tensors as one call (DDP's buckets, funcol's coalesced)."""
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        op = _reduce_op(opts.reduceOp, "allreduce_coalesced", self)
        return self._issue(
            opts,
            lambda a: _undeprecated(
                inplace.all_reduce_coalesced, list(tensors), op, group=self._handle, async_op=a
            ),
            tensors,
        )

    @_translated
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:
        """Broadcast one tensor from group rank ``opts.rootRank``."""
        opts = dist.BroadcastOptions() if opts is None else opts
        t = self._one(tensors, "broadcast")
        root = opts.rootRank
        return self._issue(
            opts,
            lambda a: inplace.broadcast(t, group=self._handle, async_op=a, group_src=root),
            tensors,
        )

    @_translated
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchWork:
        """Reduce one tensor onto group rank ``opts.rootRank``."""
        opts = dist.ReduceOptions() if opts is None else opts
        t = self._one(tensors, "reduce")
        op = _reduce_op(opts.reduceOp, "reduce", self)
        root = opts.rootRank
        return self._issue(
            opts,
            lambda a: inplace.reduce(t, op=op, group=self._handle, async_op=a, group_dst=root),
            tensors,
        )

    @_translated
    def allgather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        """Gather one tensor from every rank into a list (``dist.all_gather``)."""
        t = self._one(inputs, "allgather")
        outs = self._one(output_lists, "allgather")
        return self._issue(
            opts, lambda a: inplace.all_gather(outs, t, group=self._handle, async_op=a), outs
        )

    @_translated
    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        """Gather several tensors from every rank (``dist.all_gather_coalesced``)."""
        return self._issue(
            opts,
            lambda a: _undeprecated(
                inplace.all_gather_coalesced,
                output_lists,
                list(inputs),
                group=self._handle,
                async_op=a,
            ),
            output_lists,
        )

    @_translated
    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> TorchWork:
        """Gather into one tensor of ``size`` blocks (``all_gather_into_tensor``, FSDP's)."""
        return self._issue(
            opts,
            lambda a: inplace.all_gather_single(output, input, group=self._handle, async_op=a),
            [output],
        )

    all_gather_single = _allgather_base

    @_translated
    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        """Several ``_allgather_base`` calls as one (FSDP2's, funcol's coalesced)."""
        _same_length(outputs, inputs, "allgather_into_tensor_coalesced", self)

        def issue(a: bool) -> Any:
            works = [
                inplace.all_gather_single(o, i, group=self._handle, async_op=a)
                for o, i in zip(outputs, inputs, strict=True)
            ]
            return _joined(works, outputs) if a else None

        return self._issue(opts, issue, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    @_translated
    def gather(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        """Gather one tensor per rank onto group rank ``opts.rootRank``."""
        opts = dist.GatherOptions() if opts is None else opts
        t = self._one(inputs, "gather")
        root = opts.rootRank
        outs = self._one(output_lists, "gather") if self.mesh_group.rank == root else None
        return self._issue(
            opts,
            lambda a: inplace.gather(t, outs, group=self._handle, async_op=a, group_dst=root),
            output_lists,
        )

    @_translated
    def scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> TorchWork:
        """Scatter a list from group rank ``opts.rootRank``, one tensor per rank."""
        opts = dist.ScatterOptions() if opts is None else opts
        t = self._one(outputs, "scatter")
        root = opts.rootRank
        pieces = self._one(input_lists, "scatter") if self.mesh_group.rank == root else None
        return self._issue(
            opts,
            lambda a: inplace.scatter(t, pieces, group=self._handle, async_op=a, group_src=root),
            outputs,
        )

    @_translated
    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> TorchWork:
        """Reduce lists elementwise and scatter: rank ``i`` gets entry ``i``."""
        opts = dist.ReduceScatterOptions() if opts is None else opts
        t = self._one(outputs, "reduce_scatter")
        pieces = self._one(input_lists, "reduce_scatter")
        op = _reduce_op(opts.reduceOp, "reduce_scatter", self)
        return self._issue(
            opts,
            lambda a: inplace.reduce_scatter(t, pieces, op, group=self._handle, async_op=a),
            outputs,
        )

    @_translated
    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> TorchWork:
        """Reduce ``size`` blocks and keep this rank's (``reduce_scatter_tensor``, FSDP's)."""
        opts = dist.ReduceScatterOptions() if opts is None else opts
        op = _reduce_op(opts.reduceOp, "reduce_scatter_tensor", self)
        return self._issue(
            opts,
            lambda a: inplace.reduce_scatter_single(
                output, input, op, group=self._handle, async_op=a
            ),
            [output],
        )

    reduce_scatter_single = _reduce_scatter_base

    @_translated
    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        """Several ``_reduce_scatter_base`` calls as one."""
        opts = dist.ReduceScatterOptions() if opts is None else opts
        _same_length(outputs, inputs, "reduce_scatter_tensor_coalesced", self)
        op = _reduce_op(opts.reduceOp, "reduce_scatter_tensor_coalesced", self)

        def issue(a: bool) -> Any:
            works = [
                inplace.reduce_scatter_single(o, i, op, group=self._handle, async_op=a)
                for o, i in zip(outputs, inputs, strict=True)
            ]
            return _joined(works, outputs) if a else None

        return self._issue(opts, issue, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    @_translated
    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchWork:
        """Send ``inputs[j]`` to rank ``j``; ``outputs[i]`` receives rank ``i``'s."""
        return self._issue(
            opts,
            lambda a: inplace.all_to_all(outputs, inputs, group=self._handle, async_op=a),
            outputs,
        )

    @_translated
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> TorchWork:
        """All-to-all of one tensor, split along dim 0 (equal splits when the lists are empty)."""
        out_splits = list(output_split_sizes) or None
        in_splits = list(input_split_sizes) or None
        return self._issue(
            opts,
            lambda a: inplace.all_to_all_single(
                output, input, out_splits, in_splits, group=self._handle, async_op=a
            ),
            [output],
        )

    all_to_all_single = alltoall_base

    @_translated
    def barrier(self, opts: Any = None) -> TorchWork:
        """Wait until every rank of the group arrives."""
        return self._issue(
            opts, lambda a: inplace.barrier(group=self._handle, async_op=a), [torch.empty(0)]
        )

    @_translated
    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier whose rank 0 names the ranks that did not arrive within ``timeout``."""
        inplace.monitored_barrier(self._handle, timeout, wait_all_ranks)

    # -- point to point ------------------------------------------------------------------
    @_translated
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> TorchWork:
        """Send one tensor to group rank ``dst`` (copied now: the tensor may be reused)."""
        t = self._one(tensors, "send")
        work = inplace.isend(t, group=self._handle, tag=tag, group_dst=dst)
        return TorchWork(work, tensors)

    @_translated
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> TorchWork:
        """Receive one tensor from group rank ``src``."""
        t = self._one(tensors, "recv")
        work = inplace.irecv(t, group=self._handle, tag=tag, group_src=src)
        return TorchWork(work, tensors)

    @_translated
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> TorchWork:
        """Receive one tensor from whichever rank sends first; ``_source_rank()`` says who."""
        t = self._one(tensors, "recv_anysource")
        work = inplace.irecv(t, group=self._handle, tag=tag)
        return TorchWork(work, tensors, source=None if work is None else work.source_rank)

    # -- lifetime ------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close the meshcomm group (torch's ``destroy_process_group``). Idempotent."""
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    def abort(self) -> None:
        """As :meth:`shutdown`: meshcomm's close never blocks on peers."""
        self.shutdown()


def _undeprecated(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    """Call one of the in-place layer's deprecated functions without its FutureWarning.

    torch already warned the user who called ``dist.all_reduce_coalesced`` (and funcol's
    coalesced calls, which torch routes here, are not deprecated): the backend's own use
    of the in-place layer must not add a second warning pointing into meshcomm.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"`meshcomm\.distributed\.", FutureWarning)
        return fn(*args, **kwargs)


def _reduce_op(op: Any, what: str, pg: MeshcommProcessGroup) -> Any:
    """torch's ReduceOp as the in-place layer's; ``PREMUL_SUM`` keeps its factor."""
    from meshcomm.distributed._reduce_op import RedOpType, ReduceOp

    kind = getattr(op, "op", op)
    if getattr(kind, "name", None) != "PREMUL_SUM":
        return op
    factor = op.factor
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise Unsupported(
                f"{what}: PREMUL_SUM with a factor of {factor.numel()} elements on group "
                f"{pg.group_name!r} (rank {pg.mesh_group.rank}); the meshcomm backend takes a "
                "scalar factor"
            )
        factor = factor.item()
    return ReduceOp(RedOpType.PREMUL_SUM, float(factor))


def _check_timeout(opts: Any, pg: MeshcommProcessGroup) -> None:
    timeout = getattr(opts, "timeout", None)
    if timeout is None or timeout == _UNSET or timeout.total_seconds() <= 0:
        return
    own = pg.mesh_group.timeout
    if abs(timeout.total_seconds() - own) > 1e-3:
        raise Unsupported(
            f"a per-call timeout ({timeout.total_seconds()} s) on group {pg.group_name!r} "
            f"(rank {pg.mesh_group.rank}): the meshcomm backend bounds every call by the "
            f"group's timeout ({own} s); give the timeout to init_process_group"
        )


def _same_length(outputs: Sequence[Any], inputs: Sequence[Any], what: str, pg: Any) -> None:
    if len(outputs) != len(inputs):
        raise ValueError(
            f"{what} on group {pg.group_name!r} (rank {pg.mesh_group.rank}): "
            f"{len(outputs)} outputs but {len(inputs)} inputs; they must match"
        )


def _joined(works: list[Any], outputs: Any) -> Any:
    """One in-place layer work that completes when all of ``works`` have."""
    from meshcomm.distributed._work import Work

    joined = Work("coalesced", outputs)
    inner = [w._future for w in works if w is not None]
    lock = threading.Lock()

    def when_all(_f: Any) -> None:
        with lock:
            if joined._future.done() or not all(f.done() for f in inner):
                return
            excs = [f._inner.exception() for f in inner if f._inner.exception() is not None]
            if excs:
                joined._future.set_exception(excs[0])
            else:
                joined._future.set_result(outputs)

    joined._started = True
    if not inner:
        joined._future.set_result(outputs)
    for f in inner:
        f.add_done_callback(when_all)
    return joined
