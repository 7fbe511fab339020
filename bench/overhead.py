"""Per-layer Python overhead of one small all_reduce, layer by layer.

Run under a launcher (two or more ranks)::

    .venv/bin/meshrun --nproc-per-node 2 bench/overhead.py [--iters 2000] [--repeats 5]
    .venv/bin/meshrun --nproc-per-node 2 bench/overhead.py --profile group  # cProfile on rank 0

Times (microseconds per call, rank 0's median over ``--repeats`` loops of ``--iters``
calls, after a barrier) for a float32 all_reduce of ``--bytes`` bytes (default 8) through:

* ``exchange``: the bare ``Link.exchange`` steps recursive doubling does at world 2 (one
  send and one receive with rank ^ 1), at world 2 only;
* ``algorithms``: ``meshcomm.backends.algorithms.all_reduce`` on the link;
* ``mpi4py``, ``iallreduce`` (the mpi backend only): raw ``Allreduce`` into a fixed buffer,
  and ``Iallreduce`` polled with ``Test`` (what the runner calls);
* ``comm``: ``Communicator.all_reduce`` (the backend's checks on top);
* ``runner``: the backend's runner of the signature into a fixed buffer, where it offers one
  (what the group layer's plan calls);
* ``group``: ``ProcessGroup.all_reduce`` (argument checks, snapshot, result, engine);
* ``psum``: ``meshcomm.ops.psum`` over a 1-D mesh (axis resolution, pytree handling).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import numpy as np

from meshcomm import ops, world
from meshcomm.backends import algorithms
from meshcomm.mesh import init_device_mesh
from meshcomm.reduction import ReduceOp


def _time(fn: Callable[[], object], iters: int, barrier: Callable[[], object]) -> float:
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def _complete(request: object) -> None:
    test = request.Test  # type: ignore[attr-defined]
    while not (test() or test() or test()):
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--profile", default="", help="a layer to run under cProfile on rank 0")
    args = p.parse_args()

    group = world.init()
    mesh = init_device_mesh((group.size,), ("x",))
    comm = group._comm
    link = getattr(comm, "link", None)
    x = np.ones(max(1, args.bytes // 4), np.float32)
    buf = np.zeros_like(x)  # stays 0 however often it is reduced
    spare = x.copy()
    layers: dict[str, Callable[[], object]] = {}
    if link is not None and group.size == 2:
        peer = group.rank ^ 1
        layers["exchange"] = lambda: link.exchange([(peer, buf)], [(peer, spare)])
    if link is not None:
        layers["algorithms"] = lambda: algorithms.all_reduce(link, buf, ReduceOp.SUM)
    mpi_comm = getattr(comm, "mpi_comm", None)
    if mpi_comm is not None:
        # Raw mpi4py into a fixed buffer (mpi4py_bench.py's call), then its nonblocking form
        # polled the way the runner polls: what MPI itself costs under the layers.
        layers["mpi4py"] = lambda: mpi_comm.Allreduce(x, spare)
        layers["iallreduce"] = lambda: _complete(mpi_comm.Iallreduce(x, spare))
    layers["comm"] = lambda: comm.all_reduce(buf, ReduceOp.SUM)
    runner = comm.runner("all_reduce", x.dtype, ReduceOp.SUM)
    if runner is not None:
        layers["runner"] = lambda: runner(x, spare)
    layers["group"] = lambda: group.all_reduce(x)
    layers["psum"] = lambda: ops.psum(x, "x", mesh=mesh)
    # Make every group (and connection) before timing.
    for fn in layers.values():
        fn()
    if args.profile:
        fn = layers[args.profile]
        group.barrier()
        if group.rank == 0:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.iters):
                fn()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        else:
            for _ in range(args.iters):
                fn()
    else:
        results: dict[str, list[float]] = {name: [] for name in layers}
        for _ in range(args.repeats):
            for name, fn in layers.items():
                results[name].append(_time(fn, args.iters, group.barrier))
        if group.rank == 0:
            print(f"world {group.size}, {x.nbytes} B float32, us per call (median of repeats)")
            prev = None
            for name, values in results.items():
                med = statistics.median(values)
                extra = "" if prev is None else f"  (+{med - prev:.1f})"
                print(f"  {name:<11} {med:8.1f}{extra}   [{min(values):.1f} .. {max(values):.1f}]")
                prev = med
    world.shutdown()


if __name__ == "__main__":
    main()
