"""meshcomm.init / shutdown: the lifecycle of the default world, and real multi-rank worlds.

In-process tests use a world of one (the process's one default world, reset after each
test). Multi-rank worlds run as separate processes over env://, tcp://, file://, a
launcher-hosted store, and under a real ``mpiexec`` (marked ``mpi``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshcomm import world
from meshcomm.errors import InvalidArgument, MeshCommError, RendezvousError
from meshcomm.store import HashStore

_spec = importlib.util.spec_from_file_location(
    "rdzv_ranks", Path(__file__).parent / "scripts" / "rdzv_ranks.py"
)
assert _spec is not None and _spec.loader is not None
ranks = importlib.util.module_from_spec(_spec)
sys.modules["rdzv_ranks"] = ranks
_spec.loader.exec_module(ranks)


@pytest.fixture(autouse=True)
def _fresh_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No launcher variables leak in, and no test leaves the world initialized."""
    for key in [k for k in os.environ if ranks.is_launcher_var(k)]:
        monkeypatch.delenv(key)
    world.shutdown()
    yield
    world.shutdown()


# -- a world of one, in this process -------------------------------------------------------


def test_init_without_arguments_is_a_world_of_one() -> None:
    assert not world.is_initialized()
    group = world.init(timeout=timedelta(seconds=10))
    assert world.is_initialized()
    assert (group.rank, group.size, tuple(group.ranks)) == (0, 1, (0,))
    assert world.get_world() is group
    assert group.store is not None
    group.store.set("k", "v")
    assert group.store.get("k") == b"v"
    info = world.get_world_info()
    assert (info.launcher, info.local_rank, info.local_world_size) == ("single", 0, 1)


def test_world_of_one_runs_collectives() -> None:
    group = world.init()
    out = group.all_reduce(np.arange(4.0))
    assert np.array_equal(out, np.arange(4.0))


def test_double_init_raises() -> None:
    world.init()
    with pytest.raises(RendezvousError, match="already called"):
        world.init()
    assert world.is_initialized()


def test_get_world_before_init_raises() -> None:
    with pytest.raises(RendezvousError, match="not initialized"):
        world.get_world()
    with pytest.raises(RendezvousError, match="not initialized"):
        world.get_world_info()
    fresh = world.World()
    with pytest.raises(RendezvousError, match=r"not initialized; call meshcomm.init\(\) first"):
        _ = fresh.group


def test_shutdown_then_use_raises_and_shutdown_twice_is_a_no_op() -> None:
    group = world.init()
    world.shutdown()
    assert not world.is_initialized()
    with pytest.raises(RendezvousError, match=r"shutdown\(\) was called"):
        world.get_world()
    with pytest.raises(MeshCommError):
        group.all_reduce(np.ones(2))
    world.shutdown()
    world.shutdown()
    assert not world.is_initialized()


def test_init_again_after_shutdown() -> None:
    first = world.init()
    world.shutdown()
    second = world.init()
    assert second is not first and second.size == 1
    assert world.get_world() is second


def test_shutdown_before_init_is_a_no_op() -> None:
    world.shutdown()
    assert not world.is_initialized()


def test_explicit_store_world_of_one() -> None:
    store = HashStore(timeout=5)
    group = world.init(store=store, rank=0, world_size=1)
    group.store.set("x", "1")
    world.shutdown()
    # The caller's store stays open: meshcomm did not create it, so it does not close it.
    assert store.num_keys() > 0
    # A second world on the same store starts clean (its keys live under a new generation).
    assert world.init(store=store, rank=0, world_size=1).size == 1


def test_explicit_world_of_one_over_tcp_and_file(tmp_path: Path) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    group = world.init(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=10)
    assert world.get_world_info().address == f"tcp://127.0.0.1:{port}"
    group.store.set("a", "b")
    world.shutdown()
    world.init(init_method=f"file://{tmp_path / 'store'}", world_size=1)
    assert world.get_world_info().address.startswith("file://")


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"backend": "gloo"}, InvalidArgument, "unknown backend 'gloo'"),
        ({"backend": 3}, TypeError, "backend must be a str"),
        ({"timeout": 0}, InvalidArgument, "positive"),
        ({"rank": 1, "world_size": 1}, InvalidArgument, "rank must be in [0, 1)"),
        ({"world_size": 0}, InvalidArgument, "world size must be >= 1"),
        ({"init_method": "udp://x:1"}, InvalidArgument, "unsupported scheme"),
        ({"store": HashStore()}, InvalidArgument, "rank and world_size are required"),
    ],
)
def test_bad_init_arguments_leave_the_world_uninitialized(
    kwargs: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error) as info:
        world.init(**kwargs)
    assert fragment in str(info.value)
    assert not world.is_initialized()


def test_bad_environment_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "abc")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InvalidArgument, match=r"RANK .* must be an integer, got 'abc'"):
        world.init()


