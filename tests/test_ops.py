"""meshcomm.ops: semantics at a world of one (in this process), argument errors before any
I/O, pytrees and their coalescing, async Work, the ambient mesh, and an 8-rank tcp world
checked against numpy oracles. (Op-by-op agreement with jax.lax is tests/test_jax_oracle.py.)
"""

from __future__ import annotations

import importlib.util
import os
import re
import threading
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from meshcomm import ops, world
from meshcomm.errors import InvalidArgument
from meshcomm.mesh import DeviceMesh, init_device_mesh
from meshcomm.work import Work


def _tcp_available() -> bool:
    try:
        return importlib.util.find_spec("meshcomm.backends.tcp") is not None
    except ImportError:
        return False


needs_tcp = pytest.mark.skipif(
    not _tcp_available(), reason="the tcp backend (worlds above one) is not available yet"
)
_LAUNCH_PREFIXES = ("MESHCOMM_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "HYDRA_")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")

Pair = namedtuple("Pair", ["first", "second"])


@pytest.fixture(autouse=True)
def _fresh_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in list(os.environ):
        if key in _LAUNCH_VARS or key.startswith(_LAUNCH_PREFIXES):
            monkeypatch.delenv(key)
    world.shutdown()
    yield
    world.shutdown()


@pytest.fixture
def mesh() -> DeviceMesh:
    return init_device_mesh((1, 1), ("dp", "tp"))


# -- a world of one ---------------------------------------------------------------------------
ALL_OPS = [
    ("psum", lambda x, m: ops.psum(x, "tp", mesh=m)),
    ("pmean", lambda x, m: ops.pmean(x, "tp", mesh=m)),
    ("pmax", lambda x, m: ops.pmax(x, "tp", mesh=m)),
    ("pmin", lambda x, m: ops.pmin(x, ("dp", "tp"), mesh=m)),
    ("pprod", lambda x, m: ops.pprod(x, "dp", mesh=m)),
    ("all_reduce", lambda x, m: ops.all_reduce(x, "tp", op="max", mesh=m)),
    ("all_gather", lambda x, m: ops.all_gather(x, "tp", axis=1, tiled=True, mesh=m)),
    ("psum_scatter", lambda x, m: ops.psum_scatter(x, "tp", scatter_dimension=1, tiled=True,
                                                   mesh=m)),
    ("all_to_all", lambda x, m: ops.all_to_all(x, "tp", 0, 1, tiled=True, mesh=m)),
    ("ppermute", lambda x, m: ops.ppermute(x, "tp", [(0, 0)], mesh=m)),
    ("pshuffle", lambda x, m: ops.pshuffle(x, ("tp", "dp"), [0], mesh=m)),
    ("pbroadcast", lambda x, m: ops.pbroadcast(x, "dp", 0, mesh=m)),
]  # fmt: skip


@pytest.mark.parametrize(("name", "op"), ALL_OPS, ids=[n for n, _ in ALL_OPS])
def test_world_of_one_each_op_is_identity_and_returns_a_new_array(
    name: str, op: Any, mesh: DeviceMesh
) -> None:
    x = np.arange(6.0).reshape(2, 3)
    keep = x.copy()
    out = op(x, mesh)
    assert isinstance(out, np.ndarray) and out is not x
    assert not np.shares_memory(out, x)
    np.testing.assert_array_equal(out, keep)
    np.testing.assert_array_equal(x, keep)  # input untouched


@pytest.mark.parametrize(("name", "op"), ALL_OPS, ids=[n for n, _ in ALL_OPS])
def test_world_of_one_async_gives_a_work(name: str, op: Any, mesh: DeviceMesh) -> None:
    fn = getattr(ops, name)
    x = np.arange(4.0).reshape(2, 2)
    args: dict[str, tuple[Any, ...]] = {
        "all_to_all": (0, 0),
        "ppermute": ([(0, 0)],),
        "pshuffle": ([0],),
        "pbroadcast": (0,),
    }
    tiled = {"tiled": True}
    kwargs: dict[str, Any] = {"psum_scatter": tiled, "all_gather": tiled, "all_to_all": tiled}
    work = fn(x, "tp", *args.get(name, ()), mesh=mesh, async_op=True, **kwargs.get(name, {}))
    assert isinstance(work, Work)
    np.testing.assert_array_equal(work.wait(timeout=10), x)
    assert work.is_completed() and work.exception() is None


