"""Raw mpi4py buffer collectives, timed like meshcomm-bench. Run under mpiexec.

mpiexec -n 2 python bench/peers/mpi4py_bench.py all_reduce 8 64M
"""

from __future__ import annotations

import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from common import float32_input, sizes, sweep

from meshcomm.bench import parse_size


def main() -> None:
    op, lo, hi = sys.argv[1], parse_size(sys.argv[2]), parse_size(sys.argv[3])
    comm = MPI.COMM_WORLD
    world, rank = comm.Get_size(), comm.Get_rank()
    out_cache: dict[tuple[str, int], np.ndarray] = {}

    def out(n: int) -> np.ndarray:
        # Raw MPI writes into a preallocated buffer: that is the peer's best case.
        key = (op, n)
        if key not in out_cache:
            out_cache[key] = np.empty(n, dtype=np.float32)
        return out_cache[key]

    def run(x: object) -> object:
        a = x  # type: ignore[assignment]
        if op == "all_reduce":
            r = out(a.size)
            comm.Allreduce(a, r)
            return r
        if op == "all_gather":
            piece = a[: a.size // world]
            r = out(piece.size * world)
            comm.Allgather(piece, r)
            return r
        if op == "reduce_scatter":
            n = a.size // world * world
            r = out(n // world)
            comm.Reduce_scatter_block(a[:n], r)
            return r
        if op == "broadcast":
            comm.Bcast(a, root=0)
            return a
        raise SystemExit(f"mpi4py_bench: op {op} not wired")

    def sync_max(seconds: float) -> float:
        return float(comm.allreduce(seconds, op=MPI.MAX))

    sweep(op, world, rank, sizes(lo, hi), float32_input, run, comm.Barrier, sync_max)


if __name__ == "__main__":
    main()
