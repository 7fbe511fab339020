"""What each layer above raw mpi4py costs an 8-byte all_reduce, in one MPI job. Run under mpiexec.

    mpiexec -n 2 python bench/peers/mpi_floor.py --repeats 15

The same processes time, alternating, so that the VM's changing CPU speed hits every line
alike (docs/benchmarks.md, "The 8-byte path, third pass"):

- ``raw``: ``comm.Allreduce(x, out)`` into a preallocated buffer (mpi4py's best case);
- ``bare``: a fresh result and ``Iallreduce`` tested to completion, written inline: what a
  call that must time out costs with no Python frame of meshcomm's;
- ``runner``: a fresh result filled by the mpi backend's runner of the signature (the
  nonblocking call, its tests, the timeout's poll);
- ``method``: the runner behind a method with ``ProcessGroup.all_reduce``'s signature and
  first checks, doing nothing else: the floor of a Python group layer without duties;
- ``group``: ``group.all_reduce(x)``, duties included (the engine's claim, the sequence
  number, the ledger's record with the caller's site, the running hash of signatures);
- ``persistent``: ``MPI_Allreduce_init`` once, then per call the input copied in,
  ``MPI_Start``, tests, the result copied out. Cheaper than raw ``Allreduce`` in MPICH, but
  not what the backend does: two ranks that start different persistent requests (a
  float32 call against an int32 call of the same size) never match, so a mismatch would
  hang until the timeout instead of being named.

Rank 0 prints each line's median time and its added time over ``raw`` (the median of the
per-repeat differences, slowest rank).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

import meshcomm
from meshcomm.reduction import ReduceOp

__all__ = ["main"]


def _lines(group: Any) -> tuple[dict[str, Callable[[], object]], Any]:
    """Each line's call, on an 8-byte float32 vector, and the persistent request (to free)."""
    comm = group._comm
    mpi_comm = comm.mpi_comm
    x = np.ones(2, np.float32)
    out = np.empty_like(x)
    shape, dtype, empty = x.shape, x.dtype, np.empty
    float32, total, start = MPI.FLOAT, MPI.SUM, mpi_comm.Iallreduce
    runner = comm.runner("all_reduce", dtype, ReduceOp.SUM)

    def bare() -> object:
        result = empty(shape, dtype)
        test = start([x, float32], [result, float32], total).Test
        while not test():
            pass
        return result

    def through_runner() -> object:
        result = empty(shape, dtype)
        runner(x, result)
        return result

    class Bare:
        def all_reduce(
            self, x: Any, op: Any = "sum", *, factor: Any = None, async_op: bool = False,
            out: Any = None,
        ) -> Any:  # fmt: skip
            if out is None and type(x) is np.ndarray and factor is None:
                result = empty(shape, dtype)
                runner(x, result)
                return result
            raise NotImplementedError

    method = Bare()
    sent, received = np.empty_like(x), np.empty_like(x)
    persistent = mpi_comm.Allreduce_init([sent, float32], [received, float32], total)

    def started() -> object:
        np.copyto(sent, x)
        persistent.Start()
        while not persistent.Test():
            pass
        return received.copy()

    return {
        "raw": lambda: mpi_comm.Allreduce(x, out),
        "bare": bare,
        "runner": through_runner,
        "method": lambda: method.all_reduce(x),
        "group": lambda: group.all_reduce(x),
        "persistent": started,
    }, persistent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--iters", type=int, default=5000, help="calls per timed loop")
    args = p.parse_args()
    group = meshcomm.init(backend="mpi")
    mpi_comm = group._comm.mpi_comm
    lines, persistent = _lines(group)
    times: dict[str, list[float]] = {name: [] for name in lines}
    for run in lines.values():
        for _ in range(300):
            run()
    for _ in range(args.repeats):
        for name, run in lines.items():
            mpi_comm.Barrier()
            begin = time.perf_counter()
            for _ in range(args.iters):
                run()
            took = (time.perf_counter() - begin) / args.iters
            times[name].append(mpi_comm.allreduce(took, op=MPI.MAX) * 1e6)
    if mpi_comm.Get_rank() == 0:
        raw = times["raw"]
        print(f"# 8-byte float32 all_reduce, world {mpi_comm.Get_size()}, medians of "
              f"{args.repeats} (slowest rank), us")  # fmt: skip
        print(f"{'line':>12} {'time':>8} {'added':>8}")
        for name, each in times.items():
            added = statistics.median(a - b for a, b in zip(each, raw, strict=True))
            print(f"{name:>12} {statistics.median(each):8.2f} {added:+8.2f}")
    persistent.Free()  # MPICH warns at exit about a persistent request left
    group.barrier()


if __name__ == "__main__":
    main()
