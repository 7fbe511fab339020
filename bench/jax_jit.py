"""``meshcomm.ops`` inside ``jax.jit`` against the eager op on jax arrays, side by side.

    meshrun --nproc-per-node 2 bench/jax_jit.py [--iters 300] [--rounds 7]

Per op (psum, all_gather, psum_scatter, all_to_all, ppermute on float32 jax arrays, 8 B and
1 MiB per rank): the eager op on a jax array, and a jitted function holding only that op
(one ordered ``io_callback`` that runs the eager op on numpy views). Both results are
waited for (``block_until_ready``). The difference is what jit adds: the program's
dispatch with its effect token, the callback's hops (device buffers to numpy views and
back), less what the eager op spends turning jax arrays into numpy and back. "psum x8"
holds eight psums in one jitted function; its figures are per psum.

Each figure is the median over rounds of the per-call mean of ``--iters`` calls (a tenth
of them at 1 MiB); eager and jit alternate within each round, so load on a shared machine
hits both alike. Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import meshcomm
from meshcomm import ops


def _per_call(fn: Callable[[], Any], iters: int, barrier: Callable[[], Any]) -> float:
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        jax.block_until_ready(fn())
    return (time.perf_counter() - start) / iters * 1e6


def _chain(t: Any) -> Any:
    for _ in range(8):
        t = ops.psum(t, "x")
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    world = meshcomm.init()
    n = world.size
    mesh = meshcomm.init_device_mesh((n,), mesh_dim_names=("x",))
    ring = [(i, (i + 1) % n) for i in range(n)]
    cases: dict[str, Callable[[Any], Any]] = {
        "psum": lambda t: ops.psum(t, "x"),
        "all_gather": lambda t: ops.all_gather(t, "x", tiled=True),
        "psum_scatter": lambda t: ops.psum_scatter(t, "x", tiled=True),
        "all_to_all": lambda t: ops.all_to_all(t, "x", 0, 0, tiled=True),
        "ppermute": lambda t: ops.ppermute(t, "x", ring),
        "psum x8": _chain,
    }
    rows: list[tuple[str, str, float, float]] = []
    with mesh:
        for label, nbytes in (("8 B", 8), ("1 MiB", 1 << 20)):
            x = jnp.ones(max(n, nbytes // 4), jnp.float32)  # splits into n blocks
            iters = args.iters if nbytes == 8 else max(10, args.iters // 10)
            for name, fn in cases.items():
                jitted = jax.jit(fn)
                jax.block_until_ready(jitted(x))  # compile, make the groups
                jax.block_until_ready(fn(x))
                eager_t, jit_t = [], []
                for _ in range(args.rounds):
                    eager_t.append(_per_call(lambda fn=fn, x=x: fn(x), iters, world.barrier))
                    jit_t.append(_per_call(lambda j=jitted, x=x: j(x), iters, world.barrier))
                per = 8 if name == "psum x8" else 1
                rows.append(
                    (name, label, statistics.median(eager_t) / per, statistics.median(jit_t) / per)
                )
    if world.rank == 0:
        print(f"# jax.jit vs eager, world {n}, backend {world.backend}, jax {jax.__version__}; "
              f"us per op, median of {args.rounds} rounds")  # fmt: skip
        print(f"{'op':<14}{'size':>7}{'eager':>10}{'jit':>10}{'jit - eager':>13}")
        for name, label, eager, jit in rows:
            print(f"{name:<14}{label:>7}{eager:>10.1f}{jit:>10.1f}{jit - eager:>+13.1f}")
    jax.effects_barrier()
    meshcomm.shutdown()


if __name__ == "__main__":
    main()
