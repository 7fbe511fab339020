"""DeviceMesh: the pure grid (no world needed), a world of one in this process, and real
8-rank worlds over the tcp backend (one launch per scenario)."""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from meshcomm import world
from meshcomm.errors import InvalidArgument, RendezvousError
from meshcomm.mesh import DeviceMesh, current_mesh, infer_mesh_shape, init_device_mesh


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


@pytest.fixture(autouse=True)
def _fresh_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in list(os.environ):
        if key in _LAUNCH_VARS or key.startswith(_LAUNCH_PREFIXES):
            monkeypatch.delenv(key)
    world.shutdown()
    yield
    world.shutdown()


# -- the pure grid ---------------------------------------------------------------------------
def test_grid_is_validated_copied_and_frozen() -> None:
    ranks = np.arange(8).reshape(2, 4)
    mesh = DeviceMesh(ranks, ("dp", "tp"))
    ranks[0, 0] = 99
    assert mesh.mesh[0, 0] == 0
    assert mesh.mesh.dtype == np.int64
    with pytest.raises(ValueError, match="read-only"):
        mesh.mesh[0, 0] = 5
    assert (mesh.shape, mesh.ndim, mesh.mesh_dim_names) == ((2, 4), 2, ("dp", "tp"))
    assert (mesh.size(), mesh.size("dp"), mesh.size(1), mesh.size(-2)) == (8, 2, 4, 2)
    assert mesh.axis_sizes == {"dp": 2, "tp": 4}


def test_default_names_and_single_name_for_1d() -> None:
    assert DeviceMesh([[0, 1], [2, 3]]).mesh_dim_names == ("dim0", "dim1")
    assert DeviceMesh([3, 1, 2], "x").mesh_dim_names == ("x",)


def test_any_layout_is_accepted() -> None:
    mesh = DeviceMesh([[7, 2], [0, 5]], ("a", "b"))
    assert mesh.mesh.tolist() == [[7, 2], [0, 5]]
    assert mesh._coordinate_of(0) == (1, 0)
    assert mesh._coordinate_of(3) is None


