"""Every launcher gives its ranks one secret per job, and their store authenticates with it.

Real launcher processes (meshrun, meshcomm.spawn, ``meshrun --backend mpi``) running real
ranks; the jupyter engines are checked in test_jupyter.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from meshcomm.common.secret import SECRET_ENV
from meshcomm.errors import InvalidArgument
from meshcomm.launcher.job_secret import read_secret_file
from meshcomm.spawn import spawn

SCRIPT = str(Path(__file__).parent / "scripts" / "launch_secret.py")
RUN_TIMEOUT = 90.0


def _env(secret: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    if secret is not None:
        env[SECRET_ENV] = secret
    return env


def _meshrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshcomm.run", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=_env() if env is None else env,
    )


def _records(stdout: str) -> list[dict[str, Any]]:
    records = []
    for line in stdout.splitlines():
        tag, _, body = line.partition(" ")
        if tag.startswith("[rank") and body.startswith("{"):
            records.append(json.loads(body))
    return sorted(records, key=lambda r: r["rank"])


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def test_meshrun_makes_one_secret_per_job() -> None:
    runs = [_meshrun("--nproc-per-node", "2", SCRIPT) for _ in range(2)]
    digests = []
    for run in runs:
        assert run.returncode == 0, run.stderr
        records = _records(run.stdout)
        assert [r["rank"] for r in records] == [0, 1]
        assert all(r["authenticated"] is True and r["sum"] == 2.0 for r in records), records
        assert records[0]["secret"] is not None
        assert records[0]["secret"] == records[1]["secret"]
        digests.append(records[0]["secret"])
        assert "unauthenticated" not in run.stderr
    assert digests[0] != digests[1]  # a fresh secret per job


def test_meshrun_keeps_a_secret_from_the_environment() -> None:
    run = _meshrun("--nproc-per-node", "2", SCRIPT, env=_env("given-by-user"))
    assert run.returncode == 0, run.stderr
    assert {r["secret"] for r in _records(run.stdout)} == {_digest("given-by-user")}


def test_meshrun_secret_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("from-a-file\n")
    path.chmod(0o644)
    run = _meshrun("--nproc-per-node", "2", "--secret-file", str(path), SCRIPT)
    assert run.returncode == 2
    assert "mode 0644" in run.stderr and "chmod 600" in run.stderr
    path.chmod(0o600)
    run = _meshrun("--nproc-per-node", "2", "--secret-file", str(path), SCRIPT)
    assert run.returncode == 0, run.stderr
    records = _records(run.stdout)
    assert {r["secret"] for r in records} == {_digest("from-a-file")}
    assert all(r["authenticated"] for r in records)


def test_secret_file_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read the secret file"):
        read_secret_file(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    empty.chmod(0o600)
    with pytest.raises(InvalidArgument, match="is empty"):
        read_secret_file(str(empty))
    with pytest.raises(InvalidArgument, match="not a regular file"):
        read_secret_file(str(tmp_path))


def test_meshrun_no_secret_runs_unauthenticated_and_says_so() -> None:
    run = _meshrun("--nproc-per-node", "2", "--no-secret", SCRIPT, env=_env("inherited"))
    assert run.returncode == 0, run.stderr
    records = _records(run.stdout)
    assert all(r["secret"] is None and r["authenticated"] is False for r in records), records
    assert "this job is unauthenticated" in run.stderr


def test_meshrun_several_nodes_need_a_shared_secret() -> None:
    run = _meshrun("--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", SCRIPT)
    assert run.returncode == 2
    assert "every node needs the same secret" in run.stderr
    assert "--secret-file" in run.stderr and SECRET_ENV in run.stderr


def test_two_nodes_share_a_secret_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("shared-by-both-nodes")
    path.chmod(0o600)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
              "--master-port", port, "--secret-file", str(path)]  # fmt: skip
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "meshcomm.run", *common, "--node-rank", str(k), SCRIPT],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for k in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=RUN_TIMEOUT) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
            node.wait(timeout=RUN_TIMEOUT)
    assert [node.returncode for node in nodes] == [0, 0], outputs
    records = _records(outputs[0][0] + outputs[1][0])
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["authenticated"] and r["sum"] == 2.0 for r in records), records
    assert {r["secret"] for r in records} == {_digest("shared-by-both-nodes")}


def report(rank: int, outdir: str) -> None:
    import numpy as np

    import meshcomm

    secret = os.environ.get(SECRET_ENV, "")
    group = meshcomm.init(timeout=60)
    info = meshcomm.get_world_info()
    total = float(group.all_reduce(np.ones(1))[0])
    record = {"secret": _digest(secret), "authenticated": info.raw_store.authenticated}
    Path(outdir, f"{rank}.json").write_text(json.dumps({**record, "sum": total}))
    meshcomm.shutdown()


def test_spawn_gives_its_processes_a_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    spawn(report, args=(str(tmp_path),), nprocs=2, timeout=RUN_TIMEOUT)
    records = [json.loads(Path(tmp_path, f"{r}.json").read_text()) for r in range(2)]
    assert records[0]["secret"] == records[1]["secret"] != _digest("")
    assert all(r["authenticated"] and r["sum"] == 2.0 for r in records), records
    monkeypatch.setenv(SECRET_ENV, "the-callers")
    spawn(report, args=(str(tmp_path),), nprocs=2, timeout=RUN_TIMEOUT)
    records = [json.loads(Path(tmp_path, f"{r}.json").read_text()) for r in range(2)]
    assert {r["secret"] for r in records} == {_digest("the-callers")}


_MPI_JOB = """
import hashlib, os
import meshcomm
from meshcomm.store import TCPStore
secret = os.environ.get("MESHCOMM_SECRET", "")
group = meshcomm.init(timeout=60)
print("secret", hashlib.sha256(secret.encode()).hexdigest(), "set", bool(secret))
"""


def test_meshrun_backend_mpi_gives_its_ranks_a_secret(tmp_path: Path) -> None:
    from meshcomm.launcher.mpiexec import find_mpiexec

    pytest.importorskip("mpi4py")
    if find_mpiexec() is None:
        pytest.skip("no mpiexec")
    script = tmp_path / "job.py"
    script.write_text(_MPI_JOB)
    run = _meshrun("--backend", "mpi", "--nproc-per-node", "2", str(script))
    assert run.returncode == 0, run.stderr
    lines = sorted(line for line in run.stdout.splitlines() if " secret " in line)
    assert len(lines) == 2, run.stdout
    assert lines[0].split()[2] == lines[1].split()[2]
    assert all(line.endswith("set True") for line in lines), lines
