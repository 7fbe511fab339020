"""The backend "meshcomm" with CUDA tensors: torch's API over the world's NCCL communicator.

A world of one on ``cpu:tcp,cuda:nccl`` (NCCL refuses two ranks on one GPU): torch's
``init_process_group("meshcomm")`` adopts it, and torch's collectives, the functional
collectives, DDP and FSDP2 on CUDA tensors must go over NCCL (the group's ledger says
``device``) and give torch's meaning. Skipped, with the reason, without a GPU, cupy or torch;
run through the device tool (bench/gpu_checks.sh, section ``c10d``).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from test_nccl import GPU_SKIP

from meshcomm.testing import run_ranks

PAIR = "cpu:tcp,cuda:nccl"
_SKIP = GPU_SKIP or (None if importlib.util.find_spec("torch") else "torch is not installed")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(_SKIP), reason=_SKIP or "ok")]


def _torch_stack_on_cuda(group: Any) -> list[str]:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import meshcomm.c10d  # noqa: F401 - registers the backend

    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        "meshcomm", store=dist.HashStore(), rank=0, world_size=1, device_id=device
    )
    problems: list[str] = []
    pg = dist.distributed_c10d._get_default_group()
    if pg.mesh_group is not group:
        problems.append("torch's default group did not adopt meshcomm's world")

    def check(what: str, got: Any, want: Any, device: bool = True) -> None:
        last = group.ledger()[-1]
        if device and not last["device"]:
            problems.append(f"{what} went through host memory: {last}")
        if got.device.type != "cuda" or not torch.equal(got, want.to(got.device)):
            problems.append(f"{what}: got {got}, expected {want}")

    x = torch.arange(6.0, device="cuda")
    t = x.clone()
    dist.all_reduce(t)
    check("all_reduce", t, x)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    got = work.get_future().wait()
    if not (isinstance(got, list) and got[0] is t):
        problems.append(f"all_reduce's future holds {got!r}, not [tensor]")
    out = torch.empty(6, device="cuda")
    dist.all_gather_into_tensor(out, x)
    check("all_gather_into_tensor", out, x)
    chunk = torch.empty(6, device="cuda")
    dist.reduce_scatter_tensor(chunk, x)
    check("reduce_scatter_tensor", chunk, x)
    b = x.clone()
    dist.broadcast(b, 0)
    check("broadcast", b, x, device=False)  # a world of one has nothing to send
    swapped = torch.empty(6, device="cuda")
    dist.all_to_all_single(swapped, x)
    check("all_to_all_single", swapped, x)
    check("funcol all_reduce", funcol.all_reduce(x, "sum", pg), x)
    compiled = torch.compile(lambda a: funcol.all_reduce(a * 2, "sum", pg) + 1, fullgraph=True)
    check("compiled funcol all_reduce", compiled(x), x * 2 + 1)

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp(torch.ones(2, 4, device="cuda")).sum().backward()
    if model.weight.grad is None or not torch.equal(
        model.weight.grad, torch.ones(3, 4, device="cuda") * 2
    ):
        problems.append(f"DDP gradient: {model.weight.grad}")

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("dp",))
    sharded = fully_shard(torch.nn.Linear(4, 3).cuda(), mesh=mesh)
    sharded(torch.ones(2, 4, device="cuda")).sum().backward()
    grad = sharded.weight.grad
    if grad is None or not torch.equal(grad.full_tensor(), torch.ones(3, 4, device="cuda") * 2):
        problems.append(f"FSDP2 gradient: {grad}")
    dist.destroy_process_group()
    return problems


def test_torch_stack_on_cuda_tensors_over_nccl() -> None:
    for problems in run_ranks(_torch_stack_on_cuda, 1, backend=PAIR, timeout=300):
        assert problems == [], "\n".join(problems)
