"""meshrun's torchrun flags, end to end: restarts, log files, console filters, rendezvous.

Each test starts real ``meshrun`` processes running small rank scripts written to
``tmp_path``; the flag tables are checked against torchrun's own parser when torch is there.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from meshcomm.launcher.command_line import build_parser
from meshcomm.launcher.rank_logs import Route
from meshcomm.launcher.torchrun_flags import FlagError, parse_endpoint, parse_std_map
from meshcomm.run import child_environment, parse_args

ROOT = Path(__file__).parent.parent
RUN_TIMEOUT = 90.0

# Fails (exit 3) on local rank 1 while TORCHELASTIC_RESTART_COUNT < argv[1]; prints to both.
FLAKY = """\
import os, sys
count = os.environ["TORCHELASTIC_RESTART_COUNT"]
rank = os.environ["RANK"]
print(f"out rank {rank} attempt {count} of {os.environ['TORCHELASTIC_MAX_RESTARTS']}")
print(f"err rank {rank} attempt {count}", file=sys.stderr)
if int(count) < int(sys.argv[1]) and rank == "1":
    sys.exit(3)
"""

# A real collective: every rank of every node sums its rank + 1.
COLLECTIVE = """\
import os
import numpy as np
import meshcomm
group = meshcomm.init()
total = group.all_reduce(np.full(1, group.rank + 1.0))
print(f"rank {group.rank} of {group.size} node {os.environ['GROUP_RANK']} sum {total[0]:g}")
meshcomm.shutdown()
"""


def meshrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshcomm.run", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=env,
    )


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


# -- restarts ------------------------------------------------------------------------------


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_failure_restarts_the_group_until_it_succeeds(tmp_path: Path, start_method: str) -> None:
    flaky = script(tmp_path, "flaky.py", FLAKY)
    result = meshrun("--nproc-per-node", "2", "--max-restarts", "2",
                     "--start-method", start_method, flaky, "1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # Rank 0 of attempt 0 may be stopped before it prints: rank 1 fails at once.
    assert "[rank1] out rank 1 attempt 0 of 2" in lines
    for rank in (0, 1):
        assert f"[rank{rank}] out rank {rank} attempt 1 of 2" in lines
    assert not any("attempt 2" in line for line in lines)  # success ends the run
    assert "restarting this node's 2 ranks (restart 1 of --max-restarts 2)" in result.stderr


def test_the_last_attempt_gives_the_exit_status(tmp_path: Path) -> None:
    flaky = script(tmp_path, "flaky.py", FLAKY)
    result = meshrun("--nproc-per-node", "2", "--max_restarts=1", flaky, "9")
    assert result.returncode == 3, result.stderr
    assert "[rank1] out rank 1 attempt 1 of 1" in result.stdout.splitlines()
    assert result.stderr.count("restarting this node") == 1


def test_without_restarts_a_failure_ends_the_run(tmp_path: Path) -> None:
    result = meshrun("--nproc-per-node", "2", script(tmp_path, "flaky.py", FLAKY), "1")
    assert result.returncode == 3
    assert "restarting" not in result.stderr


# Attempt 0: rank 1 leaves a key in the store and fails after a collective; attempt 1 must
# form a new world in an empty store.
RESTARTED = COLLECTIVE.replace(
    "meshcomm.shutdown()",
    """from meshcomm.store import TCPStore
store = TCPStore(os.environ["MESHCOMM_MASTER_ADDR"], int(os.environ["MESHCOMM_MASTER_PORT"]),
                 timeout=30)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"attempt {attempt} rank {group.rank} sees the old key: {store.check(['left-behind'])}")
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and group.rank == 1:
    store.set("left-behind", "x")
    os._exit(4)
