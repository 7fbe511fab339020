"""PyTorch's "Getting Started with Distributed Data Parallel" tutorial, ported by changing
the imports.

Run it with ``python examples/ddp_tutorial.py`` (two processes, started by
:func:`meshcomm.spawn`, the ``torch.multiprocessing.spawn`` stand-in). The three imports
marked below are the only difference from the torch version; going back is the same
three-line change. Otherwise it follows the tutorial, with these edits, which both versions
share:

- backend ``"gloo"`` on CPU and no ``device_ids`` (the tutorial uses NCCL on GPUs);
- the rendezvous address comes from the environment (``MASTER_ADDR``/``MASTER_PORT``, with
  the tutorial's address as the default) instead of a fixed ``tcp://`` URL, so two jobs
  on one machine do not fight over a port;
- seeds, so every run (and both libraries) trains the same model on the same data, and
  ``DDP_STEPS`` training steps instead of one.

With ``DDP_TUTORIAL_OUT=path``, rank 0 saves the trained ``state_dict`` there
(tests/test_distributed_torch.py compares it with torch's own DDP).
"""

import os

import torch
from torch import nn, optim

import meshcomm.distributed as dist  # torch: import torch.distributed as dist
from meshcomm.distributed import DistributedDataParallel as DDP  # torch: from torch.nn.parallel
from meshcomm.spawn import spawn  # torch: from torch.multiprocessing import spawn

STEPS = int(os.environ.get("DDP_STEPS", "5"))


def setup(rank, world_size):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dist.init_process_group(backend="gloo", init_method="env://", world_size=world_size, rank=rank)


def cleanup():
    dist.destroy_process_group()


def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)

    # Create the model on the CPU (the tutorial: .to(rank) on GPU ``rank``)
    torch.manual_seed(0)
    model = nn.Linear(10, 10)
    ddp_model = DDP(model)

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)

    # Dummy input and target, different on every rank
    torch.manual_seed(1 + rank)
    for _ in range(STEPS):
        inputs = torch.randn(20, 10)
        targets = torch.randn(20, 10)
        optimizer.zero_grad()
        outputs = ddp_model(inputs)
        loss = loss_fn(outputs, targets)
        loss.backward()
        optimizer.step()
    print(f"Rank {rank} loss: {loss.item()}")

    out = os.environ.get("DDP_TUTORIAL_OUT")
    if out and rank == 0:
        torch.save(model.state_dict(), out)
    cleanup()


def run_demo():
    world_size = 2
    spawn(demo_basic, args=(world_size,), nprocs=world_size, join=True)


if __name__ == "__main__":
    run_demo()
