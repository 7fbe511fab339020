"""meshrun, end to end: real launcher processes running real rank processes."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import meshcomm
from meshcomm.run import START_METHOD_VARIABLE, child_environment, parse_args

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).parent.parent
ENV_SCRIPT = str(SCRIPTS / "launch_env.py")
WORKER = str(SCRIPTS / "launch_worker.py")
MAIN_SCRIPT = str(SCRIPTS / "launch_main.py")
# Bounds for "promptly": generous, because a 2-core CI machine starts Pythons slowly.
RUN_TIMEOUT = 60.0
GONE_WITHIN = 10.0

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux-only"
)


def meshrun(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshcomm.run", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        cwd=cwd,
        env=env,
    )


def start_meshrun(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "meshcomm.run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def rank_records(stdout: str) -> dict[int, dict[str, Any]]:
    """The JSON lines launch_env.py printed, by rank; checks each line's ``[rankN]`` tag."""
    records = {}
    for line in stdout.splitlines():
        tag, _, text = line.partition(" ")
        assert tag.startswith("[rank") and tag.endswith("]"), line
        if text.startswith("{"):
            record = json.loads(text)
            rank = int(record["env"]["RANK"])
            assert tag == f"[rank{rank}]"
            records[rank] = record
    return records


def raw_records(stdout: str) -> dict[int, dict[str, Any]]:
    """The JSON objects in unprefixed output (a line may start with another rank's text)."""
    decoder, records, start = json.JSONDecoder(), {}, stdout.find('{"env"')
    while start >= 0:
        record, end = decoder.raw_decode(stdout, start)
        records[int(record["env"]["RANK"])] = record
        start = stdout.find('{"env"', end)
    return records


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped by init) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], within: float = GONE_WITHIN) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def read_pids(piddir: Path, names: list[str], within: float = 30.0) -> list[int]:
    deadline = time.monotonic() + within
    while True:
        if all((piddir / f"{name}.pid").exists() for name in names):
            return [int((piddir / f"{name}.pid").read_text()) for name in names]
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    raise AssertionError(f"pid files {names} did not all appear in {piddir} within {within} s")


def kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(params=["fork", "spawn"])
def start_method(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test under each start method (meshrun reads it from the environment)."""
    monkeypatch.setenv(START_METHOD_VARIABLE, request.param)
    return str(request.param)


# -- environment, prefixes, arguments ----------------------------------------------------------


def test_env_prefix_and_args(start_method: str) -> None:
    # Arguments after the script that look like meshrun's own options belong to the script.
    result = meshrun(
        "--nproc-per-node", "3", ENV_SCRIPT, "--nproc-per-node", "7", "-m", "x", "a b"
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = rank_records(result.stdout)
    assert sorted(records) == [0, 1, 2]
    ports = {record["env"]["MESHCOMM_MASTER_PORT"] for record in records.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0  # one store, on the kernel's port
    torch_ports = {record["env"]["MASTER_PORT"] for record in records.values()}
    # MASTER_PORT is another port, kept for torch's rank 0 (tests/test_meshrun_torch.py).
    assert len(torch_ports) == 1 and torch_ports != {records[0]["env"]["MESHCOMM_MASTER_PORT"]}
    for rank, record in records.items():
        expected = {
            "RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "3",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MESHCOMM_MASTER_ADDR": "127.0.0.1",
            "MESHCOMM_STORE_HOSTED": "1",
            "PYTHONUNBUFFERED": "1",
        }
        assert {key: record["env"][key] for key in expected} == expected
        assert record["argv"] == ["--nproc-per-node", "7", "-m", "x", "a b"]
        assert f"[rank{rank}] no newline from rank {rank}" in result.stdout.splitlines()
        assert f"[rank{rank}] stderr line from rank {rank}" in result.stderr.splitlines()


def test_torchrun_spellings_and_standalone() -> None:
    result = meshrun("--standalone", "--nproc_per_node=2", "--rdzv_id=job7", ENV_SCRIPT)
    assert result.returncode == 0, result.stderr
    records = rank_records(result.stdout)
    assert sorted(records) == [0, 1]
    assert records[1]["env"]["TORCHELASTIC_RUN_ID"] == "job7"


def test_no_prefix(start_method: str) -> None:
    result = meshrun("--nproc-per-node", "2", "--no-prefix", ENV_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert "[rank" not in result.stdout + result.stderr
    assert sorted(raw_records(result.stdout)) == [0, 1]


def test_module_mode(start_method: str) -> None:
    result = meshrun("--nproc-per-node", "2", "-m", "launch_env", "--flag", cwd=SCRIPTS)
    assert result.returncode == 0, result.stderr
    records = rank_records(result.stdout)
    assert sorted(records) == [0, 1]
    assert records[0]["argv"] == ["--flag"]


def test_inherited_meshcomm_identity_is_dropped() -> None:
    # MESHCOMM_RANK outranks RANK in meshcomm.init(): a stale one must not reach the ranks.
    env = {**os.environ, "MESHCOMM_RANK": "5", "MESHCOMM_WORLD_SIZE": "9"}
    result = meshrun("--nproc-per-node", "2", ENV_SCRIPT, env=env)
    assert result.returncode == 0, result.stderr
    records = rank_records(result.stdout).values()
    assert [r["env"]["MESHCOMM_RANK"] for r in records] == [None, None]


def test_console_script() -> None:
    exe = Path(sys.executable).parent / "meshrun"
    if not exe.exists():
        exe = Path(shutil.which("meshrun") or "")
    if not exe.is_file():
        pytest.skip("the meshrun console script is not installed (pip install -e .)")
    result = subprocess.run(
        [str(exe), "--nproc-per-node", "2", ENV_SCRIPT],
        check=False,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(rank_records(result.stdout)) == [0, 1]


def test_ranks_use_the_hosted_store() -> None:
    result = meshrun("--nproc-per-node", "4", str(SCRIPTS / "launch_store.py"))
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [f"[rank{r}] sum 60" for r in range(4)]


def test_two_nodes_on_one_machine(tmp_path: Path) -> None:
    with socket.socket() as probe:  # the nodes must agree on a port before either binds it
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    secret = tmp_path / "secret"  # several nodes need one secret (tests/test_launch_secret.py)
    secret.write_text("two nodes")
    secret.chmod(0o600)
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--secret-file", str(secret)]  # fmt: skip
    store_script = str(SCRIPTS / "launch_store.py")
    nodes = [
        start_meshrun(*common, "--node-rank", str(k), "--master-port", port, store_script)
        for k in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=RUN_TIMEOUT) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
            node.wait(timeout=RUN_TIMEOUT)
    assert [node.returncode for node in nodes] == [0, 0], outputs
    # Ranks 0, 1 on node 0 and 2, 3 on node 1; each read all four values from node 0's store.
    assert sorted(outputs[0][0].splitlines()) == ["[rank0] sum 60", "[rank1] sum 60"]
    assert sorted(outputs[1][0].splitlines()) == ["[rank2] sum 60", "[rank3] sum 60"]


def test_node_environment_of_a_later_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHCOMM_SECRET", "shared")  # several nodes need one
    cfg = parse_args(
        ["--nnodes", "3", "--node-rank", "2", "--nproc-per-node", "4", "--master-addr", "h0",
         "x.py"]
    )  # fmt: skip
    assert (cfg.world_size, cfg.master_addr, cfg.master_port, cfg.bind_addr) == (
        12, "h0", 29500, "0.0.0.0"
    )  # fmt: skip
    assert child_environment(cfg, 0, 29500, base={})["MESHCOMM_SECRET"] == "shared"
    assert "shared" not in repr(cfg)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nnodes", "1:4", "x.py"], "elastic"),
        (["--nnodes", "2", "--node-rank", "2", "x.py"], "--node-rank must be in [0, 2)"),
        (["--nproc-per-node", "0", "x.py"], "at least 1"),
        (["--nproc-per-node", "many", "x.py"], "got 'many'"),
        (["--standalone", "--nnodes", "2", "x.py"], "single node"),
        (["--grace-period", "-1", "x.py"], "positive"),
        (["--nnodes", "2", "--master-port", "0", "x.py"], "only works on one node"),
    ],
)
def test_bad_arguments(args: list[str], message: str) -> None:
    result = meshrun(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""


def test_missing_script() -> None:
    result = meshrun("--nproc-per-node", "2", "no/such/script.py")
    assert result.returncode == 2
    assert "no such script: no/such/script.py" in result.stderr


def test_missing_executable() -> None:
    result = meshrun("--nproc-per-node", "2", "--no-python", "/no/such/program")
    assert result.returncode == 127
    assert "cannot run '/no/such/program'" in result.stderr
    assert "exited with code 127" in result.stderr


def test_no_python_runs_a_program() -> None:
    result = meshrun("--nproc-per-node", "2", "--no-python", sys.executable, ENV_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert sorted(rank_records(result.stdout)) == [0, 1]


# -- start methods -------------------------------------------------------------------------------


def test_start_method_choice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("print('hi')\n")
    monkeypatch.delenv(START_METHOD_VARIABLE, raising=False)
    fork = "fork" if sys.platform.startswith("linux") else "spawn"
    assert parse_args([str(script)]).start_method == fork
    assert parse_args(["-m", "json.tool"]).start_method == fork
    assert parse_args(["--start-method", "spawn", str(script)]).start_method == "spawn"
    assert parse_args(["--start_method=spawn", "-m", "json.tool"]).start_method == "spawn"
    # Not a Python source file meshrun can run in its own interpreter: spawned.
    assert parse_args(["--no-python", sys.executable, str(script)]).start_method == "spawn"
    assert parse_args([str(tmp_path)]).start_method == "spawn"  # a directory with __main__
    monkeypatch.setenv("PYTHON_EXEC", "/another/python")
    assert parse_args([str(script)]).start_method == "spawn"
    monkeypatch.delenv("PYTHON_EXEC")
    monkeypatch.setenv(START_METHOD_VARIABLE, "spawn")
    assert parse_args([str(script)]).start_method == "spawn"
    assert parse_args(["--start-method", "fork", str(script)]).start_method == fork
    monkeypatch.setenv(START_METHOD_VARIABLE, "forkserver")
    with pytest.raises(SystemExit):
        parse_args([str(script)])


def _main_records(*args: str, cwd: Path | None = None, **env: str) -> list[dict[str, Any]]:
    records = []
    for method in ("fork", "spawn"):
        result = meshrun(
            "--nproc-per-node", "2", "--start-method", method, *args,
            cwd=cwd, env={**os.environ, **env},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        by_rank = rank_records_of(result.stdout)
        assert sorted(by_rank) == [0, 1]
        records.append(by_rank[0])
    return records


def test_signals_ignored_at_start_stay_ignored_in_every_rank() -> None:
    # As under `nohup meshrun ... &`: a shell leaves SIGHUP and SIGINT ignored. meshrun must not
    # catch them (it would stop on a hangup), and its ranks inherit them ignored, forked or not.
    for method in ("fork", "spawn"):
        command = [sys.executable, "-m", "meshcomm.run", "--nproc-per-node", "2"]
        command += ["--start-method", method, str(MAIN_SCRIPT), "ok"]
        script = 'trap "" HUP INT; exec "$@"'
        result = subprocess.run(
            ["bash", "-c", script, "bash", *command],
            check=False,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
        )
        assert result.returncode == 0, result.stderr
        by_rank = rank_records_of(result.stdout)
        assert sorted(by_rank) == [0, 1]
        ignored = str(int(signal.SIG_IGN))
        default = str(int(signal.SIG_DFL))
        assert [r["signals"] for r in by_rank.values()] == [[ignored, default, ignored]] * 2


def rank_records_of(stdout: str) -> dict[int, dict[str, Any]]:
    out = {}
    for line in stdout.splitlines():
        tag, _, text = line.partition(" ")
        if text.startswith("{"):
            out[int(tag[len("[rank") : -1])] = json.loads(text)
    return out


@pytest.mark.parametrize("omp", [None, "3"])
def test_forked_rank_starts_like_a_spawned_one(omp: str | None) -> None:
    # __main__, argv, sys.path[0], descriptors, signals, streams and the BLAS thread pool
    # must not tell a forked rank from a fresh interpreter.
    env = {} if omp is None else {"OMP_NUM_THREADS": omp}
    forked, spawned = _main_records(MAIN_SCRIPT, "ok", **env)
    assert forked == spawned
    assert forked["name"] == "__main__" and forked["main_is_this"]
    assert forked["argv"] == [MAIN_SCRIPT, "ok"]
    assert forked["path0"] == str(SCRIPTS.resolve())
    assert forked["leads_group"] and forked["stdin"] == ""
    assert forked["omp"] == (omp or "1")


def test_forked_module_starts_like_a_spawned_one() -> None:
    forked, spawned = _main_records("-m", "launch_main", "x", cwd=SCRIPTS)
    assert forked == spawned
    assert forked["spec"] == "launch_main" and forked["argv"][1:] == ["x"]


@pytest.mark.parametrize(
    ("action", "status", "expected"),
    [
        ("exit3", 3, "exited with code 3"),
        ("exit-text", 1, "[rank0] bye"),
        ("interrupt", 128 + signal.SIGINT, "killed by SIGINT"),
        ("raise", 1, "[rank0] ValueError: boom"),
    ],
)
def test_exit_statuses(start_method: str, action: str, status: int, expected: str) -> None:
    result = meshrun("--nproc-per-node", "1", MAIN_SCRIPT, action)
    assert result.returncode == status, result.stderr
    assert expected in result.stderr
    if action == "raise":  # the traceback starts at the program, as python prints it
        tb = result.stderr.splitlines()
        first = tb.index("[rank0] Traceback (most recent call last):")
        assert tb[first + 1].startswith(f'[rank0]   File "{Path(MAIN_SCRIPT).resolve()}"')


def test_threads_and_atexit_finish(start_method: str) -> None:
    result = meshrun("--nproc-per-node", "2", MAIN_SCRIPT, "finish")
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        lines = [line for line in result.stdout.splitlines() if line.startswith(f"[rank{rank}]")]
        assert lines[1:] == [f"[rank{rank}] thread done", f"[rank{rank}] atexit ran"]


# -- failures ----------------------------------------------------------------------------------


def test_rank_raises(start_method: str, tmp_path: Path) -> None:
    start = time.monotonic()
    result = meshrun("--nproc-per-node", "4", WORKER, str(tmp_path), "raise", "2")
    elapsed = time.monotonic() - start
    pids = read_pids(tmp_path, [f"rank{r}" for r in range(4)], within=0)
    try:
        assert result.returncode == 1
        assert elapsed < RUN_TIMEOUT / 2  # the sleeping ranks (120 s) were stopped
        err = result.stderr
        assert "[rank2] ValueError: boom from rank 2" in err.splitlines()
        assert "[rank2] Traceback (most recent call last):" in err.splitlines()
        # The traceback went by on the console: the summary repeats only the error.
        summary = err[err.index(f"rank 2 (pid {pids[2]}) exited with code 1; its error") :]
        assert "Traceback" not in summary
        assert "[rank2] ValueError: boom from rank 2" in summary
        assert "stopped ranks 0, 1, 3 with SIGTERM after rank 2 failed" in summary
        assert wait_gone(pids) == []
    finally:
        kill_leftovers(pids)


def test_rank_killed_by_signal(start_method: str, tmp_path: Path) -> None:
    result = meshrun("--nproc-per-node", "3", WORKER, str(tmp_path), "sigkill", "1")
    pids = read_pids(tmp_path, [f"rank{r}" for r in range(3)], within=0)
    try:
        assert result.returncode == 128 + signal.SIGKILL
        assert f"rank 1 (pid {pids[1]}) killed by SIGKILL" in result.stderr
        assert wait_gone(pids) == []
    finally:
        kill_leftovers(pids)


def test_ranks_ignoring_sigterm_get_sigkill(start_method: str, tmp_path: Path) -> None:
    result = meshrun(
        "--nproc-per-node", "3", "--grace-period", "1", WORKER, str(tmp_path), "exit3", "1",
        "--ignore-term",
    )  # fmt: skip
    pids = read_pids(tmp_path, [f"rank{r}" for r in range(3)], within=0)
    try:
        assert result.returncode == 3
        assert f"rank 1 (pid {pids[1]}) exited with code 3" in result.stderr
        assert "killed ranks 0, 2 with SIGKILL: still running 1 s after SIGTERM" in result.stderr
        assert wait_gone(pids) == []
    finally:
        kill_leftovers(pids)


@pytest.mark.parametrize(
    ("signum", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 128 + signal.SIGTERM)]
)
def test_ctrl_c_stops_every_rank(
    start_method: str, tmp_path: Path, signum: int, status: int
) -> None:
    proc = start_meshrun(
        "--nproc-per-node", "3", WORKER, str(tmp_path), "sleep", "0", "--grandchild"
    )
    names = [f"{kind}{r}" for kind in ("rank", "child") for r in range(3)]
    pids: list[int] = []
    try:
        pids = read_pids(tmp_path, names)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=RUN_TIMEOUT)
        assert proc.returncode == status
        assert f"received {signal.Signals(signum).name}; stopping 3 ranks" in err
        assert wait_gone(pids) == []  # the ranks' own children too: their group was signalled
    finally:
        proc.kill()
        proc.wait(timeout=RUN_TIMEOUT)
        kill_leftovers(pids)


@linux_only
def test_sigkilled_meshrun_leaves_no_orphans(start_method: str, tmp_path: Path) -> None:
    proc = start_meshrun("--nproc-per-node", "3", WORKER, str(tmp_path), "sleep", "0")
    pids: list[int] = []
    try:
        pids = read_pids(tmp_path, [f"rank{r}" for r in range(3)])
        proc.kill()
        proc.wait(timeout=RUN_TIMEOUT)
        assert wait_gone(pids) == []
    finally:
        kill_leftovers(pids)


# -- the demo ----------------------------------------------------------------------------------


def test_demo_under_meshrun() -> None:
    if not hasattr(meshcomm, "init"):
        pytest.skip("meshcomm.init is not exported yet (meshcomm/__init__.py)")
    result = meshrun("--nproc-per-node", "4", str(ROOT / "examples" / "demo.py"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for rank in range(4):
        assert any(line.startswith(f"[rank{rank}] rank {rank} of 4") for line in lines), lines
    assert "[rank0] sum of ranks through the store: 6 (expected 6)" in lines
