"""Gradients through ``meshcomm.ops``: torch autograd and jax.grad, against JAX's shard_map.

- **The oracle is JAX.** A tensor-parallel block that uses every differentiable op
  (column- and row-parallel matmuls, psum, psum_scatter + all_gather, ppermute, all_to_all,
  pbroadcast, pmean, pcast) is written once, over a namespace of collectives. JAX runs it
  in ``jax.shard_map`` (``check_vma=True``) on N CPU devices in a subprocess and takes
  ``jax.grad``; meshcomm runs it on N ranks (tcp) with torch tensors and with jax arrays
  (eager ``jax.grad``). Loss and every gradient agree to 1e-9 in float64, at world 2, 3 and
  4 on a 1-D "tp" mesh and on a (2, 2) "dp" x "tp" mesh (there the weight gradients are
  psummed over "dp" after backward, as a data-parallel user does; JAX does it implicitly).
- ``torch.autograd.gradcheck`` (and ``gradgradcheck`` for the linear ops) on each op at
  world 2, rank by rank: the rank under test perturbs its input while the other rank feeds
  a constant (``x * 0 + c``) and zeroes its output, so the numerical Jacobian of the rank
  under test is well defined and its analytic one must match it.
- A tensor-parallel MLP trained for 20 steps on a (2, 2) mesh equals the same MLP trained
  in one process on the whole batch.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("jax") is None,
    reason="needs torch and jax (make test installs both)",
)

B, D, H = 12, 3, 2  # batch (divisible by 2, 3 and 4), model width, hidden units per tp rank
CONFIGS: tuple[tuple[int, int], ...] = ((1, 2), (1, 3), (1, 4), (2, 2))  # (dp, tp)


# -- the program, written once ----------------------------------------------------------------
def block(c: Any, x: Any, w1: Any, w2: Any, n: int) -> Any:
    """One tensor-parallel step on this rank's shards; returns the invariant loss.

    ``c`` holds the collectives (jax.lax or meshcomm.ops) and ``tanh``; ``x`` is (B, D),
    invariant over "tp"; ``w1`` (D, H) a column shard, ``w2`` (H, D) a row shard. The
    loss is averaged over "dp" too (an axis of size 1 on a 1-D config).
    """
    ring = [(i, (i + 1) % n) for i in range(n)]
    xv = c.pcast(x, "tp", to="varying")  # replicated activations enter the tp region
    h = c.tanh(xv @ w1)  # column-parallel: (B, H) per rank
    partial = h @ w2  # row-parallel partial sums: (B, D)
    z = c.psum(partial, "tp")  # (B, D), invariant
    s = c.psum_scatter(partial, "tp", scatter_dimension=0, tiled=True)  # (B/n, D)
    g = c.all_gather(c.tanh(s), "tp", axis=0, tiled=True)  # (B, D)
    stacked = c.all_gather(s * s, "tp", axis=1)  # (B/n, n, D), not tiled
    r = c.ppermute(g * h[:, 0:1], "tp", ring)  # (B, D)
    q = c.all_to_all(r, "tp", 0, 1, tiled=True)  # (B/n, n * D)
    b = c.pbroadcast(h, "tp", n - 1)  # (B, H)
    zv = c.pcast(z, "tp", to="varying")
    local = (
        (q * q).sum()
        + (zv * g).sum()
        + (stacked * stacked).sum() * 0.5
        + (b * h).sum()
        + (zv * zv).sum() * 0.25
    )
    loss = c.pmean(local, "tp")
    return c.pmean(loss, "dp")


def jax_collectives() -> Any:
    import jax.numpy as jnp
    from jax import lax

    def pbroadcast(x: Any, axis: str, source: int) -> Any:
        # lax.pbroadcast has no CPU lowering; this is its definition, cast back to varying
        # so its transpose is pbroadcast's (a psum to the source).
        mine = lax.axis_index(axis) == source
        return lax.pcast(lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), axis), axis, to="varying")

    return SimpleNamespace(
        pcast=lax.pcast, psum=lax.psum, pmean=lax.pmean, psum_scatter=lax.psum_scatter,
        all_gather=lax.all_gather, ppermute=lax.ppermute, all_to_all=lax.all_to_all,
        pbroadcast=pbroadcast, tanh=jnp.tanh,
    )  # fmt: skip


def meshcomm_collectives(tanh: Any) -> Any:
    from meshcomm import ops

    return SimpleNamespace(
        pcast=ops.pcast, psum=ops.psum, pmean=ops.pmean, psum_scatter=ops.psum_scatter,
        all_gather=ops.all_gather, ppermute=ops.ppermute, all_to_all=ops.all_to_all,
        pbroadcast=ops.pbroadcast, tanh=tanh,
    )  # fmt: skip


def global_inputs(dp: int, tp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng([dp, tp])
    x = rng.standard_normal((dp * B, D))
    w1 = rng.standard_normal((D, tp * H)) * 0.5
    w2 = rng.standard_normal((tp * H, D)) * 0.5
    return x, w1, w2


def shards(dp: int, tp: int, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, t = divmod(rank, tp)
    x, w1, w2 = global_inputs(dp, tp)
    return x[d * B : (d + 1) * B], w1[:, t * H : (t + 1) * H], w2[t * H : (t + 1) * H]


# -- the JAX side (a subprocess) -----------------------------------------------------------------
def jax_main(out_path: str) -> None:
    """Loss and gradients of every config by jax.grad of shard_map; saved per rank."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    jax.config.update("jax_enable_x64", True)
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    c = jax_collectives()
    results: dict[str, np.ndarray] = {}
    for dp, tp in CONFIGS:
        devices = np.array(jax.devices()[: dp * tp]).reshape(dp, tp)
        mesh = Mesh(devices, ("dp", "tp"))

        def body(x: Any, w1: Any, w2: Any, tp: int = tp) -> Any:
            return block(c, x, w1, w2, tp)

        loss_fn = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("dp", None), P(None, "tp"), P("tp", None)),
            out_specs=P(),
            check_vma=True,
        )
        x, w1, w2 = global_inputs(dp, tp)
        loss, grads = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(x, w1, w2)
        gx, g1, g2 = (np.asarray(g) for g in grads)
        for rank in range(dp * tp):
            d, t = divmod(rank, tp)
            key = f"{dp}x{tp}_r{rank}"
            results[key + "_loss"] = np.asarray(loss)
            results[key + "_x"] = gx[d * B : (d + 1) * B]
            results[key + "_w1"] = g1[:, t * H : (t + 1) * H]
            results[key + "_w2"] = g2[t * H : (t + 1) * H]
    np.savez(out_path, **results)


