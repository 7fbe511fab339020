"""torch's parallel stack on one backend, in one rank: the scenarios of test_c10d_parallel.py.

Run under torchrun by tests/test_c10d_parallel.py, once per backend and world size::

    torchrun --nproc-per-node N c10d_parallel_run.py BACKEND OUT_DIR [OTHER_CKPT_DIR]

Each scenario (DeviceMesh and DTensor redistributions, tensor parallelism with
``parallelize_module``, FSDP2 training steps, torch.distributed.checkpoint) records its
values as tensors; a scenario that raises records its traceback instead, so one failure
does not hide the others. Each rank ``torch.save``s its record to ``OUT_DIR/rank<N>.pt``;
the DCP scenario also saves a checkpoint under ``OUT_DIR/ckpt`` and, given
``OTHER_CKPT_DIR`` (another backend's ``ckpt``), loads that one too.

The test compares the records of backend "meshcomm" with those of "gloo".
``C10D_PARALLEL_ONLY=dcp,tp`` runs only the scenarios named.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

import meshcomm.c10d  # noqa: F401 - registers backend "meshcomm"

Record = dict[str, Any]

DTYPE = torch.float64


def _full(t: Any) -> torch.Tensor:
    """A DTensor's full value (or a plain tensor), detached, on the CPU."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def _placements_2d() -> list[tuple[Placement, ...]]:
    s0, s1, r = Shard(0), Shard(1), Replicate()
    return [(s0, s1), (s1, s0), (r, s0), (s0, r), (r, s1), (s1, s1), (r, r)]


def _placements_1d() -> list[tuple[Placement, ...]]:
    return [(Shard(0),), (Shard(1),), (Replicate(),)]


def scenario_dtensor(mesh: DeviceMesh) -> Record:
    """distribute_tensor and redistribute across Shard(0)/Shard(1)/Replicate/Partial."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 12, dtype=DTYPE, generator=gen)
    placements = _placements_2d() if mesh.ndim == 2 else _placements_1d()
    out: Record = {}
    for src in placements:
        d = distribute_tensor(x, mesh, list(src))
        key = "/".join(map(str, src))
        out[f"local {key}"] = d.to_local().clone()
        out[f"full {key}"] = _full(d)
        for dst in placements:
            moved = d.redistribute(mesh, list(dst))
            out[f"redistribute {key} -> {'/'.join(map(str, dst))}"] = moved.to_local().clone()
    # Partial: a rank-dependent local value, reduced by the redistribution.
    local = torch.randn(4, 6, dtype=DTYPE, generator=gen) * (rank + 1) + rank
    partials: list[tuple[Placement, ...]]
    if mesh.ndim == 2:
        partials = [(Partial(), Shard(0)), (Partial(), Partial()), (Shard(1), Partial())]
        partials.append((Partial("max"), Replicate()))
    else:
        partials = [(Partial(),), (Partial("max"),), (Partial("min"),)]
    for src in partials:
        d = DTensor.from_local(local, mesh, list(src))
        key = "/".join(map(str, src))
        out[f"partial full {key}"] = _full(d)
        for dst in placements:
            moved = d.redistribute(mesh, list(dst))
            out[f"partial {key} -> {'/'.join(map(str, dst))}"] = moved.to_local().clone()
    if mesh.ndim == 2:
        # A sub-mesh's redistribution runs over one dim group only.
        tp = mesh["tp"]
        d = distribute_tensor(x, tp, [Shard(0)])
        out["tp sub-mesh full"] = _full(d)
        out["tp sub-mesh S0 -> S1"] = d.redistribute(tp, [Shard(1)]).to_local().clone()
    # Uneven shards (7 rows, 5 columns over 2 ranks per dim): torch pads and unpads.
    odd = torch.randn(7, 5, dtype=DTYPE, generator=gen)
    for src in placements[:3]:
        d = distribute_tensor(odd, mesh, list(src))
        key = "/".join(map(str, src))
        out[f"uneven local {key}"] = d.to_local().clone()
        for dst in placements:
            moved = d.redistribute(mesh, list(dst))
            out[f"uneven {key} -> {'/'.join(map(str, dst))}"] = moved.to_local().clone()
    return out


class MLP(nn.Module):
    """Two linears with a ReLU between them, as in torch's TP examples."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, dtype=DTYPE)
        self.w2 = nn.Linear(hidden, dim, dtype=DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


class NormMLP(nn.Module):
    """A LayerNorm (sequence parallel) in front of an MLP (tensor parallel)."""

    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, dtype=DTYPE)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x))


