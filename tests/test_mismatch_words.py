"""Mismatches in what the user wrote (issue 33, items 3 and 4), on tcp and mpi, worlds 2 and 4.

Ranks that pass pytrees of other structures to one op (other keys, other leaf shapes),
or differ in ``perm``, ``tiled``, a split axis, or the order of a tuple of mesh axes, raise
:class:`~meshcomm.errors.MismatchError` on every rank, and its words show the field that
differs, in the user's form: the trees as passed (not the buffer they were packed into),
the argument by its name, the mesh axes as named. tcp runs through
:func:`meshcomm.testing.run_ranks`, mpi under a real ``mpiexec`` running this file as a
script (as ``tests/test_probe_fixes.py`` does); each case runs on a fresh group, so one
case's failed group leaves the next alone.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers of the sibling tests
from test_mpi import SKIP as MPI_SKIP
from test_mpi import mpirun

HERE = Path(__file__).resolve()

BACKENDS = [
    "tcp",
    pytest.param(
        "mpi", marks=[pytest.mark.mpi, pytest.mark.skipif(bool(MPI_SKIP), reason=MPI_SKIP)]
    ),
]

#: What one rank saw in one case: the error's type and words, or "ok" and the result.
Outcome = tuple[str, str]


# == the cases (run inside the ranks) =========================================================
def _mesh(world: Any, name: str, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A mesh over a fresh group of every rank (a case's failure stays in it)."""
    from meshcomm.mesh import DeviceMesh

    fresh = world.subgroup(list(world.ranks), name)
    return DeviceMesh(np.arange(world.size).reshape(shape), names, group=fresh)


def tree_keys(world: Any) -> Any:
    mesh = _mesh(world, "tree-keys", (world.size,), ("x",))
    key = "c" if world.rank == 1 else "b"
    x, y = np.ones(4, np.float32), np.ones(2, np.float32)
    from meshcomm import ops

    return ops.psum({key: x, "w": y}, "x", mesh=mesh)


def leaf_shapes(world: Any) -> Any:
    mesh = _mesh(world, "leaf-shapes", (world.size,), ("x",))
    a, b = (3, 2) if world.rank == 1 else (2, 3)
    from meshcomm import ops

    return ops.psum({"a": np.ones(a, np.float32), "b": np.ones(b, np.float32)}, "x", mesh=mesh)


def perm(world: Any) -> Any:
    mesh = _mesh(world, "perm", (world.size,), ("x",))
    n = world.size
    # Rank 1 only receives (from rank 0, whose frame it compares); the others pass a ring.
    pairs = [(0, 1)] if world.rank == 1 else [(i, (i + 1) % n) for i in range(n)]
    from meshcomm import ops

    out = ops.ppermute(np.ones(4, np.float32), "x", pairs, mesh=mesh)
    # A rank whose own exchange agreed returns; it raises the mismatch in its next call.
    ops.psum(np.ones(1, np.float32), "x", mesh=mesh)
    return out


def tiled(world: Any) -> Any:
    mesh = _mesh(world, "tiled", (world.size,), ("x",))
    from meshcomm import ops

    return ops.all_gather(np.ones(4, np.float32), "x", tiled=world.rank == 1, mesh=mesh)


def split_axis(world: Any) -> Any:
    mesh = _mesh(world, "split-axis", (world.size,), ("x",))
    n = world.size
    from meshcomm import ops

    split = 1 if world.rank == 1 else 0
    return ops.all_to_all(np.ones((n, n), np.float32), "x", split, 0, mesh=mesh)


def tree_tiled(world: Any) -> Any:
    """Packed: the leaves of one dtype move as one buffer, whose call says nothing of the
    scatter's layout; the op's own arguments are checked with the tree."""
    mesh = _mesh(world, "tree-tiled", (world.size,), ("x",))
    n = world.size
    from meshcomm import ops

    tree = {"a": np.ones((n, 2), np.float32), "b": np.ones((n, 3), np.float32)}
    return ops.psum_scatter(tree, "x", scatter_dimension=0, tiled=world.rank == 1, mesh=mesh)


