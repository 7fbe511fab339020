"""A data-parallel training loop under meshcomm.elastic (run by tests/test_elastic.py).

    meshrun --elastic --nproc-per-node N elastic_train.py SHAPE STEPS MS [RANK:STEP ...]

SHAPE is ``4`` or ``4x2`` (axes dp, tp); each step sleeps MS milliseconds (the compute);
each RANK:STEP makes that rank SIGKILL itself when it starts that step (not a replacement
that ``--max-restarts`` started: that one joins the running mesh). Each rank that
finishes prints one JSON line: its final parameters, the members (first-world ranks) of
every committed step, its recoveries and growths; a rank that left the mesh for good prints
``{"rank": R, "left": true}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

from meshcomm import ops
from meshcomm.elastic import ElasticMesh, Manager
from meshcomm.errors import NoValidMesh

DIM = 8
RATE = 0.1


def sample(step: int, replica: int) -> np.ndarray:
    """Replica ``replica``'s data at ``step`` (what tests/test_elastic.py replays)."""
    return np.array([(step * 31 + replica * 7 + k) % 11 for k in range(DIM)], np.float64)


def main() -> None:
    shape = tuple(int(n) for n in sys.argv[1].split("x"))
    steps, pause = int(sys.argv[2]), float(sys.argv[3]) / 1e3
    kills = {tuple(int(v) for v in arg.split(":")) for arg in sys.argv[4:]}
    if os.environ.get("MESHCOMM_ELASTIC_JOIN") == "1":
        kills = set()
    rank = int(os.environ["RANK"])
    elastic = ElasticMesh(shape, ("dp", "tp")[: len(shape)], unit="dp")

    def step(mesh, state, i):  # type: ignore[no-untyped-def]
        if (rank, i) in kills:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(pause)
        replicas, replica = mesh.size("dp"), mesh.get_local_rank("dp")
        grad = state["w"] - sample(i, replica)
        return {"w": state["w"] - RATE * ops.psum(grad, "dp", mesh=mesh) / replicas}

    manager = Manager(elastic, {"w": np.zeros(DIM)})
    try:
        final = manager.run(step, steps)
    except NoValidMesh as exc:
        print(json.dumps({"rank": rank, "no_mesh": str(exc)}), flush=True)
        return
    if final is None:
        print(json.dumps({"rank": rank, "left": True}), flush=True)
        return
    history = [[s, list(members)] for s, members in manager.history]
    line = {
        "rank": rank,
        "w": final["w"].tolist(),
        "history": history,
        "recoveries": manager.recoveries,
        "growths": manager.growths,
        "shape": list(elastic.shape),
        "joined": os.environ.get("MESHCOMM_ELASTIC_JOIN"),
    }
    print(json.dumps(line), flush=True)
    elastic.close()


if __name__ == "__main__":
    main()