store.close()
meshcomm.shutdown()""",
)


@pytest.mark.parametrize("port", ["free", "fixed"])
def test_restarted_ranks_meet_in_a_fresh_store(tmp_path: Path, port: str) -> None:
    fixed = ("--master-port", free_port()) if port == "fixed" else ()
    result = meshrun("--nproc-per-node", "2", "--max-restarts", "1", *fixed,
                     script(tmp_path, "job.py", RESTARTED))  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("of 2 node 0 sum 3") == 4  # both ranks, both attempts
    lines = result.stdout.splitlines()
    # Attempt 0's rank 0 may see the key rank 1 just set; attempt 1 starts with an empty store.
    assert "[rank0] attempt 1 rank 0 sees the old key: False" in lines
    assert "[rank1] attempt 1 rank 1 sees the old key: False" in lines


# -- log files and the console ---------------------------------------------------------------


def test_log_dir_layout_redirects_tee_and_filter(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    flaky = script(tmp_path, "flaky.py", FLAKY)
    # rank 0: stdout to its file only; rank 1: stderr to its file only; rank 2: both tee'd;
    # only local ranks 0 and 2 on the console.
    result = meshrun("--nproc-per-node", "3", "--rdzv-id", "job9", "--log-dir", str(logs),
                     "-r", "0:1,1:2", "--tee", "2:3", "--local-ranks-filter", "0,2",
                     "--max-restarts", "1", flaky, "1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    (run_dir,) = logs.iterdir()  # <log_dir>/<rdzv_id>_<random>, as torchrun
    assert run_dir.name.startswith("job9_")
    assert f"rank log files in {run_dir}" in result.stderr
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    expected = []
    for attempt in (0, 1):
        names = ["0/stdout.log", "1/stderr.log", "2/stderr.log", "2/stdout.log"]
        expected += [f"attempt_{attempt}/{name}" for name in names]
    assert files == sorted(expected)
    attempt1 = run_dir / "attempt_1"
    assert (attempt1 / "0" / "stdout.log").read_text() == "out rank 0 attempt 1 of 1\n"
    assert (attempt1 / "1" / "stderr.log").read_text() == "err rank 1 attempt 1\n"
    assert (attempt1 / "2" / "stdout.log").read_text() == "out rank 2 attempt 1 of 1\n"
    out, err = result.stdout.splitlines(), result.stderr.splitlines()
    assert "[rank2] out rank 2 attempt 1 of 1" in out  # tee: file and console
    assert "[rank2] err rank 2 attempt 1" in err
    assert "[rank0] err rank 0 attempt 1" in err  # not redirected, in the filter
    assert not any(line.startswith("[rank0] out") for line in out)  # redirected
    assert not any(line.startswith("[rank1] out") for line in out)  # filtered out
    assert "[rank1] err rank 1 attempt 1" not in err  # redirected, and filtered out


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_record_writes_the_error_file_meshrun_names(tmp_path: Path) -> None:
    job = script(tmp_path, "job.py", (
        "import os\n"
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\n"
        "def main():\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise ValueError('boom')\n"
        "main()\n"
    ))  # fmt: skip
    result = meshrun("--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), job)
    assert result.returncode == 1
    match = re.search(r"rank 1 wrote its error to (\S+)", result.stderr)
    assert match, result.stderr
    error_file = Path(match.group(1))
    assert error_file.is_absolute() and error_file.parts[-3:] == ("attempt_0", "1", "error.json")
    assert "ValueError: boom" in error_file.read_text()


def test_tee_without_log_dir_and_duplicate_filters(tmp_path: Path) -> None:
    flaky = script(tmp_path, "flaky.py", FLAKY)
    result = meshrun("--nproc-per-node", "2", "-t", "3", "--no-prefix",
                     "--duplicate-stdout-filters", "rank 1,,x", "--duplicate_stderr_filters",
                     "rank 0", flaky, "0")  # fmt: skip
    assert result.returncode == 0, result.stderr
    match = re.search(r"rank log files in (\S+)", result.stderr)
    assert match, result.stderr
    attempt = Path(match.group(1)) / "attempt_0"
    assert Path(match.group(1)).name.startswith("none_")
    assert "out rank 1 attempt 0 of 0" in result.stdout.splitlines()  # --no-prefix console
    assert (attempt / "1" / "stdout.log").read_text() == "out rank 1 attempt 0 of 0\n"
    assert (attempt / "filtered_stderr.log").read_text() == "err rank 0 attempt 0\n"
    # "rank 1,,x" is one word with a comma in it: no stdout line holds it.
    assert (attempt / "filtered_stdout.log").read_text() == ""


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_local_ranks_filter_hides_other_ranks(tmp_path: Path, start_method: str) -> None:
    result = meshrun("--nproc-per-node", "3", "--local_ranks_filter=1", "--start-method",
                     start_method, script(tmp_path, "flaky.py", FLAKY), "0")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[rank1] out rank 1 attempt 0 of 0"]
    assert "rank log files" not in result.stderr  # a filter alone writes no files


def test_signals_to_handle_stop_the_job(tmp_path: Path) -> None:
    sleeper = script(tmp_path, "sleep.py", "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshcomm.run", "--nproc-per-node", "2",
         "--signals-to-handle", "SIGTERM,SIGUSR1", sleeper],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        for _ in range(2):  # both ranks are up
            assert proc.stdout.readline().endswith("up\n")
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        proc.kill()
        proc.wait(timeout=RUN_TIMEOUT)
    assert proc.returncode == 128 + signal.SIGUSR1, err
    assert "received SIGUSR1; stopping 2 ranks" in err


# -- rendezvous ------------------------------------------------------------------------------


def _two_nodes(
    tmp_path: Path, backend: str, *extra: str, port: str | None = None, started: Any = None
) -> list[tuple[int, str, str]]:
    job = script(tmp_path, "job.py", COLLECTIVE)
    env = dict(os.environ, MESHCOMM_SECRET="two nodes on one machine")
    endpoint = f"127.0.0.1:{port or free_port()}"
    nodes = []
    for k in (0, 1):
        node_rank = () if backend == "c10d" else ("--node-rank", str(k))
        cmd = [sys.executable, "-m", "meshcomm.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, *node_rank, *extra,
               job]  # fmt: skip
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))  # fmt: skip
    results = []
    try:
        if started is not None:
            started()
        for node in nodes:
            out, err = node.communicate(timeout=RUN_TIMEOUT)
            results.append((node.returncode, out, err))
    finally:
        for node in nodes:
            node.kill()
            node.wait(timeout=RUN_TIMEOUT)
    return results


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_rdzv_endpoint_runs_two_nodes(tmp_path: Path, backend: str) -> None:
    results = _two_nodes(tmp_path, backend, "--rdzv-conf", "join_timeout=60,last_call_timeout=1")
    assert [code for code, _, _ in results] == [0, 0], results
    lines = sorted(line for _, out, _ in results for line in out.splitlines())
    # Four ranks, two per node (c10d numbers the nodes in join order), all summing 1+2+3+4.
    assert lines == [f"[rank{r}] rank {r} of 4 node {r // 2} sum 10" for r in range(4)]


def test_c10d_hosts_once_a_port_bound_without_a_listener_is_free(tmp_path: Path) -> None:
    # Two launchers binding the endpoint at the same moment can both be refused; neither may
    # then assume the other hosts. A socket bound, not listening, stands in for that moment.
    blocker = socket.socket()
    blocker.bind(("0.0.0.0", 0))
    port = str(blocker.getsockname()[1])

    def release() -> None:
        time.sleep(1.0)
        blocker.close()

    try:
        results = _two_nodes(tmp_path, "c10d", "--rdzv-conf", "join_timeout=60", port=port,
                             started=release)  # fmt: skip
    finally:
        blocker.close()
    assert [code for code, _, _ in results] == [0, 0], results


def test_c10d_join_timeout_names_the_endpoint(tmp_path: Path) -> None:
    env = dict(os.environ, MESHCOMM_SECRET="alone")
    port = free_port()
    result = meshrun("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     f"127.0.0.1:{port}", "--rdzv-conf", "join_timeout=1",
                     script(tmp_path, "job.py", COLLECTIVE), env=env)  # fmt: skip
    assert result.returncode == 1
    assert f"--rdzv-endpoint 127.0.0.1:{port}: not every one of 2 nodes joined" in result.stderr


# -- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "the script to run is missing"),
        (["--nproc-per-node", "2"], "the script to run is missing"),
        (["--nnodes", "1:2", "x.py"], "--nnodes 1:2: elastic membership (MIN:MAX with MIN < MAX)"),
        (["--nnodes", "2:1", "x.py"], "--nnodes 2:1: MIN:MAX needs MIN <= MAX"),
        (["--max-restarts", "-1", "x.py"], "--max-restarts must be 0 or more, got -1"),
        (["--max-restarts", "1", "--nnodes", "2", "--no-secret", "x.py"], "one node only"),
        (["--monitor-interval", "0", "x.py"], "--monitor-interval must be a positive"),
        (["--redirects", "5", "x.py"], "--redirects '5': expected 0 (none)"),
        (["--nproc-per-node", "2", "--tee", "0:1,2:1", "x.py"], "local rank 2 is not in [0, 2)"),
        (["--local-ranks-filter", "a", "x.py"], "--local-ranks-filter 'a'"),
        (["--rdzv-backend", "etcd", "x.py"], "--rdzv-backend 'etcd'"),
        (["--rdzv-endpoint", "host:port", "x.py"], "the port 'port' is not a number"),
        (["--rdzv-conf", "join_timeout", "x.py"], "expected key=value pairs"),
        (["--rdzv-conf", "join_timeout=soon", "x.py"], "--rdzv-conf join_timeout 'soon'"),
        (["--signals-to-handle", "SIGKILL", "x.py"], "'SIGKILL' is not a signal"),
        (["--logs-specs", "mine", "x.py"], "--logs-specs 'mine': not supported"),
        (["--numa-binding", "node", "x.py"], "--numa-binding 'node': not supported"),
        (
            ["--virtual-local-rank", "--nproc-per-node", "3", "x.py"],
            "--virtual-local-rank: local rank 2 has no GPU in CUDA_VISIBLE_DEVICES='0,1'",
        ),
        (
            ["--backend", "mpi", "--max-restarts", "1", "-t", "3", "x.py"],
            "--backend mpi: --max-restarts, --log-dir/--redirects/--tee",
        ),
    ],
)
def test_bad_flags_are_named(args: list[str], message: str) -> None:
    result = meshrun(*args, env=dict(os.environ, CUDA_VISIBLE_DEVICES="0,1"))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "script_args" not in result.stderr


def test_flags_shape_the_rank_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    cfg = parse_args(["--nproc-per-node", "2", "--role", "trainer", "--local-addr", "10.1.2.3",
                      "--virtual-local-rank", "--max-restarts", "3", "--shutdown-timeout", "7",
                      "--start-method", "forkserver", "--event-log-handler", "x",
                      "x.py"])  # fmt: skip
    env = child_environment(cfg, 1, 29500, restart=2, rank_log_dir="/logs/attempt_2/1")
    assert env["ROLE_NAME"] == "trainer"
    assert env["MESHCOMM_HOST"] == "10.1.2.3"
    assert (env["LOCAL_RANK"], env["CUDA_VISIBLE_DEVICES"], env["RANK"]) == ("0", "5", "1")
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("2", "3")
    assert env["TORCHELASTIC_ERROR_FILE"] == "/logs/attempt_2/1/error.json"
    assert (cfg.grace_period, cfg.start_method) == (7.0, "spawn")


def test_pet_variables_are_flag_defaults(tmp_path: Path) -> None:
    env = dict(os.environ, PET_NPROC_PER_NODE="3", PET_MAX_RESTARTS="1")
    result = meshrun("--nproc-per-node", "2", script(tmp_path, "flaky.py", FLAKY), "1", env=env)
    assert result.returncode == 0, result.stderr  # the command line's 2 ranks, one restart
    assert "[rank1] out rank 1 attempt 1 of 1" in result.stdout.splitlines()
    assert "[rank2]" not in result.stdout
    bad = meshrun("x.py", env=dict(os.environ, PET_STANDALONE="yes"))
    assert bad.returncode == 2
    assert "PET_STANDALONE='yes' (the default of --standalone): expected 0 or 1" in bad.stderr


def test_torch_elastic_shutdown_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7")
    assert parse_args(["x.py"]).grace_period == 7.0
    monkeypatch.setenv("PET_SHUTDOWN_TIMEOUT", "9")  # torchrun: PET_ first
    assert parse_args(["x.py"]).grace_period == 9.0
    assert parse_args(["--shutdown_timeout", "3", "x.py"]).grace_period == 3.0


def test_rdzv_endpoint_is_the_store() -> None:
    cfg = parse_args(["--rdzv-endpoint", "127.0.0.1:29511", "x.py"])
    assert (cfg.master_addr, cfg.master_port) == ("127.0.0.1", 29511)
    c10d = parse_args(["--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1]", "x.py"])
    assert (c10d.master_addr, c10d.master_port) == ("::1", 29400)  # torchrun's c10d port
    standalone = parse_args(["--standalone", "--rdzv-endpoint", "h:1", "x.py"])
    assert standalone.master_port == 0  # --standalone ignores the rendezvous flags


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_sends_the_stream_to_the_console() -> None:
    with open("/dev/full", "wb", buffering=0) as full:
        route = Route(file=full, console=False)
        problem = route.write([b"line"], b"[rank0] ")
    assert problem is not None and "cannot write /dev/full" in problem
    assert (route.file, route.console) == (None, True)
    assert route.write([b"next"], b"") is None


def test_flag_parsers() -> None:
    assert parse_std_map("2", "--tee", 2) == {0: 2, 1: 2}
    assert parse_std_map("1:3", "--tee", 2) == {0: 0, 1: 3}
    assert parse_endpoint("[fe80::1]:7", "--rdzv-endpoint") == ("fe80::1", 7)
    with pytest.raises(FlagError, match="no port given"):
        parse_endpoint("host", "--rdzv-endpoint")


# -- torchrun's whole flag set, and the docs table -----------------------------------------------


def _meshrun_options() -> set[str]:
    return set(build_parser()._option_string_actions)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_every_torchrun_flag_is_accepted() -> None:
    from torch.distributed.run import get_args_parser

    theirs = set(get_args_parser()._option_string_actions)
    assert sorted(theirs - _meshrun_options()) == []


def test_the_docs_table_names_every_torchrun_flag() -> None:
    text = (ROOT / "docs" / "launch.md").read_text()
    start = text.index("### Every torchrun flag")
    table = text[start : text.index("\n#", start + 1)]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    named = {flag for row in rows for flag in re.findall(r"`(-[-\w]+)", row.split("|")[1])}
    long_flags = {flag for flag in _meshrun_options() if flag.startswith("--") and "_" not in flag}
    torchrun_only = {"--help"}
    meshrun_only = {"--no-prefix", "--grace-period", "--backend", "--elastic", "--mpiexec",
                    "--secret-file", "--no-secret", "--run-id"}  # fmt: skip
    assert sorted(long_flags - torchrun_only - meshrun_only - named) == []
