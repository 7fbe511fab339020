"""``meshcomm.ops`` inside ``jax.jit``: ordered host callbacks under the ops' custom_vjp rules.

- Every op (but pprod, which the docs list as unsupported), jitted alone on every datum
  jax takes, equals the same op called eagerly on numpy (dtype, shape and bytes), or raises
  the same exception type while tracing; at a world of one here and on 2 tcp ranks.
- ``jax.jit(jax.value_and_grad(block))`` of tests/test_autodiff.py's tensor-parallel block
  equals eager ``jax.value_and_grad`` to 1e-12 (of the largest entry, when above 1: XLA
  reorders the arithmetic around the collectives) and JAX's shard_map oracle to 1e-9 (float64)
  at worlds 2 (1 x 2) and 4 (2 x 2), called three times on new data (one trace, then cache
  hits), and so does ``jax.value_and_grad(jax.jit(loss))``.
- An eager op issued right after a jitted program whose inputs were not ready (so jax
  dispatched it asynchronously and its callbacks run later) still pairs with the program's
  collectives in order on the other rank.
- vmap and shard_map keep a TypeError saying jit works; async_op=True under jit is an
  InvalidArgument; argument errors are raised while tracing, naming the op.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("jax") is None,
    reason="needs torch and jax (make test installs both)",
)

import test_autodiff as autodiff  # noqa: E402
import test_ops_kinds as kinds  # noqa: E402

from meshcomm import ops, world  # noqa: E402
from meshcomm.errors import InvalidArgument  # noqa: E402
from meshcomm.mesh import DeviceMesh, init_device_mesh  # noqa: E402

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

JIT_CONFIGS = ((1, 2), (2, 2))  # (dp, tp): worlds 2 and 4


# -- every op, jitted alone, against the eager numpy call ---------------------------------------
def check_jitted_ops(mesh: DeviceMesh, n: int, r: int) -> list[str]:
    """Each op jitted on each datum against the eager op on numpy; the mismatches."""
    bad: list[str] = []
    for name, op in kinds.OPS:
        if name == "pprod":
            continue
        for label, arr, _, jax_ok in kinds._data(r, n):
            if not jax_ok:
                continue
            where = f"{name} {label} jit"
            want, want_exc = kinds._call(op, arr, mesh, n, {})
            try:
                got = jax.jit(lambda a, op=op: op(a, mesh, n))(jnp.asarray(arr))
            except (TypeError, ValueError) as exc:
                if type(exc) is not want_exc:
                    bad.append(f"{where}: raised {exc!r}, numpy raised {want_exc}")
                continue
            if want_exc is not None:
                bad.append(f"{where}: no error, numpy raised {want_exc}")
                continue
            kinds._same(where, got, want, "jax", bad)
    return bad


def jitted_ops_rank(group: Any) -> list[str]:
    mesh = init_device_mesh((group.size,), ("x",))
    return check_jitted_ops(mesh, group.size, group.rank)


# -- the tensor-parallel block under jit, against eager and the shard_map oracle -----------------
def block_rank(group: Any, dp: int, tp: int, expected_path: str) -> list[str]:
    jax.config.update("jax_enable_x64", True)
    mesh = init_device_mesh((dp, tp), ("dp", "tp"))
    rank = group.rank
    c = autodiff.meshcomm_collectives(jnp.tanh)
    traces = []

    def loss_fn(x: Any, w1: Any, w2: Any) -> Any:
        return autodiff.block(c, x, w1, w2, tp)

    def step(x: Any, w1: Any, w2: Any) -> tuple[Any, ...]:
        traces.append(1)
        value, (gx, g1, g2) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(x, w1, w2)
        g1, g2 = ops.psum([g1, g2], "dp")  # the data-parallel sum a user writes
        return value, gx, g1, g2

    def grad_of_jit(x: Any, w1: Any, w2: Any) -> tuple[Any, ...]:
        value, (gx, g1, g2) = jax.value_and_grad(jax.jit(loss_fn), argnums=(0, 1, 2))(x, w1, w2)
        return value, gx, *ops.psum([g1, g2], "dp")

    with np.load(expected_path) as data:
        key = f"{dp}x{tp}_r{rank}"
        oracle = [data[f"{key}_{k}"] for k in ("loss", "x", "w1", "w2")]
    problems: list[str] = []

    def compare(label: str, got: Any, want: Any, tol: float) -> None:
        for name, got_one, want_one in zip(("loss", "x", "w1", "w2"), got, want, strict=True):
            g, w = np.asarray(got_one), np.asarray(want_one)
            if g.dtype != np.float64 or g.shape != w.shape:
                problems.append(f"{label} {dp}x{tp} rank {rank} {name}: {g.dtype}{g.shape}")
                continue
            err = np.max(np.abs(g - w)) / max(1.0, np.max(np.abs(w)))
            if err > tol:
                problems.append(f"{label} {dp}x{tp} rank {rank} {name}: error {err}")

    inputs = [jnp.asarray(a) for a in autodiff.shards(dp, tp, rank)]
    with mesh:
        jitted = jax.jit(step)
        for call in range(3):
            scaled = [a * (1 + call) for a in inputs]
            eager = step(*scaled)
            got = jitted(*scaled)
            compare(f"jit call {call} vs eager", got, eager, 1e-12)
            if call == 0:
                compare("jit vs shard_map", got, oracle, 1e-9)
        compare("grad of jit vs shard_map", grad_of_jit(*inputs), oracle, 1e-9)
    if len(traces) != 3 + 1:  # three eager calls and one trace: the other jit calls hit
        problems.append(f"rank {rank}: step traced {len(traces) - 3} times under jit")
    return problems


@pytest.fixture(scope="module")
def jit_expected(tmp_path_factory: pytest.TempPathFactory) -> str:
    """JAX's shard_map oracle of tests/test_autodiff.py, for JIT_CONFIGS only."""
    out = str(tmp_path_factory.mktemp("jax_jit") / "jax.npz")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path.insert(0, {here!r}); import test_autodiff as t; "
        f"t.CONFIGS = {JIT_CONFIGS!r}; t.jax_main({out!r})"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


