"""Shared sweep logic for the peer benchmarks (torch gloo, raw mpi4py).

Each peer script supplies ``run(x) -> result`` for one collective and ``sync_max(t) -> t``;
this module times it exactly as ``meshcomm-bench`` does (warm-up, barrier, mean of the timed
iterations, slowest rank) and prints JSON rows shaped like ``meshcomm.bench.BenchRow``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import numpy as np

from meshcomm.bench import bus_factor

__all__ = ["iters_for", "sizes", "sweep"]


def sizes(min_bytes: int, max_bytes: int, itemsize: int = 4) -> list[int]:
    """Powers of two from ``min_bytes`` to ``max_bytes``."""
    out, size = [], max(min_bytes, itemsize)
    while size <= max_bytes:
        out.append(size)
        size *= 2
    return out


def iters_for(size: int) -> int:
    """Timed iterations per size, as ``meshcomm-bench`` picks them (``BENCH_ITERS``: that many
    at every size, as ``meshcomm-bench --iters``)."""
    fixed = os.environ.get("BENCH_ITERS")
    if fixed:
        return int(fixed)
    if size <= 64 << 10:
        return 200
    if size <= 1 << 20:
        return 50
    return 10 if size <= 16 << 20 else 5


def sweep(
    op: str,
    world: int,
    rank: int,
    byte_sizes: list[int],
    make_input: Callable[[int], object],
    run: Callable[[object], object],
    barrier: Callable[[], None],
    sync_max: Callable[[float], float],
    warmup: int = 3,
) -> list[dict[str, object]]:
    """Time ``run`` at each size; return rows (every rank gets them, rank 0 prints)."""
    rows = []
    for size in byte_sizes:
        x = make_input(size // 4)
        for _ in range(warmup):
            run(x)
        barrier()
        iters = iters_for(size)
        start = time.perf_counter()
        for _ in range(iters):
            run(x)
        slowest = sync_max((time.perf_counter() - start) / iters)
        algbw = size / slowest / 1e9
        rows.append(
            {
                "op": op,
                "world": world,
                "size": size,
                "time_us": slowest * 1e6,
                "algbw": algbw,
                "busbw": algbw * bus_factor(op, world),
            }
        )
    if rank == 0:
        print(json.dumps(rows))
    return rows


def float32_input(count: int) -> np.ndarray:
    """A float32 vector of small integers (exact sums)."""
    return (np.arange(max(count, 1)) % 7 + 1).astype(np.float32)
