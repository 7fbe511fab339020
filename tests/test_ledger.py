"""The collective ledger: always on, bounded, with the caller's line."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from meshcomm.backends.local import SelfCommunicator
from meshcomm.errors import InvalidArgument
from meshcomm.group import ProcessGroup
from meshcomm.testing import run_ranks


def _calls(world: ProcessGroup) -> list[dict[str, object]]:
    x = np.ones(4, np.float32)
    world.all_reduce(x)  # general path; the direct path learns the pair
    world.all_reduce(x)  # direct path
    world.all_gather(np.ones(2), async_op=True).wait(timeout=30)  # async: the engine's thread
    return world.ledger()


def test_every_route_is_recorded_with_the_callers_line() -> None:
    for records in run_ranks(_calls, 2, timeout=60):
        assert [(r["seq"], r["op"], r["state"]) for r in records] == [
            (1, "all_reduce", "done"),
            (2, "all_reduce", "done"),
            (3, "all_gather", "done"),
        ]
        assert all(str(r["site"]).startswith("test_ledger.py:") for r in records), records
        assert records[0]["dtype"] == "float32" and records[0]["shape"] == (4,)


def _psum_both_paths(world: ProcessGroup) -> list[dict[str, object]]:
    import meshcomm

    mesh = meshcomm.init_device_mesh((world.size,), mesh_dim_names=("tp",))
    group = mesh.get_group("tp")
    x = np.ones(3, np.float32)
    for general_path in (True, False):
        group._issuer.debug = general_path  # DETAIL's checks take the call through Ledger.add
        meshcomm.ops.psum(x, "tp", mesh=mesh)
    group._issuer.debug = False
    return group.ledger()


def test_the_direct_path_records_what_the_general_path_does() -> None:
    """Issuer.run_plan writes Ledger.add's record itself (a frame less per call): one call
    site's two records, one from each, must read the same, the caller's line and the API
    the user called (psum) included."""
    for records in run_ranks(_psum_both_paths, 2, timeout=60):
        general, direct = ({k: v for k, v in r.items() if k != "seconds"} for r in records)
        assert general.pop("seq") == 1 and direct.pop("seq") == 2
        assert direct == general, (general, direct)
        assert str(direct["site"]).startswith("test_ledger.py:") and direct["name"] == "psum"


def test_the_ledger_is_bounded_over_many_calls() -> None:
    g = ProcessGroup(SelfCommunicator(timeout=10))
    x = np.ones(2, np.float32)
    tracemalloc.start()
    for _ in range(3000):  # the ring fills, and the direct path's buffers are made
        g.all_reduce(x)
    before = tracemalloc.take_snapshot()
    for _ in range(100_000):
        g.all_reduce(x)
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert len(g.ledger()) == 2048 and g.ledger()[-1]["seq"] == 103_000
    assert grown < 256 * 1024, grown  # flat: the ring replaces, it does not grow
    g.close()


def test_a_failed_collective_is_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    g = ProcessGroup(SelfCommunicator(timeout=0.2))
    with pytest.raises(Exception, match="nobody sent"):
        g.recv(0, tag=3)  # point to point: not in the ledger
    assert g.ledger() == []
    g.close()


def test_ledger_length_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHCOMM_LEDGER", "0")
    g = ProcessGroup(SelfCommunicator(timeout=10))
    g.all_reduce(np.ones(2))
    assert g.ledger() == []
    g.close()
    monkeypatch.setenv("MESHCOMM_LEDGER", "lots")
    with pytest.raises(InvalidArgument, match="MESHCOMM_LEDGER must be a non-negative integer"):
        ProcessGroup(SelfCommunicator(timeout=10))


def test_sigusr1_prints_where_a_rank_is() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "usr1_report.py"
    root = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--- meshcomm: where this rank is (SIGUSR1) ---" in out.stderr, out.stderr[-3000:]
    assert "rank 0, group 'world' (size 2):" in out.stderr
    assert "all_reduce #2 float64 (3,) in flight for" in out.stderr, out.stderr[-3000:]
    assert "at usr1_report.py:" in out.stderr and "Current thread" in out.stderr
