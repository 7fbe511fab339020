"""Array kinds at the ops boundary: torch CPU tensors and jax arrays in, the same kind out.

Every op of ``meshcomm.ops`` is called on the same data as a numpy array, a torch tensor
and a jax array; the torch and jax results must have the numpy result's dtype, shape and
bytes, be of the input's kind (``torch.Tensor``, ``jax.Array``), and leave the input
unchanged. The data covers 0-d arrays, non-contiguous tensors (transposed, strided),
bfloat16, bool (psum -> int32, pmean -> float32), int pmean -> float, tensors with the
conjugate bit set, mixed-kind pytrees, and ``async_op=True``. When numpy raises, the other
kinds must raise the same exception type. Run at a world of one in this process and on 3
(and 2) tcp ranks, where every rank compares against its own numpy call. Bad inputs: a torch
dtype numpy lacks, a jax array under ``jax.vmap``, ``requires_grad`` with ``async_op=True``
and ``pprod`` of a ``requires_grad`` tensor. Gradients themselves: tests/test_autodiff.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from meshcomm import ops, world
from meshcomm.errors import InvalidArgument
from meshcomm.mesh import DeviceMesh, init_device_mesh
from meshcomm.work import Work

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

_BF16 = np.dtype(ml_dtypes.bfloat16)
_LAUNCH_PREFIXES = ("MESHCOMM_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "HYDRA_")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")

Op = Callable[..., Any]  # (x, mesh, n, **async) -> result


def _ring(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


#: Every op, called on axis "x" of size n; ``kw`` carries async_op (pcast has none).
OPS: list[tuple[str, Op]] = [
    ("psum", lambda x, m, n, **kw: ops.psum(x, "x", mesh=m, **kw)),
    ("pmean", lambda x, m, n, **kw: ops.pmean(x, "x", mesh=m, **kw)),
    ("pmax", lambda x, m, n, **kw: ops.pmax(x, "x", mesh=m, **kw)),
    ("pmin", lambda x, m, n, **kw: ops.pmin(x, "x", mesh=m, **kw)),
    ("pprod", lambda x, m, n, **kw: ops.pprod(x, "x", mesh=m, **kw)),
    ("all_reduce", lambda x, m, n, **kw: ops.all_reduce(x, "x", op="sum", mesh=m, **kw)),
    ("all_gather", lambda x, m, n, **kw: ops.all_gather(x, "x", mesh=m, **kw)),
    ("all_gather", lambda x, m, n, **kw: ops.all_gather(x, "x", axis=1, tiled=True, mesh=m,
                                                        **kw)),
    ("psum_scatter", lambda x, m, n, **kw: ops.psum_scatter(x, "x", tiled=True, mesh=m, **kw)),
    ("all_to_all", lambda x, m, n, **kw: ops.all_to_all(x, "x", 0, 1, tiled=True, mesh=m,
                                                        **kw)),
    ("ppermute", lambda x, m, n, **kw: ops.ppermute(x, "x", _ring(n), mesh=m, **kw)),
    ("pshuffle", lambda x, m, n, **kw: ops.pshuffle(x, "x", list(range(n))[::-1], mesh=m,
                                                    **kw)),
    ("pbroadcast", lambda x, m, n, **kw: ops.pbroadcast(x, "x", n - 1, mesh=m, **kw)),
    ("pcast", lambda x, m, n, **kw: ops.pcast(x, "x", to="varying", mesh=m)),
]  # fmt: skip


def _data(r: int, n: int) -> list[tuple[str, np.ndarray, Callable[[np.ndarray], Any], bool]]:
    """(label, numpy data, torch tensor of it, whether jax takes it) for rank ``r`` of ``n``.

    Values are small integers, so every op is exact and the kinds agree bit for bit.
    """
    grid = (np.arange(2 * n * 3).reshape(2 * n, 3) + 7 * r) % 5 - 2
    f32 = grid.astype(np.float32)
    cplx = (f32 + 1j * (f32[::-1] + 1)).astype(np.complex64)

    def plain(a: np.ndarray) -> Any:
        return torch.from_numpy(a.copy())

    def transposed(a: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a.T)).T

    def strided(a: np.ndarray) -> Any:
        wide = np.zeros((a.shape[0] * 2, *a.shape[1:]), a.dtype)
        wide[::2] = a
        return torch.from_numpy(wide)[::2]

    def bf16(a: np.ndarray) -> Any:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)

    def conj(a: np.ndarray) -> Any:
        return torch.from_numpy(np.conj(a)).conj()  # conj bit set; values are ``a``

    return [
        ("f32", f32, plain, True),
        ("f32 0-d", np.array(r + 1.5, np.float32), plain, True),
        ("i64 0-d", np.array(r - 1), plain, False),
        ("i32", grid.astype(np.int32), plain, True),
        ("u8", (grid + 2).astype(np.uint8), plain, True),
        ("f64", grid.astype(np.float64), plain, False),
        ("bool", grid > 0, plain, True),
        ("bool 0-d", np.array(r % 2 == 0), plain, True),
        ("bf16", f32.astype(_BF16), bf16, True),
        ("f32 transposed", f32, transposed, False),
        ("f32 strided", f32, strided, False),
        ("bf16 strided", f32.astype(_BF16), lambda a: bf16(a)[::1].T.T[::1], False),
        ("i32 transposed", grid.astype(np.int32), transposed, False),
        ("c64 conj-bit", cplx, conj, False),
        ("c64", cplx, plain, True),
    ]


def _np_dtype(dt: Any) -> np.dtype:
    return _BF16 if dt == torch.bfloat16 else torch.empty(0, dtype=dt).numpy().dtype


def _torch_np(t: Any) -> np.ndarray:
    t = t.resolve_conj()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16)
    return t.numpy()


def _same(label: str, got: Any, want: Any, kind: str, bad: list[str]) -> None:
    """Record in ``bad`` how ``got`` (of ``kind``) differs from the numpy result ``want``."""
    if kind == "torch":
        if type(got) is not torch.Tensor:
            bad.append(f"{label}: got {type(got).__name__}, want torch.Tensor")
            return
        dtype, arr = _np_dtype(got.dtype), _torch_np(got)
        if got.device.type != "cpu":
            bad.append(f"{label}: on {got.device}")
    elif kind == "jax":
        if not isinstance(got, jax.Array):
            bad.append(f"{label}: got {type(got).__name__}, want jax.Array")
            return
        dtype, arr = np.dtype(got.dtype), np.asarray(got)
    else:
        if type(got) is not np.ndarray:
            bad.append(f"{label}: got {type(got).__name__}, want numpy")
            return
        dtype, arr = got.dtype, got
    if dtype != want.dtype or tuple(got.shape) != want.shape:
        bad.append(f"{label}: {dtype}{tuple(got.shape)}, want {want.dtype}{want.shape}")
    elif np.ascontiguousarray(arr).tobytes() != np.ascontiguousarray(want).tobytes():
        bad.append(f"{label}: values {arr.tolist()} != {want.tolist()}")


def _call(op: Op, x: Any, mesh: DeviceMesh, n: int, mode: dict[str, Any]) -> tuple[Any, Any]:
    """``(op's result, None)``, or ``(None, the type of the error it raised)``."""
    try:
        return op(x, mesh, n, **mode), None
    except (TypeError, ValueError) as exc:  # InvalidArgument is a ValueError
        return None, type(exc)


def _snapshot(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.is_conj(), x.resolve_conj().clone()  # clone() alone drops the conj bit
    return np.array(x)


def _unchanged(label: str, x: Any, keep: Any, bad: list[str]) -> None:
    if isinstance(x, torch.Tensor):
        same = x.is_conj() == keep[0] and torch.equal(x.resolve_conj(), keep[1])
    else:
        same = np.array_equal(np.asarray(x), np.asarray(keep))
    if not same:
        bad.append(f"{label}: the input was modified")


def check_kinds(mesh: DeviceMesh, n: int, r: int) -> list[str]:
    """Every op on every datum and kind, sync and async, against numpy; the mismatches.

    Every rank calls the ops in the same order with its own data, so each collective
    pairs up across the ranks.
    """
    bad: list[str] = []
    for name, op in OPS:
        modes: list[dict[str, Any]] = [{}] if name == "pcast" else [{}, {"async_op": True}]
        for label, arr, to_torch, jax_ok in _data(r, n):
            for mode in modes:
                where = f"{name} {label}{' async' if mode else ''}"
                want, want_exc = _call(op, arr, mesh, n, mode)
                if mode and want_exc is None:
                    assert isinstance(want, Work)
                    want = want.wait()
                inputs = [("torch", to_torch(arr))]
                if jax_ok:
                    inputs.append(("jax", jnp.asarray(arr)))
                for kind, x in inputs:
                    keep = _snapshot(x)
                    got, exc = _call(op, x, mesh, n, mode)
                    if exc is not want_exc:
                        bad.append(f"{where} {kind}: raised {exc}, numpy raised {want_exc}")
                        continue
                    _unchanged(f"{where} {kind}", x, keep, bad)
                    if exc is not None:
                        continue
                    if mode:
                        if not isinstance(got, Work):
                            bad.append(f"{where} {kind}: async_op=True gave {type(got)}")
                            continue
                        got = got.wait(timeout=30)
                    _same(f"{where} {kind}", got, want, kind, bad)
    bad += _check_trees(mesh, n, r)
    return bad


def _check_trees(mesh: DeviceMesh, n: int, r: int) -> list[str]:
    """Pytrees mixing numpy, torch and jax leaves: each leaf comes back as its kind."""
    bad: list[str] = []
    base = _data(r, n)
    f32, i32, boolean = base[0][1], base[3][1], base[6][1]
    scalar = base[1][1]
    numpy_tree = {"a": f32, "b": f32 + 1, "c": f32 * 2, "d": [i32, boolean, scalar], "e": None}
    mixed = {
        "a": torch.from_numpy(f32.copy()),
        "b": f32 + 1,
        "c": jnp.asarray(f32 * 2),
        "d": [jnp.asarray(i32), torch.from_numpy(boolean.copy()), torch.from_numpy(scalar)],
        "e": None,
    }
    kinds = {"a": "torch", "b": "numpy", "c": "jax", "d": ["jax", "torch", "torch"]}
    for name, op in OPS:
        if name in ("all_to_all", "psum_scatter") or "tiled" in str(op):
            leaves_ok = {"a", "b", "c"}  # ops that need an axis to cut: no 0-d / bool leaves
        else:
            leaves_ok = {"a", "b", "c", "d"}
        want_tree = {k: v for k, v in numpy_tree.items() if k in leaves_ok}
        tree = {k: v for k, v in mixed.items() if k in leaves_ok}
        modes: list[dict[str, Any]] = [{}] if name == "pcast" else [{}, {"async_op": True}]
        for mode in modes:
            where = f"{name} tree{' async' if mode else ''}"
            want, want_exc = _call(op, want_tree, mesh, n, mode)
            got, exc = _call(op, tree, mesh, n, mode)
            if exc is not want_exc:
                bad.append(f"{where}: raised {exc}, numpy raised {want_exc}")
                continue
            if exc is not None:
                continue
            if mode:
                want, got = want.wait(), got.wait(timeout=30)
            if sorted(got) != sorted(want_tree):
                bad.append(f"{where}: keys {sorted(got)}")
                continue
            for key in want_tree:
                if key == "d":
                    for i, kind in enumerate(kinds["d"]):
                        _same(f"{where} d[{i}]", got["d"][i], want["d"][i], kind, bad)
                else:
                    _same(f"{where} {key}", got[key], want[key], str(kinds[key]), bad)
    return bad


# -- a world of one, in this process -------------------------------------------------------
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
    return init_device_mesh((1,), ("x",))


def test_world_of_one_every_op_every_kind_matches_numpy(mesh: DeviceMesh) -> None:
    assert check_kinds(mesh, 1, 0) == []


def test_results_are_new_memory(mesh: DeviceMesh) -> None:
    t = torch.arange(6.0).reshape(2, 3)
    for name, op in OPS:
        out = op(t, mesh, 1)
        assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), name
        out.add_(1)  # writing into the result leaves the input alone
        assert torch.equal(t, torch.arange(6.0).reshape(2, 3)), name


def test_a_torch_dtype_numpy_lacks_is_a_type_error_naming_the_op(mesh: DeviceMesh) -> None:
    x = torch.zeros(2, 3).to(torch.float8_e4m3fn)
    for name, op in OPS:
        with pytest.raises(TypeError, match=rf"^{name}\b.*float8_e4m3fn"):
            op(x, mesh, 1)


def test_a_torch_meta_tensor_is_a_type_error_naming_the_op(mesh: DeviceMesh) -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"psum over 'x' .*a torch meta tensor has no values"):
        ops.psum(torch.ones(2, device="meta"), "x", mesh=mesh)
    assert torch.equal(ops.psum(torch.ones(2), "x", mesh=mesh), torch.ones(2))


