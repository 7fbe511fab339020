"""meshcomm.spawn with real spawned processes: environment, failures, timeouts, join=False."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshcomm.errors import InvalidArgument, MeshCommError
from meshcomm.spawn import (
    ProcessExitedException,
    ProcessRaisedException,
    SpawnContext,
    SpawnError,
    SpawnTimeout,
    spawn,
)

# Bounds for "promptly": generous, a 2-core machine starts interpreters slowly.
RUN_TIMEOUT = 60.0
GONE_WITHIN = 10.0
SLEEP = 120.0

# -- functions the spawned processes run (module level: they travel by reference) -------------


def write_env(rank: int, outdir: str) -> None:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "MESHCOMM_STORE_HOSTED", "MESHCOMM_RANK")  # fmt: skip
    env = {key: os.environ.get(key) for key in keys}
    Path(outdir, f"{rank}.json").write_text(json.dumps({"rank": rank, "env": env}))


def use_store(rank: int, outdir: str) -> None:
    from meshcomm.store import TCPStore

    world_size = int(os.environ["WORLD_SIZE"])
    store = TCPStore(
        os.environ["MESHCOMM_MASTER_ADDR"], int(os.environ["MESHCOMM_MASTER_PORT"]), timeout=30
    )
    try:
        store.set(f"value/{rank}", str(rank + 1))
        total = sum(int(store.get(f"value/{r}")) for r in range(world_size))
        Path(outdir, f"{rank}.sum").write_text(str(total))
    finally:
        store.close()


def init_and_exchange(rank: int, outdir: str) -> None:
    from meshcomm import world

    group = world.init(timeout=30)
    try:
        store = group.store
        assert store is not None  # the world group always has the rendezvous store
        store.set(f"value/{rank}", str(rank + 1))
        total = sum(int(store.get(f"value/{r}")) for r in range(group.size))
        Path(outdir, f"{rank}.sum").write_text(f"{group.rank} {group.size} {total}")
    finally:
        world.shutdown()


def fail_on_cue(rank: int, piddir: str, mode: str, failing: int, world_size: int) -> None:
    """Write a pid file; the failing rank waits for every pid file, then fails; others sleep."""
    Path(piddir, f"{rank}.tmp").write_text(str(os.getpid()))
    os.replace(Path(piddir, f"{rank}.tmp"), Path(piddir, f"{rank}.pid"))
    if rank == failing:
        deadline = time.monotonic() + 30
        while len(list(Path(piddir).glob("*.pid"))) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
        if mode == "raise":
            raise ValueError(f"boom from rank {rank}")
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "exit3":
            sys.exit(3)
    time.sleep(SLEEP)


def sleep_for(rank: int, seconds: float) -> None:
    time.sleep(seconds)


# -- helpers -------------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], within: float = GONE_WITHIN) -> list[int]:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def run_failing(tmp_path: Path, mode: str, failing: int, nprocs: int = 3) -> SpawnError:
    ctx = spawn(fail_on_cue, args=(str(tmp_path), mode, failing, nprocs), nprocs=nprocs, join=False)
    assert isinstance(ctx, SpawnContext)
    pids = ctx.pids()
    start = time.monotonic()
    try:
        with pytest.raises(SpawnError) as info:
            ctx.join(timeout=RUN_TIMEOUT)
        assert time.monotonic() - start < RUN_TIMEOUT / 2  # the sleepers were stopped
        assert wait_gone(pids) == []
        assert info.value.rank == failing
        assert info.value.pid == pids[failing]
        return info.value
    finally:
        ctx.terminate()


def torch_backend_all_reduce(rank: int, outdir: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("meshcomm")  # torch's own env:// rendezvous on MASTER_PORT
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    Path(outdir, f"{rank}.sum").write_text(f"{dist.get_backend()} {t.tolist()}")
    dist.destroy_process_group()


# -- tests ---------------------------------------------------------------------------------------


def test_environment(tmp_path: Path) -> None:
    assert spawn(write_env, args=(str(tmp_path),), nprocs=3, timeout=RUN_TIMEOUT) is None
    records = [json.loads(Path(tmp_path, f"{r}.json").read_text()) for r in range(3)]
    ports = {rec["env"]["MASTER_PORT"] for rec in records}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for rank, rec in enumerate(records):
        assert rec["rank"] == rank
        env = rec["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank), "3", str(rank), "3"
        )  # fmt: skip
        assert (env["MASTER_ADDR"], env["MESHCOMM_STORE_HOSTED"]) == ("127.0.0.1", "1")


def test_inherited_meshcomm_identity_is_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHCOMM_RANK", "7")
    spawn(write_env, args=(str(tmp_path),), nprocs=1, timeout=RUN_TIMEOUT)
    assert json.loads(Path(tmp_path, "0.json").read_text())["env"]["MESHCOMM_RANK"] is None


def test_processes_share_the_hosted_store(tmp_path: Path) -> None:
    spawn(use_store, args=(str(tmp_path),), nprocs=3, timeout=RUN_TIMEOUT)
    assert [Path(tmp_path, f"{r}.sum").read_text() for r in range(3)] == ["6", "6", "6"]


def test_init_inside_fn(tmp_path: Path) -> None:
    pytest.importorskip("meshcomm.group", reason="meshcomm.init needs meshcomm.group")
    spawn(init_and_exchange, args=(str(tmp_path),), nprocs=3, timeout=RUN_TIMEOUT)
    sums = [Path(tmp_path, f"{r}.sum").read_text() for r in range(3)]
    assert sums == [f"{r} 3 6" for r in range(3)]


def test_rank_raises(tmp_path: Path) -> None:
    error = run_failing(tmp_path, "raise", failing=1)
    assert isinstance(error, ProcessRaisedException)
    assert isinstance(error, MeshCommError)
    assert error.traceback.rstrip().endswith("ValueError: boom from rank 1")
    assert "Traceback (most recent call last):" in error.traceback
    assert str(error).startswith(f"rank 1 (pid {error.pid}) raised an exception")
    assert "ValueError: boom from rank 1" in str(error)


def test_rank_killed_by_signal(tmp_path: Path) -> None:
    error = run_failing(tmp_path, "sigkill", failing=2)
    assert isinstance(error, ProcessExitedException)
    assert (error.exit_code, error.signal_name) == (-signal.SIGKILL, "SIGKILL")
    assert f"rank 2 (pid {error.pid}) killed by SIGKILL" in str(error)


def test_rank_exits_nonzero(tmp_path: Path) -> None:
    error = run_failing(tmp_path, "exit3", failing=0, nprocs=2)
    assert isinstance(error, ProcessExitedException)
    assert (error.exit_code, error.signal_name) == (3, None)


def test_join_false_context() -> None:
    ctx = spawn(sleep_for, args=(SLEEP,), nprocs=2, join=False)
    assert isinstance(ctx, SpawnContext)
    pids = ctx.pids()
    try:
        assert len(pids) == 2 and all(alive(p) for p in pids)
        assert ctx.join(timeout=0.05) is False  # still sleeping
    finally:
        ctx.terminate()
    assert wait_gone(pids) == []

    ctx = spawn(sleep_for, args=(0.0,), nprocs=2, join=False)
    assert isinstance(ctx, SpawnContext)
    assert ctx.join(timeout=RUN_TIMEOUT) is True
    assert ctx.join() is True  # joining again is harmless


def test_timeout_stops_everything() -> None:
    start = time.monotonic()
    with pytest.raises(SpawnTimeout) as info:
        spawn(sleep_for, args=(SLEEP,), nprocs=2, timeout=1.0)
    assert time.monotonic() - start < RUN_TIMEOUT / 2
    assert info.value.running == [0, 1]
    assert isinstance(info.value, TimeoutError)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_sigkilled_parent_leaves_no_orphans() -> None:
    script = Path(__file__).parent / "scripts" / "launch_spawn_parent.py"
    parent = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True
    )  # fmt: skip
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], RUN_TIMEOUT)
        assert ready, "the parent did not print its children's pids"
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        parent.kill()
        parent.wait(timeout=RUN_TIMEOUT)
        assert wait_gone(pids) == []
    finally:
        parent.kill()
        parent.wait(timeout=RUN_TIMEOUT)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"nprocs": 0}, InvalidArgument, "nprocs must be an int >= 1, got 0"),
        ({"nprocs": True}, InvalidArgument, "nprocs must be an int >= 1"),
        ({"fn": lambda rank: None}, InvalidArgument, "must be picklable"),
        ({"args": (lambda: 0,)}, InvalidArgument, "args must be picklable"),
        ({"args": [1]}, TypeError, "args must be a tuple"),
        ({"fn": 3}, TypeError, "fn must be callable"),
        ({"join": False, "timeout": 5}, InvalidArgument, "pass it to SpawnContext.join()"),
        ({"timeout": -1}, InvalidArgument, "positive"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], message: str) -> None:
    call: dict[str, object] = {"fn": sleep_for, "args": (0.0,), "nprocs": 1, **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        spawn(**call)  # type: ignore[arg-type]


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed (meshcomm[torch])"
)
def test_torch_init_process_group_in_spawned_ranks(tmp_path: Path) -> None:
    """torch's own init (env://) in fn: rank 0 serves torch's store on a port of its own."""
    spawn(torch_backend_all_reduce, args=(str(tmp_path),), nprocs=3, timeout=RUN_TIMEOUT)
    for rank in range(3):
        assert Path(tmp_path, f"{rank}.sum").read_text() == "meshcomm [3.0, 3.0]"