def test_world_of_one_shapes(mesh: DeviceMesh) -> None:
    x = np.ones((2, 3), np.float32)
    assert ops.all_gather(x, "tp", mesh=mesh).shape == (1, 2, 3)
    assert ops.all_gather(x, "tp", axis=2, mesh=mesh).shape == (2, 3, 1)
    assert ops.all_gather(x, "tp", axis=-1, mesh=mesh).shape == (2, 3, 1)
    assert ops.all_gather(np.float32(1), "tp", mesh=mesh).shape == (1,)
    assert ops.psum_scatter(np.ones((1, 3)), "tp", mesh=mesh).shape == (3,)
    assert ops.psum_scatter(np.ones((3, 1)), "tp", scatter_dimension=-1, mesh=mesh).shape == (3,)
    assert ops.all_to_all(np.ones((1, 3)), "tp", 0, 1, mesh=mesh).shape == (3, 1)
    assert ops.all_to_all(np.ones((2, 3)), "tp", 1, 0, tiled=True, mesh=mesh).shape == (2, 3)


def test_one_array_at_axis_0_goes_straight_to_the_group(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:

    group = mesh.get_group("tp")
    seen: list[tuple[str, bool, bool]] = []
    run_plan = group._issuer.run_plan

    def spy(plan: Any, arr: Any, async_op: bool) -> Any:
        seen.append((plan.collective, arr is x, async_op))
        return run_plan(plan, arr, async_op)

    # The direct paths run the group's plan for the call (with the axis' note: its words).
    monkeypatch.setattr(group._issuer, "run_plan", spy)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)[:1]
    for op in (
        lambda: ops.psum(x, "tp", mesh=mesh),
        lambda: ops.all_gather(x, "tp", tiled=True, mesh=mesh),
        lambda: ops.psum_scatter(x, "tp", tiled=True, mesh=mesh),
        lambda: ops.all_to_all(x, "tp", 0, 0, mesh=mesh),
    ):
        out = op()
        assert out.dtype == np.float32 and not np.shares_memory(out, x)
        np.testing.assert_array_equal(out, x)
    # The caller's array itself, at axis 0, synchronous, no factor: the group's direct paths.
    assert seen == [
        ("all_reduce", True, False),
        ("all_gather", True, False),
        ("reduce_scatter", True, False),
        ("all_to_all", True, False),
    ]
    seen.clear()
    assert ops.pmax(x.astype(ml_dtypes.bfloat16), "tp", mesh=mesh).dtype == ml_dtypes.bfloat16
    assert seen == [("all_reduce", False, False)]  # bfloat16 goes straight too
    # What the kernel still handles gives the same results and the ops' own messages.
    assert ops.psum(x.astype(">f4"), "tp", mesh=mesh).dtype == np.float32
    assert ops.psum(np.ones(2, bool), "tp", mesh=mesh).dtype == np.int32
    named = re.escape("psum over 'tp' (size 1) on rank 0: dtype float128")
    with pytest.raises(TypeError, match=named):
        ops.psum(np.ones(2, np.longdouble), "tp", mesh=mesh)
    with pytest.raises(TypeError, match=r"pmax over 'tp'.*no order"):
        ops.pmax(np.ones(2, np.complex64), "tp", mesh=mesh)


def test_jax_dtype_rules(mesh: DeviceMesh) -> None:
    assert ops.psum(np.array([True, False]), "tp", mesh=mesh).dtype == np.int32
    assert ops.pmax(np.array([True, False]), "tp", mesh=mesh).dtype == np.bool_
    assert ops.pmean(np.array([1, 2], np.int32), "tp", mesh=mesh).dtype == np.float32
    assert ops.pmean(np.array([1, 2], np.uint64), "tp", mesh=mesh).dtype == np.float64
    assert ops.pmean(np.array([1, 2], np.float16), "tp", mesh=mesh).dtype == np.float16
    bf = np.array([1.5], ml_dtypes.bfloat16)
    assert ops.pmean(bf, "tp", mesh=mesh).dtype == bf.dtype
    assert ops.all_reduce(np.array([True]), "tp", mesh=mesh).dtype == np.bool_
    out = ops.pmean(np.int32(3), "tp", mesh=mesh)
    assert isinstance(out, np.ndarray) and out.shape == ()
    work = ops.pmean(np.array([1, 2], np.int64), "tp", mesh=mesh, async_op=True)
    assert work.wait(timeout=10).dtype == np.float64  # chained after the group's Work


