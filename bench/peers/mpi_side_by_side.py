"""meshcomm's mpi backend and raw mpi4py, side by side in one MPI job. Run under mpiexec.

    mpiexec -n 2 python bench/peers/mpi_side_by_side.py all_reduce 8 64M --repeats 5
    mpiexec -n 2 python bench/peers/mpi_side_by_side.py all_reduce 8 64K --backend tcp

``--backend tcp`` times meshcomm's own tcp backend in the same processes instead (its world
made beside MPI's: rank 0 picks the store's port and the job's secret and broadcasts them
over MPI). Timed back to back in the same processes, both run on the same vCPUs at the same
moments: on a VM whose cores change speed from run to run (docs/benchmarks.md, "The 8-byte
path, third pass"), separate jobs compare one moment's speed with another's.

For each size, both are timed ``--repeats`` times, alternating (raw, meshcomm, raw, ...) so
machine noise hits both alike, exactly as ``meshcomm-bench`` and ``mpi4py_bench.py`` time
them (warm-up, barrier, mean of the timed iterations, slowest rank); the median per size is
kept. meshcomm runs ``group.all_reduce(x)`` (functional: a fresh result each call); raw
mpi4py runs ``comm.Allreduce(x, out)`` into a preallocated buffer, its best case.

Rank 0 prints a table (time, busbw, meshcomm - raw in us, busbw ratio, and the CPU time each
rank spends per call: with more ranks than cores the cores are the bottleneck, and the wall
time follows the CPU time of all ranks) and, with ``--json``, one JSON line of rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import float32_input, iters_for, sizes

import meshcomm
from meshcomm.bench import bus_factor, parse_size


def _time(
    run: Callable[[], object], iters: int, barrier: Callable[[], None]
) -> tuple[float, float]:
    """Seconds per call: wall time and this process's CPU time (user + system)."""
    for _ in range(3):
        run()
    barrier()
    cpu = time.process_time()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    wall = (time.perf_counter() - start) / iters
    return wall, (time.process_time() - cpu) / iters


#: The raw mpi4py call each op is timed against (into preallocated buffers).
_RAW_CALLS = {
    "all_reduce": "Allreduce",
    "all_gather": "Allgather",
    "reduce_scatter": "Reduce_scatter_block",
    "broadcast": "Bcast",
}


