"""meshcomm.ops on the mpi backend against jax.lax in shard_map, under ``mpiexec -n 8``.

The cases, inputs, JAX side and comparison are those of ``tests/test_jax_oracle.py`` (reused,
not copied): JAX computes every case on 8 simulated CPU devices in a subprocess, then one
``mpiexec -n 8`` launch runs every case on 8 meshcomm ranks with ``backend="mpi"`` (meshes
(8,), (2, 4), (4, 2), (2, 2, 2), so every mesh axis is an MPI sub-communicator) and compares
exactly.

Run the rank side by hand: ``mpiexec -n 8 python tests/test_mpi_jax_oracle.py JAX.npz``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers of the sibling tests
import test_jax_oracle as oracle
from test_mpi import SKIP, mpirun

HERE = Path(__file__).resolve()

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(bool(SKIP), reason=SKIP),
    pytest.mark.skipif(
        importlib.util.find_spec("jax") is None, reason="jax is not installed (pip install jax)"
    ),
]


def rank_main(expected_path: str) -> None:
    """One of the 8 ranks: join the mpi world, run every case, write the mismatches."""
    import meshcomm

    group = meshcomm.init(backend="mpi")
    try:
        failures = oracle.meshcomm_rank(group, expected_path)
    finally:
        meshcomm.shutdown()
    out = Path(os.environ["MESHCOMM_TEST_RESULTS"]) / f"rank{group.rank}.json"
    out.write_text(json.dumps(failures))


@pytest.mark.timeout(300)
def test_ops_match_jax_lax_under_mpiexec(tmp_path: Path) -> None:
    out = str(tmp_path / "jax.npz")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, oracle.__file__, "--jax", out],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    jax_s = time.monotonic() - start
    run = mpirun(8, [out], script=[str(HERE)], timeout=240)
    assert run.rc == 0, run.tail()
    assert len(run.results) == 8, run.tail()
    failures = [f for per_rank in run.results for f in per_rank]
    print(f"{len(oracle.cases())} cases x 8 ranks; jax {jax_s:.1f} s, mpi {run.seconds:.1f} s")
    assert not failures, "\n".join(failures[:30]) + f"\n({len(failures)} mismatches)"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: mpiexec -n 8 {sys.argv[0]} JAX.npz")
    rank_main(sys.argv[1])
