"""meshcomm.jupyter with real ipyparallel engines: rendezvous, mesh, errors, stop, detection."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from ipyparallel.error import CompositeError

from meshcomm.errors import InvalidArgument, MeshCommError, RendezvousError
from meshcomm.jupyter import MeshCluster, start_cluster
from meshcomm.launch import detect_ipyparallel
from meshcomm.rendezvous import rendezvous
from meshcomm.store import HashStore

# Generous bounds: a 2-core machine starts Python interpreters slowly.
START_TIMEOUT = 150.0
CALL_TIMEOUT = 60.0
GONE_WITHIN = 20.0

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ipython_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Keep IPython's and ipyparallel's files (profiles, cluster files) out of $HOME."""
    path = tmp_path_factory.mktemp("ipython")
    old = os.environ.get("IPYTHONDIR")
    os.environ["IPYTHONDIR"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("IPYTHONDIR", None)
        else:
            os.environ["IPYTHONDIR"] = old


@pytest.fixture(scope="module")
def cluster(ipython_dir: Path) -> Iterator[MeshCluster]:
    mc = start_cluster(4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp"), timeout=START_TIMEOUT)
    try:
        yield mc
    finally:
        mc.stop()


def engine_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``fn`` run against the engine's namespace, as a function from a notebook cell does.

    ipyparallel re-imports a function's module on the engine for its globals; this test module
    is not importable there, and a notebook's functions live in ``__main__``, whose globals on
    the engine are the engine's namespace (``rank``, ``mesh``, ``world``, ...).
    """
    fn.__module__ = "__main__"
    return fn


# -- what the engines run (their namespace defines rank, world_size, world, mesh) ---------------
# ruff: noqa: F821


@engine_fn
def who_am_i() -> tuple[int, int, int]:
    return rank, meshcomm.get_world().rank, world_size


@engine_fn
def my_secret() -> tuple[str, bool]:
    import hashlib
    import os

    secret = os.environ.get("MESHCOMM_SECRET", "")
    store = meshcomm.get_world_info().raw_store
    return hashlib.sha256(secret.encode()).hexdigest(), bool(store.authenticated) and bool(secret)


@engine_fn
def my_coordinate() -> tuple[int, ...]:
    return mesh.get_coordinate()


@engine_fn
def count_ranks() -> int:
    return int(world.all_reduce(np.ones(1))[0])


@engine_fn
def mesh_html() -> str:
    return mesh._repr_html_()


@engine_fn
def backend_name() -> str:
    return world.backend


@engine_fn
def ranked_sum() -> list[float]:
    return world.all_reduce(np.arange(3.0) + rank).tolist()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + GONE_WITHIN
    while time.monotonic() < deadline:
        left = [pid for pid in pids if _alive(pid)]
        if not left:
            return []
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


# -- pure detection ---------------------------------------------------------------------------


def test_detect_ipyparallel_from_environment() -> None:
    env = {"IPP_CLUSTER_ID": "1700000000-ab12", "IPP_PROFILE_DIR": "/tmp/p"}
    assert detect_ipyparallel(env) == "ipyparallel engine (cluster 1700000000-ab12)"
    assert detect_ipyparallel({"IPP_CONNECTION_INFO": "{}"}, engine_id=2) == (
        "ipyparallel engine 2 (IPP_CONNECTION_INFO set)"
    )
    assert detect_ipyparallel({"IPP_NONINTERACTIVE": "1"}) is None
    assert detect_ipyparallel({}) is None


def test_rendezvous_refuses_a_bare_engine_but_takes_explicit_ranks() -> None:
    env = {"IPP_CLUSTER_ID": "1700000000-ab12"}
    with pytest.raises(RendezvousError, match=r"ipyparallel engine \(cluster 1700000000-ab12\)"):
        rendezvous(env=env, timeout=5)
    rdzv = rendezvous(rank=0, world_size=1, store=HashStore(), env=env, timeout=5)
    assert (rdzv.rank, rdzv.world_size) == (0, 1)
    rdzv.close()
    launched = {**env, "MESHCOMM_RANK": "0", "MESHCOMM_WORLD_SIZE": "1"}
    rdzv = rendezvous(env=launched, timeout=5)  # a launcher's variables win
    assert rdzv.launcher == "meshcomm"
    rdzv.close()


# -- bad arguments fail before anything starts -------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, "n must be >= 1 engines, got 0"),
        ({"n": 2, "backend": "nccl"}, "backend must be one of tcp, mpi, got 'nccl'"),
        ({"n": 4, "mesh_shape": (3, 2)}, "has 6 ranks but the world has 4"),
        ({"n": 4, "mesh_dim_names": ("dp",)}, "without mesh_shape"),
        ({"n": 4, "mesh_shape": (2, 2), "mesh_dim_names": ("dp",)}, "dp"),
    ],
)
def test_bad_arguments_raise_before_starting(kwargs: dict, match: str) -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(InvalidArgument, match=match):
        start_cluster(**kwargs)
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


# -- a running cluster ------------------------------------------------------------------------


def test_engines_are_ranks_with_a_mesh(cluster: MeshCluster) -> None:
    assert cluster.n == 4
    assert cluster.engine_ids == [0, 1, 2, 3]
    assert 1 <= cluster.master_port <= 65535
    assert cluster.startup_seconds > 0
    ranks = cluster.apply(who_am_i, timeout=CALL_TIMEOUT)
    assert ranks == [(r, r, 4) for r in range(4)]
    coords = cluster.apply(my_coordinate, timeout=CALL_TIMEOUT)
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_engines_share_a_secret_and_an_authenticated_store(cluster: MeshCluster) -> None:
    answers = cluster.apply(my_secret, timeout=CALL_TIMEOUT)
    assert len({digest for digest, _ in answers}) == 1, answers
    assert all(authenticated for _, authenticated in answers), answers


def test_psum_and_all_gather_match_numpy(cluster: MeshCluster) -> None:
    cluster.view.execute(
        "x = np.arange(6, dtype=np.float64).reshape(2, 3) * (rank + 1)\n"
        "with mesh:\n"
        "    tp_sum = ops.psum(x, 'tp')\n"
        "    dp_sum = ops.psum(x, 'dp')\n"
        "    everything = ops.psum(x, ('dp', 'tp'))\n"
        "    gathered = ops.all_gather(x, 'tp', tiled=True)\n",
        block=False,
    ).get(timeout=CALL_TIMEOUT)
    xs = [np.arange(6, dtype=np.float64).reshape(2, 3) * (r + 1) for r in range(4)]
    grid = np.arange(4).reshape(2, 2)
    tp_sum = cluster.gather("tp_sum", timeout=CALL_TIMEOUT)
    dp_sum = cluster.gather("dp_sum", timeout=CALL_TIMEOUT)
    everything = cluster.gather("everything", timeout=CALL_TIMEOUT)
    gathered = cluster.gather("gathered", timeout=CALL_TIMEOUT)
    for r in range(4):
        row, col = divmod(r, 2)
        np.testing.assert_array_equal(tp_sum[r], sum(xs[q] for q in grid[row]))
        np.testing.assert_array_equal(dp_sum[r], sum(xs[q] for q in grid[:, col]))
        np.testing.assert_array_equal(everything[r], sum(xs))
        np.testing.assert_array_equal(gathered[r], np.concatenate([xs[q] for q in grid[row]]))


def test_the_mesh_is_ambient_on_the_engines(cluster: MeshCluster) -> None:
    cluster.view.execute("ambient = ops.psum(np.full(2, rank), 'tp')", block=False).get(
        timeout=CALL_TIMEOUT
    )
    assert [a.tolist() for a in cluster.gather("ambient")] == [[1, 1], [1, 1], [5, 5], [5, 5]]


def test_cell_error_names_the_rank(cluster: MeshCluster) -> None:
    with pytest.raises(CompositeError) as info:
        cluster.view.execute("if rank == 1:\n    1 / 0", block=False).get(timeout=CALL_TIMEOUT)
    err = info.value
    assert len(err.elist) == 1
    assert "[1:execute]ZeroDivisionError" in str(err)
    assert "(raised on meshcomm rank 1 of 4)" in "\n".join(err.render_traceback())
    # The world survives a failing cell.
    assert cluster.apply(count_ranks, timeout=CALL_TIMEOUT) == [4] * 4


def test_apply_error_names_the_rank(cluster: MeshCluster) -> None:
    def fails_on_rank_three() -> int:
        if rank == 3:
            raise RuntimeError("bad shard")
        return 0

    with pytest.raises(CompositeError) as info:
        cluster.apply(engine_fn(fails_on_rank_three), timeout=CALL_TIMEOUT)
    assert "[3:apply]RuntimeError: bad shard" in str(info.value)
    assert "(raised on meshcomm rank 3 of 4)" in "\n".join(info.value.render_traceback())


def test_init_in_an_engine_without_a_rank_says_what_it_needs(cluster: MeshCluster) -> None:
    def bare_init() -> str:
        import os

        from meshcomm.world import World

        saved = {k: v for k, v in os.environ.items() if k.startswith("MESHCOMM_")}
        for key in saved:
            del os.environ[key]
        try:
            World().init(timeout=5)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            os.environ.update(saved)  # later tests restart the world on this engine
        return "no error"

    messages = (
        cluster.client[cluster.engine_ids[2]]
        .apply_async(engine_fn(bare_init))
        .get(timeout=CALL_TIMEOUT)
    )
    assert messages.startswith("RendezvousError: meshcomm.init() runs in an ipyparallel engine 2 ")
    assert "meshcomm.jupyter.start_cluster(n=...)" in messages
    assert "MESHCOMM_RANK" in messages


def test_visualize_renders_html_on_engines(cluster: MeshCluster) -> None:
    pages = cluster.apply(mesh_html, timeout=CALL_TIMEOUT)
    assert all("<table" in page for page in pages)
    assert pages[0] != pages[3]  # each marks its own rank


def test_world_restarts_on_the_engines(cluster: MeshCluster) -> None:
    cluster.view.execute(
        "meshcomm.shutdown()\n"
        "world = meshcomm.init(timeout=60)\n"
        "mesh = meshcomm.init_device_mesh((2, 2), ('dp', 'tp')).__enter__()\n",
        block=False,
    ).get(timeout=CALL_TIMEOUT)
    assert cluster.apply(count_ranks, timeout=CALL_TIMEOUT) == [4] * 4
    assert cluster.apply(my_coordinate, timeout=CALL_TIMEOUT) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_rank_failing_before_a_collective_is_named_by_the_others(ipython_dir: Path) -> None:
    with start_cluster(2, mesh_shape=(2,), mesh_dim_names=("tp",), op_timeout=5) as mc:
        with pytest.raises(CompositeError) as info:
            mc.view.execute(
                "if rank == 1:\n    raise ValueError('boom')\ny = ops.psum(np.ones(1), 'tp')",
                block=False,
            ).get(timeout=CALL_TIMEOUT)
        errors = {entry[3]["engine_id"]: entry for entry in info.value.elist}
        assert errors[1][:2] == ("ValueError", "boom")
        assert errors[0][0] == "CommTimeout"
        assert "rank 0: no progress for 5 s" in errors[0][1]
        assert "rank 1" in errors[0][1].split("still waiting")[1]


# -- stopping ---------------------------------------------------------------------------------


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_stop_leaves_no_engine_processes(ipython_dir: Path) -> None:
    before = _children()
    mc = start_cluster(2, timeout=START_TIMEOUT)
    try:
        started = _children() - before  # controller, engines, their nannies
        pids = list(mc.pids)
        assert set(pids) <= started
        assert len(pids) == 2
        assert all(_alive(pid) for pid in pids)
        assert mc.apply(count_ranks, timeout=CALL_TIMEOUT) == [2, 2]
    finally:
        mc.stop()
    assert mc.stopped
    assert _wait_gone(sorted(started)) == []
    mc.stop()  # idempotent
    with pytest.raises(MeshCommError, match="stopped"):
        mc.gather("rank")


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH")
def test_mpi_engines(ipython_dir: Path) -> None:
    pytest.importorskip("mpi4py")
    before = _children()
    with start_cluster(2, backend="mpi", timeout=START_TIMEOUT) as mc:
        started = _children() - before  # mpiexec, its proxy, engines, nannies, controller
        assert set(mc.pids) <= started
        assert mc.apply(who_am_i, timeout=CALL_TIMEOUT) == [(0, 0, 2), (1, 1, 2)]
        assert mc.apply(backend_name, timeout=CALL_TIMEOUT) == ["mpi", "mpi"]
        sums = mc.apply(ranked_sum, timeout=CALL_TIMEOUT)
        assert sums == [[1.0, 3.0, 5.0]] * 2
    assert _wait_gone(sorted(started)) == []
