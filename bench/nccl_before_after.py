"""The group path's cost over raw NCCL before and after a change, side by side in one run.

    python bench/nccl_before_after.py --before /tmp/base --after . [--rounds 5]

World 1 on one GPU. Each round runs one process per tree, alternating trees, so that the
machine's drift hits both alike; each process times, in alternation, raw
``NcclCommunicator.allReduce`` out of place and ``group.all_reduce`` of the same 8-byte
float32 cupy array (N calls queued, then one synchronize), and prints both. Prints the
medians per tree and what the group adds over raw NCCL (after - before is the change's).
Needs a GPU and cupy (run it through the device tool).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

__all__ = ["main"]

_CHILD = r"""
import json, statistics, time
import cupy as cp
from cupy.cuda import nccl
import meshcomm
group = meshcomm.init(backend="cpu:tcp,cuda:nccl", world_size=1, rank=0)
raw = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
x, out = cp.ones(2, dtype=cp.float32), cp.empty(2, dtype=cp.float32)
stream = cp.cuda.get_current_stream()
def raw_call():
    raw.allReduce(x.data.ptr, out.data.ptr, 2, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
def group_call():
    group.all_reduce(x)
def per_call(call, n):
    stream.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        call()
    stream.synchronize()
    return (time.perf_counter() - start) / n * 1e6
for call in (raw_call, group_call):
    per_call(call, 200)
raws, groups = [], []
for _ in range(5):
    raws.append(per_call(raw_call, 1000))
    groups.append(per_call(group_call, 1000))
print(json.dumps({"raw": statistics.median(raws), "group": statistics.median(groups)}))
meshcomm.shutdown()
"""


def main() -> None:
    """Run the rounds and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a checkout (holds meshcomm/)")
    parser.add_argument("--after", required=True, help="a checkout (holds meshcomm/)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name in ("before", "after"):
            tree = str(Path(getattr(args, name)).resolve())
            env = dict(os.environ, PYTHONPATH=tree)
            done = subprocess.run(
                [sys.executable, "-c", _CHILD], env=env, cwd="/", capture_output=True,
                text=True, timeout=120, check=True,
            )  # fmt: skip
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("world 1, 8 B float32 all_reduce, us per call (median of the rounds)")
    print(f"{'tree':>8} {'raw NCCL':>9} {'group':>8} {'added':>8}")
    for name, rows in runs.items():
        raw = statistics.median(r["raw"] for r in rows)
        group = statistics.median(r["group"] for r in rows)
        added = statistics.median(r["group"] - r["raw"] for r in rows)
        print(f"{name:>8} {raw:9.2f} {group:8.2f} {added:8.2f}")


if __name__ == "__main__":
    main()