def test_a_jax_array_under_vmap_is_a_type_error_about_tracers(mesh: DeviceMesh) -> None:
    # Under jax.jit the ops run as ordered host callbacks: tests/test_jax_jit.py.
    x = jnp.ones((2, 3))
    for name, op in OPS:
        with pytest.raises(TypeError, match=rf"^{name}\b.*jax tracer"):
            jax.vmap(lambda a, op=op: op(a, mesh, 1))(x)
        with pytest.raises(TypeError, match="jax tracer"):
            jax.vmap(lambda a, op=op: op({"a": a, "b": np.ones(2)}, mesh, 1))(x)


@pytest.mark.parametrize("case", ["pprod", "async"])
def test_under_jit_pprod_runs_and_async_is_invalid(mesh: DeviceMesh, case: str) -> None:
    if case == "pprod":  # no backward rule: refused only if a gradient is asked of it
        out = jax.jit(lambda a: ops.pprod(a, "x", mesh=mesh))(jnp.full(2, 3.0))
        assert np.array_equal(out, np.full(2, 3.0))
        return
    with pytest.raises(InvalidArgument, match=r"async_op=True inside jax\.jit"):
        jax.jit(lambda a: ops.psum(a, "x", mesh=mesh, async_op=True))(jnp.ones(2))


