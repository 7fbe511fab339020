"""Blame without races (issue 33 item 5): every survivor names the first failure.

World 4 under the launchers (:func:`meshcomm.testing.run_ranks`, which starts ranks with
:func:`meshcomm.spawn`, and ``meshrun``): rank 2 is SIGKILLed during a 64 MiB all_reduce over
each route (the CMA collectives, shared-memory rings, sockets); every survivor must blame rank
2, never a survivor that left after its own error or that the launcher stopped. A rank that
exits with status 0 while the others still need it is reported as having exited normally,
not as dead. The unit tests drive :class:`~meshcomm.backends.tcp.faults.Faults` over a
:class:`~meshcomm.store.HashStore`: the grace for the first failure's record, and the
launcher's notes (:mod:`meshcomm.launcher.exit_notes`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshcomm.backends.tcp.abort import AbortRecord
from meshcomm.backends.tcp.faults import ABORT_KEY, BLAME_GRACE, LEFT_KEY, Faults
from meshcomm.errors import CommError, SpawnError
from meshcomm.launcher.exit_notes import ExitNote, exit_key, read_note
from meshcomm.spawn import spawn
from meshcomm.store import HashStore, PrefixStore
from meshcomm.testing import run_ranks

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")

VICTIM = 2
# Set in this process, whose environment the ranks inherit: the size knobs are read when
# meshcomm is imported, before run_ranks's own environment reaches the rank.
ROUTES = {
    "cma": {},  # the CMA collectives (64 MiB is far above MESHCOMM_SHM_DIRECT_MIN)
    # The ring algorithm, every payload streamed through the shared-memory rings.
    "rings": {"MESHCOMM_SHM_DIRECT_MIN": "0", "MESHCOMM_SHM_CMA_MIN": str(1 << 40)},
    "sockets": {"MESHCOMM_TRANSPORT": "tcp"},
}
# Generous: the machine may have 2 slow cores shared with other test runs.
_RUN_TIMEOUT = 90


# == in the ranks =============================================================================
def _report(folder: str, rank: int, exc: CommError) -> None:
    value = {"type": type(exc).__name__, "blamed": getattr(exc, "rank", None), "message": str(exc)}
    tmp = os.path.join(folder, f".{rank}.json")
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, os.path.join(folder, f"{rank}.json"))


def kill_mid_all_reduce(group: Any, folder: str, delay: float) -> None:
    """64 MiB all_reduces until rank 2 is SIGKILLed ``delay`` s into its second call.

    The survivors ignore the launcher's SIGTERM (it follows rank 2's death at once) so that
    each lives to write its report; the launcher's SIGKILL still ends them after its grace.
    """
    rank = group.rank
    if rank != VICTIM:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    buf = np.ones(16 << 20, np.float32)
    for step in range(1000):
        if rank == VICTIM and step == 1:
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        try:
            group.all_reduce(buf)
        except CommError as exc:
            _report(folder, rank, exc)
            raise
    raise AssertionError("the victim never died")


def exit_normally_mid_world(rank: int, folder: str) -> None:
    """Rank 2 ends its process with status 0, without closing its world (as a script that
    simply ends does); the others then need it."""
    from meshcomm import world

    group = world.init()
    group.barrier()
    if rank == VICTIM:
        os._exit(0)  # no goodbye on its links: only its launcher knows it exited normally
    try:
        group.all_reduce(np.ones(4, np.float32))
    except CommError as exc:
        _report(folder, rank, exc)
    else:
        raise AssertionError("rank 2's absence went unnoticed")
    finally:
        world.shutdown()


# == the checks ===============================================================================
def _reports(folder: Path, ranks: list[int]) -> dict[int, dict[str, Any]]:
    found = {}
    for rank in ranks:
        path = folder / f"{rank}.json"
        assert path.exists(), f"rank {rank} left no report"
        found[rank] = json.loads(path.read_text())
    return found


def check_blames_first_failure(reports: dict[int, dict[str, Any]]) -> None:
    for rank, report in reports.items():
        assert (report["type"], report["blamed"]) == ("PeerError", VICTIM), (rank, report)
        for other in (0, 1, 3):
            assert f"rank {other} died" not in report["message"], (rank, report)


@pytest.fixture(params=sorted(ROUTES))
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each route's knobs in this process's environment, which the ranks inherit."""
    for name, value in ROUTES[request.param].items():
        monkeypatch.setenv(name, value)
    return str(request.param)


def _kill_runs(tmp_path: Path, route: str, runs: int, seed: int) -> None:
    rng = random.Random(seed)
    for run in range(runs):
        folder = tmp_path / f"{route}-{run}"
        folder.mkdir()
        args = (str(folder), rng.uniform(0.0, 0.3))
        with pytest.raises((SpawnError, CommError)):
            run_ranks(
                kill_mid_all_reduce,
                4,
                timeout=_RUN_TIMEOUT,
                env={"MESHCOMM_TIMEOUT": "20"},
                args=args,
            )
        check_blames_first_failure(_reports(folder, [0, 1, 3]))


def test_every_survivor_blames_the_rank_killed_mid_64mib_all_reduce(
    tmp_path: Path, route: str
) -> None:
    _kill_runs(tmp_path, route, 2, seed=33)


@pytest.mark.slow
@pytest.mark.timeout(300)  # 8 runs of 2-4 s each on the loaded 2-core VM
def test_every_survivor_blames_the_killed_rank_8_runs(tmp_path: Path, route: str) -> None:
    """8 runs x 3 survivors per route, no wrong blame (the issue's measure, 50 runs per route
    and launcher, is in docs/backends/tcp.md: too long for the suite)."""
    _kill_runs(tmp_path, route, 8, seed=5)