# -- ordering between a program dispatched asynchronously and eager ops ------------------------
def async_dispatch_rank(group: Any) -> list[float]:
    mesh = init_device_mesh((group.size,), ("x",))
    slow = jax.jit(lambda a: jnp.tanh((a @ a) @ a) @ a)  # keeps the next program's input busy
    summed = jax.jit(lambda a: ops.psum(a[0, :2] * 0 + 1.0 + group.rank, "x", mesh=mesh))
    big = jnp.ones((700, 700)) / 700
    summed(slow(big)).block_until_ready()  # compile both
    outs = []
    for _ in range(3):
        pending = summed(slow(big))  # returns before its callback ran (rank 0 only)
        if group.rank == 0:
            eager = ops.psum(np.array([100.0]), "x", mesh=mesh)
        else:
            jax.block_until_ready(pending)
            eager = ops.psum(np.array([100.0]), "x", mesh=mesh)
        outs += [float(pending[0]), float(eager[0])]
    return outs


# -- tests ---------------------------------------------------------------------------------------
@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    world.shutdown()
    yield init_device_mesh((1,), ("x",))
    jax.effects_barrier()
    world.shutdown()


def test_world_of_one_every_op_jitted_matches_eager_numpy(mesh: DeviceMesh) -> None:
    assert check_jitted_ops(mesh, 1, 0) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_op_jitted_matches_eager_numpy_at_world_2() -> None:
    from meshcomm.testing import run_ranks

    problems = [p for rank in run_ranks(jitted_ops_rank, 2, timeout=240) for p in rank]
    assert not problems, "\n".join(problems[:10])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dp", "tp"), JIT_CONFIGS, ids=[f"{d}x{t}" for d, t in JIT_CONFIGS])
def test_jit_of_value_and_grad_matches_eager_and_shard_map(
    jit_expected: str, dp: int, tp: int
) -> None:
    from meshcomm.testing import run_ranks

    per_rank = run_ranks(block_rank, dp * tp, args=(dp, tp, jit_expected), timeout=240)
    problems = [p for rank in per_rank for p in rank]
    assert not problems, "\n".join(problems[:10])


def test_eager_op_waits_for_a_program_dispatched_before_it() -> None:
    from meshcomm.testing import run_ranks

    r0, r1 = run_ranks(async_dispatch_rank, 2, timeout=120)
    assert r0 == r1 == [3.0, 200.0] * 3