def test_requires_grad_with_async_op_is_invalid(mesh: DeviceMesh) -> None:
    x = torch.ones(2, 3, requires_grad=True)
    for name, op in OPS:
        if name == "pcast":
            continue
        # pprod has no gradient at all, which it reports first
        why = "pprod has no gradient" if name == "pprod" else "async_op=True"
        with pytest.raises(InvalidArgument, match=rf"^{name}\b.*{why}"):
            op(x, mesh, 1, async_op=True)
        with pytest.raises(InvalidArgument, match=why):
            op({"a": x, "b": np.ones(2)}, mesh, 1, async_op=True)
    with torch.no_grad():  # no gradient needed: async is fine, and sync the fast path
        out = ops.psum(x, "x", mesh=mesh, async_op=True).wait()
        sync = ops.all_gather(x, "x", mesh=mesh)
    assert type(out) is torch.Tensor and not out.requires_grad
    assert type(sync) is torch.Tensor and not sync.requires_grad and sync.shape == (1, 2, 3)


def test_pprod_of_a_requires_grad_tensor_is_invalid_naming_pprod(mesh: DeviceMesh) -> None:
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(InvalidArgument, match="pprod"):
        ops.pprod(x, "x", mesh=mesh)
    with pytest.raises(InvalidArgument, match="pprod"):
        ops.pprod([x, np.ones(2)], "x", mesh=mesh)
    out = ops.pprod(x.detach(), "x", mesh=mesh)
    assert type(out) is torch.Tensor and torch.equal(out, x.detach())


# -- several ranks -------------------------------------------------------------------------
def _ranks(group: Any) -> list[str]:
    """On each rank: every case against this rank's numpy results (imports torch and jax)."""
    import jax as _jax  # noqa: F401 - in the rank's own process
    import torch as _torch  # noqa: F401

    mesh = init_device_mesh((group.size,), ("x",))
    return check_kinds(mesh, group.size, group.rank)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_ranks_every_op_every_kind_matches_numpy(nprocs: int) -> None:
    from meshcomm.testing import run_ranks

    per_rank = run_ranks(_ranks, nprocs, timeout=100)
    assert per_rank == [[]] * nprocs