def test_pytrees_keep_their_structure(mesh: DeviceMesh) -> None:
    tree = {
        "z": [np.ones(2, np.float32), (np.int64(4), None)],
        "a": Pair(np.zeros((2, 2)), 3.5),
        "m": {"k": np.arange(3, dtype=np.float32)},
    }
    out = ops.psum(tree, ("dp", "tp"), mesh=mesh)
    assert list(out) == ["z", "a", "m"]  # the input's key order
    assert isinstance(out["z"], list) and isinstance(out["z"][1], tuple)
    assert out["z"][1][1] is None
    assert isinstance(out["a"], Pair) and out["a"].second.shape == ()
    np.testing.assert_array_equal(out["m"]["k"], np.arange(3, dtype=np.float32))
    assert out["z"][0].dtype == np.float32 and out["a"].second.dtype == np.float64
    gathered = ops.all_gather(tree, "tp", mesh=mesh)
    assert gathered["m"]["k"].shape == (1, 3) and gathered["z"][1][0].shape == (1,)
    assert ops.psum([], "tp", mesh=mesh) == []
    assert ops.psum({}, "tp", mesh=mesh, async_op=True).wait(timeout=5) == {}


def test_lists_are_pytrees_like_in_jax(mesh: DeviceMesh) -> None:
    out = ops.psum([1.0, 2.0], "tp", mesh=mesh)
    assert isinstance(out, list) and [o.shape for o in out] == [(), ()]


def test_async_pytree(mesh: DeviceMesh) -> None:
    tree = {"a": np.ones(3), "b": np.arange(4, dtype=np.int32), "c": np.zeros(2)}
    work = ops.all_gather(tree, "tp", tiled=True, mesh=mesh, async_op=True)
    out = work.wait(timeout=10)
    assert set(out) == {"a", "b", "c"} and out["b"].dtype == np.int32
    np.testing.assert_array_equal(out["b"], np.arange(4))


def test_empty_axis_tuple_is_the_identity(mesh: DeviceMesh) -> None:
    x = np.arange(3)
    out = ops.psum(x, (), mesh=mesh)
    assert out is not x and out.tolist() == [0, 1, 2]
    assert ops.all_gather(x, (), mesh=mesh).shape == (3,)  # as jax: nothing gathered
    assert ops.ppermute(x, (), [], mesh=mesh).tolist() == [0, 0, 0]
    assert ops.axis_index((), mesh=mesh) == 0 and ops.axis_size((), mesh=mesh) == 1
    assert ops.pmean(x, (), mesh=mesh, async_op=True).wait(timeout=5).dtype == np.float64


def test_ambient_mesh(mesh: DeviceMesh) -> None:
    with pytest.raises(InvalidArgument, match="no mesh"):
        ops.psum(np.ones(1), "tp")
    with mesh:
        assert ops.psum(np.ones(1), "tp").tolist() == [1.0]
        assert ops.axis_index("tp") == 0 and ops.axis_size(("dp", "tp")) == 1
        other = DeviceMesh([[0]], ("x", "y"))
        with other:
            assert ops.axis_size("y") == 1
            with pytest.raises(InvalidArgument, match="unbound axis name: 'tp'"):
                ops.psum(np.ones(1), "tp")
        assert ops.psum(np.ones(1), "tp").tolist() == [1.0]  # the outer mesh again
    with pytest.raises(TypeError, match="DeviceMesh"):
        ops.psum(np.ones(1), "tp", mesh="tp")  # type: ignore[arg-type]


