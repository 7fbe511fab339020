"""Page faults per call of a large functional collective (issue 3: "results must not cost a
fresh page-faulted buffer per call on the hot path").

Run under a launcher::

    .venv/bin/meshrun --nproc-per-node 2 bench/page_faults.py [--mib 16] [--iters 50]

Rank 0 prints, for each case, the minor page faults (``ru_minflt``) per call in steady
state (after ``--warmup`` calls): the mean, and the median of the calls (a one-off fault
burst elsewhere in the process, such as a transport buffer growing, moves the mean only),
next to the number of 4 KiB pages the buffer spans:

* ``numpy``: ``y = x + 1`` (a fresh numpy array per call, for reference);
* ``all_reduce``: ``y = group.all_reduce(x)``, the usual loop (each result dropped when the
  next one is bound);
* ``all_reduce (kept)``: every result kept alive (nothing can be recycled);
* ``all_reduce_into``: ``out[...] = group.all_reduce(out)``, the torch-style in-place face;
* ``psum``: ``y = ops.psum(x, "x")``.

Without recycling, what a dropped result costs depends on glibc: after the first free of a
large block, malloc raises its mmap threshold (up to 32 MiB) and serves later blocks of that
size from the heap, often without faults; bigger blocks are always a fresh ``mmap`` whose
every page faults (once per 2 MiB where numpy gets transparent huge pages). Try
``--mib 64`` to see that case.
"""

from __future__ import annotations

import argparse
import resource
import statistics
from collections.abc import Callable

import numpy as np

from meshcomm import ops, world
from meshcomm.mesh import init_device_mesh


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _per_call(
    fn: Callable[[], object], iters: int, warmup: int, barrier: Callable[[], object]
) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    barrier()
    counts = []
    for _ in range(iters):
        before = _faults()
        fn()
        counts.append(_faults() - before)
    return statistics.mean(counts), statistics.median(counts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()

    group = world.init()
    mesh = init_device_mesh((group.size,), ("x",))
    x = np.ones(args.mib * (1 << 20) // 4, np.float32)
    state: dict[str, object] = {}
    kept: list[object] = []
    out = np.zeros_like(x)

    def numpy_case() -> None:
        state["y"] = x + 1

    def all_reduce_case() -> None:
        state["y"] = group.all_reduce(x)

    def kept_case() -> None:
        kept.append(group.all_reduce(x))

    def into_case() -> None:
        out[...] = group.all_reduce(out)

    def psum_case() -> None:
        state["y"] = ops.psum(x, "x", mesh=mesh)

    cases: list[tuple[str, Callable[[], None], int]] = [
        ("numpy y = x + 1", numpy_case, args.iters),
        ("all_reduce", all_reduce_case, args.iters),
        ("all_reduce (kept)", kept_case, min(args.iters, 10)),
        ("all_reduce_into", into_case, args.iters),
        ("psum", psum_case, args.iters),
    ]
    results = []
    for name, fn, iters in cases:
        results.append((name, _per_call(fn, iters, args.warmup, group.barrier)))
        state.clear()
        kept.clear()
    if group.rank == 0:
        pages = x.nbytes // 4096
        print(f"world {group.size}, {args.mib} MiB float32 ({pages} pages of 4 KiB)")
        print(f"  {'case':<20} {'minor faults / call: mean':>26} {'median':>8}")
        for name, (mean, median) in results:
            print(f"  {name:<20} {mean:>26.1f} {median:>8.1f}")
    world.shutdown()


if __name__ == "__main__":
    main()
