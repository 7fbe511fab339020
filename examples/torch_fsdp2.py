"""FSDP2 with torch's own stack, on backend "meshcomm" (or any other).

torch's FSDP2 example in small: a little transformer-style model, ``fully_shard`` on every
block and then on the root, a few training steps, and a sharded checkpoint with
``torch.distributed.checkpoint``, saved and loaded back. Written against plain torch:
nothing here imports meshcomm. The backend string is the only choice::

    torchrun --nproc-per-node 2 examples/torch_fsdp2.py            # backend "meshcomm"
    torchrun --nproc-per-node 2 examples/torch_fsdp2.py gloo       # torch's own
    DIST_BACKEND=gloo torchrun --nproc-per-node 2 examples/torch_fsdp2.py
    meshrun --nproc-per-node 2 examples/torch_fsdp2.py             # meshcomm's launcher, too

Both print the same losses and train the same weights, bit for bit. With meshcomm
installed, torch's backend autoload registers "meshcomm" when torch is imported (an
``import meshcomm`` does the same where the entry points are not installed).

``EXAMPLE_CKPT=dir`` puts the checkpoint there (default: a temporary directory). With
``EXAMPLE_OUT=path``, rank 0 saves the losses and the full trained weights there
(tests/test_c10d_parallel.py compares the two backends).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

BACKEND = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DIST_BACKEND", "meshcomm")
STEPS = int(os.environ.get("EXAMPLE_STEPS", "5"))
VOCAB, DIM, SEQ = 64, 32, 16


class Block(nn.Module):
    """A pre-norm MLP block with a residual connection."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    """Embedding, blocks, a norm and an output projection: a language model's shape."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x).flatten(0, 1))  # (batch * seq, vocab) logits


def build(mesh: DeviceMesh) -> Model:
    """The model, each block sharded as its own unit, then the root."""
    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(p: torch.Tensor) -> torch.Tensor:
    """A sharded parameter's whole value, on every rank."""
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def main() -> None:
    """Train with FSDP2, checkpoint, load the checkpoint into a fresh model, check it."""
    dist.init_process_group(BACKEND)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = build(mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    losses = []
    data = torch.Generator().manual_seed(100 + rank)  # data parallel: a batch per rank
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=data)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits, tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if rank == 0:
            print(f"[{BACKEND}] step {step}: loss {loss.item():.6f}")

    # A sharded checkpoint: every rank writes its own shards.
    ckpt = os.environ.get("EXAMPLE_CKPT", "")
    temporary = not ckpt
    if temporary:
        holder = [tempfile.mkdtemp(prefix="fsdp2-ckpt-") if rank == 0 else ""]
        dist.broadcast_object_list(holder, src=0)  # one directory for all ranks
        ckpt = holder[0]
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
    }
    dcp.save(state, checkpoint_id=ckpt)

    fresh = build(mesh)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    loaded: dict[str, Any] = {
        "model": get_model_state_dict(fresh),
        "optim": get_optimizer_state_dict(fresh, fresh_optimizer),
    }
    dcp.load(loaded, checkpoint_id=ckpt)
    set_model_state_dict(fresh, loaded["model"])
    set_optimizer_state_dict(fresh, fresh_optimizer, loaded["optim"])

    full = {name: _full(p) for name, p in model.named_parameters()}
    restored = {name: _full(p) for name, p in fresh.named_parameters()}
    assert all(torch.equal(full[n], restored[n]) for n in full), "checkpoint did not round-trip"
    if rank == 0:
        print(f"[{BACKEND}] checkpoint in {ckpt} round-trips")

    out = os.environ.get("EXAMPLE_OUT")
    if out and rank == 0:
        torch.save({"backend": dist.get_backend(), "losses": losses, "weights": full}, out)
    dist.barrier()  # every rank is done with the checkpoint
    if temporary and rank == 0:
        shutil.rmtree(ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
