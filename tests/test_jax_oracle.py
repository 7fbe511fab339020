"""meshcomm.ops against jax.lax inside jax.shard_map, rank by rank.

JAX runs in a subprocess on its CPU backend with 8 simulated devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set before jax is imported, and
x64 enabled) and writes every case's per-device output to an npz file. Then 8 meshcomm
ranks (tcp backend, one launch for all cases) compute the same cases from the same inputs
and compare: same dtype, same shape, same values (inputs are small integers, so every sum
and mean is exact and the comparison is exact).

Device ``i`` of the JAX mesh is rank ``i`` of the meshcomm mesh: both lay ranks out
row-major. Cases cover every op on meshes (8,), (2, 4), (4, 2) and (2, 2, 2), each axis
and tuples of axes in several orders, tiled and not, several dtypes and shapes.

Run one side by hand: ``python tests/test_jax_oracle.py --jax OUT.npz``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import pytest

MESHES: tuple[tuple[tuple[int, ...], tuple[str, ...]], ...] = (
    ((8,), ("x",)),
    ((2, 4), ("a", "b")),
    ((4, 2), ("a", "b")),
    ((2, 2, 2), ("a", "b", "c")),
)
AXES: dict[int, tuple[Any, ...]] = {
    1: ("x",),
    2: ("a", "b", ("a", "b"), ("b", "a")),
    3: ("a", "b", "c", ("a", "b"), ("c", "a"), ("b", "c"), ("a", "b", "c"), ("c", "a", "b")),
}
BF16 = np.dtype(ml_dtypes.bfloat16)
#: Dtypes cycled through per op (each op sees several across the cases).
_NAMES = ("float32", "int32", "float64", "int64", "uint8", "float16", "complex64", "int8")
DTYPES = (*(np.dtype(d) for d in _NAMES), BF16)
ORDERED = tuple(d for d in DTYPES if d.kind != "c")  # pmax / pmin


class Case(NamedTuple):
    cid: int
    mesh_shape: tuple[int, ...]
    names: tuple[str, ...]
    op: str
    axis: Any
    kwargs: dict[str, Any]
    dtype: np.dtype
    shape: tuple[int, ...]


def _size(mesh_shape: tuple[int, ...], names: tuple[str, ...], axis: Any) -> int:
    axes = axis if isinstance(axis, tuple) else (axis,)
    return int(np.prod([mesh_shape[names.index(a)] for a in axes]))


def cases() -> list[Case]:
    """Every case, deterministic (both processes build the same list)."""
    out: list[Case] = []
    pick = iter(range(10**9))

    def dt(pool: tuple[np.dtype, ...] = DTYPES) -> np.dtype:
        return pool[next(pick) % len(pool)]

    def add(op: str, axis: Any, kwargs: dict[str, Any], dtype: np.dtype, shape: tuple[int, ...]):
        out.append(Case(len(out), mesh_shape, names, op, axis, kwargs, dtype, shape))

    for mesh_shape, names in MESHES:
        for axis in AXES[len(mesh_shape)]:
            n = _size(mesh_shape, names, axis)
            add("psum", axis, {}, dt(), (3,))
            add("psum", axis, {}, dt(), (2, 3))
            add("psum", axis, {}, np.dtype(bool), (4,))
            add("pmean", axis, {}, dt(tuple(d for d in DTYPES if d.kind in "fc")), (2, 2))
            add("pmean", axis, {}, np.dtype("int32"), (3,))
            add("pmax", axis, {}, dt(ORDERED), (5,))
            add("pmin", axis, {}, dt(ORDERED), (2, 1))
            add("pmax", axis, {}, np.dtype(bool), (3,))
            add("all_reduce_max", axis, {}, dt(ORDERED), (3,))
            add("all_gather", axis, {"axis": 0, "tiled": False}, dt(), (3,))
            add("all_gather", axis, {"axis": 1, "tiled": False}, dt(), (2, 3))
            add("all_gather", axis, {"axis": -1, "tiled": False}, dt(), (2,))
            add("all_gather", axis, {"axis": 0, "tiled": True}, dt(), (2, 3))
            add("all_gather", axis, {"axis": 1, "tiled": True}, dt(), (2, 3))
            add("all_gather", axis, {"axis": 0, "tiled": False}, dt(), ())
            add("psum_scatter", axis, {"scatter_dimension": 0, "tiled": False}, dt(), (n, 3))
            add("psum_scatter", axis, {"scatter_dimension": 1, "tiled": False}, dt(), (2, n))
            add("psum_scatter", axis, {"scatter_dimension": 0, "tiled": True}, dt(), (2 * n,))
            add("psum_scatter", axis, {"scatter_dimension": 1, "tiled": True}, dt(), (3, n, 2))
            a2a = "all_to_all"
            add(a2a, axis, {"split_axis": 0, "concat_axis": 0, "tiled": False}, dt(), (n, 2))
            add(a2a, axis, {"split_axis": 0, "concat_axis": 1, "tiled": False}, dt(), (n, 3))
            add(a2a, axis, {"split_axis": 1, "concat_axis": 0, "tiled": False}, dt(), (2, n))
            add(a2a, axis, {"split_axis": 0, "concat_axis": 1, "tiled": True}, dt(), (2 * n, 3))
            add(a2a, axis, {"split_axis": 1, "concat_axis": 0, "tiled": True}, dt(), (2, n))
            ring = [(i, (i + 1) % n) for i in range(n)]
            add("ppermute", axis, {"perm": ring}, dt(), (2, 2))
            add("ppermute", axis, {"perm": [(0, n - 1)] if n > 1 else []}, dt(), (3,))
            add("ppermute", axis, {"perm": [(i, n - 1 - i) for i in range(0, n, 2)]}, dt(), (2,))
            add("pshuffle", axis, {"perm": [(i * 3 + 1) % n for i in range(n)]}, dt(), (2,))
            no_bool = tuple(d for d in DTYPES if d.kind != "b")
            add("pbroadcast", axis, {"source": n - 1}, dt(no_bool), (3,))
            add("pbroadcast", axis, {"source": 0}, dt(no_bool), (2, 2))
            add("axis_index", axis, {}, np.dtype("int32"), ())
            add("axis_size", axis, {}, np.dtype("int32"), ())
    return out


def case_input(case: Case, rank: int) -> np.ndarray:
    """Small integers from (case, rank): exact under every sum and mean here."""
    rng = np.random.default_rng([case.cid, rank])
    if case.dtype.kind == "b":
        return rng.integers(0, 2, size=case.shape).astype(bool)
    low = 0 if case.dtype.kind == "u" else -3
    values = rng.integers(low, 5, size=case.shape)
    if case.dtype.kind == "c":
        values = values + 1j * rng.integers(low, 5, size=case.shape)
    return np.asarray(values).astype(case.dtype)


def jax_perm(case: Case) -> list[tuple[int, int]]:
    """The ``(source, destination)`` pairs to give ``lax.ppermute`` for this case.

    meshcomm's indices along a tuple of axes are ``axis_index`` values: row-major in the
    order given, as JAX's ``axis_index`` and ``all_gather`` use them. JAX's ppermute
    lowering sorts each group by device id instead, so for a tuple out of mesh order
    (``("b", "a")``) its indices run in mesh order. Translate, so both sides make the same
    physical moves.
    """
    kw = case.kwargs
    if case.op == "pshuffle":
        pairs = [(src, dst) for dst, src in enumerate(kw["perm"])]
    else:
        pairs = [tuple(p) for p in kw["perm"]]
    tup = case.axis if isinstance(case.axis, tuple) else (case.axis,)
    given = [case.names.index(a) for a in tup]
    in_mesh_order = sorted(given)
    sizes = [case.mesh_shape[d] for d in given]

    def to_jax(index: int) -> int:
        coord = dict(zip(given, np.unravel_index(index, sizes), strict=True))
        flat = 0
        for d in in_mesh_order:
            flat = flat * case.mesh_shape[d] + int(coord[d])
        return flat

    return [(to_jax(s), to_jax(d)) for s, d in pairs]


def _key(cid: int, rank: int) -> str:
    return f"c{cid}_r{rank}"


# -- the JAX side (a subprocess) -------------------------------------------------------------
def jax_main(out_path: str) -> None:
    """Compute every case with jax.lax in shard_map; save per-device outputs."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax  # after XLA_FLAGS: the device count is read at import

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices())
    assert devices.size == 8, devices

    def op_fn(case: Case) -> Any:
        axis, kw = case.axis, case.kwargs
        tup = axis if isinstance(axis, tuple) else (axis,)
        if case.op == "psum":
            return lambda x: lax.psum(x, axis)
        if case.op == "pmean":
            return lambda x: lax.pmean(x, axis)
        if case.op in ("pmax", "all_reduce_max"):
            return lambda x: lax.pmax(x, axis)
        if case.op == "pmin":
            return lambda x: lax.pmin(x, axis)
        if case.op == "all_gather":
            return lambda x: lax.all_gather(x, axis, **kw)
        if case.op == "psum_scatter":
            return lambda x: lax.psum_scatter(x, axis, **kw)
        if case.op == "all_to_all":
            return lambda x: lax.all_to_all(x, axis, **kw)
        if case.op in ("ppermute", "pshuffle"):
            pairs = jax_perm(case)
            return lambda x: lax.ppermute(x, axis, pairs)
        if case.op == "pbroadcast":
            # lax.pbroadcast has no CPU lowering; this is its documented definition.
            def pbroadcast(x: Any) -> Any:
                mine = lax.axis_index(tup) == kw["source"]
                return lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), tup)

            return pbroadcast
        if case.op == "axis_index":
            return lambda x: lax.axis_index(axis).astype(jnp.int32)
        if case.op == "axis_size":
            return lambda x: jnp.asarray(lax.axis_size(axis), jnp.int32)
        raise AssertionError(case.op)

    results: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    # One jit per mesh over all its cases: one compilation instead of hundreds.
    for mesh_shape, names in MESHES:
        batch = [c for c in cases() if c.mesh_shape == mesh_shape]
        mesh = Mesh(devices.reshape(mesh_shape), names)
        spec = P(*names)
        fns = [op_fn(c) for c in batch]
        ones = (1,) * len(mesh_shape)

        def body(*blocks: Any, fns: Any = fns, batch: Any = batch, ones: Any = ones) -> Any:
            outs = []
            for fn, case, block in zip(fns, batch, blocks, strict=True):
                out = jnp.asarray(fn(block.reshape(case.shape)))
                outs.append(out.reshape(ones + out.shape))
            return tuple(outs)

        specs = (spec,) * len(batch)
        mapped = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False)
        )
        ranks = np.arange(8).reshape(mesh_shape)
        inputs = []
        for case in batch:
            glob = np.stack([case_input(case, int(r)) for r in ranks.reshape(-1)])
            glob = glob.reshape(mesh_shape + case.shape)
            inputs.append(jax.device_put(glob, NamedSharding(mesh, spec)))
        for case, out in zip(batch, mapped(*inputs), strict=True):
            host = np.asarray(out)
            for coord in np.ndindex(*mesh_shape):
                key = _key(case.cid, int(ranks[coord]))
                value = np.asarray(host[coord])
                dtypes[key] = value.dtype.name
                results[key] = value.view(np.uint16) if value.dtype == BF16 else value
    np.savez(out_path, **results)
    Path(out_path + ".json").write_text(json.dumps(dtypes))


