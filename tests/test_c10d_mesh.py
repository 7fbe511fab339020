"""One mesh for both: meshcomm meshes and torch DeviceMeshes over the same groups.

A (2, 2) world under a real torchrun: DTensor redistributions and ``meshcomm.ops`` run in
one program, on one set of transports, whichever mesh came first (the script is
tests/scripts/c10d_mesh.py). Skipped, with the reason, when torch is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed (pip install meshcomm[torch]): the c10d backend needs it",
)

from tests.test_torchrun import ROOT, _clean_env, _free_port, _run  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "c10d_mesh.py"


def _records(out_dir: Path) -> dict[int, dict[str, Any]]:
    found = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    return {record["rank"]: record for record in found}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["meshcomm-first", "torch-first"])
def test_dtensor_and_meshcomm_ops_share_one_mesh(mode: str, tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "4",
        "--master-port",
        str(_free_port()),
        str(SCRIPT),
        mode,
        str(tmp_path),
    ]
    code, out = _run(command, _clean_env())
    assert code == 0, out[-4000:]
    records = _records(tmp_path)
    assert sorted(records) == [0, 1, 2, 3], out[-4000:]
    for rank, rec in records.items():
        assert rec["backend"] == "meshcomm"
        assert rec["same_world"], f"rank {rank}: torch's default group is not meshcomm's world"
        assert rec["same_tp_group"], f"rank {rank}: torch's tp group is not the mesh's"
        assert rec["full_ok"], f"rank {rank}: Shard/Shard -> Replicate lost values"
        assert rec["partial"] == [[2.0, 2.0], [2.0, 2.0]]
        assert rec["psum_tp"] == [float(sum(rec["tp_row"]))]
        assert rec["gathered"] == rec["expected_rows"]


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_an_mpi_world_hands_torch_its_mesh(tmp_path: Path) -> None:
    """Under mpiexec (no store): meshcomm's MPI world under torch's default group."""
    from tests.test_mpi import SKIP, find_mpiexec

    if SKIP:
        pytest.skip(SKIP)
    mpiexec = find_mpiexec()
    assert mpiexec is not None
    env = _clean_env({"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"})
    command = [mpiexec, "-n", "4", sys.executable, str(SCRIPT), "meshcomm-first", str(tmp_path)]
    code, out = _run(command, env)
    assert code == 0, out[-4000:]
    records = _records(tmp_path)
    assert sorted(records) == [0, 1, 2, 3], out[-4000:]
    for rec in records.values():
        assert rec["same_world"] and rec["same_tp_group"] and rec["full_ok"]
        assert rec["psum_tp"] == [float(sum(rec["tp_row"]))]
        assert rec["gathered"] == rec["expected_rows"]
