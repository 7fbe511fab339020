"""MESHCOMM_TRACE: per-rank Chrome traces, merged, with a straggler report."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from meshcomm import trace
from meshcomm.errors import InvalidArgument
from meshcomm.group import ProcessGroup
from meshcomm.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


def _late_rank_three(world: ProcessGroup) -> int:
    """20 all_reduces on the world; rank 3 calls each one 30 ms after the others."""
    pair = world.new_group([0, 1])
    for _ in range(20):
        if world.rank == 3:
            time.sleep(0.03)
        world.all_reduce(np.ones(4, np.float32))
    if pair is not None:
        pair.all_gather(np.ones(2), async_op=True).wait(timeout=30)
    return world.rank


def test_trace_files_merge_and_name_the_straggler(tmp_path: Path) -> None:
    env = {"MESHCOMM_TRACE": str(tmp_path)}
    assert run_ranks(_late_rank_three, 4, env=env, timeout=90) == [0, 1, 2, 3]
    for rank in range(4):
        doc = json.loads((tmp_path / f"rank{rank}.json").read_text())
        spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
        assert sum(e["args"]["op"] == "all_reduce" for e in spans) == 20, rank
        assert all(e["args"]["bytes"] == 16 for e in spans if e["args"]["op"] == "all_reduce")
        assert "world" in names and (("world/group1" in names) == (rank < 2)), names
    merged, report = trace.merge(tmp_path)
    assert json.loads(merged.read_text())["traceEvents"]
    world = next(row for row in report if row["group"] == "world")
    assert world["rank"] == 3 and world["count"] == 21, report  # and new_group
    assert 20 <= world["median_ms"] <= 80, report
    assert trace.main([str(tmp_path)]) == 0


def test_a_trace_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("")
    with pytest.raises(InvalidArgument, match="is not a directory"):
        trace.start(0, None, env={"MESHCOMM_TRACE": str(path)})
    assert trace.active is None


def test_merge_of_an_empty_dir_says_so(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="no rank"):
        trace.merge(tmp_path)
    assert trace.main([str(tmp_path)]) == 1
