"""``DistributedDataParallel`` for torch modules, over meshcomm's in-place collectives.

What it does, as torch's:

- at wrap time, broadcasts the module's parameters and buffers from group rank 0;
- before each forward (``broadcast_buffers=True``), broadcasts the buffers from rank 0;
- during backward, as soon as every gradient of a bucket (about ``bucket_cap_mb`` MiB of
  parameters, in reverse registration order; the first bucket at most 1 MiB) has been accumulated,
  divides the bucket by the group size and issues an asynchronous all-reduce (SUM) of it;
  the communication runs on meshcomm's progress thread while backward computes the next
  buckets. At the end of backward it waits for the buckets and writes the averaged
  gradients into ``param.grad``;
- ``no_sync()`` skips the all-reduces (gradients accumulate locally until the next
  synchronized backward);
- ``find_unused_parameters=True`` finds the parameters the forward did not use (by walking
  the output's autograd graph), counts them as ready with zero gradients, and leaves
  ``grad`` alone for those no rank used;
- ``gradient_as_bucket_view=True`` makes each ``param.grad`` a view of its bucket.

Gradients of CUDA modules are staged through host memory (meshcomm's backends compute on
host memory today). Not supported: communication hooks, mixed precision, ``static_graph``
optimizations (accepted, no effect), ``join()``.

Example:
    >>> import torch
    >>> import meshcomm.distributed as dist
    >>> dist.init_process_group("gloo", world_size=1, rank=0)
    >>> model = DistributedDataParallel(torch.nn.Linear(2, 1))
    >>> model(torch.ones(3, 2)).sum().backward()
    >>> model.module.weight.grad.shape
    torch.Size([1, 2])
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from meshcomm.distributed._collectives import all_reduce, broadcast
from meshcomm.distributed._reduce_op import ReduceOp
from meshcomm.distributed._state import resolve
from meshcomm.distributed._work import Work

__all__ = ["DistributedDataParallel"]

_FIRST_BUCKET_BYTES = 1024 * 1024


class _Bucket:
    """Parameters whose gradients are all-reduced together (one dtype, one device)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.numels = [p.numel() for p in params]
        self.flat: torch.Tensor | None = None  # persistent with gradient_as_bucket_view
        self.reset()

    def reset(self) -> None:
        self.missing = len(self.params)
        self.ready = [False] * len(self.params)
        self.work: Work | None = None
        self.buffer: torch.Tensor | None = None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value


