"""Collectives in flight while a survivor re-forms the mesh (run by tests/test_elastic.py).

    meshrun --elastic --nproc-per-node N elastic_inflight.py SHAPE

SHAPE is ``3`` (axis dp) or ``2x2`` (dp, tp). Rank 0 acts as the survivor that saw a
failure first: after a moment it calls ``shrink`` while every other rank waits for it in a
psum over the whole mesh. Nobody died, so every rank must be in the new mesh. Each rank
prints one JSON line: the error its call in flight ended with (rank 0: none), the new
mesh's shape and a psum on it.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from meshcomm import ops
from meshcomm.elastic import ElasticMesh
from meshcomm.errors import CommError


def main() -> None:
    import sys

    shape = tuple(int(n) for n in sys.argv[1].split("x"))
    names = ("dp", "tp")[: len(shape)]
    elastic = ElasticMesh(shape, names)
    rank = elastic.rank
    error: CommError | None = None
    if rank == 0:
        time.sleep(0.5)  # the others are waiting in their psum by now
        elastic.shrink()
    else:
        try:
            ops.psum(np.ones(4), names, mesh=elastic.mesh)
        except CommError as exc:
            error = exc
        elastic.shrink(error)
    total = ops.psum(np.ones(2), names, mesh=elastic.mesh)
    line = {
        "rank": int(os.environ["RANK"]),
        "error": None if error is None else [type(error).__name__, str(error)],
        "shape": list(elastic.shape),
        "psum": total.tolist(),
    }
    print(json.dumps(line), flush=True)
    elastic.close()


if __name__ == "__main__":
    main()
