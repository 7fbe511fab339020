"""meshcomm before and after a change, and MPICH, side by side in one run.

    python bench/before_after.py --before /tmp/base --after /tmp/new --worlds 2 4 \\
        --max-bytes 4M --repeats 3

Each repeat runs ``meshcomm-bench`` (tcp backend) on the ``--before`` tree, then on the
``--after`` tree, then raw mpi4py on MPICH (``peers/mpi4py_bench.py``), one after the other,
so that the machine's drift hits all three alike; the median per size over the repeats is
kept. Each tree is imported through ``PYTHONPATH`` from a neutral working directory (a
module run with ``-m`` puts the working directory ahead of ``PYTHONPATH``). Prints one table
per world: the three times (us), the ratios after/before and after/MPICH (and before/MPICH),
and the spread (min..max) of the after tree's times. ``--json`` keeps every run.

Put both trees at paths of one length (``/tmp/base`` against ``/tmp/head``, say): the path's
length moves where the heap places the arrays, and one placement halved MPICH's large
all_reduces (docs/benchmarks.md, "The 8-byte path on mpi, fourth pass").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = ("before", "after", "mpich")

__all__ = ["main"]


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def _run(
    peer: str, tree: Path | None, world: int, lo: str, hi: str, iters: int = 0
) -> list[dict[str, float]]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if iters:
        env["BENCH_ITERS"] = str(iters)
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MESHCOMM_BENCH_CHILD"):
        env.pop(key, None)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    if peer == "mpich":
        command = [_bin("mpiexec"), "-n", str(world), sys.executable,
                   str(HERE / "peers" / "mpi4py_bench.py"), "all_reduce", lo, hi]  # fmt: skip
    else:
        fixed = ["--iters", str(iters)] if iters else []
        command = [_bin("meshcomm-bench"), "-n", str(world), "--op", "all_reduce",
                   "-b", lo, "-e", hi, "--json", *fixed]  # fmt: skip
    proc = subprocess.run(
        command,
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=tempfile.gettempdir(),
    )
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("["):
            return list(json.loads(line))
    sys.stderr.write(f"{peer} world {world} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}\n")
    return []


def _times(runs: list[list[dict[str, float]]]) -> dict[int, list[float]]:
    by_size: dict[int, list[float]] = {}
    for rows in runs:
        for row in rows:
            by_size.setdefault(int(row["size"]), []).append(float(row["time_us"]))
    return by_size


def _table(world: int, runs: dict[str, list[list[dict[str, float]]]]) -> str:
    times = {peer: _times(runs[peer]) for peer in PEERS}
    head = (
        f"{'size':>9} | {'before us':>9} {'after us':>9} {'mpich us':>9} | {'aft/bef':>7} "
        f"{'aft/mpich':>9} {'bef/mpich':>9} | after's spread"
    )
    lines = [f"## all_reduce, world {world}, tcp (float32, medians)", head, "-" * len(head)]
    for size in sorted(times["after"]):
        b, a, m = (statistics.median(times[p].get(size, [float("nan")])) for p in PEERS)
        spread = times["after"][size]
        lines.append(
            f"{size:>9} | {b:>9.1f} {a:>9.1f} {m:>9.1f} | {a / b:>7.2f} {a / m:>9.2f} "
            f"{b / m:>9.2f} | {min(spread):.1f}..{max(spread):.1f}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", type=Path, required=True, help="the tree before (its root)")
    p.add_argument("--after", type=Path, required=True, help="the tree after (its root)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--min-bytes", default="8")
    p.add_argument("--max-bytes", default="4M")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--iters", type=int, default=0, help="timed iterations at every size (default: by size)"
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve(), "mpich": None}
    every: dict[str, dict[str, list[list[dict[str, float]]]]] = {}
    for world in args.worlds:
        runs: dict[str, list[list[dict[str, float]]]] = {peer: [] for peer in PEERS}
        for _ in range(args.repeats):
            for peer in PEERS:
                tree = trees[peer]
                got = _run(peer, tree, world, args.min_bytes, args.max_bytes, args.iters)
                runs[peer].append(got)
        every[f"w{world}"] = runs
        print(_table(world, runs), flush=True)
        print()
    if args.json:
        args.json.write_text(json.dumps(every, indent=1))


if __name__ == "__main__":
    main()