@pytest.mark.parametrize(
    ("grid", "match"),
    [
        ([], "at least one rank|non-empty"),
        (np.int64(3), "at least one axis"),
        ([0, -1], ">= 0"),
        ([[0, 1], [1, 2]], r"unique.*\[1\]"),
        ([0.0, 1.0], "ints"),
        ([[0, 1], [2]], "array of ranks|int ranks"),
    ],
)
def test_bad_grids(grid: Any, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        DeviceMesh(grid)


def test_bad_names() -> None:
    with pytest.raises(InvalidArgument, match=r"2 names \('a', 'b'\) but the mesh has 1 axes"):
        DeviceMesh([0, 1], ("a", "b"))
    with pytest.raises(InvalidArgument, match=r"unique, got \['a'\] twice"):
        DeviceMesh([[0, 1]], ("a", "a"))
    with pytest.raises(InvalidArgument, match="non-empty"):
        DeviceMesh([[0, 1]], ("a", ""))
    with pytest.raises(TypeError, match="strs"):
        DeviceMesh([[0, 1]], ("a", 1))  # type: ignore[arg-type]


def test_unknown_dims_list_the_valid_ones() -> None:
    mesh = DeviceMesh(np.arange(4).reshape(2, 2), ("dp", "tp"))
    with pytest.raises(InvalidArgument, match=r"unknown mesh dim 'pp'; valid dims: 'dp', 'tp'"):
        mesh.size("pp")
    with pytest.raises(InvalidArgument, match=r"mesh dim 2 is out of range; valid dims"):
        mesh.size(2)
    with pytest.raises(TypeError, match="name or an int"):
        mesh.size(True)
    with pytest.raises(InvalidArgument, match="repeat"):
        mesh["dp", "dp"]
    with pytest.raises(InvalidArgument, match="at least one"):
        mesh[()]


def test_repr_eq_hash() -> None:
    a = DeviceMesh(np.arange(4).reshape(2, 2), ("dp", "tp"))
    b = DeviceMesh([[0, 1], [2, 3]], ("dp", "tp"))
    assert repr(a) == "DeviceMesh([[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp'))"
    assert a == b and hash(a) == hash(b)
    assert a != DeviceMesh([[0, 1], [2, 3]], ("x", "y"))
    assert a != DeviceMesh([[0, 2], [1, 3]], ("dp", "tp"))


def test_constructor_does_no_io_and_rank_queries_need_a_world() -> None:
    mesh = DeviceMesh(np.arange(64).reshape(4, 4, 4), ("pp", "dp", "tp"))
    assert mesh.size("tp") == 4  # no world exists: nothing was contacted
    with pytest.raises(RendezvousError, match="not initialized"):
        mesh.get_rank()
    with pytest.raises(RendezvousError, match="not initialized"):
        mesh.get_group("tp")


def test_visualize_text_marks_rank_and_groups(capsys: pytest.CaptureFixture[str]) -> None:
    DeviceMesh(np.arange(8).reshape(2, 4), ("dp", "tp")).visualize(rank=5)
    text = capsys.readouterr().out
    assert "rank 5 at dp=1, tp=1" in text
    assert "[ 5]" in text or "[5]" in text
    assert "*(1, 5)" in text and "*(4, 5, 6, 7)" in text
    DeviceMesh(np.arange(8).reshape(2, 2, 2), ("pp", "dp", "tp")).visualize(rank=9)
    text = capsys.readouterr().out
    assert "rank 9 is not in this mesh" in text and "pp=1:" in text


def test_visualize_cuts_long_group_lists(capsys: pytest.CaptureFixture[str]) -> None:
    DeviceMesh(np.arange(64).reshape(32, 2), ("dp", "tp")).visualize(rank=63)
    text = capsys.readouterr().out
    assert "(32 groups)" in text and "*(62, 63)" in text


def test_html_highlights_this_rank() -> None:
    html = DeviceMesh(np.arange(8).reshape(2, 4), ("dp", "tp"))._repr_html_()
    assert html.count("<td") == 8 and "font-weight:bold" not in html  # no world: no rank
    from meshcomm.mesh.drawing import render_html

    html = render_html(DeviceMesh(np.arange(8).reshape(2, 4), ("dp", "tp")), 6)
    assert "font-weight:bold" in html and "dp=1" in html


# -- the ambient mesh -----------------------------------------------------------------------
def test_with_mesh_nests_and_restores() -> None:
    a, b = DeviceMesh([0], "x"), DeviceMesh([0], "y")
    assert current_mesh() is None
    with a:
        assert current_mesh() is a
        with b as entered:
            assert entered is b and current_mesh() is b
            with a:
                assert current_mesh() is a
            assert current_mesh() is b
        assert current_mesh() is a
    assert current_mesh() is None


def test_with_mesh_is_per_thread() -> None:
    a, b = DeviceMesh([0], "x"), DeviceMesh([0], "y")
    seen: dict[str, Any] = {}
    ready, release = threading.Event(), threading.Event()

    def other() -> None:
        seen["before"] = current_mesh()
        with b:
            ready.set()
            release.wait(10)
            seen["inside"] = current_mesh()
        seen["after"] = current_mesh()

    with a:
        t = threading.Thread(target=other)
        t.start()
        assert ready.wait(10)
        assert current_mesh() is a  # the other thread's `with b` does not leak here
        release.set()
        t.join(10)
    assert seen == {"before": None, "inside": b, "after": None}


def test_with_mesh_exit_out_of_order_raises() -> None:
    a, b = DeviceMesh([0], "x"), DeviceMesh([0], "y")
    a.__enter__()
    b.__enter__()
    with pytest.raises(InvalidArgument, match="order"):
        a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    a.__exit__(None, None, None)
    assert current_mesh() is None


# -- init_device_mesh: shape rules (no world needed for the errors) -------------------------
@pytest.mark.parametrize(
    ("shape", "error", "match"),
    [
        ((2, 0), InvalidArgument, ">= 1"),
        ((-1, -1), InvalidArgument, "only one axis"),
        ((2, -3), InvalidArgument, ">= 1"),
        ((), InvalidArgument, "at least one axis"),
        ((2.0, 4), TypeError, "ints"),
        ("24", TypeError, "ints"),
    ],
)
def test_init_device_mesh_rejects_bad_shapes_before_joining(
    shape: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        init_device_mesh(shape)
    assert not world.is_initialized()


def test_init_device_mesh_rejects_bad_names_before_joining() -> None:
    with pytest.raises(InvalidArgument, match="2 names"):
        init_device_mesh((8,), ("a", "b"))
    assert not world.is_initialized()


def test_shape_inference_and_the_world_size_check() -> None:
    assert infer_mesh_shape((-1, 4), 8) == (2, 4)
    assert infer_mesh_shape((2, -1, 2), 8) == (2, 2, 2)
    with pytest.raises(InvalidArgument, match=r"\(2, 4\) has 8 ranks but the world has 4"):
        infer_mesh_shape((2, 4), 4)
    with pytest.raises(InvalidArgument, match="6 is not divisible by 4"):
        infer_mesh_shape((-1, 4), 6)


# -- a world of one, in this process -------------------------------------------------------
def test_world_of_one_mesh() -> None:
    mesh = init_device_mesh((1, -1, 1), ("pp", "dp", "tp"))
    assert world.is_initialized()
    assert mesh.shape == (1, 1, 1)
    assert mesh.get_rank() == 0 and mesh.get_coordinate() == (0, 0, 0)
    assert mesh.get_local_rank("dp") == 0
    groups = mesh.get_all_groups()
    assert [g.size for g in groups] == [1, 1, 1]
    assert all(g is world.get_world() for g in groups)  # each spans the world: no split
    assert mesh["tp"].mesh.tolist() == [0]
    assert mesh["tp", "pp"].mesh_dim_names == ("tp", "pp")
    assert mesh.flatten().mesh_dim_names == ("pp_dp_tp",)
    assert mesh.get_group(("tp", "dp")).size == 1
    with pytest.raises(InvalidArgument, match="needs a dim"):
        mesh.get_local_rank()
    with pytest.raises(InvalidArgument, match="2 ranks but the world has 1"):
        init_device_mesh((2,))


def test_world_of_one_backend_check() -> None:
    world.init(world_size=1)
    assert init_device_mesh((1,), backend="tcp").size() == 1  # "self" stands in for any
    assert init_device_mesh(1).mesh_dim_names == ("dim0",)


def test_mesh_ranks_outside_the_world_are_refused() -> None:
    made_before_init = DeviceMesh([0, 1], "x")  # no world yet: checked at first need
    world.init(world_size=1)
    with pytest.raises(InvalidArgument, match=r"holds ranks \[1\], which are not members"):
        made_before_init.get_all_groups()
    # With a world (or a group) in hand the constructor checks, before anything uses it.
    with pytest.raises(InvalidArgument, match=r"holds ranks \[1\], which are not members"):
        DeviceMesh([0, 1], "x")
    with pytest.raises(InvalidArgument, match=r"holds ranks \[3, 4\], which are not members"):
        DeviceMesh([[3, 4]], ("a", "b"), group=world.get_world())


def test_flatten_rules() -> None:
    world.init(world_size=1)
    mesh = DeviceMesh(np.zeros((1, 1, 1), dtype=int), ("pp", "dp", "tp"))
    assert mesh.flatten(("tp", "pp"), name="tp_pp").mesh_dim_names == ("tp_pp", "dp")
    assert mesh.flatten(("dp",), name="dp").mesh_dim_names == ("pp", "dp", "tp")
    with pytest.raises(InvalidArgument, match="clashes"):
        mesh.flatten(("dp", "tp"), name="pp")
    flat = mesh.flatten(("dp", "tp"))
    assert flat.mesh_dim_names == ("pp", "dp_tp") and flat.shape == (1, 1)


# -- real worlds: 8 ranks over tcp ----------------------------------------------------------
def _count_splits(group: Any) -> list[Any]:
    """Wrap ``group.split`` and ``group.subgroup`` on this instance to record every group
    made from it."""
    calls: list[Any] = []

    def counted(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(args)
            return original(*args, **kwargs)

        return call

    group.split = counted(group.split)
    group.subgroup = counted(group.subgroup)
    return calls


def _mesh_scenarios(group: Any) -> dict[str, Any]:
    from meshcomm import ops

    r = group.rank
    out: dict[str, Any] = {}
    splits = _count_splits(group)

    mesh = init_device_mesh((2, 4), ("dp", "tp"))
    out["splits_2x4"] = len(splits)
    out["coord"] = mesh.get_coordinate()
    out["local"] = (mesh.get_local_rank("dp"), mesh.get_local_rank("tp"))
    out["dp_ranks"] = mesh.get_group("dp").ranks
    out["tp_ranks"] = mesh.get_group(1).ranks
    out["tp_group_rank"] = mesh.get_group("tp").rank
    out["tp_slice"] = mesh["tp"].mesh.tolist()
    out["transposed"] = mesh["tp", "dp"].mesh.tolist()
    out["slice_splits"] = len(splits) - out["splits_2x4"]
    flat = mesh.flatten(("tp", "dp"), name="tp_dp")
    out["flat"] = (flat.mesh.tolist(), flat.get_group().ranks, flat.get_local_rank())
    both = mesh.get_group(("dp", "tp"))
    out["both_is_world"] = both is group
    before = len(splits)
    ops.psum(np.ones(1), ("tp", "dp"), mesh=mesh)  # same group as the flatten above
    ops.psum(np.ones(1), ("tp", "dp"), mesh=mesh)
    out["tuple_splits"] = len(splits) - before

    # Side by side: a second and third mesh over the same world, used interleaved.
    other = init_device_mesh((4, 2), ("a", "b"))
    line = init_device_mesh((8,), ("x",))
    out["line_group_is_world"] = line.get_group() is group
    out["interleaved"] = [
        int(ops.psum(np.array(r), "tp", mesh=mesh)),
        int(ops.psum(np.array(r), "a", mesh=other)),
        int(ops.psum(np.array(r), "x", mesh=line)),
        int(ops.psum(np.array(r), "dp", mesh=mesh)),
    ]

    cube = init_device_mesh((2, 2, 2), ("pp", "dp", "tp"))
    out["cube_groups"] = [g.ranks for g in cube.get_all_groups()]
    out["cube_sub"] = cube["dp", "tp"].mesh.tolist()
    out["splits_total"] = len(splits)

    # Any layout: a reversed grid; group ranks follow the grid, not the world order.
    rev = DeviceMesh(np.arange(8)[::-1].reshape(2, 4), ("dp", "tp"))
    out["rev"] = (
        rev.get_coordinate(),
        rev.get_group("tp").ranks,
        ops.axis_index("tp", mesh=rev),
        int(ops.psum(np.array(r), "tp", mesh=rev)),
    )

    # A mesh over half the world: all ranks make its groups, the others get [].
    half = DeviceMesh([[0, 1], [2, 3]], ("a", "b"))
    groups = half.get_all_groups()
    out["half"] = [g.ranks for g in groups]
    if groups:
        out["half_sum"] = int(ops.psum(np.array(r), "b", mesh=half))

    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        mesh.visualize()
    out["picture"] = buf.getvalue()
    return out


@needs_tcp
@pytest.mark.timeout(180)
def test_meshes_on_eight_ranks() -> None:
    from meshcomm.testing import run_ranks

    results = run_ranks(_mesh_scenarios, 8, timeout=150)
    for r, out in enumerate(results):
        dp, tp = divmod(r, 4)
        assert out["splits_2x4"] == 2, "one split per axis"
        assert out["coord"] == (dp, tp) and out["local"] == (dp, tp)
        assert out["dp_ranks"] == (tp, 4 + tp)
        assert out["tp_ranks"] == tuple(range(4 * dp, 4 * dp + 4))
        assert out["tp_group_rank"] == tp
        assert out["tp_slice"] == list(range(4 * dp, 4 * dp + 4))
        assert out["transposed"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
        assert out["slice_splits"] == 0
        order = [0, 4, 1, 5, 2, 6, 3, 7]
        assert out["flat"] == (order, tuple(order), order.index(r))
        assert out["both_is_world"]
        assert out["tuple_splits"] == 0, "the flatten already made the ('tp', 'dp') group"
        assert out["line_group_is_world"]
        assert out["interleaved"] == [
            sum(range(4 * dp, 4 * dp + 4)),
            sum(v for v in range(8) if v % 2 == r % 2),
            28,
            tp + 4 + tp,
        ]
        pp, rest = divmod(r, 4)
        cdp, ctp = divmod(rest, 2)
        assert out["cube_groups"] == [
            (rest, 4 + rest),
            (4 * pp + ctp, 4 * pp + 2 + ctp),
            (4 * pp + 2 * cdp, 4 * pp + 2 * cdp + 1),
        ]
        assert out["cube_sub"] == [[4 * pp, 4 * pp + 1], [4 * pp + 2, 4 * pp + 3]]
        # (2,4): 2 splits, flatten 1, (4,2): 2, (8,): 0, (2,2,2): 3.
        assert out["splits_total"] == 8
        rdp, rtp = divmod(7 - r, 4)
        row = tuple(range(7 - 4 * rdp, 3 - 4 * rdp, -1))
        assert out["rev"] == ((rdp, rtp), row, rtp, sum(row))
        if r < 4:
            a, b = divmod(r, 2)
            assert out["half"] == [(b, 2 + b), (2 * a, 2 * a + 1)]
            assert out["half_sum"] == 4 * a + 1
        else:
            assert out["half"] == []
    picture = results[5]["picture"]
    assert "rank 5 at dp=1, tp=1" in picture and "*(4, 5, 6, 7)" in picture


def _tuple_axis_used_by_one_slice(group: Any) -> list[Any]:
    from meshcomm import ops

    mesh = init_device_mesh((2, 2, 2), ("pp", "dp", "tp"))
    pp = mesh.get_coordinate()[0]
    got = None
    if pp == 0:  # the pp=1 slice never uses ("dp", "tp")
        got = float(ops.psum(np.float64(group.rank), ("dp", "tp"), mesh=mesh))
        again = float(ops.psum(np.float64(1.0), ("tp", "dp"), mesh=mesh))  # transposed: its own
        assert again == 4.0
    # ... and everyone goes on with the axes made at init.
    total = float(ops.psum(np.float64(group.rank), ("pp",), mesh=mesh))
    return [got, total]


def test_a_tuple_axis_used_first_by_only_some_ranks() -> None:
    from meshcomm.testing import run_ranks

    results = run_ranks(_tuple_axis_used_by_one_slice, 8, timeout=120)
    for rank, (got, total) in enumerate(results):
        assert got == (0 + 1 + 2 + 3 if rank < 4 else None), (rank, got)
        assert total == rank % 4 + rank % 4 + 4, (rank, total)
