"""A tour of meshcomm: a (2, 4) mesh, every functional collective, and a bandwidth table.

Run it with::

    meshrun --nproc-per-node 8 examples/tour.py

Eight ranks on this machine (tcp backend) build a 2 x 4 mesh with axes "dp" and "tp",
draw it, run each collective of ``meshcomm.ops`` along "dp", along "tp" and along both,
check every result against numpy on every rank, take one tensor-parallel gradient step
(torch autograd when torch is installed, checked against the transposes by hand), and
finish with a short psum bandwidth table per axis. Any world size works (the mesh is
``(2, -1)``, or ``(1, -1)`` for an odd world); ``python examples/tour.py`` is a world of one.
Exits non-zero if a check failed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from meshcomm import ops, world
from meshcomm.mesh import DeviceMesh, init_device_mesh

AXES: tuple[Any, ...] = ("dp", "tp", ("dp", "tp"))


def data(rank: int, shape: tuple[int, ...] = (4,)) -> np.ndarray:
    """Rank ``r``'s input: small integers, so float sums are exact."""
    return (np.arange(int(np.prod(shape))).reshape(shape) % 5 + rank).astype(np.float32)


def members(mesh: DeviceMesh, axis: Any) -> list[int]:
    """The ranks of this rank's group along ``axis``, in axis-index order."""
    names = axis if isinstance(axis, tuple) else (axis,)
    return mesh[names].mesh.reshape(-1).tolist()


def checks(mesh: DeviceMesh, axis: Any) -> list[tuple[str, Callable[[], Any], Any]]:
    """(name, call, expected) for every op along ``axis``; expected computed with numpy."""
    ranks = members(mesh, axis)
    n, me = len(ranks), ops.axis_index(axis, mesh=mesh)
    rank = mesh.get_rank()
    x = data(rank)
    xs = [data(r) for r in ranks]
    blocks = [data(r, (n, 2)) for r in ranks]
    ring = [(i, (i + 1) % n) for i in range(n)]
    return [
        ("psum", lambda: ops.psum(x, axis), np.sum(xs, axis=0)),
        ("pmean", lambda: ops.pmean(x, axis), np.mean(xs, axis=0, dtype=np.float32)),
        ("pmax", lambda: ops.pmax(x, axis), np.max(xs, axis=0)),
        ("pmin", lambda: ops.pmin(x, axis), np.min(xs, axis=0)),
        ("all_gather", lambda: ops.all_gather(x, axis), np.stack(xs)),
        ("all_gather tiled", lambda: ops.all_gather(x, axis, tiled=True), np.concatenate(xs)),
        ("psum_scatter", lambda: ops.psum_scatter(data(rank, (n, 2)), axis), sum(blocks)[me]),
        ("all_to_all", lambda: ops.all_to_all(data(rank, (n, 2)), axis, 0, 0),
         np.stack([b[me] for b in blocks])),
        ("ppermute ring", lambda: ops.ppermute(x, axis, ring), xs[(me - 1) % n]),
        ("pbroadcast", lambda: ops.pbroadcast(x, axis, source=n - 1), xs[-1]),
        ("pytree psum", lambda: ops.psum({"w": x, "step": np.int32(1)}, axis)["step"],
         np.int32(n)),
        ("axis_size", lambda: ops.axis_size(axis), n),
    ]  # fmt: skip


def run_checks(mesh: DeviceMesh) -> int:
    """Run every op along every axis; rank 0 prints one line each. Returns failures here."""
    lead = mesh.get_rank() == 0
    failures = 0
    for axis in AXES:
        label = "+".join(axis) if isinstance(axis, tuple) else axis
        for name, call, want in checks(mesh, axis):
            got = call()
            ok = np.array_equal(np.asarray(got), np.asarray(want))
            failures += not ok
            # Every rank checked its own result; count the failures across the mesh.
            bad = int(ops.psum(np.int64(not ok), ("dp", "tp")))
            if lead:
                shown = np.array2string(np.asarray(got).reshape(-1)[:6], precision=1)
                status = "ok" if bad == 0 else f"FAILED on {bad} ranks"
                print(f"  {name:<17} along {label:<6} {status:<4}  rank 0 got {shown}")
    return failures


def gradient_step(mesh: DeviceMesh) -> int:
    """One tensor-parallel gradient step, Megatron style: torch autograd through the ops
    (when torch is installed), checked against the same gradients written by hand with the
    transposed collectives (docs/autograd.md). Returns failures on this rank."""
    lead = mesh.get_rank() == 0
    dp, tp = mesh.get_coordinate()
    rng = np.random.default_rng([dp, tp])
    x = np.random.default_rng(dp).standard_normal((4, 3))  # the same on every tp rank
    w1, w2 = rng.standard_normal((3, 2)), rng.standard_normal((2, 3))  # this rank's shards

    # By hand: forward, then each collective's transpose in reverse order.
    h = np.tanh(ops.pcast(x, "tp", to="varying") @ w1)
    y = ops.psum(h @ w2, "tp")  # row-parallel output, the same on every tp rank
    loss = float(ops.pmean(np.mean(y**2), "dp"))
    dy = 2 * y / y.size / mesh.size("dp")  # d loss / d y: psum's backward is the identity
    dpre = (dy @ w2.T) * (1 - h**2)
    by_hand = {"w1": x.T @ dpre, "w2": h.T @ dy, "x": ops.psum(dpre @ w1.T, "tp")}  # pcast^T
    by_hand["w1"], by_hand["w2"] = ops.psum([by_hand["w1"], by_hand["w2"]], "dp")

    try:
        import torch
    except ImportError:
        if lead:
            print(f"\n  gradient step (numpy, transposes by hand): loss {loss:.6f}")
            print("  (pip install torch for the same step through torch autograd)")
        return 0
    tx, t1, t2 = (torch.tensor(a, requires_grad=True) for a in (x, w1, w2))
    ty = ops.psum(torch.tanh(ops.pcast(tx, "tp", to="varying") @ t1) @ t2, "tp")
    tloss = ops.pmean((ty**2).mean(), "dp")
    tloss.backward()
    grads = dict(zip(("w1", "w2"), ops.psum([t1.grad, t2.grad], "dp"), strict=True))
    grads["x"] = tx.grad
    ok = abs(float(tloss) - loss) < 1e-12
    ok = ok and all(np.allclose(grads[k].numpy(), by_hand[k]) for k in by_hand)
    if lead:
        verdict = "ok" if ok else "FAILED"
        print(f"\n  gradient step: loss {float(tloss):.6f}; torch autograd through pcast, psum")
        print(f"  and pmean equals the transposes by hand: {verdict}")
    return 0 if ok else 1