def _pair(
    op: str, size: int, group: Any, comm: Any
) -> tuple[Callable[[], object], Callable[[], object], int]:
    """(raw run, meshcomm run, wrong elements in one checked call of each) for ``size``
    bytes: all_reduce's and broadcast's vector, all_gather's output and reduce_scatter's
    input (nccl-tests' sizes); all_gather and reduce_scatter are tiled, at axis 0."""
    world, rank = comm.Get_size(), comm.Get_rank()
    count = max(size // 4, world)
    if op == "all_gather":
        x = float32_input(count // world) + rank
        out = np.empty(x.size * world, np.float32)
        expected = np.concatenate([float32_input(count // world) + r for r in range(world)])

        def raw() -> object:
            return comm.Allgather(x, out)

        def ours() -> object:
            return group.all_gather(x, tiled=True)

    elif op == "reduce_scatter":
        x = float32_input(count - count % world)
        out = np.empty(x.size // world, np.float32)
        expected = (x * world)[rank * out.size : (rank + 1) * out.size]

        def raw() -> object:
            return comm.Reduce_scatter_block(x, out)

        def ours() -> object:
            return group.reduce_scatter(x, tiled=True)

    elif op == "broadcast":
        expected = float32_input(count)
        x = expected.copy() if rank == 0 else np.zeros_like(expected)
        # Each side its own buffer: alternating MPI_Bcast and meshcomm's MPI_Ibcast on one
        # root buffer made the Ibcast 4-5x slower (MPICH; the same calls on separate
        # buffers run at raw speed).
        out = x.copy()

        def raw() -> object:
            return comm.Bcast(out, 0)

        def ours() -> object:
            return group.broadcast(x, 0)

    else:
        x = float32_input(count)
        out = np.empty_like(x)
        expected = x * world

        def raw() -> object:
            return comm.Allreduce(x, out)

        def ours() -> object:
            return group.all_reduce(x)

    got = ours()
    raw()
    wrong = int(np.count_nonzero(got != expected)) + int(np.count_nonzero(out != expected))
    return raw, ours, wrong


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("op", choices=[*_RAW_CALLS, "mesh"])
    p.add_argument("min_bytes", type=parse_size, nargs="?", default=8)
    p.add_argument("max_bytes", type=parse_size, nargs="?", default=parse_size("64M"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--backend", choices=["mpi", "tcp"], default="mpi", help="meshcomm's side")
    args = p.parse_args()
    if args.op == "mesh" and args.backend != "mpi":
        raise SystemExit("mpi_side_by_side: the mesh costs are the mpi backend's (--backend mpi)")

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if args.backend == "tcp":
        _tcp_environment(comm)
    group = meshcomm.init(backend=args.backend)
    world, rank = comm.Get_size(), comm.Get_rank()

    def slowest(seconds: float) -> float:
        return float(comm.allreduce(seconds, op=MPI.MAX))

    def timed(run: Callable[[], object], iters: int) -> tuple[float, float]:
        """(slowest rank's wall time, mean CPU time per rank) per call."""
        wall, cpu = _time(run, iters, comm.Barrier)
        return slowest(wall), float(comm.allreduce(cpu)) / world

    if args.op == "mesh":
        mesh_costs(group, comm, args.repeats, slowest)
        meshcomm.shutdown()
        return
    rows = []
    for size in sizes(args.min_bytes, args.max_bytes):
        raw_run, meshcomm_run, wrong = _pair(args.op, size, group, comm)
        iters = iters_for(size)
        raw_t, mc_t, raw_cpu, mc_cpu = [], [], [], []
        for _ in range(args.repeats):
            for run, walls, cpus in ((raw_run, raw_t, raw_cpu), (meshcomm_run, mc_t, mc_cpu)):
                wall, cpu = timed(run, iters)
                walls.append(wall)
                cpus.append(cpu)
        raw, mc = statistics.median(raw_t), statistics.median(mc_t)
        factor = bus_factor(args.op, world)
        rows.append(
            {
                "op": args.op,
                "world": world,
                "size": size,
                "raw_us": raw * 1e6,
                "meshcomm_us": mc * 1e6,
                "added_us": (mc - raw) * 1e6,
                "raw_busbw": size / raw / 1e9 * factor,
                "meshcomm_busbw": size / mc / 1e9 * factor,
                "busbw_ratio": raw / mc,
                "raw_cpu_us": statistics.median(raw_cpu) * 1e6,
                "meshcomm_cpu_us": statistics.median(mc_cpu) * 1e6,
                "wrong": wrong,
            }
        )
    if rank == 0:
        if args.json:
            print(json.dumps(rows))
        else:
            print(
                f"# {args.op}, world {world}: raw mpi4py {_RAW_CALLS[args.op]} vs meshcomm "
                f"{args.backend} backend"
            )
            print(
                f"# {args.repeats} alternating repeats per size, medians; busbw in GB/s; "
                "cpu: us of CPU per call, mean over ranks"
            )
            print(
                f"{'size':>10} {'raw(us)':>10} {'meshcomm(us)':>13} {'added(us)':>10} "
                f"{'raw busbw':>10} {'mc busbw':>10} {'ratio':>6} {'#wrong':>7} "
                f"{'raw cpu':>8} {'mc cpu':>8}"
            )
            for r in rows:
                print(
                    f"{r['size']:>10} {r['raw_us']:>10.1f} {r['meshcomm_us']:>13.1f} "
                    f"{r['added_us']:>10.1f} {r['raw_busbw']:>10.3f} {r['meshcomm_busbw']:>10.3f} "
                    f"{r['busbw_ratio']:>6.2f} {r['wrong']:>7} "
                    f"{r['raw_cpu_us']:>8.1f} {r['meshcomm_cpu_us']:>8.1f}"
                )
    meshcomm.shutdown()


def _tcp_environment(comm: Any) -> None:
    """What ``meshcomm.init(backend="tcp")`` needs beside what mpiexec set (the rank and the
    world's size, read from ``PMI_RANK`` and ``PMI_SIZE``): the store's address and the job's
    secret, chosen on rank 0 and broadcast."""
    import secrets
    import socket

    offer = None
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            offer = (int(s.getsockname()[1]), secrets.token_hex(16))
    port, secret = comm.bcast(offer, root=0)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        MESHCOMM_SECRET=secret,
    )


def mesh_costs(group: Any, comm: Any, repeats: int, slowest: Callable[[float], float]) -> None:
    """Time mesh groups: one split per axis, ``init_device_mesh`` (Cart), ``cart_subs``."""
    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    n = comm.Get_size()
    shape = (2, n // 2) if n % 2 == 0 and n > 2 else (n,)
    names = ("dp", "tp")[: len(shape)]
    made, first, cart, splits, old_mesh = [], [], [], [], []
    me = comm.Get_rank()
    coord = np.unravel_index(me, shape)
    for _ in range(repeats):
        # Before: one group-layer split (all-gather + MPI_Comm_create_group) per axis.
        comm.Barrier()
        t0 = time.perf_counter()
        made_by_split = []
        for d in range(len(shape)):
            others = [int(c) for k, c in enumerate(coord) if k != d]
            color = int(np.ravel_multi_index(others, [s for k, s in enumerate(shape) if k != d]))
            made_by_split.append(group.split(color, int(coord[d])))
        splits.append(slowest(time.perf_counter() - t0))
        for g in made_by_split:
            g.close()
        # init_device_mesh as before this change: grid_split unavailable, one split per axis.
        comm.Barrier()
        t0 = time.perf_counter()
        with _no_grid_split():
            init_device_mesh(shape, names, backend="mpi")
        old_mesh.append(slowest(time.perf_counter() - t0))
        comm.Barrier()
        t0 = time.perf_counter()
        mesh = init_device_mesh(shape, names, backend="mpi")
        t1 = time.perf_counter()
        for name in names:
            ops.psum(np.ones(1, np.float32), name, mesh=mesh)
        t2 = time.perf_counter()
        made.append(slowest(t1 - t0))
        first.append(slowest(t2 - t1))
        comm.Barrier()
        t0 = time.perf_counter()
        axes = group._comm.cart_subs(shape)
        cart.append(slowest(time.perf_counter() - t0))
        for axis in axes:
            axis.close()
    if comm.Get_rank() == 0:
        print(f"# mesh {shape} on {n} ranks, mpi backend, medians of {repeats} (slowest rank)")
        print(f"one group split per axis (before): {statistics.median(splits) * 1e3:.2f} ms")
        print(
            f"init_device_mesh{shape}, split per axis: {statistics.median(old_mesh) * 1e3:.2f} ms"
        )
        print(f"init_device_mesh{shape} (Cart): {statistics.median(made) * 1e3:.2f} ms")
        print(f"first psum on each axis: {statistics.median(first) * 1e3:.2f} ms")
        print(f"MpiCommunicator.cart_subs{shape}: {statistics.median(cart) * 1e3:.2f} ms")


@contextlib.contextmanager
def _no_grid_split() -> Iterator[None]:
    from meshcomm.group import ProcessGroup

    saved = ProcessGroup.grid_split
    ProcessGroup.grid_split = lambda self, dims: None  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        ProcessGroup.grid_split = saved  # type: ignore[method-assign]


if __name__ == "__main__":
    main()
