"""Mesh axes overlap: an 8-byte psum over 'tp' while a 32 MiB psum over 'dp' is in flight.

The N-D training pattern: the data-parallel gradient all-reduce runs async while the
tensor-parallel collectives of the next layer go on. On a (2, 2) mesh of 4 ranks (one host,
the tcp backend), each repeat times, after a barrier:

- **big alone**: a synchronous 32 MiB float32 all_reduce over 'dp';
- **big async alone**: the same all_reduce issued with ``async_op=True`` and waited for at
  once (what the overlapped big one costs without the small one: its input's copy);
- **out=** rows: the same with the 32 MiB buffer reduced in place
  (``all_reduce(grad, out=grad)``, the DDP pattern: no copy of the input), both alone and
  overlapped;
- **small alone**: a synchronous 8-byte all_reduce over 'tp';
- **overlapped**: the 32 MiB all_reduce over 'dp' issued with ``async_op=True``, then the
  8-byte one over 'tp' (its own time: "small in flight"), then the wait for the big one
  ("total").

Targets (issue: independent progress per group): small in flight <= 0.1x big alone; total
<= 1.1x big alone ("total/big async" says what the overlap itself adds). Medians over
the repeats, slowest rank per repeat.

Usage::

    python bench/overlap.py                               # this checkout
    python bench/overlap.py --compare-with ../main        # and another checkout, same run

``--compare-with`` runs the same measurement with another checkout first on PYTHONPATH,
alternating which goes first, so both sides see the same machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BIG = 32 << 20
NPROC = 4


def _rank(out_path: str, repeats: int) -> None:
    import meshcomm

    mesh = meshcomm.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    world = meshcomm.get_world()
    dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
    big = np.ones(BIG // 4, np.float32)
    small = np.ones(2, np.float32)
    grad = np.ones(BIG // 4, np.float32)  # the in-place rows' buffer (a gradient bucket)
    for _ in range(3):  # connections, rings and result buffers exist before timing
        dp.all_reduce(big)
        tp.all_reduce(small)
    try:
        dp.all_reduce(grad, out=grad)
        in_place = True
    except TypeError:  # a checkout without out=
        in_place = False
    nan = float("nan")
    rows = []
    clock = time.perf_counter
    for _ in range(repeats):
        world.barrier()
        t0 = clock()
        dp.all_reduce(big)
        big_alone = clock() - t0
        world.barrier()
        t0 = clock()
        dp.all_reduce(big, async_op=True).wait(timeout=120)
        big_async_alone = clock() - t0
        world.barrier()
        t0 = clock()
        tp.all_reduce(small)
        small_alone = clock() - t0
        world.barrier()
        t0 = clock()
        work = dp.all_reduce(big, async_op=True)
        t1 = clock()
        tp.all_reduce(small)
        small_in_flight = clock() - t1
        work.wait(timeout=120)
        total = clock() - t0
        ip_alone = ip_small = ip_total = nan
        if in_place:
            grad.fill(1.0)
            world.barrier()
            t0 = clock()
            dp.all_reduce(grad, out=grad)
            ip_alone = clock() - t0
            world.barrier()
            t0 = clock()
            work = dp.all_reduce(grad, async_op=True, out=grad)
            t1 = clock()
            tp.all_reduce(small)
            ip_small = clock() - t1
            work.wait(timeout=120)
            ip_total = clock() - t0
        rows.append(
            (big_alone, small_alone, small_in_flight, total, big_async_alone, ip_alone, ip_small,
             ip_total)
        )  # fmt: skip
    mine = np.array(rows)
    every = world.all_gather(mine)  # (ranks, repeats, 5)
    if world.rank == 0:
        slowest = every.max(axis=0)
        Path(out_path).write_text(json.dumps(slowest.tolist()))
    meshcomm.shutdown()


def _measure(checkout: Path, repeats: int, transport: str) -> np.ndarray:
    with tempfile.TemporaryDirectory(prefix="meshcomm-overlap-") as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(checkout), env.get("PYTHONPATH")]))
        env["MESHCOMM_TRANSPORT"] = transport
        command = [
            sys.executable, "-m", "meshcomm.run", "--nproc-per-node", str(NPROC),
            "--start-method", "spawn", str(Path(__file__).resolve()), "_rank", out, str(repeats),
        ]  # fmt: skip
        subprocess.run(command, env=env, check=True, timeout=600, cwd=str(checkout))
        return np.array(json.loads(Path(out).read_text()))


def _summary(rows: np.ndarray) -> dict[str, float]:
    med = [statistics.median(rows[:, k]) for k in range(rows.shape[1])]
    return {
        "big_alone_ms": med[0] * 1e3,
        "big_async_alone_ms": med[4] * 1e3,
        "small_alone_us": med[1] * 1e6,
        "small_in_flight_ms": med[2] * 1e3,
        "total_ms": med[3] * 1e3,
        "small_in_flight_over_big": statistics.median(rows[:, 2] / rows[:, 0]),
        "total_over_big": statistics.median(rows[:, 3] / rows[:, 0]),
        "total_over_big_async": statistics.median(rows[:, 3] / rows[:, 4]),
        "in_place_big_alone_ms": med[5] * 1e3,
        "in_place_small_in_flight_ms": med[6] * 1e3,
        "in_place_total_ms": med[7] * 1e3,
        "in_place_small_in_flight_over_big": statistics.median(rows[:, 6] / rows[:, 5]),
        "in_place_total_over_big": statistics.median(rows[:, 7] / rows[:, 5]),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "_rank":
        _rank(args[1], int(args[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=15, help="timed repeats per run")
    p.add_argument("--runs", type=int, default=2, help="runs per checkout, alternating")
    p.add_argument("--compare-with", type=Path, default=None, help="another checkout")
    p.add_argument(
        "--transport",
        nargs="+",
        default=["auto", "tcp"],
        choices=["auto", "tcp"],
        help="MESHCOMM_TRANSPORT for the ranks: auto (shared memory on one host), tcp (sockets)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the summaries here")
    ns = p.parse_args(args)
    sides = {"this": REPO}
    if ns.compare_with is not None:
        sides["other"] = ns.compare_with.resolve()
    summaries: dict[str, Any] = {}
    print(f"# (2, 2) mesh, {NPROC} ranks, tcp; 32 MiB psum over 'dp' async, 8 B psum over 'tp'")
    print(
        f"# {'transport':<9} {'checkout':<16} {'big alone':>10} {'small alone':>12} "
        f"{'small in flight':>16} {'total':>9} {'small/big':>10} {'total/big':>10} "
        f"{'big async':>10} {'total/big async':>16}"
    )
    for transport in ns.transport:
        rows: dict[str, list[np.ndarray]] = {name: [] for name in sides}
        for run in range(ns.runs):
            order = list(sides) if run % 2 == 0 else list(sides)[::-1]
            for name in order:
                rows[name].append(_measure(sides[name], ns.repeats, transport))
        for name, path in sides.items():
            s = _summary(np.concatenate(rows[name]))
            summaries[f"{transport} {path}"] = s
            print(
                f"  {transport:<9} {path.name:<16} {s['big_alone_ms']:8.1f}ms "
                f"{s['small_alone_us']:10.0f}us {s['small_in_flight_ms']:14.2f}ms "
                f"{s['total_ms']:7.1f}ms {s['small_in_flight_over_big']:10.3f} "
                f"{s['total_over_big']:10.3f} {s['big_async_alone_ms']:8.1f}ms "
                f"{s['total_over_big_async']:16.3f}"
            )
            print(
                f"  {transport:<9} {path.name + ' out=':<16} {s['in_place_big_alone_ms']:8.1f}ms "
                f"{s['small_alone_us']:10.0f}us {s['in_place_small_in_flight_ms']:14.2f}ms "
                f"{s['in_place_total_ms']:7.1f}ms {s['in_place_small_in_flight_over_big']:10.3f} "
                f"{s['in_place_total_over_big']:10.3f}"
            )
    if ns.json is not None:
        ns.json.write_text(json.dumps(summaries, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
