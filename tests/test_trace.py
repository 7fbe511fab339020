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


def _mesh_axes(world: ProcessGroup) -> list[str]:
    """psum over 'tp' three times, over 'dp' twice, over ('dp', 'tp') once, on a
    (2, size / 2) mesh; returns this rank's group names by axis."""
    from meshcomm import ops
    from meshcomm.mesh import DeviceMesh

    mesh = DeviceMesh(np.arange(world.size).reshape(2, world.size // 2), ("dp", "tp"))
    x = np.ones(4, np.float32)
    for axis, times in (("tp", 3), ("dp", 2), (("dp", "tp"), 1)):
        for _ in range(times):
            ops.psum(x, axis, mesh=mesh)
    return [mesh.get_group(axis).name for axis in ("tp", "dp")]


@pytest.mark.parametrize("size", [2, 4])
def test_tracks_are_named_by_the_mesh_axes(tmp_path: Path, size: int) -> None:
    """A mesh's groups are tracks named by the axes the user wrote and the slice's
    coordinates (unique per slice, so the straggler report never mixes two groups)."""
    env = {"MESHCOMM_TRACE": str(tmp_path)}
    names = run_ranks(_mesh_axes, size, env=env, timeout=90)
    half = size // 2
    for rank, (tp, dp) in enumerate(names):
        assert tp == f"world/tp (dp={rank // half})", names
        assert dp == ("world" if size == 2 else f"world/dp (tp={rank % half})"), names
        doc = json.loads((tmp_path / f"rank{rank}.json").read_text())
        tracks = {
            e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"
        }
        spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
        assert all(tracks[e["tid"]] == e["args"]["group"] for e in spans), (tracks, spans)
        assert tp in tracks.values() and dp in tracks.values(), tracks
        assert not any("axes(" in name for name in tracks.values()), tracks
        on_tp = [e for e in spans if e["args"]["group"] == tp]
        assert len(on_tp) == 3 and all(e["name"] == f"all_reduce {tp}" for e in on_tp)
    merged, report = trace.merge(tmp_path)
    assert json.loads(merged.read_text())["traceEvents"]
    counts = {row["group"]: row["count"] for row in report}
    if size == 4:  # each slice's group alone: 3 psums each, not 6 from two slices
        assert counts["world/tp (dp=0)"] == counts["world/tp (dp=1)"] == 3, report
        assert counts["world/dp (tp=0)"] == counts["world/dp (tp=1)"] == 2, report
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