def overlap_step(mesh: DeviceMesh) -> int:
    """The N-D training pattern: the data-parallel gradient mean in flight (async) while a
    tensor-parallel psum runs; each axis has its own engine, so neither waits for the other.
    Returns failures on this rank."""
    dp, tp = mesh.get_coordinate()
    grads = np.full(1 << 18, float(dp + 1))  # 2 MiB of "gradients"
    pending = ops.pmean(grads, "dp", async_op=True)  # in flight on the 'dp' groups
    h = ops.psum(np.float64(tp), "tp")  # runs now, on the 'tp' groups
    mean = pending.wait(timeout=60)
    # A DDP-style bucket reduced where it lies (out=): no copy of it, even async.
    bucket = np.full(1 << 18, float(dp + 1))
    work = mesh.get_group("dp").all_reduce(bucket, "avg", out=bucket, async_op=True)
    h2 = ops.psum(np.float64(tp), "tp")
    n_dp, n_tp = mesh.size("dp"), mesh.size("tp")
    ok = bool(mean[0] == mean[-1] == (n_dp + 1) / 2) and float(h) == n_tp * (n_tp - 1) / 2
    ok = ok and work.wait(timeout=60) is bucket and bool(bucket[-1] == (n_dp + 1) / 2)
    ok = ok and float(h2) == float(h)
    if mesh.get_rank() == 0:
        verdict = "ok" if ok else "FAILED"
        print(f"  a psum over 'tp' while the 'dp' gradient pmean was in flight: {verdict}")
        print(f"  the same with the gradient bucket reduced in place (out=): {verdict}")
    return 0 if ok else 1


def bandwidth_table(mesh: DeviceMesh) -> None:
    """Time psum along each axis for a few sizes; rank 0 prints nccl-tests-like rows."""
    lead = mesh.get_rank() == 0
    if lead:
        print(f"\n  {'size':>9} {'axis':>6} {'ranks':>5} {'time(us)':>9} {'algbw':>7} {'busbw':>7}")
    for size in (8, 1 << 10, 64 << 10, 1 << 20):
        x = np.ones(size // 4, np.float32)
        iters = 50 if size <= 64 << 10 else 10
        for axis in AXES:
            n = ops.axis_size(axis)
            for _ in range(3):
                ops.psum(x, axis)
            world.get_world().barrier()
            start = time.perf_counter()
            for _ in range(iters):
                ops.psum(x, axis)
            mine = (time.perf_counter() - start) / iters
            slowest = float(ops.pmax(np.float64(mine), ("dp", "tp")))
            algbw = size / slowest / 1e9
            busbw = algbw * (2 * (n - 1) / n if n > 1 else 1.0)
            if lead:
                label = "+".join(axis) if isinstance(axis, tuple) else axis
                # Below 64 KiB a psum is all latency: its bandwidth rounds to 0.000.
                bw = f"{algbw:>7.3f} {busbw:>7.3f}" if size >= 64 << 10 else f"{'-':>7} {'-':>7}"
                print(f"  {size:>9} {label:>6} {n:>5} {slowest * 1e6:>9.1f} {bw}")
    if lead:
        print(
            "  (time: slowest rank's mean; algbw, busbw in GB/s with nccl-tests' factors, "
            "from 64 KiB)"
        )


def main() -> int:
    group = world.init()
    try:
        dp = 2 if group.size % 2 == 0 else 1
        mesh = init_device_mesh((dp, -1), ("dp", "tp"))
        lead = group.rank == 0
        with mesh:
            coords = ops.all_gather(np.array(mesh.get_coordinate()), ("dp", "tp"))
            if lead:
                print(f"meshcomm tour: {group.size} ranks, backend {group.backend}\n")
                mesh.visualize()
                pairs = ", ".join(f"{r}->{tuple(c)}" for r, c in enumerate(coords.tolist()))
                print(f"\n  coordinates (rank -> (dp, tp)): {pairs}\n")
                print("  each collective, checked on every rank against numpy:")
            failures = run_checks(mesh)
            failures += gradient_step(mesh)
            failures += overlap_step(mesh)
            total = int(ops.psum(np.int64(failures), ("dp", "tp")))
            bandwidth_table(mesh)
            if lead:
                print("\nall checks passed" if total == 0 else f"\n{total} checks FAILED")
        return 0 if total == 0 else 1
    finally:
        world.shutdown()


if __name__ == "__main__":
    sys.exit(main())
