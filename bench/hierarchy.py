"""Host-aware psum across simulated hosts with shaped links: flat vs hierarchical, side by side.

For ``docs/benchmarks.md`` (issue 20, item 2). Hosts are network namespaces
(``tests/hosts.py``, root only), each host's link limited with tc tbf (1 Gbit/s by default);
a host's ranks share one set of namespaces, so they use shared memory among themselves.
For each layout (hosts x ranks per host) and each mode, one job runs float32 psums over the
whole world at each size and reports, per psum:

* **link bytes**: what host 0's link sent plus received (its veth counters), over the psum
  size: 3.0x flat and 2.0x hierarchical on 2 hosts x 2 ranks (3.5x and 3.0x on 4 x 2:
  any all-reduce over k hosts sends at least 2 (k-1)/k of the buffer out of each host);
* **most sent**: the most any host's link sent, over the psum size;
* **time**: the slowest rank's, median of the repeats;
* **CPU**: the processes' CPU time during the psum, summed over the ranks (the kernel's
  work for the veths, bridge and tbf is not in it);
* **wire time**: that most sent, at the shaped rate (bytes * 8 / rate),
  and time / wire time (target <= 1.15).

Modes: ``hier`` (the default: MESHCOMM_HIER_MIN unset) and ``flat`` (``MESHCOMM_HIER_MIN=0``:
the same algorithms as on one host); with ``--piece-kib 128,512``, ``hier/128`` and
``hier/512`` instead of ``hier`` (the pipeline's piece size set in each rank, to tune
``PIECE_BYTES``). The jobs of a layout run back to back, in alternating order across
``--passes``.

Usage (as root)::

    python bench/hierarchy.py                           # 2x2 and 4x2, 8 and 64 MiB
    python bench/hierarchy.py --layouts 2x2 --sizes 8 --repeat 5 --json out.json
    python bench/hierarchy.py --piece-kib 128,512,1024 --passes 2   # tune PIECE_BYTES
    python bench/hierarchy.py --sizes 0.0625,0.25,1 --hier-min 1     # tune MESHCOMM_HIER_MIN
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PORT = 29533
SECRET = "bench-hierarchy-" + "3" * 32
RATES = {"gbit": 1e9, "mbit": 1e6}


def _link(way: str) -> int:
    with open(f"/sys/class/net/eth0/statistics/{way}_bytes") as fh:
        return int(fh.read())


def _rank(sizes_mib: list[float], repeat: int, piece_kib: int) -> None:
    """One rank of a job: psums at each size; local rank 0 of each host reads its link."""
    import meshcomm
    from meshcomm.backends.algorithms import hierarchical

    if piece_kib:  # a tuning run: the pipeline's piece size (read at every call)
        hierarchical.PIECE_BYTES = piece_kib << 10
    world = meshcomm.init()
    reader = os.environ["LOCAL_RANK"] == "0"
    rows = []
    for mib in sizes_mib:
        x = np.ones(_bytes(mib) // 4, np.float32)
        world.all_reduce(x)  # connections, rings, the layout agreement
        times, sent, moved, cpu = [], [], [], []
        out = None
        for _ in range(repeat):
            # The last result goes back to the group's pool before the next call, as in a
            # steady loop: otherwise the second call pays the page faults of a new result.
            del out
            world.barrier()
            tx, rx = (_link("tx"), _link("rx")) if reader else (0, 0)
            world.barrier()
            start, used = time.perf_counter(), time.process_time()
            out = world.all_reduce(x)
            took, used = time.perf_counter() - start, time.process_time() - used
            world.barrier()
            dtx, drx = (_link("tx") - tx, _link("rx") - rx) if reader else (0, 0)
            stats = np.array([took, dtx, dtx + drx if world.rank == 0 else 0], np.float64)
            stats = world.all_reduce(stats, "max")
            times.append(float(stats[0]))
            sent.append(float(stats[1]))
            moved.append(float(stats[2]))
            cpu.append(float(world.all_reduce(np.array([used]), "sum")[0]))
        if not np.all(out == world.size):
            raise SystemExit(f"rank {world.rank}: wrong psum at {mib} MiB")
        rows.append(
            {"mib": mib, "times": times, "max_sent": sent, "host0_bytes": moved, "cpu": cpu}
        )
    if world.rank == 0:
        os.write(1, ("RESULT " + json.dumps(rows) + "\n").encode())
    meshcomm.shutdown()


def _job(n_hosts: int, per_host: int, mode: str, args: argparse.Namespace) -> list[dict]:
    sys.path.insert(0, str(REPO / "tests"))
    from hosts import Hosts

    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        MESHCOMM_SECRET=SECRET,
        MESHCOMM_TIMEOUT="120",
        WORLD_SIZE=str(n_hosts * per_host),
        MASTER_PORT=str(PORT),
    )
    env.pop("MESHCOMM_HIER_MIN", None)
    if args.hier_min is not None:
        env["MESHCOMM_HIER_MIN"] = str(args.hier_min)
    if mode == "flat":
        env["MESHCOMM_HIER_MIN"] = "0"
    piece = mode.partition("/")[2] or "0"
    script = str(Path(__file__).resolve())
    argv = [sys.executable, script, "_rank", args.sizes, str(args.repeat), piece]
    with Hosts(n_hosts) as hosts:
        hosts.shape(args.rate)
        env["MASTER_ADDR"] = hosts.addresses[0]
        procs = []
        for h in range(n_hosts):
            envs = [
                {"RANK": str(h * per_host + i), "LOCAL_RANK": str(i),
                 "LOCAL_WORLD_SIZE": str(per_host)}
                for i in range(per_host)
            ]  # fmt: skip
            procs.append(hosts.run_all(h, argv, envs, env))
        outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise SystemExit(f"{mode} {n_hosts}x{per_host} failed:\n{out[-2000:]}\n{err[-3000:]}")
    for line in outs[0][0].splitlines():
        if line.startswith("RESULT "):
            rows: list[dict] = json.loads(line[len("RESULT ") :])
            return rows
    raise SystemExit(f"{mode} {n_hosts}x{per_host}: no result\n{outs[0][0][-2000:]}")


def _bytes(mib: float) -> int:
    return int(mib * (1 << 20)) // 4 * 4  # whole float32 elements


def _rate(text: str) -> float:
    for unit, scale in RATES.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * scale
    raise SystemExit(f"--rate must end with one of {list(RATES)}, got {text!r}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        _rank([float(s) for s in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="2x2,4x2", help="hosts x ranks per host, ...")
    parser.add_argument("--sizes", default="8,64", help="psum sizes in MiB (0.25: 256 KiB), ...")
    parser.add_argument("--repeat", type=int, default=5, help="timed psums per size and job")
    parser.add_argument("--passes", type=int, default=1, help="jobs per mode and layout")
    parser.add_argument("--rate", default="1gbit", help="tc tbf rate of every host's link")
    parser.add_argument(
        "--piece-kib",
        default="",
        help="tuning: one hierarchical mode per pipeline piece size (KiB, comma separated) "
        "instead of the library's PIECE_BYTES",
    )
    parser.add_argument(
        "--hier-min",
        type=int,
        help="MESHCOMM_HIER_MIN of the hierarchical jobs (bytes; default: the library's), "
        "to time the hierarchy below its threshold",
    )
    parser.add_argument("--json", help="write the raw figures here")
    args = parser.parse_args()
    bits = _rate(args.rate)
    pieces = [f"hier/{int(kib)}" for kib in args.piece_kib.split(",") if kib]
    modes = ["flat", *(pieces or ["hier"])]
    results: dict[str, Any] = {"rate": args.rate, "layouts": {}, "load": {}}
    for layout in args.layouts.split(","):
        n_hosts, per_host = (int(v) for v in layout.split("x"))
        runs: dict[str, list[list[dict]]] = {mode: [] for mode in modes}
        # The machine's cores are all the hosts' cores: say how busy it was (the 1-minute
        # load average before and after; the job's own ranks count in the second).
        load = [os.getloadavg()[0]]
        for k in range(args.passes):
            for mode in modes[::-1] if k % 2 == 0 else modes:
                runs[mode].append(_job(n_hosts, per_host, mode, args))
        load.append(os.getloadavg()[0])
        results["layouts"][layout] = runs
        results["load"][layout] = load
        print(f"\n{layout} ({n_hosts} hosts x {per_host} ranks), links at {args.rate}, "
              f"medians of {args.repeat * args.passes}, load average {load[0]:.1f} before, "
              f"{load[1]:.1f} after, {os.cpu_count()} cores")  # fmt: skip
        print("| MiB | mode | host 0 link bytes / psum | most a host sent / psum | time (ms) "
              "| wire (ms) | time / wire | CPU (ms, all ranks) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for i, mib in enumerate(float(s) for s in args.sizes.split(",")):
            size = _bytes(mib)
            for mode in modes:
                rows = [run[i] for run in runs[mode]]
                took = statistics.median(t for r in rows for t in r["times"])
                used = statistics.median(t for r in rows for t in r["cpu"])
                moved = statistics.median(b for r in rows for b in r["host0_bytes"])
                sent = statistics.median(b for r in rows for b in r["max_sent"])
                wire = sent * 8 / bits
                print(f"| {mib:g} | {mode} | {moved / size:.2f}x | {sent / size:.2f}x | "
                      f"{took * 1e3:.1f} | {wire * 1e3:.1f} | {took / wire:.2f} | "
                      f"{used * 1e3:.0f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