class DistributedDataParallel(torch.nn.Module):
    """Data parallelism for a torch module: same parameters on every rank, averaged gradients.

    Args:
        module: the module to replicate.
        device_ids: for a module on one CUDA device, ``[device]`` (inputs are moved there);
            None for CPU modules.
        output_device: kept for compatibility.
        dim: kept for compatibility (inputs are not scattered).
        broadcast_buffers: broadcast buffers from rank 0 before each forward.
        init_sync: broadcast parameters and buffers from rank 0 now.
        process_group: the group (default: the default group).
        bucket_cap_mb: bucket size in MiB (default 25).
        find_unused_parameters: allow parameters that a forward does not use.
        check_reduction: ignored (deprecated in torch).
        gradient_as_bucket_view: make gradients views of the buckets.
        static_graph: accepted; no effect.
        delay_all_reduce_named_params: must be None.
        param_to_hook_all_reduce: must be None.
        mixed_precision: must be None.
        device_mesh: a 1-D :class:`~meshcomm.distributed.device_mesh.DeviceMesh` whose group
            replaces ``process_group``.
        skip_all_reduce_unused_params: accepted; no effect.
        bucket_cap_mb_list: must be None.
        batched_grad_copy: accepted; no effect.
        forward_sync_buffers: overrides ``broadcast_buffers`` when not None.

    Raises:
        ValueError: an unsupported option, or ``device_ids`` for a CPU module.

    Attributes:
        module: the wrapped module.
        process_group: the group.
        require_backward_grad_sync: False inside :meth:`no_sync`.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device_ids: list[Any] | None = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Any = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[int] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
    ) -> None:
        super().__init__()
        unsupported = {
            "delay_all_reduce_named_params": delay_all_reduce_named_params,
            "param_to_hook_all_reduce": param_to_hook_all_reduce,
            "mixed_precision": mixed_precision,
            "bucket_cap_mb_list": bucket_cap_mb_list,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise ValueError(
                    f"DistributedDataParallel({name}=...) is not supported by meshcomm"
                )
        devices = {p.device for p in module.parameters()}
        if device_ids is not None and all(d.type == "cpu" for d in devices):
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with "
                f"GPU modules; got device_ids {device_ids} for a module on "
                f"{sorted(map(str, devices))}"
            )
        self.module = module
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        if device_mesh is not None:
            process_group = device_mesh.get_group()
        pg = resolve(process_group)
        if pg is None:
            raise ValueError("DistributedDataParallel: this rank is not in process_group")
        self.process_group = pg
        if forward_sync_buffers is not None:
            broadcast_buffers = forward_sync_buffers
        self.broadcast_buffers = True if broadcast_buffers is None else bool(broadcast_buffers)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        cap = 25.0 if bucket_cap_mb is None else float(bucket_cap_mb)
        self.bucket_bytes_cap = int(cap * 1024 * 1024)
        self.require_backward_grad_sync = True
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._buckets, self._where = self._assign_buckets()
        self._syncing = False
        self._queued = False
        if init_sync:
            self._broadcast(list(module.parameters()) + list(module.buffers()))
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self._params)
        ]

    # -- setup ---------------------------------------------------------------------------
    def _assign_buckets(self) -> tuple[list[_Bucket], list[tuple[int, int]]]:
        """Reverse registration order (gradients arrive roughly so); one dtype and device
        per bucket; a bucket closes once it reaches the cap (the first one at 1 MiB)."""
        open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
        groups: list[list[int]] = []
        for i in reversed(range(len(self._params))):
            p = self._params[i]
            key = (p.dtype, p.device)
            members, nbytes = open_.get(key, ([], 0))
            members.append(i)
            nbytes += p.numel() * p.element_size()
            cap = self.bucket_bytes_cap
            if not groups:  # a small first bucket starts communication early
                cap = min(cap, _FIRST_BUCKET_BYTES)
            if nbytes >= cap:
                groups.append(members)
                open_.pop(key, None)
            else:
                open_[key] = (members, nbytes)
        groups.extend(members for members, _ in open_.values())
        buckets = [_Bucket([self._params[i] for i in g]) for g in groups]
        where = [(0, 0)] * len(self._params)
        for b, g in enumerate(groups):
            for slot, i in enumerate(g):
                where[i] = (b, slot)
        return buckets, where

    @torch.no_grad()
    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast ``tensors`` from group rank 0, one flat message per dtype and device."""
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        for group in by_kind.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            broadcast(flat, group=self.process_group, group_src=0)
            offset = 0
            for t in group:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n

    # -- forward -------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; prepare this iteration's gradient synchronization."""
        self._syncing = self.require_backward_grad_sync and torch.is_grad_enabled()
        for bucket in self._buckets:
            bucket.reset()
        self._queued = False
        if self.device_ids:
            device = torch.device(self.device_ids[0])
            inputs = _to_device(inputs, device)
            kwargs = _to_device(kwargs, device)
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers:
                self._broadcast(buffers)
        output = self.module(*inputs, **kwargs)
        if self._syncing and self.find_unused_parameters:
            used = self._used_parameters(output)
            for i, p in enumerate(self._params):
                if p not in used:
                    self._mark_ready(i)
        return output

    def _used_parameters(self, output: Any) -> set[torch.nn.Parameter]:
        """Parameters reachable from the output's autograd graph."""
        seen: set[Any] = set()
        used: set[torch.nn.Parameter] = set()
        stack: list[Any] = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            variable = getattr(fn, "variable", None)
            if isinstance(variable, torch.nn.Parameter):
                used.add(variable)
            stack.extend(nxt for nxt, _ in fn.next_functions)
        return used

    # -- backward ------------------------------------------------------------------------
    def _make_hook(self, index: int) -> Any:
        def hook(_param: torch.Tensor) -> None:
            if not self._syncing:
                return
            if not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            self._mark_ready(index)

        return hook

    def _mark_ready(self, index: int) -> None:
        b, slot = self._where[index]
        bucket = self._buckets[b]
        if bucket.ready[slot]:
            return
        bucket.ready[slot] = True
        bucket.missing -= 1
        if bucket.missing == 0:
            self._launch(bucket)

    @torch.no_grad()
    def _launch(self, bucket: _Bucket) -> None:
        """Flatten the bucket's gradients, pre-divide by the group size, all-reduce async."""
        pieces = [
            torch.zeros(n, dtype=p.dtype, device=p.device) if p.grad is None else p.grad.reshape(-1)
            for p, n in zip(bucket.params, bucket.numels, strict=True)
        ]
        flat = torch.cat(pieces)
        flat.div_(self.process_group.size())
        bucket.buffer = flat
        bucket.work = all_reduce(flat, ReduceOp.SUM, group=self.process_group, async_op=True)

    @torch.no_grad()
    def _finalize(self) -> None:
        """End of backward: wait for every bucket and write the averaged gradients."""
        self._syncing = False
        late = [b for b in self._buckets if b.work is None]
        if late:
            names = {id(p): n for n, p in self.module.named_parameters()}
            missing = [
                names.get(id(p), "?")
                for b in late
                for p, ok in zip(b.params, b.ready, strict=True)
                if not ok
            ]
            raise RuntimeError(
                "Expected every parameter to receive a gradient in this backward, but these "
                f"did not: {missing}. Pass find_unused_parameters=True to "
                "DistributedDataParallel if the forward does not use every parameter."
            )
        used = self._globally_used() if self.find_unused_parameters else None
        for bucket in self._buckets:
            assert bucket.work is not None and bucket.buffer is not None  # set by _launch
            bucket.work.wait()
            self._write_back(bucket, used)

    def _globally_used(self) -> list[bool]:
        """Which parameters got a gradient on some rank (local flags, all-reduced with MAX)."""
        flags = torch.tensor([p.grad is not None for p in self._params], dtype=torch.int32)
        all_reduce(flags, ReduceOp.MAX, group=self.process_group)
        return [bool(f) for f in flags.tolist()]

    def _write_back(self, bucket: _Bucket, used: list[bool] | None) -> None:
        flat = bucket.buffer
        assert flat is not None  # set by _launch
        if self.gradient_as_bucket_view:
            if bucket.flat is None or bucket.flat.shape != flat.shape:
                bucket.flat = torch.empty_like(flat)
            bucket.flat.copy_(flat)
            flat = bucket.flat
        offset = 0
        index = {id(p): i for i, p in enumerate(self._params)}
        for p, n in zip(bucket.params, bucket.numels, strict=True):
            view = flat[offset : offset + n].view_as(p)
            offset += n
            if used is not None and not used[index[id(p)]]:
                continue
            if self.gradient_as_bucket_view:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            elif p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)

    # -- API -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient synchronization for forwards and backwards run inside.

        Example:
            >>> # with ddp.no_sync():
            >>> #     ddp(x).sum().backward()   # accumulates locally
            >>> # ddp(y).sum().backward()       # synchronizes the accumulated gradients
        """
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Not supported: raises NotImplementedError."""
        raise NotImplementedError("DistributedDataParallel.register_comm_hook is not supported")
