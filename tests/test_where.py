"""meshrun's report of where each rank is: SIGUSR1, the first Ctrl-C, a timed-out collective."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from polling import wait_until

pytestmark = pytest.mark.timeout(120)
SCRIPT = Path(__file__).parent / "scripts" / "where_ranks.py"
ROOT = str(Path(__file__).resolve().parents[1])


def _line(text: str) -> int:
    lines = SCRIPT.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {text}"))


def _meshrun(tmp_path: Path, timeout: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
        "WHERE_TEST_DIR": str(tmp_path),
        "MESHCOMM_TIMEOUT": timeout,
    }
    return subprocess.Popen(
        [sys.executable, "-m", "meshcomm.run", "--nproc-per-node", "3", str(SCRIPT)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _ready(tmp_path: Path, proc: subprocess.Popen[str]) -> None:
    def all_ready() -> bool:
        assert proc.poll() is None, proc.communicate()
        return all((tmp_path / f"ready{r}").exists() for r in range(3))

    assert wait_until(all_ready, 60), "the ranks did not get ready"


def _check(report: str, why: str) -> None:
    assert f"meshrun: where each rank is ({why}" in report, report
    wait, nap = _line("THE WAIT"), _line("THE CALL OF NAP")
    assert "rank 0: in all_reduce #2 on group 'world' for " in report, report
    assert f"(called at where_ranks.py:{wait}) with float64[2], sum" in report, report
    for rank in (1, 2):
        assert f"rank {rank}: not in a collective; none called for " in report, report
    assert report.count("last done: all_reduce #1 at where_ranks.py:") == 3, report
    assert report.count(f"at where_ranks.py:{_line('THE NAP')} in nap <- where_ranks.py:{nap}") == 2


def test_sigusr1_then_ctrl_c_report_every_rank(tmp_path: Path) -> None:
    proc = _meshrun(tmp_path, "60")
    try:
        _ready(tmp_path, proc)
        time.sleep(0.3)  # rank 0 is in its all_reduce
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        assert proc.poll() is None  # SIGUSR1 stops nothing
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    usr1, _, ctrl_c = err.partition("received SIGINT")
    _check(usr1, "SIGUSR1")
    _check(ctrl_c, "Ctrl-C")
    assert "stopped ranks" in ctrl_c or "stopped rank" in ctrl_c, ctrl_c


def test_a_timed_out_collective_makes_meshrun_report(tmp_path: Path) -> None:
    proc = _meshrun(tmp_path, "2")
    try:
        _out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0, err[-3000:]
    assert err.count("meshrun: where each rank is (a collective timed out: ") == 1, err[-4000:]
    report = err.split("meshrun: where each rank is")[1]
    assert "rank 1: not in a collective; none called for " in report, err[-4000:]
    assert "rank 1 has not entered all_reduce #2 on group 'world'" in err, err[-4000:]
