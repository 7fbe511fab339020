"""Run meshcomm, torch gloo and raw mpi4py side by side and print the ratios.

    python bench/compare.py --worlds 2 4 --ops all_reduce --max-bytes 64M --repeats 3

Each (op, world) is measured for the three in one run, ``--repeats`` times, interleaved, and
the median per size is kept (the machine is noisy). Prints one table per (op, world) with
time at each size, busbw, and the ratios meshcomm/gloo and meshcomm/MPICH; ``--json`` saves
everything, ``--plot`` draws busbw against size (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS = ("meshcomm", "gloo", "mpich")


def _bin(name: str) -> str:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def _command(peer: str, op: str, world: int, lo: str, hi: str) -> list[str]:
    if peer == "meshcomm":
        return [_bin("meshcomm-bench"), "-n", str(world), "--op", op, "-b", lo, "-e", hi, "--json"]
    if peer == "gloo":
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(world), str(HERE / "peers" / "gloo_bench.py"), op, lo, hi,
        ]  # fmt: skip
    return [_bin("mpiexec"), "-n", str(world), sys.executable,
            str(HERE / "peers" / "mpi4py_bench.py"), op, lo, hi]  # fmt: skip


def _run(peer: str, op: str, world: int, lo: str, hi: str) -> list[dict[str, float]]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MESHCOMM_BENCH_CHILD"):
        env.pop(key, None)
    proc = subprocess.run(
        _command(peer, op, world, lo, hi),
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith("["):
            rows: list[dict[str, float]] = json.loads(line)
            return rows
    text = proc.stdout.strip()
    if text.startswith("["):
        return list(json.loads(text))
    sys.stderr.write(
        f"{peer} {op} world {world} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}\n"
    )
    return []


def _median_rows(runs: list[list[dict[str, float]]]) -> dict[int, dict[str, float]]:
    by_size: dict[int, list[dict[str, float]]] = {}
    for rows in runs:
        for row in rows:
            by_size.setdefault(int(row["size"]), []).append(row)
    return {
        size: {
            "time_us": statistics.median(r["time_us"] for r in rows),
            "busbw": statistics.median(r["busbw"] for r in rows),
        }
        for size, rows in sorted(by_size.items())
    }


def _table(op: str, world: int, data: dict[str, dict[int, dict[str, float]]]) -> str:
    sizes = sorted(set().union(*(d.keys() for d in data.values())))
    head = (
        f"{'size':>10} | {'meshcomm us':>11} {'busbw':>7} | {'gloo us':>9} {'busbw':>7} | "
        f"{'mpich us':>9} {'busbw':>7} | {'t/gloo':>7} {'bw/gloo':>7} {'bw/mpich':>8}"
    )
    lines = [f"## {op}, world {world} (float32, medians)", head, "-" * len(head)]
    nan = {"time_us": float("nan"), "busbw": float("nan")}
    for size in sizes:
        m, g, p = (data[peer].get(size, nan) for peer in PEERS)
        lines.append(
            f"{size:>10} | {m['time_us']:>11.1f} {m['busbw']:>7.3f} | {g['time_us']:>9.1f} "
            f"{g['busbw']:>7.3f} | {p['time_us']:>9.1f} {p['busbw']:>7.3f} | "
            f"{m['time_us'] / g['time_us']:>7.3f} {m['busbw'] / g['busbw']:>7.2f} "
            f"{m['busbw'] / p['busbw']:>8.2f}"
        )
    return "\n".join(lines)


def _plot(results: dict[str, dict[str, dict[int, dict[str, float]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(results)
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for peer in PEERS:
            rows = results[key][peer]
            ax.plot(list(rows), [r["busbw"] for r in rows.values()], marker=".", label=peer)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(key)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--ops", nargs="+", default=["all_reduce"])
    parser.add_argument("--min-bytes", default="8")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, dict[str, dict[int, dict[str, float]]]] = {}
    for op in args.ops:
        for world in args.worlds:
            runs: dict[str, list[list[dict[str, float]]]] = {peer: [] for peer in PEERS}
            for _ in range(args.repeats):
                for peer in PEERS:  # interleaved, so drift hits all three alike
                    runs[peer].append(_run(peer, op, world, args.min_bytes, args.max_bytes))
            key = f"{op} w{world}"
            results[key] = {peer: _median_rows(runs[peer]) for peer in PEERS}
            print(_table(op, world, results[key]), flush=True)
            print()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        _plot(results, args.plot)


if __name__ == "__main__":
    main()