def _grads(model: nn.Module) -> Record:
    return {
        f"grad {name}": _full(p.grad) for name, p in model.named_parameters() if p.grad is not None
    }


def _params(model: nn.Module, prefix: str = "param") -> Record:
    return {f"{prefix} {name}": _full(p) for name, p in model.named_parameters()}


def scenario_tp(tp_mesh: DeviceMesh) -> Record:
    """parallelize_module with Colwise/Rowwise/SequenceParallel: forward, backward, one step."""
    out: Record = {}
    for src_rank in (0, None):
        torch.manual_seed(0)
        model = MLP()
        plan = {
            "w1": ColwiseParallel(),
            "w2": RowwiseParallel(),
        }
        parallelize_module(model, tp_mesh, plan, src_data_rank=src_rank)
        x = torch.randn(4, 8, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
        y = model(x)
        y.pow(2).sum().backward()
        tag = f"mlp src={src_rank}"
        out[f"{tag} out"] = _full(y)
        out |= {f"{tag} {k}": v for k, v in _grads(model).items()}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.step()
        out |= {f"{tag} {k}": v for k, v in _params(model).items()}
        out[f"{tag} out after step"] = _full(model(x))

    torch.manual_seed(0)
    seq_model = NormMLP()
    seq_plan = {
        "norm": SequenceParallel(),
        "mlp.w1": ColwiseParallel(input_layouts=Shard(1)),
        "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(seq_model, tp_mesh, seq_plan)
    x = torch.randn(
        2, 4 * tp_mesh.size(), 8, dtype=DTYPE, generator=torch.Generator().manual_seed(3)
    )
    x_local = distribute_tensor(x, tp_mesh, [Shard(1)]).to_local()
    y = seq_model(x_local)
    y.pow(2).sum().backward()
    out["seq out"] = _full(y)
    out |= {f"seq {k}": v for k, v in _grads(seq_model).items()}
    return out


class Net(nn.Module):
    """A small model for FSDP2: three linears and a LayerNorm."""

    def __init__(self, dtype: torch.dtype = DTYPE) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Linear(12, 24, dtype=dtype), nn.Linear(24, 24, dtype=dtype)]
        )
        self.norm = nn.LayerNorm(24, dtype=dtype)
        self.head = nn.Linear(24, 5, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(self.norm(x))


def _fsdp_model(mesh: DeviceMesh, dtype: torch.dtype = DTYPE) -> Net:
    torch.manual_seed(0)
    model = Net(dtype)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train(
    model: nn.Module,
    steps: int,
    seed: int,
    dtype: torch.dtype = DTYPE,
    opt: torch.optim.Optimizer | None = None,
) -> list[torch.Tensor]:
    """``steps`` optimizer steps (default: Adam) on this rank's batches; the losses."""
    if opt is None:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(6, 12, dtype=dtype, generator=gen)
        target = torch.randn(6, 5, dtype=dtype, generator=gen)
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def scenario_fsdp(mesh: DeviceMesh, tag: str) -> Record:
    """FSDP2 fully_shard: a few Adam steps, then every parameter's full value."""
    model = _fsdp_model(mesh)
    out: Record = {f"{tag} param0 {k}": v for k, v in _params(model).items()}
    losses = _train(model, 3, seed=100 + dist.get_rank())
    out[f"{tag} losses"] = torch.stack(losses)
    out |= {f"{tag} {k}": v for k, v in _params(model).items()}
    return out


def scenario_fsdp_float32(mesh: DeviceMesh) -> Record:
    """FSDP2 in float32: gradients reduce-scattered with AVG, and with PREMUL_SUM.

    In float32 (and bf16) FSDP2 asks the backend for ``ReduceOp.AVG``, and, with a gradient
    divide factor other than the group size, for ``PREMUL_SUM(1 / factor)``, which gloo
    refuses. The PREMUL_SUM run takes SGD steps; so does an AVG run whose learning rate is
    scaled to the same update (its values are the oracle for the PREMUL_SUM run).
    """
    world = dist.get_world_size()
    f32 = torch.float32
    out: Record = {}
    model = _fsdp_model(mesh, f32)
    out["fsdp32 avg losses"] = torch.stack(_train(model, 3, 500 + dist.get_rank(), f32))
    out |= {f"fsdp32 avg {k}": v for k, v in _params(model).items()}

    factor, lr = 3.0, 0.1
    model = _fsdp_model(mesh, f32)
    sgd = torch.optim.SGD(model.parameters(), lr=lr * world / factor)
    _train(model, 2, 600 + dist.get_rank(), f32, sgd)
    out |= {f"fsdp32 sgd-avg {k}": v for k, v in _params(model).items()}
    if dist.get_backend() != "gloo":  # gloo: "Cannot use ReduceOp.PREMUL_SUM with Gloo"
        model = _fsdp_model(mesh, f32)
        for module in model.modules():  # each fully_shard unit has its own factor
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(factor)
        sgd = torch.optim.SGD(model.parameters(), lr=lr)
        _train(model, 2, 600 + dist.get_rank(), f32, sgd)
        out |= {f"fsdp32 premul {k}": v for k, v in _params(model).items()}
    return out


def scenario_fsdp_tp(mesh: DeviceMesh) -> Record:
    """2-D: tensor parallelism over ``tp``, then FSDP2 over ``dp``; a few Adam steps."""
    torch.manual_seed(0)
    model = MLP(12, 24)
    parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(400 + mesh.get_coordinate()[0])  # type: ignore[index]
    out: Record = {}
    losses = []
    for _ in range(3):
        x = torch.randn(6, 12, dtype=DTYPE, generator=gen)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    out["fsdp+tp losses"] = torch.stack(losses)
    out |= {f"fsdp+tp {k}": v for k, v in _params(model).items()}
    return out


def scenario_more(mesh: DeviceMesh, flat: DeviceMesh) -> Record:
    """More of the stack: Partial("avg"), a flattened mesh, loss_parallel, TP over the world,
    FSDP2's options (no reshard after forward, mixed precision, gradient accumulation,
    explicit prefetching), composable DDP (``replicate``), an async redistribution."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    out: Record = {}
    local = torch.randn(4, 6, dtype=DTYPE, generator=gen) * (rank + 1)
    avg = DTensor.from_local(local, flat, [Partial("avg")])
    out["more partial avg"] = _full(avg)
    out["more partial avg -> S1"] = avg.redistribute(flat, [Shard(1)]).to_local().clone()

    x = torch.randn(world * 2, 5, dtype=DTYPE, generator=gen)
    if mesh.ndim == 2:
        flattened = mesh["dp", "tp"]._flatten()
        d = distribute_tensor(x, flattened, [Shard(0)])
        out["more flattened local"] = d.to_local().clone()
        out["more flattened S0 -> S1"] = d.redistribute(flattened, [Shard(1)]).to_local().clone()

    # Tensor parallelism over every rank, and a vocabulary-parallel cross entropy.
    torch.manual_seed(0)
    model = MLP(8, 4 * world)
    parallelize_module(model, flat, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    inp = torch.randn(3, 8, dtype=DTYPE, generator=gen)
    model(inp).pow(2).sum().backward()
    out |= {f"more tpworld {k}": v for k, v in _grads(model).items()}
    torch.manual_seed(0)
    head = nn.Linear(8, 2 * world, dtype=DTYPE)
    parallelize_module(head, flat, ColwiseParallel(use_local_output=False))
    labels = torch.randint(0, 2 * world, (3,), generator=gen)
    with loss_parallel():
        loss = nn.functional.cross_entropy(head(inp), labels)
        loss.backward()
    out["more loss_parallel loss"] = _full(loss)
    out |= {f"more loss_parallel {k}": v for k, v in _grads(head).items()}

    # FSDP2 options.
    torch.manual_seed(0)
    net = Net()
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=DTYPE)
    for layer in net.layers:
        fully_shard(layer, mesh=flat, mp_policy=mp)
    fully_shard(net, mesh=flat, reshard_after_forward=False, mp_policy=mp)
    batches = torch.randn(2, 6, 12, dtype=DTYPE, generator=torch.Generator().manual_seed(rank))
    sharded = cast(FSDPModule, net)  # fully_shard made the model an FSDPModule too
    sharded.set_requires_gradient_sync(False)  # accumulate the first microbatch locally
    net(batches[0]).pow(2).mean().backward()
    sharded.set_requires_gradient_sync(True)
    net(batches[1]).pow(2).mean().backward()
    out |= {f"more fsdp {k}": v for k, v in _grads(net).items()}

    # FSDP2's explicit prefetching, and an early unshard.
    torch.manual_seed(0)
    chain = nn.Sequential(*[nn.Linear(8, 8, dtype=DTYPE) for _ in range(3)])
    units = [fully_shard(layer, mesh=flat) for layer in chain]
    root = fully_shard(chain, mesh=flat)
    units[0].set_modules_to_forward_prefetch([units[1], units[2]])
    units[2].set_modules_to_backward_prefetch([units[1], units[0]])
    root.unshard(async_op=True)
    chain(inp).pow(2).sum().backward()
    out |= {f"more prefetch {k}": v for k, v in _grads(chain).items()}

    # Composable DDP (replicate), and an asynchronous redistribution.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 6, dtype=DTYPE), nn.Linear(6, 3, dtype=DTYPE))
    replicate(plain)
    plain(inp * (rank + 1)).sum().backward()
    out |= {f"more replicate {k}": v for k, v in _grads(plain).items()}
    sharded_x = distribute_tensor(x, flat, [Shard(0)])
    later = sharded_x.redistribute(flat, [Replicate()], async_op=True)
    out["more async redistribute"] = (later.to_local() * 2).clone()
    return out


def scenario_pipeline() -> Record:
    """torch.distributed.pipelining: one stage per rank, GPipe and 1F1B, four microbatches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: Record = {}
    for name, schedule in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        torch.manual_seed(0)
        layers = nn.Sequential(*[nn.Linear(8, 8, dtype=DTYPE) for _ in range(world)])
        stage = PipelineStage(layers[rank], rank, world, torch.device("cpu"))
        run = schedule(stage, n_microbatches=4, loss_fn=lambda y, t: (y - t).pow(2).mean())
        x = torch.randn(8, 8, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
        target = torch.randn(8, 8, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
        losses: list[torch.Tensor] = []
        if rank == 0:
            run.step(x)
        elif rank == world - 1:
            run.step(target=target, losses=losses)
        else:
            run.step()
        out |= {f"pp {name} {k}": v for k, v in _grads(layers[rank]).items()}
        if losses:
            out[f"pp {name} losses"] = torch.stack([loss.detach() for loss in losses])
    return out


def scenario_state_dict(mesh: DeviceMesh, out_dir: Path) -> Record:
    """torch's state-dict helpers over FSDP2, and DCP's async_save.

    A full state dict on rank 0 only, loaded into a meta-device model with
    ``broadcast_from_rank0``; full model and optimizer state dicts gathered to rank 0;
    ``dcp.async_save`` (its collectives on a background thread, over a group of their own,
    while this thread runs an all-reduce on the world), loaded back.
    """
    rank = dist.get_rank()
    out: Record = {}
    torch.manual_seed(0)
    full = Net().state_dict() if rank == 0 else {}
    with torch.device("meta"):
        model = Net()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    out |= {f"sd broadcast {k}": v for k, v in _params(model).items()}

    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, 2, 700 + rank, opt=opt)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd: dict[str, Any] = get_model_state_dict(model, options=options)
    optim_sd: dict[str, Any] = get_optimizer_state_dict(model, opt, options=options)
    out |= {f"sd full {k}": v.clone() for k, v in model_sd.items()}
    for name, moments in optim_sd.get("state", {}).items():
        out |= {f"sd optim {name} {k}": _full(v) for k, v in moments.items()}

    ckpt = out_dir / "ckpt_async"
    # The saving thread's collectives go over a group of their own, as torch advises: two
    # threads issuing collectives on one group would interleave differently per rank.
    saving = dist.new_group(backend=dist.get_backend())
    pending: Any = dcp.async_save(
        {"model": model.state_dict()}, checkpoint_id=str(ckpt), process_group=saving
    )
    meanwhile = torch.full((3,), float(rank), dtype=DTYPE)
    dist.all_reduce(meanwhile)
    pending.result()
    out["sd async meanwhile"] = meanwhile
    fresh = _fsdp_model(mesh)
    state: dict[str, Any] = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt))
    fresh.load_state_dict(state["model"])
    out |= {f"sd async {k}": v for k, v in _params(fresh).items()}
    return out