# -- the meshcomm side ---------------------------------------------------------------------------
def meshcomm_rank(group: Any, dp: int, tp: int, expected_path: str) -> list[str]:
    """Loss and gradients with torch tensors and with jax arrays; mismatches as text."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import torch

    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    mesh = init_device_mesh((dp, tp), ("dp", "tp"))
    rank = group.rank
    x, w1, w2 = shards(dp, tp, rank)
    with np.load(expected_path) as data:
        key = f"{dp}x{tp}_r{rank}"
        want = {k: data[f"{key}_{k}"] for k in ("loss", "x", "w1", "w2")}
    problems: list[str] = []

    def check(label: str, got: dict[str, Any]) -> None:
        for name, raw in got.items():
            value = np.asarray(raw)
            if value.shape != want[name].shape or not np.allclose(
                value, want[name], rtol=0, atol=1e-9
            ):
                err = np.max(np.abs(value - want[name])) if value.shape == want[name].shape else ""
                problems.append(
                    f"{label} {dp}x{tp} rank {rank} {name}: max error {err} "
                    f"(shapes {value.shape} and jax {want[name].shape})"
                )

    with mesh:
        # torch: backward, then the data-parallel gradient psum over "dp" a user writes.
        c = meshcomm_collectives(torch.tanh)
        tx, t1, t2 = (torch.tensor(a, requires_grad=True) for a in (x, w1, w2))
        loss = block(c, tx, t1, t2, tp)
        loss.backward()
        g1, g2 = ops.psum([t1.grad, t2.grad], "dp")
        assert isinstance(g1, torch.Tensor) and isinstance(loss, torch.Tensor)
        check("torch", {"loss": loss.detach(), "x": tx.grad, "w1": g1, "w2": g2})

        # jax arrays, eager jax.grad of the same program.
        c = meshcomm_collectives(jnp.tanh)
        value, grads = jax.value_and_grad(lambda a, b, d: block(c, a, b, d, tp), argnums=(0, 1, 2))(
            jnp.asarray(x), jnp.asarray(w1), jnp.asarray(w2)
        )
        jx, j1, j2 = grads
        j1, j2 = ops.psum([j1, j2], "dp")
        assert isinstance(j1, jax.Array) and isinstance(value, jax.Array)
        check("jax", {"loss": value, "x": jx, "w1": j1, "w2": j2})
    return problems


@pytest.fixture(scope="module")
def jax_expected(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = str(tmp_path_factory.mktemp("autodiff") / "jax.npz")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    proc = subprocess.run(
        [sys.executable, __file__, "--jax", out],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dp", "tp"), CONFIGS, ids=[f"{d}x{t}" for d, t in CONFIGS])
def test_tensor_parallel_block_matches_jax_grad(jax_expected: str, dp: int, tp: int) -> None:
    from meshcomm.testing import run_ranks

    per_rank = run_ranks(meshcomm_rank, dp * tp, args=(dp, tp, jax_expected), timeout=240)
    problems = [p for rank in per_rank for p in rank]
    assert not problems, "\n".join(problems[:10])


# -- in one process ----------------------------------------------------------------------------
def test_backward_runs_outside_with_mesh_on_the_forward_mesh() -> None:
    import torch

    from meshcomm import ops, world
    from meshcomm.mesh import init_device_mesh

    try:
        mesh = init_device_mesh((1, 1), ("dp", "tp"))
        x = torch.arange(6.0, dtype=torch.float64, requires_grad=True)
        with mesh:
            y = ops.all_gather(ops.pcast(x, "tp", to="varying"), ("dp", "tp"), tiled=True)
            z = ops.psum_scatter(y * y, "tp", tiled=True)
        assert z.grad_fn is not None and type(z.grad_fn).__name__ == "PsumScatterBackward"
        z.sum().backward()  # no ambient mesh here: the captured one is used
        assert torch.equal(x.grad, 2 * x.detach())
        w = torch.ones(2, requires_grad=True)
        with torch.no_grad():  # under no_grad nothing is recorded, pprod included
            assert ops.pprod(w, "tp", mesh=mesh).grad_fn is None
    finally:
        world.shutdown()


# -- gradcheck, op by op, at world 2 -------------------------------------------------------------
def _op_cases() -> list[tuple[str, Any, tuple[int, ...], bool]]:
    """(name, fn(x) -> tensor or tuple, input shape, linear) for every differentiable op."""
    from meshcomm import ops

    a = "tp"

    def leaves(tree: Any) -> tuple[Any, ...]:
        return tuple(ops.tree_flatten(tree)[0])

    return [
        ("psum", lambda x: ops.psum(x, a), (3,), True),
        ("pmean", lambda x: ops.pmean(x, a), (3,), True),
        ("pmax", lambda x: ops.pmax(x, a), (4,), False),
        ("pmin", lambda x: ops.pmin(x, a), (4,), False),
        ("all_reduce avg", lambda x: ops.all_reduce(x, a, op="avg"), (3,), True),
        ("all_reduce max", lambda x: ops.all_reduce(x, a, op="max"), (4,), False),
        ("premul_sum", lambda x: ops.all_reduce(x, a, op="premul_sum", factor=0.5), (3,), True),
        ("all_gather", lambda x: ops.all_gather(x, a, axis=1), (2, 3), True),
        ("tiled all_gather", lambda x: ops.all_gather(x, a, axis=-1, tiled=True), (2, 3), True),
        ("psum_scatter", lambda x: ops.psum_scatter(x, a, scatter_dimension=1), (3, 2), True),
        ("tiled psum_scatter", lambda x: ops.psum_scatter(x, a, tiled=True), (4,), True),
        ("all_to_all", lambda x: ops.all_to_all(x, a, 0, 1), (2, 3), True),
        ("tiled all_to_all", lambda x: ops.all_to_all(x, a, 1, 0, tiled=True), (3, 4), True),
        ("ring ppermute", lambda x: ops.ppermute(x, a, [(0, 1), (1, 0)]), (3,), True),
        ("one-pair ppermute", lambda x: ops.ppermute(x, a, [(1, 0)]), (3,), True),
        ("pshuffle", lambda x: ops.pshuffle(x, a, [1, 0]), (2, 2), True),
        ("pbroadcast", lambda x: ops.pbroadcast(x, a, 1), (3,), True),
        ("pcast varying", lambda x: ops.pcast(x, a, to="varying"), (3,), True),
        ("pytree psum", lambda x: leaves(ops.psum({"a": x, "b": [x * 2]}, a)), (3,), True),
        ("pytree all_gather", lambda x: leaves(ops.all_gather([x, x[:1]], a)), (2,), True),
    ]


#: Ops whose backward is the true transpose of the map from every rank's input to every
#: rank's output: checked on that whole map (the checked rank's input against all outputs).
#: The others (psum, pmean, pmax, pcast, ...) have invariant results, whose JAX rule assumes
#: one value on every rank; they are checked on the checked rank's own output.
_TRUE_TRANSPOSE = frozenset(
    ("all_gather", "psum_scatter", "all_to_all", "ppermute", "pshuffle", "pbroadcast")
)


def gradcheck_rank(group: Any) -> list[str]:
    """gradcheck of every op, and gradgradcheck of the true transposes, each rank in turn.

    The rank under test perturbs its input; the other feeds a constant and zeroes what it
    returns, so the analytic Jacobian of the rank under test (a collective backward, run
    on both) must equal its numerical one.
    """
    import torch

    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    me = group.rank
    failures = []
    with init_device_mesh((2,), ("tp",)):
        for checked in (0, 1):
            for name, fn, shape, linear in _op_cases():
                size = int(np.prod(shape))
                # Distinct magnitudes, both signs: no ties for pmax / pmin against the zeros
                # the other rank feeds.
                values = (np.arange(size) + 1.0) * np.where(np.arange(size) % 2, -1, 1)
                x = torch.tensor(values.reshape(shape), requires_grad=True)
                const = torch.zeros(shape, dtype=torch.float64)

                every = name.split()[-1] in _TRUE_TRANSPOSE

                def f(
                    x: Any,
                    fn: Any = fn,
                    checked: int = checked,
                    every: bool = every,
                    const: Any = const,
                ) -> Any:
                    if me != checked:
                        x = x * 0 + const  # the values stay fixed, the graph stays connected
                    out = fn(x)
                    outs = out if isinstance(out, tuple) else (out,)
                    if every:  # every rank's output, so cross-rank terms are checked too
                        outs = tuple(ops.all_gather(o, "tp") for o in outs)
                    return tuple(o if me == checked else o * 0 for o in outs)

                checks = [torch.autograd.gradcheck]
                if linear and every:
                    checks.append(torch.autograd.gradgradcheck)
                for check in checks:
                    try:
                        check(f, (x,), eps=1e-6, atol=1e-8)
                    except Exception as exc:
                        # Raising ends this rank: the other one then fails fast with a
                        # PeerError, and run_ranks reports this rank's error first.
                        where = f"{check.__name__} {name}, rank {checked} checked"
                        raise AssertionError(f"{where}: {exc}") from exc
        # pcast to invariant assumes equal values on every rank, so perturbing one rank's
        # input alone says nothing; its rule (pmean's: ct / n) and the round trip instead.
        x = torch.ones(3, dtype=torch.float64, requires_grad=True)
        ops.pcast(x, "tp", to="invariant").backward(torch.full((3,), 4.0, dtype=torch.float64))
        if x.grad.tolist() != [2.0] * 3:
            failures.append(f"pcast invariant backward: {x.grad.tolist()}, want 4 / 2")
        x.grad = None
        there = ops.pcast(x, "tp", to="varying")
        ops.pcast(there, "tp", to="invariant").backward(torch.full((3,), 4.0, dtype=torch.float64))
        if x.grad.tolist() != [4.0] * 3:
            failures.append(f"pcast round trip backward: {x.grad.tolist()}, want 4")
    return failures


@pytest.mark.timeout(300)
def test_gradcheck_every_op_at_world_2() -> None:
    from meshcomm.testing import run_ranks

    per_rank = run_ranks(gradcheck_rank, 2, timeout=240)
    problems = [p for rank in per_rank for p in rank]
    assert not problems, "\n".join(problems)


def extremes_rank(group: Any) -> list[str]:
    """pmax / pmin gradients with ties, in torch and in eager jax: shared equally."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import torch

    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    mine = [[1.0, 3.0, 2.0], [1.0, 0.0, 5.0]][group.rank]
    weights = np.array([1.0, 2.0, 3.0])
    # position 0 ties (half each), 1 goes to rank 0, 2 to rank 1; pmin the other way round
    want_max = [[0.5, 2.0, 0.0], [0.5, 0.0, 3.0]][group.rank]
    want_min = [[0.5, 0.0, 3.0], [0.5, 2.0, 0.0]][group.rank]
    problems = []
    with init_device_mesh((2,), ("tp",)):
        for name, want in (("pmax", want_max), ("pmin", want_min)):
            op = getattr(ops, name)
            t = torch.tensor(mine, requires_grad=True)
            (op(t, "tp") * torch.from_numpy(weights)).sum().backward()
            got_jax = jax.grad(lambda a, op=op: (op(a, "tp") * weights).sum())(jnp.asarray(mine))
            for label, got in (("torch", t.grad.numpy()), ("jax", np.asarray(got_jax))):
                if not np.allclose(got, want, rtol=0, atol=1e-12):
                    problems.append(f"{name} {label} rank {group.rank}: {got} != {want}")
    return problems


