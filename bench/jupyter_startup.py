"""Time to a ready ipyparallel cluster of n engines with a meshcomm mesh, per heartbeat period.

    python bench/jupyter_startup.py --engines 8 --repeats 3 --heartbeats 3000 200

For each repeat, every heartbeat period is measured once, interleaved (the machine is
noisy), and the median is printed: seconds from ``start_cluster`` to a world whose mesh is
built on every engine, then the seconds ``stop()`` takes. 3000 ms is ipyparallel's default
period; meshcomm.jupyter uses ``DEFAULT_HEARTBEAT_MS``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from meshcomm.jupyter import start_cluster


def _mesh_shape(n: int) -> tuple[int, int]:
    dp = 2 if n % 2 == 0 and n > 2 else 1
    return dp, n // dp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heartbeats", type=int, nargs="+", default=[3000, 200])
    args = parser.parse_args()
    os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="meshcomm-bench-ipython-"))
    shape = _mesh_shape(args.engines)
    ready: dict[int, list[float]] = {hb: [] for hb in args.heartbeats}
    stop: dict[int, list[float]] = {hb: [] for hb in args.heartbeats}
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min), {os.cpu_count()} cores")
    for rep in range(args.repeats):
        for hb in args.heartbeats:
            cluster = start_cluster(
                args.engines, mesh_shape=shape, mesh_dim_names=("dp", "tp"), heartbeat_ms=hb
            )
            try:
                assert cluster.apply(_mesh_size) == [args.engines] * args.engines
            finally:
                tic = time.perf_counter()
                cluster.stop()
                stop[hb].append(time.perf_counter() - tic)
            ready[hb].append(cluster.startup_seconds)
            print(f"repeat {rep}: heartbeat {hb:5d} ms: ready in {cluster.startup_seconds:.2f} s")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(f"\n{args.engines} engines, mesh {shape}, medians of {args.repeats}")
    print(f"{'heartbeat ms':>12}  {'ready s':>8}  {'stop s':>7}  {'ready/ours':>10}")
    ours = statistics.median(ready[args.heartbeats[-1]])
    for hb in args.heartbeats:
        med = statistics.median(ready[hb])
        print(f"{hb:12d}  {med:8.2f}  {statistics.median(stop[hb]):7.2f}  {med / ours:10.2f}")


def _mesh_size() -> int:
    from meshcomm.world import get_world

    return get_world().size


if __name__ == "__main__":
    main()
