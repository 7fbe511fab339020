"""torch.distributed gloo, timed like meshcomm-bench. Run under torchrun.

python -m torch.distributed.run --nproc-per-node 2 bench/peers/gloo_bench.py all_reduce 8 64M
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from common import float32_input, sizes, sweep

from meshcomm.bench import parse_size


def main() -> None:
    op, lo, hi = sys.argv[1], parse_size(sys.argv[2]), parse_size(sys.argv[3])
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()

    def make(count: int) -> torch.Tensor:
        return torch.from_numpy(float32_input(count))

    def run(x: object) -> object:
        t = x  # type: ignore[assignment]
        if op == "all_reduce":
            dist.all_reduce(t)
        elif op == "all_gather":
            piece = t[: max(1, t.numel() // world)]
            out = torch.empty(piece.numel() * world, dtype=t.dtype)
            dist.all_gather_into_tensor(out, piece)
        elif op == "reduce_scatter":
            n = t.numel() // world * world
            out = torch.empty(n // world, dtype=t.dtype)
            dist.reduce_scatter_tensor(out, t[:n])
        elif op == "broadcast":
            dist.broadcast(t, 0)
        else:
            raise SystemExit(f"gloo_bench: op {op} not wired")
        return t

    def sync_max(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    sweep(op, world, rank, sizes(lo, hi), make, run, dist.barrier, sync_max)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
