"""bench/torch_backend.py still runs: DDP and FSDP2 on "meshcomm" and "gloo", and the 8 B route.

The smoke mode (``--quick``: world 2, one step, a small model, few iterations) launches five
torchrun jobs, so the test takes 45-80 s on two cores (more under load).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "torch_backend.py"


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_torch_backend_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "meshcomm / gloo:" in proc.stdout, proc.stdout
    data = json.loads(out.read_text())
    for what in ("ddp", "fsdp"):
        row = data[what]
        assert row["world"] == 2
        assert row["ratio"] > 0
        assert all(row[b]["step_ms"] > 0 for b in ("meshcomm", "gloo")), row
    assert data["ddp"]["meshcomm"]["nosync_ms"] > 0
    route = data["overhead w2"]
    assert route["world"] == 2
    assert route["medians_us"]["dist.all_reduce(t)"] > 0
    assert route["medians_us"]["mesh_group.all_reduce(x)"] > 0
    assert "completed([t]) (TorchWork creation)" in route["local_us"]