_MESHRUN_RANK = """
import os, sys
sys.path.insert(0, {tests!r})
import meshcomm
from test_blame import kill_mid_all_reduce
kill_mid_all_reduce(meshcomm.init(), {folder!r}, float(os.environ["BLAME_DELAY"]))
"""


def test_every_survivor_blames_the_killed_rank_under_meshrun(tmp_path: Path, route: str) -> None:
    script = tmp_path / "rank.py"
    folder = tmp_path / "reports"
    folder.mkdir()
    tests = str(Path(__file__).resolve().parent)
    script.write_text(_MESHRUN_RANK.format(tests=tests, folder=str(folder)))
    env = dict(os.environ, MESHCOMM_TIMEOUT="20", BLAME_DELAY="0.1")
    meshrun = [sys.executable, "-m", "meshcomm.run", "--nproc-per-node", "4", str(script)]
    done = subprocess.run(meshrun, check=False, env=env, capture_output=True, timeout=_RUN_TIMEOUT)
    assert done.returncode != 0, done.stderr.decode(errors="replace")[-2000:]
    check_blames_first_failure(_reports(folder, [0, 1, 3]))


def test_a_rank_that_exits_normally_is_not_called_dead(
    tmp_path: Path, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHCOMM_TIMEOUT", "20")
    spawn(exit_normally_mid_world, args=(str(tmp_path),), nprocs=4, timeout=_RUN_TIMEOUT)
    for rank, report in _reports(tmp_path, [0, 1, 3]).items():
        assert (report["type"], report["blamed"]) == ("PeerError", VICTIM), (rank, report)
        message = report["message"]
        assert "died" not in message, (route, rank, message)
        assert "rank 2 exited normally (status 0)" in message, (route, rank, message)


# == Faults over a HashStore ===================================================================
def _launched(monkeypatch: pytest.MonkeyPatch, rank: int, size: int) -> None:
    """This process is rank ``rank`` of a launcher's world of ``size`` (the notes apply)."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(size))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("MESHCOMM_LAUNCHER", "meshrun")


def test_exit_notes_round_trip_through_a_prefixed_store() -> None:
    root = HashStore(timeout=5)
    view = PrefixStore("meshcomm/group/1", PrefixStore("meshcomm/world/0.0", root))
    root.set(exit_key(3, 0), ExitNote(3, code=0).encode())
    assert read_note(view, 3, "0") == ExitNote(3, code=0)
    assert read_note(view, 2, "0") is None
    root.set(exit_key(2, 0), b"not a note")
    assert read_note(view, 2, "0") is None


def test_blame_waits_for_the_first_failures_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHCOMM_LAUNCHER", raising=False)
    store = HashStore(timeout=5)
    faults = Faults(1, 4, store)
    # Rank 0 left after its own error; rank 3's record of rank 2's death comes a bit later.
    store.set(LEFT_KEY + "0", "ProtocolError: cannot read 4096 bytes of rank 2")
    record = AbortRecord(2, "rank 2 died: its process is gone (seen by rank 3)")
    timer = threading.Timer(BLAME_GRACE / 5, store.set, (ABORT_KEY, record.encode()))
    timer.start()
    try:
        reason, blamed = faults.blame(0, "its process is gone")
    finally:
        timer.join()
    assert blamed == 2, reason
    assert reason.startswith("rank 2 died") and "rank 0 left after that failure" in reason


def test_blame_without_any_record_takes_the_peer_for_dead_after_the_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MESHCOMM_LAUNCHER", raising=False)
    store = HashStore(timeout=5)
    faults = Faults(1, 4, store)
    started = time.monotonic()
    reason, blamed = faults.blame(2, "its process is gone")
    assert time.monotonic() - started >= BLAME_GRACE * 0.9
    assert (blamed, reason) == (2, "rank 2 died: its process is gone (seen by rank 1)")
    assert AbortRecord.decode(bytes(store.get(ABORT_KEY)), 4).rank == 2


def test_a_peer_its_launcher_stopped_points_at_the_first_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _launched(monkeypatch, 1, 4)
    root = HashStore(timeout=5)
    faults = Faults(1, 4, PrefixStore("meshcomm/world/0.0", root))
    root.set(exit_key(2, 0), ExitNote(2, code=-9).encode())
    root.set(exit_key(0, 0), ExitNote(0, stopped_after=2).encode())
    started = time.monotonic()
    reason, blamed = faults.blame(0, "its process is gone")
    assert time.monotonic() - started < BLAME_GRACE  # the notes settle it: no grace spent
    assert blamed == 2, reason
    assert reason.startswith("rank 2 died: it was killed by SIGKILL"), reason
    assert "rank 0 left after that failure (was stopped by its launcher" in reason
    # Published for the others: they name rank 2 too.
    assert AbortRecord.decode(bytes(root.get("meshcomm/world/0.0/" + ABORT_KEY)), 4).rank == 2


def test_a_peer_that_exited_with_status_0_is_not_called_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _launched(monkeypatch, 1, 4)
    root = HashStore(timeout=5)
    faults = Faults(1, 4, root)
    root.set(exit_key(3, 0), ExitNote(3, code=0).encode())
    reason, blamed = faults.blame(3, "its connection closed (EOF) without a goodbye")
    assert blamed == 3
    assert reason.startswith("rank 3 exited normally (status 0)"), reason
    assert "died" not in reason