def scenario_dcp(mesh: DeviceMesh, out_dir: Path, other: Path | None) -> Record:
    """DCP save and load of an FSDP2 state dict; also load another backend's checkpoint."""
    model = _fsdp_model(mesh)
    _train(model, 2, seed=200 + dist.get_rank())
    saved = {k: _full(v) for k, v in model.state_dict().items()}
    ckpt = out_dir / "ckpt"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt))
    out: Record = {f"dcp saved {k}": v for k, v in saved.items()}

    fresh = _fsdp_model(mesh)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt))
    fresh.load_state_dict(state["model"])
    out |= {f"dcp loaded {k}": _full(v) for k, v in fresh.state_dict().items()}
    # The loaded model trains on as the saved one would.
    out["dcp loaded losses"] = torch.stack(_train(fresh, 1, seed=300))

    # A plain DTensor state dict (no module): Shard(0) on the world mesh.
    gen = torch.Generator().manual_seed(4)
    table = torch.randn(8, 3, dtype=DTYPE, generator=gen)
    flat = DeviceMesh("cpu", list(range(dist.get_world_size())))
    dt = distribute_tensor(table, flat, [Shard(0)])
    dcp.save({"table": dt}, checkpoint_id=str(out_dir / "ckpt_table"))
    back = distribute_tensor(torch.zeros_like(table), flat, [Shard(0)])
    dcp.load({"table": back}, checkpoint_id=str(out_dir / "ckpt_table"))
    out["dcp table"] = _full(back)

    if other is not None:
        theirs = _fsdp_model(mesh)
        state = {"model": theirs.state_dict()}
        dcp.load(state, checkpoint_id=str(other))
        theirs.load_state_dict(state["model"])
        out |= {f"dcp other {k}": _full(v) for k, v in theirs.state_dict().items()}
    return out


