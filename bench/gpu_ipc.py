"""The cuda_ipc path against host staging, ranks sharing one GPU (issue 36).

N ranks on GPU 0 (meshrun, ``init()`` with no backend named), ``group.all_reduce`` and
``group.all_gather`` of cupy float32 arrays of 8 B, 1 MiB and 64 MiB; each call's time
includes the stream synchronize. Three modes, alternated round by round, in the same run:
``staged`` (``MESHCOMM_CUDA_IPC=0``: through pinned host memory over tcp), ``ipc``
(``MESHCOMM_CUDA_IPC=1``: windows ordered by a stream synchronize before each handshake)
and ``ipc-events`` (``MESHCOMM_CUDA_IPC_EVENTS=1`` too: interprocess events instead).
Medians of the calls, slowest rank; the ratio columns are each ipc mode / staged.

Needs a GPU and cupy (run it through the device tool)::

    python bench/gpu_ipc.py [--world 2] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SIZES = (8, 1 << 20, 64 << 20)
OPS = ("all_reduce", "all_gather")
MODES = {
    "staged": {"MESHCOMM_CUDA_IPC": "0"},
    "ipc": {"MESHCOMM_CUDA_IPC": "1", "MESHCOMM_CUDA_IPC_EVENTS": "0"},
    "ipc-events": {"MESHCOMM_CUDA_IPC": "1", "MESHCOMM_CUDA_IPC_EVENTS": "1"},
}


def _child() -> None:
    import cupy as cp

    import meshcomm

    group = meshcomm.init()
    stream = cp.cuda.get_current_stream()
    rows: dict[str, float] = {}
    for op in OPS:
        for nbytes in SIZES:
            calls = 200 if nbytes <= 1 << 20 else 10
            x = cp.ones(max(1, nbytes // 4), cp.float32)
            run = getattr(group, op)
            run(x)  # the first call: checks, windows opened
            times = []
            for _ in range(calls):
                group.barrier()
                start = time.perf_counter()
                run(x)
                stream.synchronize()
                times.append(time.perf_counter() - start)
            mine = statistics.median(times)
            rows[f"{op} {nbytes}"] = float(group.all_reduce(np.array([mine]), "max")[0])
    if group.rank == 0:
        print("RESULT " + json.dumps({"backend": group.backend, **rows}), flush=True)
    meshcomm.shutdown()


def _run(mode: str, world: int) -> dict[str, object]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    env.pop("MESHCOMM_BACKEND", None)
    env.update(MODES[mode])
    command = [sys.executable, "-m", "meshcomm.run", "--nproc-per-node", str(world),
               "--no-prefix", __file__, "--child"]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    result: dict[str, object] = json.loads(line[len("RESULT ") :])
    return result


def main() -> None:
    """Alternate the modes and print the table (and the JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        _child()
        return
    runs: dict[str, list[dict[str, object]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(_run(mode, args.world))
    for mode, results in runs.items():
        print(f"{mode}: {results[0]['backend']}")
    table = {}
    print(f"world {args.world}, one GPU; us per call (median, slowest rank)")
    print(
        f"{'op':>11} {'bytes':>9} {'staged':>9} {'ipc':>9} {'events':>9} {'ipc/st':>7} {'ev/st':>7}"
    )
    for op in OPS:
        for nbytes in SIZES:
            key = f"{op} {nbytes}"
            us = {
                mode: statistics.median(float(r[key]) for r in results) * 1e6  # type: ignore[arg-type]
                for mode, results in runs.items()
            }
            table[key] = us
            staged, ipc, events = us["staged"], us["ipc"], us["ipc-events"]
            print(
                f"{op:>11} {nbytes:>9} {staged:>9.1f} {ipc:>9.1f} {events:>9.1f} "
                f"{ipc / staged:>7.2f} {events / staged:>7.2f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"world": args.world, "us": table}, indent=1))


if __name__ == "__main__":
    main()
