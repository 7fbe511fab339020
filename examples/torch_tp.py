"""Tensor parallelism with torch's own stack, on backend "meshcomm" (or any other).

In the shape of torch's tensor-parallel example (a two-layer model, its first linear split by
columns and its second by rows, ``parallelize_module`` over a 1-D ``DeviceMesh``), written against
plain torch: nothing here imports meshcomm. The backend string is the only choice::

    torchrun --nproc-per-node 2 examples/torch_tp.py            # backend "meshcomm"
    torchrun --nproc-per-node 2 examples/torch_tp.py gloo       # torch's own
    DIST_BACKEND=gloo torchrun --nproc-per-node 2 examples/torch_tp.py
    meshrun --nproc-per-node 2 examples/torch_tp.py             # meshcomm's launcher, too

Both print the same losses and train the same weights, bit for bit. With meshcomm
installed, torch's backend autoload registers "meshcomm" when torch is imported (an
``import meshcomm`` does the same where the entry points are not installed).

With ``EXAMPLE_OUT=path``, rank 0 saves the losses and the full trained weights there
(tests/test_c10d_parallel.py compares the two backends).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

BACKEND = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DIST_BACKEND", "meshcomm")
STEPS = int(os.environ.get("EXAMPLE_STEPS", "10"))


class ToyModel(nn.Module):
    """An MLP: in_proj, ReLU, out_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.relu(self.in_proj(x)))


def main() -> None:
    """Train the toy model with its linears split over every rank."""
    dist.init_process_group(BACKEND)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))

    torch.manual_seed(0)  # the same initial weights on every rank
    model = parallelize_module(
        ToyModel(), mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, foreach=True)

    losses = []
    for step in range(STEPS):
        # Tensor parallelism: every rank of the tp group sees the same input.
        torch.manual_seed(step)
        inp = torch.rand(20, 10)
        target = inp[:, :5] - inp[:, 5:]  # something to learn
        loss = nn.functional.mse_loss(model(inp), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if rank == 0:
            print(f"[{BACKEND}] step {step}: loss {loss.item():.6f}")

    weights = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
    out = os.environ.get("EXAMPLE_OUT")
    if out and rank == 0:
        torch.save({"backend": dist.get_backend(), "losses": losses, "weights": weights}, out)
    dist.barrier()  # every rank is done before any tears down (gloo aborted at exit without)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
