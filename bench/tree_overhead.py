"""Per-call cost of a small collective in two source trees, side by side in one run.

Compares the Python overhead the group and ops layers add (the ledger, the direct paths)
between two checkouts of meshcomm, e.g. ``main`` and a branch::

    python bench/tree_overhead.py /work/main /work/wt-verdicts [--iters 20000] [--rounds 7]
    python bench/tree_overhead.py BEFORE AFTER --nproc 2 --leaves 30

Each round runs one job per tree, alternately (so load on a shared machine hits both
alike), in a world of ``--nproc`` ranks (default 1; more: one process per rank on this
host, over tcp): ``group.all_reduce`` of 8 bytes (the direct path), ``meshcomm.ops.psum``
of the same array over a 1-D mesh, and ``psum`` of a dict of ``--leaves`` float32[64]
leaves (``tree``; default 30; 0 leaves it out; its loops run ``iters / 10`` calls). Prints
per tree the median over rounds of rank 0's best-of-3 microseconds per call (each loop
after a barrier), and the ratio of the second tree to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys

_CHILD = r"""
import json, sys, time
import numpy as np
import meshcomm
from meshcomm import ops

iters, leaves, size, rank, url = (*map(int, sys.argv[1:5]), sys.argv[5])
if size == 1:
    world = meshcomm.init(world_size=1, rank=0, backend="tcp")
else:
    world = meshcomm.init(backend="tcp", init_method=url, world_size=size, rank=rank)
mesh = meshcomm.init_device_mesh((size,), mesh_dim_names=("x",))
x = np.ones(2, np.float32)
tree = {f"w{i:02d}": np.ones(64, np.float32) for i in range(leaves)}
cases = [("all_reduce", lambda: world.all_reduce(x), iters),
         ("psum", lambda: ops.psum(x, "x", mesh=mesh), iters)]
if leaves:
    cases.append(("tree", lambda: ops.psum(tree, "x", mesh=mesh), max(1, iters // 10)))
out = {}
for name, fn, n in cases:
    for _ in range(min(200, n)):
        fn()
    best = float("inf")
    for _ in range(3):
        world.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    out[name] = best
world.barrier()
meshcomm.shutdown()
print(json.dumps(out))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _run(root: str, iters: int, leaves: int, nproc: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": root}
    for name in list(env):
        if name.startswith(("MESHCOMM_", "MASTER_", "OMPI_", "PMI_")) or name in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
        ):
            env.pop(name)  # a world of its own, whatever launched this script
    url = f"tcp://127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(iters), str(leaves), str(nproc), str(r), url],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=root,
        )
        for r in range(nproc)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        if p.returncode:
            raise RuntimeError(f"{root}: a rank exited with {p.returncode}:\n{err[-3000:]}")
    result: dict[str, float] = json.loads(outs[0][0].strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=1, help="ranks per job (default 1)")
    parser.add_argument("--leaves", type=int, default=30, help="leaves of the tree psum")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {args.first: [], args.second: []}
    for _ in range(args.rounds):
        for root in (args.first, args.second):
            runs[root].append(_run(root, args.iters, args.leaves, args.nproc))
    print(f"world {args.nproc}, medians of {args.rounds} rounds, rank 0's best of 3 loops")
    for op in ("all_reduce", "psum", "tree")[: 3 if args.leaves else 2]:
        a = statistics.median(r[op] for r in runs[args.first])
        b = statistics.median(r[op] for r in runs[args.second])
        print(f"{op:10s} {args.first}: {a:.2f} us  {args.second}: {b:.2f} us  ratio {b / a:.3f}")


if __name__ == "__main__":
    main()
