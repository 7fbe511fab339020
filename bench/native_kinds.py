"""The cost of array kinds at the ops boundary: numpy vs torch CPU tensors vs jax CPU arrays.

Run from the repository root::

    .venv/bin/python bench/native_kinds.py [--worlds 1 2] [--rounds 7] [--iters 2000]

Times ``ops.psum`` and ``ops.all_gather`` (not tiled, axis 0) of float32 arrays of 8 B and
1 MiB given as a numpy array, a torch CPU tensor (``torch.from_numpy``) and a jax CPU array
(``jnp.asarray``), and the torch tensor once more with the ops' torch fast path switched
off (``torch-general``: the path every tensor took before it), at world 1 (in this
process) and world 2 (two tcp ranks started by ``meshcomm.testing.run_ranks``; rank 0's
times are printed). Each round times every (op, size, kind) once, ``--iters`` calls at
8 B (a tenth of that, at least 20, at 1 MiB) measured with ``time.perf_counter_ns`` after a
barrier; the kinds of one (op, size) are timed back to back in an order that rotates every
round, so slow spells hit every kind alike.
``us/call`` is the median over rounds; ``added us`` is the median over rounds of the
round's (kind - numpy) difference, ``ratio`` the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

#: "torch-general" is a torch tensor with the ops' torch fast path switched off (as before
#: it existed): the general path of ``_native.unwrap`` and the pytree runner.
KINDS = ("numpy", "torch", "torch-general", "jax")
_FAST_PATH_MODULES = ("meshcomm.ops.reductions", "meshcomm.ops.gathers")
SIZES = (8, 1 << 20)  # bytes of float32


def _inputs(nbytes: int) -> dict[str, Any]:
    import jax.numpy as jnp
    import torch

    x = np.arange(nbytes // 4, dtype=np.float32)
    t = torch.from_numpy(x.copy())
    return {"numpy": x, "torch": t, "torch-general": t, "jax": jnp.asarray(x)}


def _fast_path(on: bool) -> None:
    """Switch the ops' torch fast path (``_native.numpy_of_tensor``) on or off."""
    import importlib

    from meshcomm.ops import _native

    for name in _FAST_PATH_MODULES:
        module = importlib.import_module(name)
        module.numpy_of_tensor = _native.numpy_of_tensor if on else _never  # type: ignore[attr-defined]


def _never(x: Any) -> None:
    return None


def measure(
    mesh: Any, barrier: Callable[[], object], rounds: int, iters: int
) -> dict[tuple[str, int, str], list[float]]:
    """Per (op, bytes, kind): the us/call of every round (every rank runs the same loops)."""
    from meshcomm import ops

    calls: dict[str, Callable[[Any], Any]] = {
        "psum": lambda x: ops.psum(x, "x", mesh=mesh),
        "all_gather": lambda x: ops.all_gather(x, "x", mesh=mesh),
    }
    data = {n: _inputs(n) for n in SIZES}
    times: dict[tuple[str, int, str], list[float]] = {}
    for fn in calls.values():  # warm-up: first calls build groups and direct paths
        for n in SIZES:
            for kind in KINDS:
                _fast_path(kind != "torch-general")
                for _ in range(20):
                    fn(data[n][kind])
    for r in range(rounds):
        for name, fn in calls.items():
            for n in SIZES:
                count = iters if n <= 64 else max(20, iters // 10)
                order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
                for kind in order:
                    x = data[n][kind]
                    _fast_path(kind != "torch-general")
                    barrier()
                    start = time.perf_counter_ns()
                    for _ in range(count):
                        fn(x)
                    took = time.perf_counter_ns() - start
                    times.setdefault((name, n, kind), []).append(took / count / 1e3)
    _fast_path(True)
    return times


def table(world: int, times: dict[tuple[str, int, str], list[float]]) -> str:
    """An nccl-tests-like table: op, size, kind, us/call, added us vs numpy, ratio."""
    lines = [
        f"# world {world}, float32, median of {len(next(iter(times.values())))} rounds",
        f"# {'op':<12}{'size':>9}  {'kind':<14}{'us/call':>10}{'added us':>10}{'ratio':>8}",
    ]
    for (name, n, kind), per_round in times.items():
        base = times[(name, n, "numpy")]
        med = statistics.median(per_round)
        if kind == "numpy":
            added, ratio = "", ""
        else:
            added = f"{statistics.median(a - b for a, b in zip(per_round, base, strict=True)):+.2f}"
            ratio = f"{statistics.median(a / b for a, b in zip(per_round, base, strict=True)):.2f}x"
        size = f"{n} B" if n < 1024 else f"{n >> 20} MiB"
        lines.append(f"  {name:<12}{size:>9}  {kind:<14}{med:>10.2f}{added:>10}{ratio:>8}")
    return "\n".join(lines)


def _world_one(rounds: int, iters: int) -> dict[tuple[str, int, str], list[float]]:
    from meshcomm import world
    from meshcomm.mesh import init_device_mesh

    world.shutdown()
    mesh = init_device_mesh((1,), ("x",))
    try:
        return measure(mesh, lambda: None, rounds, iters)
    finally:
        world.shutdown()


def _rank(group: Any, rounds: int, iters: int) -> dict[tuple[str, int, str], list[float]]:
    from meshcomm.mesh import init_device_mesh

    mesh = init_device_mesh((group.size,), ("x",))
    return measure(mesh, group.barrier, rounds, iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    print(f"# load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for w in args.worlds:
        if w == 1:
            times = _world_one(args.rounds, args.iters)
        else:
            from meshcomm.testing import run_ranks

            times = run_ranks(_rank, w, timeout=600, args=(args.rounds, args.iters))[0]
        print(table(w, times), flush=True)
    print(f"# load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