def axes_order(world: Any) -> Any:
    """A 2x2 mesh at world 4 (ranks 1 and 3 name the axes the other way round); at world 2 the
    mesh is 1x2, where both orders are one group: no error, one result."""
    shape = (2, world.size // 2)
    mesh = _mesh(world, "axes-order", shape, ("dp", "tp"))
    names = ("tp", "dp") if world.rank % 2 else ("dp", "tp")
    from meshcomm import ops

    return ops.psum(np.ones(2, np.float32) * world.rank, names, mesh=mesh)


def get_group_order(world: Any) -> Any:
    """``axes_order`` through ``mesh.get_group`` called directly: the same first-use check."""
    shape = (2, world.size // 2)
    mesh = _mesh(world, "get-group-order", shape, ("dp", "tp"))
    names = ("tp", "dp") if world.rank % 2 else ("dp", "tp")
    group = mesh.get_group(names)
    return group.all_reduce(np.ones(2, np.float32) * world.rank)


def mixed_order(world: Any) -> Any:
    """Ranks 1 and 3 name ``("tp", "dp")`` in an op, the others ``("dp", "tp")`` in
    ``get_group``: both routes take one check, so both sides raise."""
    mesh = _mesh(world, "mixed-order", (2, world.size // 2), ("dp", "tp"))
    from meshcomm import ops

    if world.rank % 2:
        return ops.psum(np.ones(2, np.float32), ("tp", "dp"), mesh=mesh)
    return mesh.get_group(("dp", "tp")).all_reduce(np.ones(2, np.float32))


def group_names(world: Any) -> Any:
    """The names of a mesh's groups (on mpi, a 2x2 mesh's axes come from one grid split)."""
    mesh = _mesh(world, "group-names", (2, world.size // 2), ("dp", "tp"))
    return [g.name for g in mesh.get_all_groups()] + [mesh.get_group(("tp", "dp")).name]


def over_words(world: Any) -> Any:
    """The words name the axes the user wrote when the group's name does not (a tuple over
    the whole mesh is the mesh's own group)."""
    mesh = _mesh(world, "over-words", (1, world.size), ("dp", "tp"))
    dtype = np.int32 if world.rank == 1 else np.float32
    from meshcomm import ops

    return ops.psum(np.ones(4, dtype), ("dp", "tp"), mesh=mesh)


CASES: dict[str, Callable[[Any], Any]] = {
    "tree_keys": tree_keys,
    "leaf_shapes": leaf_shapes,
    "perm": perm,
    "tiled": tiled,
    "split_axis": split_axis,
    "tree_tiled": tree_tiled,
    "axes_order": axes_order,
    "get_group_order": get_group_order,
    "mixed_order": mixed_order,
    "group_names": group_names,
    "over_words": over_words,
}


def every_case(world: Any) -> dict[str, Outcome]:
    """Every case on one world: what this rank saw in each (one launch per backend, size)."""
    out: dict[str, Outcome] = {}
    for name, case in CASES.items():
        try:
            result = case(world)
        except Exception as exc:  # the case's error is its outcome
            out[name] = (type(exc).__name__, str(exc))
        else:
            out[name] = ("ok", repr(result))
    return out


def _mpi_rank_main() -> None:
    import meshcomm

    world = meshcomm.init(backend="mpi", timeout=30)
    try:
        result = every_case(world)
    finally:
        meshcomm.shutdown()
    out = Path(os.environ["MESHCOMM_TEST_RESULTS"]) / f"rank{world.rank}.json"
    out.write_text(json.dumps(result))


@functools.cache
def _results(backend: str, nprocs: int) -> tuple[dict[str, Outcome], ...]:
    if backend == "tcp":
        from meshcomm.testing import run_ranks

        return tuple(run_ranks(every_case, nprocs, timeout=120, env={"MESHCOMM_TIMEOUT": "30"}))
    run = mpirun(nprocs, [], script=[str(HERE)], timeout=240)
    assert run.rc == 0 and len(run.results) == nprocs, run.tail()
    return tuple({k: tuple(v) for k, v in r.items()} for r in run.results)


def _raised_alike(name: str, backend: str, nprocs: int, *fragments: str) -> str:
    """Every rank raised MismatchError in case ``name``, the same words on every rank (one
    group), holding every fragment; returns the words."""
    seen = [r[name] for r in _results(backend, nprocs)]
    assert all(kind == "MismatchError" for kind, _ in seen), seen
    words = {text for _, text in seen}
    assert len(words) == 1, words
    text = words.pop()
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    return text


def _one_result_everywhere(name: str, backend: str, nprocs: int) -> None:
    """Every rank returned from case ``name`` without an error, the same result on all."""
    seen = [r[name] for r in _results(backend, nprocs)]
    assert all(kind == "ok" for kind, _ in seen), seen
    assert len({text for _, text in seen}) == 1, seen


# == the tests ===============================================================================
@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pytrees_with_other_keys_raise_showing_both_trees(backend: str, nprocs: int) -> None:
    text = _raised_alike(
        "tree_keys",
        backend,
        nprocs,
        "rank 1 called psum({'c': float32[4], 'w': float32[2]}, sum)",
        "called psum({'b': float32[4], 'w': float32[2]}, sum)",
        "test_mismatch_words.py:",
    )
    assert "float32[6]" not in text  # the user's trees, not the packed buffer


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_pytrees_with_other_leaf_shapes_raise(backend: str, nprocs: int) -> None:
    _raised_alike(
        "leaf_shapes",
        backend,
        nprocs,
        "rank 1 called psum({'a': float32[3], 'b': float32[2]}, sum)",
        "called psum({'a': float32[2], 'b': float32[3]}, sum)",
    )


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_differing_perm_is_shown(backend: str, nprocs: int) -> None:
    """On tcp a ppermute compares stamps only between the ranks that exchange frames: at
    world 4 a rank whose own send and receive agree (rank 3: from 2, to 0) returns its ring
    result, and raises at its next call (the case makes one)."""
    n = nprocs
    ring = [(i, (i + 1) % n) for i in range(n)]
    _raised_alike(
        "perm",
        backend,
        nprocs,
        "rank 1 called ppermute(float32[4], perm=[(0, 1)])",
        f"called ppermute(float32[4], perm={ring})",
    )


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_differing_tiled_is_shown_alone(backend: str, nprocs: int) -> None:
    text = _raised_alike(
        "tiled",
        backend,
        nprocs,
        "rank 1 called all_gather(float32[4], tiled=True)",
        "called all_gather(float32[4], tiled=False)",
    )
    assert "axis=" not in text  # the same on every rank: not shown


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_differing_split_axis_is_shown(backend: str, nprocs: int) -> None:
    text = _raised_alike(
        "split_axis",
        backend,
        nprocs,
        f"rank 1 called all_to_all(float32[{nprocs}, {nprocs}], split_axis=1)",
        f"called all_to_all(float32[{nprocs}, {nprocs}], split_axis=0)",
    )
    assert "concat_axis" not in text and "tiled" not in text


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_packed_trees_own_arguments_are_checked(backend: str, nprocs: int) -> None:
    _raised_alike(
        "tree_tiled",
        backend,
        nprocs,
        "rank 1 called psum_scatter({'a': float32[",
        "tiled=True)",
        "tiled=False)",
    )


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_axes_named_in_another_order_raise_naming_both(backend: str, nprocs: int) -> None:
    if nprocs == 2:  # a 1x2 mesh: both orders hold the ranks in one order, one group
        _one_result_everywhere("axes_order", backend, nprocs)
        return
    _raised_alike(
        "axes_order",
        backend,
        nprocs,
        "ranks disagree on the order of the mesh axes",
        "ranks 0, 2 named ('dp', 'tp') (group ranks [0, 1, 2, 3])",
        "ranks 1, 3 named ('tp', 'dp') (group ranks [0, 2, 1, 3])",
    )


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_get_group_checks_the_order_of_a_tuple_too(backend: str, nprocs: int) -> None:
    if nprocs == 2:  # a 2x1 mesh: both orders are one group, which reduces
        _one_result_everywhere("get_group_order", backend, nprocs)
        return
    _raised_alike(
        "get_group_order",
        backend,
        nprocs,
        "get_group over ('dp', 'tp'): ranks disagree on the order of the mesh axes",
        "ranks 0, 2 named ('dp', 'tp') (group ranks [0, 1, 2, 3])",
        "ranks 1, 3 named ('tp', 'dp') (group ranks [0, 2, 1, 3])",
    )


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_op_and_get_group_agree_on_the_order_together(backend: str, nprocs: int) -> None:
    seen = [r["mixed_order"] for r in _results(backend, nprocs)]
    if nprocs == 2:
        assert all(kind == "ok" for kind, _ in seen), seen
        return
    for rank, (kind, text) in enumerate(seen):  # each names its own route: psum, get_group
        assert kind == "MismatchError", seen
        route = "psum" if rank % 2 else "get_group"
        assert text.startswith(f"{route} over ('dp', 'tp'): ranks disagree on the order"), text
        assert "ranks 1, 3 named ('tp', 'dp')" in text and "ranks 0, 2 named ('dp', 'tp')" in text


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_meshs_groups_are_named_by_its_axes(backend: str, nprocs: int) -> None:
    half = nprocs // 2
    for rank, (kind, text) in enumerate(r["group_names"] for r in _results(backend, nprocs)):
        assert kind == "ok", text
        if nprocs == 2:  # 'dp' and ('tp', 'dp') hold the mesh's group's ranks in order
            expected = ["group-names", f"group-names/tp (dp={rank})", "group-names"]
        else:
            expected = [
                f"group-names/dp (tp={rank % half})",
                f"group-names/tp (dp={rank // half})",
                "group-names/(tp,dp)",
            ]
        assert text == repr(expected), (rank, text)


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_words_name_the_axes_the_user_wrote(backend: str, nprocs: int) -> None:
    _raised_alike(
        "over_words",
        backend,
        nprocs,
        "rank 1 called psum(int32[4], sum) over ('dp', 'tp')",
        "called psum(float32[4], sum) over ('dp', 'tp')",
    )


if __name__ == "__main__":
    _mpi_rank_main()
