"""Rendezvous: launcher detection (pure), URL parsing, validation, and the agreement protocol.

Protocol tests run real ranks: threads sharing one in-process HashStore, and separate
processes over tcp://, env:// and file://. Every multi-rank test has a hard deadline, and
error cases must finish well before their rendezvous timeout (they may not wait it out).
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from meshcomm.errors import InvalidArgument, RendezvousError
from meshcomm.launch import LaunchInfo, detect_launch, expand_nodelist
from meshcomm.rendezvous import InitMethod, parse_init_method, rendezvous
from meshcomm.store import HashStore

_spec = importlib.util.spec_from_file_location(
    "rdzv_ranks", Path(__file__).parent / "scripts" / "rdzv_ranks.py"
)
assert _spec is not None and _spec.loader is not None
ranks = importlib.util.module_from_spec(_spec)
sys.modules["rdzv_ranks"] = ranks
_spec.loader.exec_module(ranks)

# -- detect_launch: a pure function over a mapping ------------------------------------------


def test_no_launcher_is_a_world_of_one() -> None:
    assert detect_launch({}) == LaunchInfo("single", 0, 1, 0, 1, None, None)
    # Inside an sbatch allocation, but not started by srun: still one process.
    alloc = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "77"}
    assert detect_launch(alloc).launcher == "single"


def test_meshcomm_variables() -> None:
    env = {
        "MESHCOMM_RANK": "3",
        "MESHCOMM_WORLD_SIZE": "8",
        "MESHCOMM_LOCAL_RANK": "1",
        "MESHCOMM_LOCAL_WORLD_SIZE": "2",
        "MESHCOMM_MASTER_ADDR": "node0",
        "MESHCOMM_MASTER_PORT": "1234",
    }
    assert detect_launch(env) == LaunchInfo("meshcomm", 3, 8, 1, 2, "node0", 1234)


def test_torchrun_variables() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "6",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "3",
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": "29500",
    }
    assert detect_launch(env) == LaunchInfo("torchrun", 5, 6, 2, 3, "10.1.2.3", 29500)


def test_open_mpi_variables() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    assert detect_launch(env) == LaunchInfo("openmpi", 1, 4, 1, 2, None, None)


def test_mpich_hydra_variables() -> None:
    env = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"}
    assert detect_launch(env) == LaunchInfo("mpich", 2, 3, 2, 3, None, None)


def test_slurm_srun_variables() -> None:
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "6",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2),2",
        "SLURM_NODELIST": "node[03-05,07],gpu1",
        "SLURM_JOB_ID": "15042",
    }
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size) == ("slurm", 5, 6)
    assert (info.local_rank, info.local_world_size) == (1, 2)
    assert info.master_addr == "node03"
    # No MASTER_PORT: every rank derives the same port from the job id.
    assert info.master_port == detect_launch(dict(env, SLURM_PROCID="0")).master_port
    assert info.master_port is not None and 1 <= info.master_port <= 65535


def test_slurm_old_step_variable_and_explicit_master() -> None:
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_STEPID": "3",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "a1",
        "MASTER_ADDR": "login",
        "MASTER_PORT": "4000",
    }
    info = detect_launch(env)
    assert (info.launcher, info.local_world_size) == ("slurm", 2)
    assert (info.master_addr, info.master_port) == ("login", 4000)


@pytest.mark.parametrize(
    ("spec", "node", "expected"),
    [("2(x3),1", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("4", 0, 4), ("2(x3)", 5, None)],
)
def test_slurm_tasks_per_node(spec: str, node: int, expected: int | None) -> None:
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "7",
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": str(node),
        "SLURM_STEP_TASKS_PER_NODE": spec,
    }
    assert detect_launch(env).local_world_size == expected


def test_precedence_order() -> None:
    layers = [
        ("meshcomm", {"MESHCOMM_RANK": "0", "MESHCOMM_WORLD_SIZE": "10"}),
        ("torchrun", {"RANK": "1", "WORLD_SIZE": "11"}),
        ("openmpi", {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "12"}),
        ("mpich", {"PMI_RANK": "3", "PMI_SIZE": "13"}),
        ("slurm", {"SLURM_PROCID": "4", "SLURM_NTASKS": "14", "SLURM_STEP_ID": "0"}),
    ]
    # With every launcher's variables present, each one wins over those after it.
    for i, (name, _) in enumerate(layers):
        env: dict[str, str] = {}
        for _, variables in layers[i:]:
            env.update(variables)
        info = detect_launch(env)
        assert (info.launcher, info.rank, info.world_size) == (name, i, 10 + i)


def test_master_address_precedence() -> None:
    env = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "torch-host",
        "MASTER_PORT": "1111",
        "MESHCOMM_MASTER_ADDR": "mesh-host",
        "MESHCOMM_MASTER_PORT": "2222",
    }
    info = detect_launch(env)
    assert (info.master_addr, info.master_port) == ("mesh-host", 2222)
    # Under MPI a user-given MASTER_ADDR still counts (it skips the MPI bootstrap).
    mpi = {"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "5"}
    assert (detect_launch(mpi).master_addr, detect_launch(mpi).master_port) == ("h", 5)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, "rank0"),
        # torchrun's agent serves its own TCPStore on MASTER_PORT; torch writes "True".
        ({"TORCHELASTIC_USE_AGENT_STORE": "True"}, "torchelastic"),
        ({"TORCHELASTIC_USE_AGENT_STORE": "true"}, "torchelastic"),
        ({"TORCHELASTIC_USE_AGENT_STORE": "1"}, "torchelastic"),
        ({"TORCHELASTIC_USE_AGENT_STORE": "False"}, "rank0"),
        ({"TORCHELASTIC_USE_AGENT_STORE": "0"}, "rank0"),
        ({"MESHCOMM_STORE_HOSTED": "1"}, "launcher"),
        # Explicit meshcomm settings win over the inherited torch flag.
        ({"MESHCOMM_STORE_HOSTED": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}, "launcher"),
        ({"TORCHELASTIC_USE_AGENT_STORE": "True", "MESHCOMM_MASTER_PORT": "7"}, "rank0"),
        ({"TORCHELASTIC_USE_AGENT_STORE": "True", "MESHCOMM_MASTER_ADDR": "h"}, "rank0"),
    ],
)
def test_who_serves_the_store(extra: dict[str, str], expected: str) -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
    info = detect_launch(env | extra)
    assert info.store_host == expected
    if expected == "torchelastic":
        # The agent's store is at the torch address, whatever else is set.
        assert (info.master_addr, info.master_port) == ("localhost", 29500)


def test_mpi_launchers_are_flagged() -> None:
    assert detect_launch({"PMI_RANK": "0", "PMI_SIZE": "2"}).is_mpi
    assert detect_launch({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}).is_mpi
    assert not detect_launch({"RANK": "0", "WORLD_SIZE": "2"}).is_mpi


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK (launcher torchrun) must be an integer"),
        ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE (launcher torchrun) must be an integer"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "must be >= 0, got -1"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "must be >= 1, got 0"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank must be in [0, 2)"),
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
        ({"MESHCOMM_WORLD_SIZE": "4"}, "MESHCOMM_WORLD_SIZE is set but MESHCOMM_RANK is not"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "x"}, "MPI_LOCALRANKID"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "[1, 65535], got 70000"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "maybe"},
            "TORCHELASTIC_USE_AGENT_STORE must be 0 or 1 (or true/false), got 'maybe'",
        ),
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_STEP_ID": "0",
                "SLURM_NODELIST": "n[",
            },
            "malformed SLURM node list",
        ),
    ],
)
def test_bad_launcher_values(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        detect_launch(env)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[03-05,07],gpu1", ["node03", "node04", "node05", "node07", "gpu1"]),
        ("single", ["single"]),
        ("a,b", ["a", "b"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-100]-ib", ["n098-ib", "n099-ib", "n100-ib"]),
        ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
        ("x[1],y[2-3],z", ["x1", "y2", "y3", "z"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "a,,b", "n[1-2", "n1-2]", "n[3-1]", "n[a-b]", "n[[1]]"])
def test_expand_nodelist_rejects_malformed(nodelist: str) -> None:
    with pytest.raises(InvalidArgument, match="SLURM node list"):
        expand_nodelist(nodelist)


# -- init_method URLs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("env://", InitMethod("env")),
        ("tcp://127.0.0.1:29500", InitMethod("tcp", host="127.0.0.1", port=29500)),
        ("tcp://[::1]:80/", InitMethod("tcp", host="::1", port=80)),
        ("tcp://h:1?rank=1&world_size=4", InitMethod("tcp", "h", 1, rank=1, world_size=4)),
        ("file:///tmp/x", InitMethod("file", path="/tmp/x")),
        ("file://localhost/tmp/a%20b", InitMethod("file", path="/tmp/a b")),
    ],
)
def test_parse_init_method(url: str, expected: InitMethod) -> None:
    assert parse_init_method(url) == expected


@pytest.mark.parametrize(
    ("url", "fragment"),
    [
        ("http://x:1", "unsupported scheme 'http'"),
        ("127.0.0.1:29500", "unsupported scheme"),
        ("env://x", "env:// takes nothing"),
        ("tcp://host", "tcp:// needs HOST:PORT"),
        ("tcp://:29500", "tcp:// needs HOST:PORT"),
        ("tcp://h:0", "[1, 65535], got 0"),
        ("tcp://h:99999", "the port must be in [1, 65535]"),
        ("tcp://h:port", "the port must be in [1, 65535]"),
        ("tcp://h:1/path", "takes only HOST:PORT"),
        ("tcp://h:1?size=2", "unknown query parameter 'size'"),
        ("tcp://h:1?rank=x", "rank must be an integer, got 'x'"),
        ("tcp://h:1?rank=1&rank=2", "rank is given twice"),
        ("file://otherhost/tmp/x", "not the host 'otherhost'"),
        ("file://", "absolute file path"),
        ("file:///tmp/dir/", "absolute file path"),
    ],
)
def test_parse_init_method_rejects(url: str, fragment: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_init_method(url)
    assert fragment in str(info.value)


def test_parse_init_method_wants_a_string() -> None:
    with pytest.raises(TypeError, match="init_method must be a str"):
        parse_init_method(29500)  # type: ignore[arg-type]


# -- argument validation: raised before any I/O --------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"rank": 2, "world_size": 2}, InvalidArgument, "rank must be in [0, 2)"),
        ({"rank": -1, "world_size": 2}, InvalidArgument, "rank must be >= 0, got -1"),
        ({"rank": 0, "world_size": 0}, InvalidArgument, "world size must be >= 1, got 0"),
        ({"rank": 1}, InvalidArgument, "rank was given but world_size was not"),
        ({"world_size": 3}, InvalidArgument, "world_size was given but rank was not"),
        ({"rank": "0", "world_size": 2}, TypeError, "rank must be an int"),
        ({"rank": 0, "world_size": 2.0}, TypeError, "world_size must be an int"),
        ({"rank": 0, "world_size": 2}, InvalidArgument, "MASTER_ADDR is not set"),
        ({"init_method": "tcp://h:1?rank=1", "rank": 0, "world_size": 2}, InvalidArgument,
         "rank=0 disagrees with rank=1"),
        ({"rank": 0, "world_size": 1, "timeout": -1}, InvalidArgument, "positive"),
        ({"rank": 0, "world_size": 1, "timeout": "5"}, InvalidArgument, "timedelta"),
        ({"rank": 0, "world_size": 2, "store": HashStore(), "init_method": "env://"},
         InvalidArgument, "either init_method or store"),
        ({"rank": 0, "store": HashStore()}, InvalidArgument, "rank and world_size are required"),
        ({"rank": 0, "world_size": 2, "store": {}}, TypeError, "meshcomm Store"),
    ],
)  # fmt: skip
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception], fragment: str) -> None:
    with pytest.raises(error) as info:
        rendezvous(env={}, **kwargs)
    assert fragment in str(info.value)


def test_env_arguments_fill_in_the_missing_one() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    rdzv = rendezvous(world_size=1, env=env, timeout=timedelta(seconds=5))
    assert (rdzv.rank, rdzv.world_size, rdzv.launcher, rdzv.timeout) == (0, 1, "torchrun", 5.0)
    rdzv.close()


def test_mpi_without_mpi4py_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import itself fail, as if mpi4py were absent.
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(RendezvousError) as info:
        rendezvous(env={"PMI_RANK": "0", "PMI_SIZE": "2"}, timeout=5)
    assert "pip install meshcomm[mpi]" in str(info.value)
    assert "MASTER_ADDR" in str(info.value)


# -- the protocol, with threads sharing one HashStore ---------------------------------------


def _threads(store: HashStore, specs: list[tuple[int, int]], timeout: float) -> list[Any]:
    """Rendezvous one thread per (rank, world_size); return each result or exception."""
    results: list[Any] = [None] * len(specs)

    def run(i: int, rank: int, size: int) -> None:
        try:
            results[i] = rendezvous(
                rank=rank, world_size=size, store=store, timeout=timeout, env={}
            )
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, *spec)) for i, spec in enumerate(specs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 30)
        assert not thread.is_alive(), "a rendezvous thread hung past its timeout"
    return results


def test_threads_agree_on_a_shared_store() -> None:
    store = HashStore(timeout=30)
    results = _threads(store, [(r, 4) for r in (2, 0, 3, 1)], timeout=30)
    assert sorted(r.rank for r in results) == [0, 1, 2, 3]
    results[0].store.set("shared", "x")
    assert results[1].store.get("shared") == b"x"
    for rdzv in results:
        rdzv.close()
    # The same store serves a second world (a later generation) without stale claims.
    again = [
        rendezvous(rank=0, world_size=1, store=store, timeout=5, env={}, generation=1),
    ]
    assert again[0].rank == 0


def test_duplicate_rank_fails_every_thread_promptly() -> None:
    start = time.monotonic()
    results = _threads(HashStore(), [(0, 3), (1, 3), (1, 3)], timeout=60)
    assert time.monotonic() - start < 30, "the abort record should end the wait at once"
    assert all(isinstance(r, RendezvousError) for r in results), results
    assert all("two processes claim rank 1" in str(r) for r in results)


def test_world_size_disagreement_names_both() -> None:
    results = _threads(HashStore(), [(0, 2), (1, 3)], timeout=60)
    assert all(isinstance(r, RendezvousError) for r in results), results
    text = str(results[0])
    assert "disagree on the world size" in text
    assert "world size 2" in text and "world size 3" in text
    assert "rank 0" in text and "rank 1" in text


def test_missing_rank_is_named_after_the_timeout() -> None:
    start = time.monotonic()
    results = _threads(HashStore(), [(0, 3), (2, 3)], timeout=1.0)
    assert time.monotonic() - start < 1.0 + 20
    assert all(isinstance(r, RendezvousError) for r in results), results
    assert all("rank(s) [1] never arrived" in str(r) for r in results)


def test_late_rank_sees_the_abort_at_once() -> None:
    store = HashStore()
    _threads(store, [(0, 2)], timeout=0.5)  # times out and leaves an abort record
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=r"aborted: .*\[1\] never arrived"):
        rendezvous(rank=1, world_size=2, store=store, timeout=60, env={})
    assert time.monotonic() - start < 30


# -- the protocol, with real processes ------------------------------------------------------


def _reserved_port() -> int:
    """A port nobody listens on; the test then lets rank 0 bind it (tests never hardcode)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _cfg(**kwargs: Any) -> dict[str, Any]:
    return {"api": "rendezvous", "kwargs": kwargs}