def load_expected(path: str) -> dict[str, np.ndarray]:
    names = json.loads(Path(path + ".json").read_text())
    with np.load(path) as data:
        return {
            key: data[key].view(BF16) if names[key] == "bfloat16" else data[key] for key in names
        }


# -- the meshcomm side (8 ranks) ---------------------------------------------------------------
def run_case(case: Case, mesh: Any, rank: int) -> Any:
    from meshcomm import ops

    x = case_input(case, rank)
    kw = dict(case.kwargs)
    op = case.op
    if op == "all_reduce_max":
        return ops.all_reduce(x, case.axis, op="max", mesh=mesh)
    if op in ("psum", "pmean", "pmax", "pmin"):
        return getattr(ops, op)(x, case.axis, mesh=mesh)
    if op == "all_to_all":
        split, concat = kw.pop("split_axis"), kw.pop("concat_axis")
        return ops.all_to_all(x, case.axis, split, concat, mesh=mesh, **kw)
    if op in ("all_gather", "psum_scatter"):
        return getattr(ops, op)(x, case.axis, mesh=mesh, **kw)
    if op in ("ppermute", "pshuffle"):
        return getattr(ops, op)(x, case.axis, kw["perm"], mesh=mesh)
    if op == "pbroadcast":
        return ops.pbroadcast(x, case.axis, kw["source"], mesh=mesh)
    if op == "axis_index":
        return ops.axis_index(case.axis, mesh=mesh)
    if op == "axis_size":
        return ops.axis_size(case.axis, mesh=mesh)
    raise AssertionError(op)