def test_failed_rendezvous_leaves_the_world_uninitialized() -> None:
    # Rank 1 of 2 never comes: rank 0 times out, names it, and can try again afterwards.
    with pytest.raises(RendezvousError, match=r"rank\(s\) \[1\] never arrived"):
        world.init(store=HashStore(), rank=0, world_size=2, timeout=0.5)
    assert not world.is_initialized()
    assert world.init().size == 1


def test_independent_world_objects() -> None:
    a, b = world.World(), world.World()
    ga = a.init(world_size=1)
    gb = b.init(world_size=1)
    assert ga is not gb and a.is_initialized() and b.is_initialized()
    assert not world.is_initialized()
    a.shutdown()
    b.shutdown()


# -- worlds of several processes -----------------------------------------------------------


def _cfg(**kwargs: Any) -> dict[str, Any]:
    return {"api": "init", "kwargs": kwargs, "try_collective": True}


def _check_world(results: list[dict[str, Any]], size: int) -> None:
    assert [r["ok"] for r in results] == [True] * size, results
    assert sorted(r["rank"] for r in results) == list(range(size))
    for result in results:
        assert result["size"] == size
        assert result["ranks"] == list(range(size))
        # Values travel through the world's store between every pair of ranks.
        assert sorted(result["values"]) == [str(r) for r in range(size)]
        for r, value in result["values"].items():
            assert value.startswith(f"hello from rank {r} ")
        # Collectives either work (tcp backend present) or say clearly why not.
        collective = result["collective"]
        assert collective == "ok" or "the tcp backend is not available yet" in collective


def _port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_init_over_env_meshcomm_variables(tmp_path: Path) -> None:
    port = str(_port())
    specs = [
        (
            ranks.clean_env(
                {
                    "MESHCOMM_RANK": str(r),
                    "MESHCOMM_WORLD_SIZE": "3",
                    "MESHCOMM_LOCAL_RANK": str(r),
                    "MESHCOMM_LOCAL_WORLD_SIZE": "3",
                    "MESHCOMM_MASTER_ADDR": "127.0.0.1",
                    "MESHCOMM_MASTER_PORT": port,
                }
            ),
            _cfg(timeout=60),
        )
        for r in range(3)
    ]
    results = ranks.launch(specs, tmp_path, deadline_s=120)
    _check_world(results, 3)
    assert [(r["launcher"], r["local_rank"]) for r in results] == [
        ("meshcomm", 0),
        ("meshcomm", 1),
        ("meshcomm", 2),
    ]


def test_init_over_tcp(tmp_path: Path) -> None:
    url = f"tcp://localhost:{_port()}"
    env = ranks.clean_env()
    specs = [(env, _cfg(init_method=url, rank=r, world_size=2, timeout=60)) for r in (1, 0)]
    _check_world(ranks.launch(specs, tmp_path, deadline_s=120), 2)


def test_init_over_file(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'rdzv'}"
    env = ranks.clean_env()
    specs = [(env, _cfg(init_method=url, rank=r, world_size=4, timeout=60)) for r in range(4)]
    _check_world(ranks.launch(specs, tmp_path, deadline_s=120), 4)


def test_init_with_a_launcher_hosted_store(tmp_path: Path) -> None:
    from meshcomm.store.server import StoreServer

    server = StoreServer("127.0.0.1", 0)
    server.start()
    try:
        specs = [
            (
                ranks.clean_env(
                    {
                        "RANK": str(r),
                        "WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(server.port),
                        "MESHCOMM_STORE_HOSTED": "1",
                    }
                ),
                _cfg(timeout=60),
            )
            for r in range(2)
        ]
        results = ranks.launch(specs, tmp_path, deadline_s=120)
    finally:
        server.close()
    _check_world(results, 2)
    # Rank 0 connected as a client: the launcher's server is the only one.
    assert [r["hosts_server"] for r in results] == [False, False]


def test_world_forms_without_the_tcp_backend(tmp_path: Path) -> None:
    # Until a tcp backend can be imported, a world of several ranks still forms: its store
    # works, and its collectives raise a CommError that says why.
    url = f"file://{tmp_path / 'rdzv'}"
    cfg = dict(_cfg(init_method=url, world_size=2), block_modules=["meshcomm.backends.tcp"])
    specs = [(ranks.clean_env(), dict(cfg, kwargs={**cfg["kwargs"], "rank": r})) for r in (0, 1)]
    results = ranks.launch(specs, tmp_path, deadline_s=120)
    _check_world(results, 2)
    for result in results:
        assert result["collective"].startswith("CommError: rank ")
        assert "the tcp backend is not available yet" in result["collective"]