def test_processes_over_tcp(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{_reserved_port()}"
    env = ranks.clean_env()
    specs = [(env, _cfg(init_method=url, rank=r, world_size=3, timeout=60)) for r in (1, 2, 0)]
    results = ranks.launch(specs, tmp_path, deadline_s=90)
    assert [r["ok"] for r in results] == [True] * 3, results
    assert [r["rank"] for r in results] == [1, 2, 0]
    assert [r["hosts_server"] for r in results] == [False, False, True]
    for result in results:
        assert result["values"] == {str(q): results[0]["values"][str(q)] for q in range(3)}
        assert result["values"]["2"].startswith("hello from rank 2")


def test_processes_over_env_torchrun_style(tmp_path: Path) -> None:
    port = str(_reserved_port())
    specs = [
        (
            ranks.clean_env(
                {
                    "RANK": str(r),
                    "WORLD_SIZE": "2",
                    "LOCAL_RANK": str(r),
                    "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "localhost",
                    "MASTER_PORT": port,
                }
            ),
            _cfg(timeout=60),
        )
        for r in range(2)
    ]
    results = ranks.launch(specs, tmp_path, deadline_s=90)
    assert all(r["ok"] for r in results), results
    assert [(r["rank"], r["local_rank"], r["launcher"]) for r in results] == [
        (0, 0, "torchrun"),
        (1, 1, "torchrun"),
    ]
    assert results[1]["values"]["0"].startswith("hello from rank 0")


def test_processes_over_file(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    env = ranks.clean_env()
    specs = [(env, _cfg(init_method=f"{url}?world_size=2", rank=r, timeout=60)) for r in range(2)]
    results = ranks.launch(specs, tmp_path, deadline_s=90)
    assert all(r["ok"] for r in results), results
    assert results[0]["values"]["1"].startswith("hello from rank 1")


@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_processes_duplicate_rank_fail_promptly(tmp_path: Path, scheme: str) -> None:
    url = f"tcp://127.0.0.1:{_reserved_port()}" if scheme == "tcp" else f"file://{tmp_path / 's'}"
    env = ranks.clean_env()
    # Rank 2 claimed twice, rank 1 never comes: only the abort record can end this early.
    specs = [(env, _cfg(init_method=url, rank=r, world_size=3, timeout=120)) for r in (0, 2, 2)]
    results = ranks.launch(specs, tmp_path, deadline_s=60)
    assert [r["ok"] for r in results] == [False] * 3, results
    assert all(r["type"] == "RendezvousError" for r in results)
    assert all("two processes claim rank 2" in r["message"] for r in results), results


def test_processes_world_size_disagreement(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{_reserved_port()}"
    env = ranks.clean_env()
    specs = [
        (env, _cfg(init_method=url, rank=0, world_size=2, timeout=120)),
        (env, _cfg(init_method=url, rank=1, world_size=3, timeout=120)),
    ]
    results = ranks.launch(specs, tmp_path, deadline_s=60)
    assert [r["type"] for r in results] == ["RendezvousError"] * 2, results
    for result in results:
        assert "world size 2" in result["message"] and "world size 3" in result["message"]


def test_processes_missing_rank_named(tmp_path: Path) -> None:
    url = f"tcp://127.0.0.1:{_reserved_port()}"
    env = ranks.clean_env()
    specs = [(env, _cfg(init_method=url, rank=r, world_size=3, timeout=3)) for r in (0, 2)]
    results = ranks.launch(specs, tmp_path, deadline_s=60)
    assert [r["type"] for r in results] == ["RendezvousError"] * 2, results
    assert all("rank(s) [1] never arrived" in r["message"] for r in results), results
    assert all(r["elapsed"] < 3 + 20 for r in results)


def test_unreachable_store_names_the_address(tmp_path: Path) -> None:
    port = _reserved_port()
    specs = [
        (
            ranks.clean_env(),
            _cfg(init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2, timeout=1.5),
        )
    ]
    [result] = ranks.launch(specs, tmp_path, deadline_s=60)
    assert result["type"] == "RendezvousError", result
    assert f"127.0.0.1:{port}" in result["message"] and "rank 1" in result["message"]


def test_port_held_by_a_stranger_is_a_clear_error() -> None:
    import socket

    # Something that is not a store listens on the port and never answers: rank 0 cannot
    # bind it, tries it as a store client, gets no handshake, and reports the bind error.
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", 0))
        stranger.listen(8)
        port = stranger.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(RendezvousError) as info:
            rendezvous(f"tcp://127.0.0.1:{port}", world_size=2, rank=0, timeout=1.0, env={})
        assert time.monotonic() - start < 1.0 + 20
    text = str(info.value)
    assert f"rank 0 could not start the store server on 127.0.0.1:{port}" in text
    assert "already in use" in text


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is not set"),
        ({"MASTER_PORT": "29500"}, "MASTER_ADDR is not set"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "MESHCOMM_STORE_HOSTED": "maybe"},
         "MESHCOMM_STORE_HOSTED must be 0 or 1"),
    ],
)  # fmt: skip
def test_env_method_needs_a_master(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        rendezvous(env={"RANK": "1", "WORLD_SIZE": "2", **env}, timeout=5)
    assert fragment in str(info.value)


def test_a_node_never_started_is_named_while_rank_0_waits() -> None:
    import os
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), MESHCOMM_TIMEOUT="3",
        MESHCOMM_RDZV_REPORT="1", MESHCOMM_SECRET="", PYTHONPATH=str(Path(__file__).parents[1]),
    )  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", "import meshcomm; meshcomm.init()"],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "waiting for rank(s) 1-3 (node(s) [0, 1] with 2 ranks per node): 1 of 4 arrived" in (
        out.stderr
    ), out.stderr[-2000:]
    assert "rank(s) [1, 2, 3] never arrived" in out.stderr, out.stderr[-2000:]
