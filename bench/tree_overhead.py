"""Per-call cost of a small collective in two source trees, side by side in one run.

Compares the Python overhead the group and ops layers add (the ledger, the direct paths)
between two checkouts of meshcomm, e.g. ``main`` and a branch::

    python bench/tree_overhead.py /work/main /work/wt-verdicts [--iters 20000] [--rounds 7]

Each round runs one child process per tree, alternately (so load on a shared machine hits
both alike), in a world of one: ``group.all_reduce`` of 8 bytes (the direct path) and
``meshcomm.ops.psum`` over a 1-D mesh. Prints per tree the median over rounds of each
child's best-of-3 microseconds per call, and the ratio of the second tree to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, sys, time
import numpy as np
import meshcomm
from meshcomm import ops

iters = int(sys.argv[1])
world = meshcomm.init(world_size=1, rank=0, backend="tcp")
mesh = meshcomm.init_device_mesh((1,), mesh_dim_names=("x",))
x = np.ones(2, np.float32)
out = {}
for name, fn in (("all_reduce", lambda: world.all_reduce(x)),
                 ("psum", lambda: ops.psum(x, "x", mesh=mesh))):
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    out[name] = best
meshcomm.shutdown()
print(json.dumps(out))
"""


def _run(root: str, iters: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": root}
    env.pop("MESHCOMM_TRACE", None)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(iters)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
        cwd=root,
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--iters", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {args.first: [], args.second: []}
    for _ in range(args.rounds):
        for root in (args.first, args.second):
            runs[root].append(_run(root, args.iters))
    for op in ("all_reduce", "psum"):
        a = statistics.median(r[op] for r in runs[args.first])
        b = statistics.median(r[op] for r in runs[args.second])
        print(f"{op:10s} {args.first}: {a:.2f} us  {args.second}: {b:.2f} us  ratio {b / a:.3f}")


if __name__ == "__main__":
    main()