def test_pmax_and_pmin_share_ties_in_torch_and_jax() -> None:
    from meshcomm.testing import run_ranks

    problems = [p for rank in run_ranks(extremes_rank, 2, timeout=120) for p in rank]
    assert not problems, "\n".join(problems)


# -- a tensor-parallel MLP trained for 20 steps on a (2, 2) mesh ---------------------------------
def mlp_rank(group: Any) -> float:
    """Train Megatron-style on (dp, tp) = (2, 2); return the max difference from the same
    MLP trained in this one process on the whole batch."""
    import torch

    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    torch.manual_seed(0)
    width, hidden, batch, lr = 4, 8, 16, 0.1
    big_x = torch.randn(batch, width, dtype=torch.float64)
    big_y = torch.randn(batch, width, dtype=torch.float64)
    full1 = torch.randn(width, hidden, dtype=torch.float64) * 0.5
    full2 = torch.randn(hidden, width, dtype=torch.float64) * 0.5

    mesh = init_device_mesh((2, 2), ("dp", "tp"))
    d, t = mesh.get_coordinate()
    rows, cols = (
        slice(d * batch // 2, (d + 1) * batch // 2),
        slice(t * hidden // 2, (t + 1) * hidden // 2),
    )
    x, y = big_x[rows], big_y[rows]
    w1 = full1[:, cols].clone().requires_grad_()
    w2 = full2[cols, :].clone().requires_grad_()
    with mesh:
        for _ in range(20):
            xv = ops.pcast(x, "tp", to="varying")
            out = ops.psum(torch.nn.functional.gelu(xv @ w1) @ w2, "tp")
            loss = ((out - y) ** 2).mean()
            loss.backward()
            with torch.no_grad():
                g1, g2 = ops.pmean([w1.grad, w2.grad], "dp")  # the data-parallel step
                w1 -= lr * g1
                w2 -= lr * g2
            w1.grad, w2.grad = None, None

    r1, r2 = full1.clone().requires_grad_(), full2.clone().requires_grad_()
    for _ in range(20):
        loss = ((torch.nn.functional.gelu(big_x @ r1) @ r2 - big_y) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            r1 -= lr * r1.grad
            r2 -= lr * r2.grad
        r1.grad, r2.grad = None, None
    moved = float((r1 - full1).abs().max())
    assert moved > 1e-3, "the reference did not train"
    return max(float((w1 - r1[:, cols]).abs().max()), float((w2 - r2[cols, :]).abs().max()))


@pytest.mark.timeout(300)
def test_tensor_parallel_mlp_trains_like_one_process() -> None:
    from meshcomm.testing import run_ranks

    diffs = run_ranks(mlp_rank, 4, timeout=240)
    assert max(diffs) <= 1e-6, diffs


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--jax":
        jax_main(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} --jax OUT.npz")
