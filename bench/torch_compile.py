"""``meshcomm.ops`` compiled with ``torch.compile`` against eager, side by side in one run.

    meshrun --nproc-per-node 2 bench/torch_compile.py [--iters 200] [--rounds 7]

1. Per op (psum, all_gather, psum_scatter on float32 torch tensors, 8 B and 1 MiB): the
   eager op, and a function holding only that op compiled with Inductor
   (``fullgraph=True``). The difference is what compiling adds: the compiled function's
   call (guards, AOTAutograd's wrapper), the torch operator's dispatch and the group-name
   lookup. "psum x8" runs eight psums in one function: its difference / 8 is the cost
   per op once the call's fixed cost is shared.
2. A step that has independent compute (``tanh(a @ a)``, 256 x 256) and a 1 MiB psum:
   eager; compiled with the psum synchronous; compiled with ``async_op=True`` and the
   ``wait()`` after the compute (the start/wait split lets the collective run while the
   matmul does).

Each figure is the median over rounds of the per-call mean of ``--iters`` calls; eager
and compiled alternate within each round, so load on a shared machine hits both alike.
Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import meshcomm
from meshcomm import ops


def _per_call(fn: Callable[[], Any], iters: int, barrier: Callable[[], Any]) -> float:
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def _chain(t: Any) -> Any:
    """Eight psums in a row: the compiled call's fixed cost spread over eight ops."""
    for _ in range(8):
        t = ops.psum(t, "tp")
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    world = meshcomm.init()
    n = world.size
    mesh = meshcomm.init_device_mesh((n,), mesh_dim_names=("tp",))
    rows: list[tuple[str, str, float, float]] = []
    with mesh:
        for size in (8, 1 << 20):
            count = size // 4
            x = torch.ones(count * n if count >= n else n, dtype=torch.float32)[: max(count, 1)]
            xs = torch.ones(max(count, n) - max(count, n) % n, dtype=torch.float32)
            for name, op, arg in (
                ("psum", lambda t: ops.psum(t, "tp"), x),
                ("all_gather", lambda t: ops.all_gather(t, "tp", tiled=True), x),
                ("psum_scatter", lambda t: ops.psum_scatter(t, "tp", tiled=True), xs),
                ("psum x8", _chain, x),
            ):
                compiled = torch.compile(op, fullgraph=True)
                for _ in range(20):
                    op(arg)
                    compiled(arg)
                eager, comp = [], []
                for _ in range(args.rounds):
                    eager.append(_per_call(functools.partial(op, arg), args.iters, world.barrier))
                    comp.append(
                        _per_call(functools.partial(compiled, arg), args.iters, world.barrier)
                    )
                rows.append((name, f"{size} B", statistics.median(eager), statistics.median(comp)))

        a = torch.randn(256, 256)
        big = torch.ones(1 << 18, dtype=torch.float32)

        def sync_step(x: Any, a: Any) -> Any:
            local = torch.tanh(a @ a)
            return ops.psum(x, "tp") * 2 + local.sum()

        def async_step(x: Any, a: Any) -> Any:
            work = ops.psum(x, "tp", async_op=True)
            local = torch.tanh(a @ a)
            return work.wait() * 2 + local.sum()

        steps = {
            "eager": lambda: sync_step(big, a),
            "compiled, sync": torch.compile(sync_step, fullgraph=True),
            "compiled, start/wait": torch.compile(async_step, fullgraph=True),
        }
        timings: dict[str, list[float]] = {k: [] for k in steps}
        for fn in steps.values():
            for _ in range(10):
                fn() if fn is steps["eager"] else fn(big, a)
        for _ in range(args.rounds):
            for key, fn in steps.items():
                call = fn if key == "eager" else (lambda f=fn: f(big, a))
                timings[key].append(_per_call(call, max(args.iters // 4, 10), world.barrier))
    if world.rank == 0:
        print(f"# torch.compile vs eager, world {n}, backend {world.backend}, torch "
              f"{torch.__version__}; us per call, median of {args.rounds} rounds")  # fmt: skip
        print(f"{'op':<14}{'size':>10}{'eager':>10}{'compiled':>10}{'added':>9}")
        for name, size, e, c in rows:
            print(f"{name:<14}{size:>10}{e:>10.1f}{c:>10.1f}{c - e:>9.1f}")
        print("# step: tanh(a @ a) on 256x256 and psum of 1 MiB")
        for key, values in timings.items():
            print(f"{key:<24}{statistics.median(values):>10.1f}")
    meshcomm.shutdown()


if __name__ == "__main__":
    main()