def _run(record: Record, name: str, fn: Callable[[], Record]) -> None:
    only = os.environ.get("C10D_PARALLEL_ONLY")
    if only and name not in only.split(","):
        return
    start = time.perf_counter()
    try:
        record["values"] |= fn()
    except Exception:
        record["errors"][name] = traceback.format_exc()
    dist.barrier()
    record["seconds"][name] = time.perf_counter() - start


def main(backend: str, out_dir: Path, other: Path | None) -> None:
    """Run every scenario on ``backend``; save this rank's record."""
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp_mesh = mesh["tp"]
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        tp_mesh = mesh
    record: Record = {
        "rank": rank,
        "backend": dist.get_backend(),
        "mesh_groups": [type(mesh.get_group(d)).__name__ for d in range(mesh.ndim)],
        "values": {},
        "errors": {},
        "seconds": {},
    }
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    _run(record, "dtensor", lambda: scenario_dtensor(mesh))
    _run(record, "tp", lambda: scenario_tp(tp_mesh))
    _run(record, "fsdp", lambda: scenario_fsdp(flat, "fsdp"))
    _run(record, "fsdp32", lambda: scenario_fsdp_float32(flat))
    if world == 4:
        hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        _run(record, "hsdp", lambda: scenario_fsdp(hsdp, "hsdp"))
        _run(record, "fsdp+tp", lambda: scenario_fsdp_tp(mesh))
    _run(record, "more", lambda: scenario_more(mesh, flat))
    _run(record, "pipeline", scenario_pipeline)
    _run(record, "dcp", lambda: scenario_dcp(flat, out_dir, other))
    _run(record, "sd", lambda: scenario_state_dict(flat, out_dir))
    torch.save(record, out_dir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None)