def compare(case: Case, rank: int, got: Any, want: np.ndarray) -> str | None:
    """Return None if ``got`` matches JAX's output exactly, else a readable mismatch."""
    label = (
        f"case {case.cid} {case.op}{case.kwargs} over {case.axis!r} on mesh "
        f"{case.mesh_shape}, {case.dtype.name}{case.shape}, rank {rank}"
    )
    if case.op in ("axis_index", "axis_size"):
        if not isinstance(got, int) or got != int(want):
            return f"{label}: got {got!r}, jax {int(want)}"
        return None
    if not isinstance(got, np.ndarray):
        return f"{label}: got {type(got).__name__}, not an ndarray"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{label}: got {got.dtype}{got.shape}, jax {want.dtype}{want.shape}"
    if not np.array_equal(got, want):
        return f"{label}: values differ:\n  got  {got.tolist()}\n  jax  {want.tolist()}"
    return None


def meshcomm_rank(group: Any, expected_path: str) -> list[str]:
    """In each of 8 ranks: build every mesh, run every case, compare to JAX."""
    from meshcomm.mesh import init_device_mesh

    expected = load_expected(expected_path)
    meshes = {shape: init_device_mesh(shape, names) for shape, names in MESHES}
    failures = []
    for case in cases():
        try:
            got = run_case(case, meshes[case.mesh_shape], group.rank)
        except Exception as exc:
            failures.append(f"case {case.cid} {case.op} on rank {group.rank}: raised {exc!r}")
            raise
        problem = compare(case, group.rank, got, expected[_key(case.cid, group.rank)])
        if problem:
            failures.append(problem)
    return failures


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _iter_failures(per_rank: list[list[str]]) -> Iterator[str]:
    for failures in per_rank:
        yield from failures