def test_ambient_meshes_in_threads() -> None:
    world.init(world_size=1)
    a, b = DeviceMesh([[0]], ("dp", "tp")), DeviceMesh([0], ("x",))
    errors: list[BaseException] = []

    def work(mesh: DeviceMesh, name: str) -> None:
        try:
            with mesh:
                for i in range(50):
                    assert ops.psum(np.array([i]), name).tolist() == [i]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=a_b) for a_b in ((a, "tp"), (b, "x"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors


# -- argument errors: raised before any I/O ---------------------------------------------------
ERRORS = [
    (lambda m: ops.psum(np.ones(2), "pp", mesh=m), InvalidArgument,
     r"psum: unbound axis name: 'pp'; mesh dims: 'dp', 'tp'"),
    (lambda m: ops.psum(np.ones(2), 0, mesh=m), TypeError, "positional axis"),
    (lambda m: ops.psum(np.ones(2), ("tp", "tp"), mesh=m), InvalidArgument, "repeat"),
    (lambda m: ops.pmax(np.ones(2, complex), "tp", mesh=m), TypeError, "no order"),
    (lambda m: ops.all_reduce(np.ones(2), "tp", op="band", mesh=m), TypeError, "bool or integer"),
    (lambda m: ops.all_reduce(np.ones(2), "tp", op="mode", mesh=m), InvalidArgument, "valid ops"),
    (lambda m: ops.all_reduce(np.ones(2), "tp", op="premul_sum", mesh=m), InvalidArgument,
     "factor"),
    (lambda m: ops.all_reduce(np.ones(2), "tp", factor=2.0, mesh=m), InvalidArgument, "factor"),
    (lambda m: ops.psum(np.array(["a"]), "tp", mesh=m), TypeError, "not supported"),
    (lambda m: ops.all_gather(np.float32(1), "tp", tiled=True, mesh=m), InvalidArgument, "0-d"),
    (lambda m: ops.all_gather(np.ones(2), "tp", axis=2, mesh=m), InvalidArgument,
     r"axis=2 is out of range for 2 positions \(valid: -2..1\)"),
    (lambda m: ops.all_gather(np.ones(2), "tp", axis=1, tiled=True, mesh=m), InvalidArgument,
     "axis=1 is out of range"),
    (lambda m: ops.all_gather(np.ones(2), "tp", axis=1.0, mesh=m), TypeError, "axis must be"),
    (lambda m: ops.psum_scatter(np.ones((3, 2)), "tp", mesh=m), InvalidArgument,
     r"x.shape\[scatter_dimension\] must equal the axis size, but they are 3 and 1"),
    (lambda m: ops.psum_scatter(np.ones(2, bool), "tp", tiled=True, mesh=m), TypeError, "bool"),
    (lambda m: ops.psum_scatter(np.float64(1), "tp", mesh=m), InvalidArgument, "0-d"),
    (lambda m: ops.psum_scatter(np.ones(2), "tp", scatter_dimension=1, mesh=m), InvalidArgument,
     "scatter_dimension=1 is out of range"),
    (lambda m: ops.all_to_all(np.ones((2, 2)), "tp", 0, 1, mesh=m), InvalidArgument,
     r"x.shape\[split_axis\] must equal the axis size, but they are 2 and 1"),
    (lambda m: ops.all_to_all(np.ones((2, 2)), "tp", 0, 2, tiled=True, mesh=m), InvalidArgument,
     "concat_axis=2 is out of range"),
    (lambda m: ops.ppermute(np.ones(2), "tp", [(0, 1)], mesh=m), InvalidArgument,
     r"destination 1 is out of range: axis indices are in \[0, 1\)"),
    (lambda m: ops.ppermute(np.ones(2), "tp", [(0, 0), (0, 0)], mesh=m), InvalidArgument,
     "sources and destinations must be unique"),
    (lambda m: ops.ppermute(np.ones(2), "tp", [0], mesh=m), InvalidArgument, "pairs"),
    (lambda m: ops.pshuffle(np.ones(2), "tp", [1], mesh=m), InvalidArgument,
     r"does not represent a permutation of range\(1\)"),
    (lambda m: ops.pbroadcast(np.ones(2), "tp", 1, mesh=m), InvalidArgument,
     r"source must be an axis index in \[0, 1\), got 1"),
    (lambda m: ops.pbroadcast(np.ones(2), "tp", "0", mesh=m), TypeError, "source must be an int"),
    (lambda m: ops.axis_index("pp", mesh=m), InvalidArgument, "unbound axis name"),
    (lambda m: ops.axis_size(("dp", 1), mesh=m), TypeError, "mesh dim name"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "match"), ERRORS)
def test_argument_errors(call: Any, error: type[Exception], match: str, mesh: DeviceMesh) -> None:
    with pytest.raises(error, match=match):
        call(mesh)
    assert ops.psum(np.ones(1), "tp", mesh=mesh).tolist() == [1.0]  # nothing was poisoned


def test_error_messages_name_the_op_axis_and_rank(mesh: DeviceMesh) -> None:
    with pytest.raises(InvalidArgument) as info:
        ops.psum_scatter(np.ones((3,)), ("dp", "tp"), mesh=mesh)
    assert str(info.value).startswith("psum_scatter over ('dp', 'tp') (size 1) on rank 0: ")


def test_a_bad_leaf_stops_the_whole_tree_before_io(mesh: DeviceMesh) -> None:
    calls: list[Any] = []
    group = mesh.get_group("tp")
    original = group.all_gather
    group.all_gather = lambda *a, **k: calls.append(a) or original(*a, **k)  # type: ignore[method-assign]
    try:
        with pytest.raises(InvalidArgument, match="0-d"):
            ops.all_gather([np.ones(2), np.float32(1)], "tp", tiled=True, mesh=mesh)
    finally:
        del group.all_gather
    assert calls == []


def test_coalescing_one_transfer_per_dtype(mesh: DeviceMesh) -> None:
    calls: list[tuple[Any, ...]] = []
    group = mesh.get_group("tp")
    original = group._issuer.run_plan

    def spy(plan: Any, x: Any, async_op: bool) -> Any:
        calls.append((np.asarray(x).dtype, np.asarray(x).shape))
        return original(plan, x, async_op)

    group._issuer.run_plan = spy  # type: ignore[method-assign]
    try:
        tree = [np.ones((2, 3), np.float32), np.ones(4, np.float32), np.int32(2), np.ones(1)]
        tree.append(np.ones(5, np.float32))
        out = ops.psum(tree, "tp", mesh=mesh)
    finally:
        del group._issuer.run_plan
    assert sorted((dt.name, shape) for dt, shape in calls) == [
        ("float32", (15,)),  # three float32 leaves in one transfer
        ("float64", (1,)),  # alone: passed as is
        ("int32", ()),
    ]
    assert [o.shape for o in out] == [(2, 3), (4,), (), (1,), (5,)]


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="cupy is not installed")
def test_cupy_leaves_are_packed_with_cupy() -> None:
    import cupy

    from meshcomm.ops.pytree import array_namespace

    assert array_namespace(cupy.zeros(2)) is cupy


# -- 8 ranks over tcp -------------------------------------------------------------------------
def _inp(seed: int, rank: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    return rng.integers(-3, 5, size=shape).astype(dtype)


def _members(coord: tuple[int, int], dims: tuple[int, ...], shape: tuple[int, int]) -> list[int]:
    """World ranks along ``dims`` (row-major in that order) through ``coord`` of a grid."""
    grid = np.arange(8).reshape(shape)
    others = [d for d in range(2) if d not in dims]
    moved = grid.transpose([*others, *dims])
    return moved[tuple(coord[d] for d in others)].reshape(-1).tolist()


def _ops_scenarios(group: Any) -> list[str]:
    """Run pytree / async / tuple-axis ops on a (2, 4) mesh; return mismatch strings."""
    r = group.rank
    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    coord = (r // 4, r % 4)
    bad: list[str] = []

    def check(label: str, got: Any, want: Any) -> None:
        if isinstance(want, np.ndarray):
            ok = isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
            ok = ok and np.array_equal(got, want)
        else:
            ok = got == want
        if not ok:
            bad.append(f"rank {r} {label}: got {got!r}, want {want!r}")

    specs = [((2, 3), np.float32), ((4,), np.float32), ((), np.int32), ((3,), np.float64)]

    def tree(seed: int, rank: int) -> dict[str, Any]:
        return {f"l{i}": _inp(seed + i, rank, s, d) for i, (s, d) in enumerate(specs)}

    for axes in (("tp",), ("dp",), ("dp", "tp"), ("tp", "dp")):
        dims = tuple(mesh.mesh_dim_names.index(a) for a in axes)
        members = _members(coord, dims, (2, 4))
        n, me = len(members), members.index(r)
        name = axes if len(axes) > 1 else axes[0]
        check(f"axis_index {axes}", ops.axis_index(name, mesh=mesh), me)

        got = ops.psum(tree(10, r), name, mesh=mesh)
        for key, leaf in got.items():
            i = int(key[1:])
            want = sum(_inp(10 + i, m, *specs[i]) for m in members).astype(specs[i][1])
            check(f"psum {axes} {key}", leaf, np.asarray(want))

        work = ops.all_gather(tree(20, r), name, axis=0, tiled=False, mesh=mesh, async_op=True)
        gathered = work.wait(timeout=60)
        for key, leaf in gathered.items():
            i = int(key[1:])
            want = np.stack([_inp(20 + i, m, *specs[i]) for m in members])
            check(f"all_gather {axes} {key}", leaf, want)

        x = {"a": _inp(30, r, (2 * n, 3), np.float32), "c": _inp(32, r, (n, 2), np.float32)}
        scat = ops.psum_scatter(x, name, scatter_dimension=0, tiled=True, mesh=mesh)
        total_a = sum(_inp(30, m, (2 * n, 3), np.float32) for m in members)
        check(f"psum_scatter {axes} a", scat["a"], total_a[2 * me : 2 * me + 2])
        total_c = sum(_inp(32, m, (n, 2), np.float32) for m in members)
        check(f"psum_scatter {axes} c", scat["c"], total_c[me : me + 1])
        b = ops.psum_scatter(_inp(31, r, (3, n), np.float32), name, scatter_dimension=1, mesh=mesh)
        check(
            f"psum_scatter {axes} b",
            b,
            sum(_inp(31, m, (3, n), np.float32) for m in members)[:, me],
        )

        y = [_inp(40, r, (n, 2), np.int64), _inp(41, r, (n,), np.int64)]
        a2a = ops.all_to_all(y, name, 0, 0, mesh=mesh)
        check(
            f"all_to_all {axes} 0",
            a2a[0],
            np.stack([_inp(40, m, (n, 2), np.int64)[me] for m in members]),
        )
        check(
            f"all_to_all {axes} 1",
            a2a[1],
            np.stack([_inp(41, m, (n,), np.int64)[me] for m in members]),
        )

        ring = [(i, (i + 1) % n) for i in range(n)]
        shifted = ops.ppermute((np.array([r]), np.array([2.0 * r])), name, ring, mesh=mesh)
        left = members[(me - 1) % n]
        check(
            f"ppermute {axes}", (shifted[0].tolist(), shifted[1].tolist()), ([left], [2.0 * left])
        )
        check(f"pbroadcast {axes}", ops.pbroadcast({"v": np.array(r)}, name, n - 1, mesh=mesh)["v"],
              np.array(members[-1]))  # fmt: skip
        check(f"bxor {axes}", ops.all_reduce(np.uint8(1 << (r % 8)), name, op="bxor", mesh=mesh),
              np.uint8(sum(1 << (m % 8) for m in members)))  # fmt: skip

    # Bad arguments on every rank: everyone raises, nothing was sent, the world still works.
    try:
        ops.psum_scatter({"ok": np.ones(4), "bad": np.ones(3)}, "tp", mesh=mesh)
        bad.append(f"rank {r}: a bad leaf did not raise")
    except InvalidArgument:
        pass
    check("after the error", ops.psum(np.array(1), ("dp", "tp"), mesh=mesh), np.array(8))

    # Several async ops in flight, waited in reverse order.
    works = [ops.psum(np.array([i * r]), "tp", mesh=mesh, async_op=True) for i in range(20)]
    row = _members(coord, (1,), (2, 4))
    for i, w in reversed(list(enumerate(works))):
        check(f"async #{i}", w.wait(timeout=60), np.array([i * sum(row)]))
    return bad


@needs_tcp
@pytest.mark.timeout(180)
def test_ops_on_eight_ranks() -> None:
    from meshcomm.testing import run_ranks

    per_rank = run_ranks(_ops_scenarios, 8, timeout=150)
    failures = [f for rank in per_rank for f in rank]
    assert not failures, "\n".join(failures[:20])


def _small_world(group: Any) -> list[str]:
    """Every op along each axis of a (2, n/2) mesh (or (n,) for odd n), against numpy."""
    n, r = group.size, group.rank
    shape = (2, n // 2) if n % 2 == 0 else (n,)
    names = ("dp", "tp") if len(shape) == 2 else ("x",)
    mesh = init_device_mesh(shape, names)
    bad: list[str] = []
    axes: list[Any] = [*names, names]
    for axis in axes:
        tup = axis if isinstance(axis, tuple) else (axis,)
        members = mesh[tup].mesh.reshape(-1).tolist()
        k, me = len(members), members.index(r)
        xs = [_inp(7, m, (k, 3), np.float64) for m in members]
        x = xs[me]
        results = {
            "psum": (ops.psum(x, axis, mesh=mesh), sum(xs)),
            "all_gather": (ops.all_gather(x, axis, tiled=True, mesh=mesh), np.concatenate(xs)),
            "psum_scatter": (ops.psum_scatter(x, axis, mesh=mesh), sum(xs)[me]),
            "all_to_all": (
                ops.all_to_all(x, axis, 0, 1, mesh=mesh),
                np.stack([xm[me] for xm in xs], axis=1),
            ),
            "ppermute": (
                ops.ppermute(x, axis, [(i, (i + 1) % k) for i in range(k)], mesh=mesh),
                xs[(me - 1) % k],
            ),
            "pbroadcast": (ops.pbroadcast(x, axis, k - 1, mesh=mesh), xs[-1]),
        }
        for name, (got, want) in results.items():
            if got.shape != want.shape or not np.allclose(got, want):
                bad.append(f"world {n} rank {r} {name} over {axis}: {got!r} != {want!r}")
    return bad


@needs_tcp
@pytest.mark.timeout(120)
@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_ops_on_small_worlds(nprocs: int) -> None:
    from meshcomm.testing import run_ranks

    per_rank = run_ranks(_small_world, nprocs, timeout=100)
    failures = [f for rank in per_rank for f in rank]
    assert not failures, "\n".join(failures[:20])


def test_tree_structures_are_made_once_and_compare_by_form() -> None:
    """A tree passed again gets the same structure object (a look-up per call); structures
    compare and hash by form however they were made, pickled ones included; leaves come in
    sorted key order and the tree comes back in its own."""
    import pickle

    from meshcomm.ops.pytree import TreeDef, tree_flatten, tree_leaves, tree_unflatten

    point = namedtuple("point", "x y")
    tree = {"w": [1, (2, None)], "b": point(3, {"k": 4}), "n": None}
    leaves, treedef = tree_flatten(tree)
    assert leaves == [3, 4, 1, 2]
    assert tree_leaves(tree) == leaves
    again = {"w": [5, (6, None)], "b": point(7, {"k": 8}), "n": None}
    assert tree_flatten(again)[1] is treedef
    assert tree_flatten({"n": None, "w": [1, (2, None)], "b": point(3, {"k": 4})})[1] != treedef
    assert tree_unflatten(treedef, leaves) == tree
    assert list(tree_unflatten(treedef, leaves)) == ["w", "b", "n"]  # the caller's key order
    made = TreeDef("list", (TreeDef("leaf"), TreeDef("none")))
    assert made == tree_flatten([1, None])[1] and hash(made) == hash(tree_flatten([0, None])[1])
    plain = tree_flatten({"w": [1, (2, None)], "b": (3, {"k": 4})})[1]
    copied = pickle.loads(pickle.dumps(plain))  # (a local namedtuple class cannot pickle)
    assert copied == plain and hash(copied) == hash(plain) and copied.num_leaves == 4
    assert tree_flatten([1, [2]])[1] != tree_flatten([1, (2,)])[1]
    assert tree_flatten(point(1, 2))[1] != tree_flatten((1, 2))[1]
