"""Host staging of cupy arrays on tcp: pinned buffers against pageable copies, same run.

Two ranks on one GPU (meshrun, the tcp backend), ``group.all_reduce`` of a cupy float32
array; each call's time includes the stream synchronize. Runs alternate
``MESHCOMM_PINNED_STAGING_MAX=0`` (pageable ``cupy.asnumpy`` / ``cupy.asarray``, as before
pinned staging) and the default (pinned buffers), with numpy arrays of the same sizes as
the floor. Medians of the calls, slowest rank; the ratio column is pinned / pageable.

Needs a GPU and cupy (run it through the device tool)::

    python bench/gpu_staging.py [--rounds 2]
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
SIZES = (8, 64 << 10, 1 << 20, 16 << 20, 64 << 20)


def _child() -> None:
    import cupy as cp

    import meshcomm

    group = meshcomm.init(backend="tcp")
    stream = cp.cuda.get_current_stream()
    rows = {}
    for nbytes in SIZES:
        calls = 20 if nbytes <= 1 << 20 else 6
        for kind in ("numpy", "cupy"):
            x = np.ones(nbytes // 4, np.float32)
            x = cp.asarray(x) if kind == "cupy" else x
            group.all_reduce(x)
            times = []
            for _ in range(calls):
                group.barrier()
                start = time.perf_counter()
                group.all_reduce(x)
                stream.synchronize()
                times.append(time.perf_counter() - start)
            mine = statistics.median(times)
            rows[f"{kind} {nbytes}"] = float(group.all_reduce(np.array([mine]), "max")[0])
    if group.rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    meshcomm.shutdown()


def _run(pinned: bool) -> dict[str, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if not pinned:
        env["MESHCOMM_PINNED_STAGING_MAX"] = "0"
    command = [sys.executable, "-m", "meshcomm.run", "--nproc-per-node", "2", "--no-prefix",
               __file__, "--child"]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    result: dict[str, float] = json.loads(line[len("RESULT ") :])
    return result


def main() -> None:
    """Alternate the two modes and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        _child()
        return
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for pinned in (False, True):
            runs[pinned].append(_run(pinned))
    print(f"{'bytes':>10} {'numpy us':>10} {'pageable us':>12} {'pinned us':>10} {'ratio':>7}")
    for nbytes in SIZES:
        numpy_us = statistics.median(
            r[f"numpy {nbytes}"] for rs in runs.values() for r in rs
        ) * 1e6  # fmt: skip
        page = statistics.median(r[f"cupy {nbytes}"] for r in runs[False]) * 1e6
        pin = statistics.median(r[f"cupy {nbytes}"] for r in runs[True]) * 1e6
        print(f"{nbytes:>10} {numpy_us:>10.0f} {page:>12.0f} {pin:>10.0f} {pin / page:>7.2f}")


if __name__ == "__main__":
    main()