def test_cases_cover_every_op_mesh_and_tuple_axes() -> None:
    all_cases = cases()
    ops_seen = {c.op for c in all_cases}
    assert ops_seen >= {
        "psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all",
        "ppermute", "pshuffle", "pbroadcast", "axis_index", "axis_size",
    }  # fmt: skip
    assert {c.mesh_shape for c in all_cases} == {(8,), (2, 4), (4, 2), (2, 2, 2)}
    assert any(isinstance(c.axis, tuple) and len(c.axis) == 3 for c in all_cases)
    assert {c.kwargs.get("tiled") for c in all_cases} >= {True, False}
    assert len({c.dtype for c in all_cases}) >= 8


@pytest.mark.skipif(not _have("jax"), reason="jax is not installed (pip install 'jax[cpu]')")
@pytest.mark.skipif(
    not _have("meshcomm.backends.tcp"), reason="the tcp backend (8 ranks) is not available yet"
)
@pytest.mark.timeout(300)
def test_ops_match_jax_lax_in_shard_map(tmp_path: Path) -> None:
    from meshcomm.testing import run_ranks

    out = str(tmp_path / "jax.npz")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, __file__, "--jax", out],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    jax_s = time.monotonic() - start
    per_rank = run_ranks(meshcomm_rank, 8, args=(out,), timeout=240)
    failures = list(_iter_failures(per_rank))
    print(f"{len(cases())} cases x 8 ranks; jax {jax_s:.1f} s, meshcomm "
          f"{time.monotonic() - start - jax_s:.1f} s")  # fmt: skip
    assert not failures, "\n".join(failures[:30]) + f"\n({len(failures)} mismatches)"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--jax":
        jax_main(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} --jax OUT.npz")