def test_mixed_pytree_and_lax_scan_under_jit(mesh: DeviceMesh) -> None:
    def f(a: Any) -> Any:
        tree = ops.psum({"a": a, "n": np.int32(3), "b": [a > 1]}, "x", mesh=mesh)

        def body(carry: Any, _: Any) -> tuple[Any, None]:
            return ops.pmean(carry, "x", mesh=mesh) * 0.5, None

        return tree, jax.lax.scan(body, a, None, length=3)[0]

    tree, scanned = jax.jit(f)(jnp.arange(3.0))
    assert tree["n"].dtype == jnp.int32 and tree["b"][0].dtype == jnp.int32
    np.testing.assert_array_equal(tree["a"], np.arange(3.0))
    np.testing.assert_array_equal(scanned, np.arange(3.0) / 8)


def test_vmap_and_shard_map_keep_a_type_error_that_names_jit(mesh: DeviceMesh) -> None:
    x = jnp.ones((2, 3))
    with pytest.raises(TypeError, match=r"^psum over 'x'.*jax.vmap.*inside jax.jit"):
        jax.vmap(lambda a: ops.psum(a, "x", mesh=mesh))(x)
    with pytest.raises(TypeError, match=r"^psum over 'x'.*jax.vmap"):
        jax.vmap(jax.grad(lambda a: ops.psum(a, "x", mesh=mesh).sum()))(x)
    jmesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    spec = jax.sharding.PartitionSpec()
    smapped = jax.shard_map(
        lambda a: ops.psum(a, "x", mesh=mesh), mesh=jmesh, in_specs=spec, out_specs=spec
    )
    with pytest.raises(TypeError, match=r"^psum over 'x'.*jax.shard_map"):
        smapped(x)
    with pytest.raises(TypeError, match=r"^psum over 'x'.*jax.shard_map"):
        jax.jit(smapped)(x)


def test_async_op_under_jit_is_invalid(mesh: DeviceMesh) -> None:
    f = jax.jit(lambda a: ops.psum(a, "x", mesh=mesh, async_op=True))
    with pytest.raises(InvalidArgument, match=r"^psum over 'x'.*async_op=True inside jax.jit"):
        f(jnp.ones(2))


def test_ops_without_a_gradient_run_under_jit_and_refuse_only_a_gradient(
    mesh: DeviceMesh,
) -> None:
    x = jnp.arange(3.0) + 2
    assert np.array_equal(jax.jit(lambda a: ops.pprod(a, "x", mesh=mesh))(x), np.asarray(x))
    bits = jax.jit(lambda a: ops.all_reduce(a, "x", "bxor", mesh=mesh))(jnp.arange(3))
    assert np.array_equal(bits, np.arange(3))
    grad = jax.jit(jax.grad(lambda a: ops.pprod(a, "x", mesh=mesh).sum()))
    with pytest.raises(InvalidArgument, match=r"^pprod over 'x' .*pprod has no gradient"):
        grad(x)


def test_argument_errors_are_raised_while_tracing(mesh: DeviceMesh) -> None:
    f = jax.jit(lambda a: ops.psum_scatter(a, "x", mesh=mesh))
    with pytest.raises(InvalidArgument, match=r"^psum_scatter over 'x' \(size 1\) on rank 0"):
        f(jnp.ones(3))
    g = jax.jit(lambda a: ops.all_gather(a, "x", axis=2, mesh=mesh))
    with pytest.raises(InvalidArgument, match=r"^all_gather .*axis=2 is out of range"):
        g(jnp.ones(3))
    h = jax.jit(lambda a: ops.pmax(a, "x", mesh=mesh))
    with pytest.raises(TypeError, match=r"^pmax over 'x'"):
        h(jnp.ones(2, jnp.complex64))


def test_the_mesh_is_captured_when_tracing(mesh: DeviceMesh) -> None:
    with mesh:
        f = jax.jit(lambda a: ops.all_gather(a, "x", tiled=True))
        f(jnp.ones(2))
    np.testing.assert_array_equal(f(jnp.arange(2.0)), np.arange(2.0))  # no ambient mesh now
