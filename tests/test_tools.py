"""The command-line tools as a newcomer meets them: help that explains every flag, no
warnings of our own, nccl-tests' flag names accepted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshcomm.bench import _parser

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def test_bench_help_explains_every_flag_in_plain_text() -> None:
    parser = _parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"
    text = parser.format_help()
    assert "``" not in text and ":func:" not in text


def test_bench_takes_nccl_tests_names() -> None:
    ns = _parser().parse_args(
        ["--minbytes", "1K", "--maxbytes", "1M", "--stepfactor", "4", "--datatype", "float64",
         "--warmup_iters", "1"]
    )  # fmt: skip
    assert (ns.min_bytes, ns.max_bytes, ns.step_factor, ns.dtype, ns.warmup) == (
        1024,
        1 << 20,
        4,
        "float64",
        1,
    )


@pytest.mark.skipif(not (BIN / "meshcomm-bench").exists(), reason="meshcomm-bench not installed")
def test_bench_runs_and_checks_its_results() -> None:
    out = _run(str(BIN / "meshcomm-bench"), "-n", "2", "-b", "8", "-e", "1K", "-f", "8", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["size"] for r in rows] == [8, 64, 512]
    assert all(r["wrong"] == 0 for r in rows), rows


@pytest.mark.skipif(not (BIN / "meshcomm-info").exists(), reason="meshcomm-info not installed")
def test_info_prints_no_warnings() -> None:
    out = _run(str(BIN / "meshcomm-info"))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert re.match(r"meshcomm \S+ \(python", out.stdout), out.stdout
    out = _run(str(BIN / "meshcomm-info"), "--json")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "backends" in json.loads(out.stdout)


def test_python_m_meshcomm_info_prints_no_warnings() -> None:
    # ``import meshcomm`` imports meshcomm.info; runpy warned when it then ran it as __main__.
    out = _run(sys.executable, "-m", "meshcomm.info")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "launcher: none (a world of one)" in out.stdout, out.stdout


@pytest.mark.skipif(not (BIN / "meshrun").exists(), reason="meshrun not installed")
def test_info_names_meshrun_and_spawn_not_torchrun() -> None:
    out = _run(str(BIN / "meshrun"), "--nproc-per-node", "2", "-m", "meshcomm.info")
    assert out.returncode == 0, out.stderr
    assert "RuntimeWarning" not in out.stdout + out.stderr, out.stdout + out.stderr
    for rank in range(2):
        assert f"[rank{rank}] launcher: meshrun, rank {rank} of 2" in out.stdout, out.stdout
    from meshcomm.testing import run_ranks

    names = run_ranks(_launcher_name, 2, timeout=60)
    assert names == ["meshcomm.spawn"] * 2, names


def _launcher_name(group: object) -> str:
    from meshcomm.info import info

    return str(info(verbose=False, query_mpi=False)["launcher"]["launcher"])


@pytest.mark.skipif(not (BIN / "meshrun").exists(), reason="meshrun not installed")
def test_benches_that_read_a_groups_internals_still_run() -> None:
    """bench/ scripts reach into private state to switch checks off; a refactor that moves it
    must not leave them broken until someone measures again."""
    script = str(REPO / "bench" / "mismatch_overhead.py")
    out = _run(str(BIN / "meshrun"), "--nproc-per-node", "2", script, "--iters", "5",
               "--repeats", "1")  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    row = r"world +\S+ +[\d.]+ +[\d.]+ +[\d.]+ +[-+][\d.]+$"  # op, group, channels, figures
    assert re.search(row, out.stdout, re.M), out.stdout
    tree = str(REPO / "bench" / "tree_overhead.py")
    out = _run(sys.executable, tree, str(REPO), str(REPO), "--iters", "20", "--rounds", "1")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_mpi_floor_bench_still_runs() -> None:
    """bench/peers/mpi_floor.py reads the group's communicator and the mpi backend's runner
    (private state): it must keep running after a refactor, every line in its table."""
    mpiexec = BIN / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("no mpiexec next to this Python (the venv's MPICH)")
    script = str(REPO / "bench" / "peers" / "mpi_floor.py")
    out = _run(str(mpiexec), "-n", "2", sys.executable, script, "--repeats", "1", "--iters", "5")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for line in ("raw", "bare", "runner", "method", "group", "persistent"):
        assert re.search(rf"^ +{line} +[\d.]+ +[-+][\d.]+$", out.stdout, re.M), out.stdout