def test_store_host_outlives_ranks_still_using_it(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{_port()}"
    env = ranks.clean_env()
    specs = [
        (env, dict(_cfg(init_method=url, rank=0, world_size=2, timeout=60))),
        (env, dict(_cfg(init_method=url, rank=1, world_size=2, timeout=60), late_store_use=1.0)),
    ]
    results = ranks.launch(specs, tmp_path, deadline_s=120)
    assert [r["ok"] for r in results] == [True, True], results
    assert results[1]["values"]["late"] == "x"


def test_init_under_meshrun(tmp_path: Path) -> None:
    results = ranks.launch_meshrun(3, ranks.clean_env(), _cfg(timeout=60), tmp_path, 120)
    _check_world(results, 3)
    assert [(r["launcher"], r["local_rank"]) for r in results] == [
        ("torchrun", 0),
        ("torchrun", 1),
        ("torchrun", 2),
    ]
    # meshrun hosts the store (MESHCOMM_STORE_HOSTED=1): no rank runs a server.
    assert [r["hosts_server"] for r in results] == [False, False, False]


def test_init_duplicate_rank_and_missing_rank(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{_port()}"
    env = ranks.clean_env()
    dup = [(env, _cfg(init_method=url, rank=r, world_size=2, timeout=120)) for r in (0, 0)]
    # The second rank 0 finds the port taken, joins that server as a client, and its claim
    # on rank 0 fails: both processes learn it through the store at once, no timeout.
    results = ranks.launch(dup, tmp_path, deadline_s=60)
    assert [r["type"] for r in results] == ["RendezvousError"] * 2, results
    assert all("two processes claim rank 0" in r["message"] for r in results), results

    url = f"tcp://127.0.0.1:{_port()}"
    missing = [(env, _cfg(init_method=url, rank=r, world_size=3, timeout=3)) for r in (0, 1)]
    results = ranks.launch(missing, tmp_path, deadline_s=60)
    assert [r["type"] for r in results] == ["RendezvousError"] * 2, results
    assert all("rank(s) [2] never arrived" in r["message"] for r in results)


# -- under a real mpiexec -------------------------------------------------------------------


def _mpiexec() -> str:
    candidates = [
        Path(sys.executable).parent / "mpiexec",
        Path(__file__).parents[1] / ".venv/bin/mpiexec",
    ]
    for candidate in candidates:
        if candidate.exists():
            return str(candidate)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.skip("mpiexec is not installed (pip install meshcomm[mpi])")
    return found


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_mpiexec_finds_the_store_through_mpi(tmp_path: Path, n: int) -> None:
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install meshcomm[mpi])")
    mpiexec = _mpiexec()
    # No MASTER_ADDR/MASTER_PORT: rank 0 picks a free port and MPI carries its address. The
    # tcp backend is named: under mpiexec the default would be the mpi backend (no store).
    cfg = _cfg(timeout=60, backend="tcp")
    results = ranks.launch_mpi(mpiexec, n, ranks.clean_env(), cfg, tmp_path, 120)
    _check_world(results, n)
    assert {r["backend"] for r in results} == {"tcp"}
    assert {r["launcher"] for r in results} <= {"mpich", "openmpi"}
    assert [r["hosts_server"] for r in results] == [True] + [False] * (n - 1)
    # All ranks on this host: the store listens on loopback only.
    assert all(r["address"].startswith("tcp://127.0.0.1:") for r in results)
    assert len({r["address"] for r in results}) == 1
    assert [r["local_rank"] for r in results] == list(range(n))


@pytest.mark.mpi
def test_mpiexec_selects_the_mpi_backend_and_serves_its_own_store(tmp_path: Path) -> None:
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install meshcomm[mpi])")
    mpiexec = _mpiexec()
    cfg = dict(_cfg(timeout=60), exchange=False)
    results = ranks.launch_mpi(mpiexec, 3, ranks.clean_env(), cfg, tmp_path, 120)
    assert [r["ok"] for r in results] == [True] * 3, results
    assert [(r["rank"], r["size"], r["collective"]) for r in results] == [
        (r, 3, "ok") for r in range(3)
    ]
    assert {r["backend"] for r in results} == {"mpi"}, results
    # No store was given: rank 0 serves one for verdicts, its address and secret sent over MPI.
    assert {r["store"] for r in results} == {"PrefixStore"}, results
    assert [r["hosts_server"] for r in results] == [True, False, False]
    # MESHCOMM_BACKEND names another backend: the usual store rendezvous over MPI.
    env = ranks.clean_env({"MESHCOMM_BACKEND": "tcp"})
    results = ranks.launch_mpi(mpiexec, 2, env, _cfg(timeout=60), tmp_path, 120)
    _check_world(results, 2)
    assert {r["backend"] for r in results} == {"tcp"}, results


def test_meshrun_inside_mpiexec_does_not_select_mpi(tmp_path: Path) -> None:
    # The launcher's variables of an outer mpiexec leak into meshrun's ranks; meshrun's win.
    outer = {"PMI_RANK": "0", "PMI_SIZE": "1", "PMI_FD": "9"}
    results = ranks.launch_meshrun(2, ranks.clean_env(outer), _cfg(timeout=60), tmp_path, 120)
    _check_world(results, 2)
    assert {r["backend"] for r in results} == {"tcp"}, results


def test_lone_process_ignores_a_stale_master_address(monkeypatch: pytest.MonkeyPatch) -> None:
    # Left over in the shell, with nothing listening there: a lone process must not use it.
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET-1, never routable
    monkeypatch.setenv("MASTER_PORT", "9")
    world.init(timeout=5)
    assert "HashStore" in world.get_world_info().address
