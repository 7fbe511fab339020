"""Collectives in flight while a survivor re-forms the mesh (run by tests/test_elastic.py).

    meshrun --elastic --nproc-per-node N elastic_inflight.py SHAPE [AXIS]

SHAPE is ``3`` (axis dp) or ``2x2`` (dp, tp). Rank 0 acts as the survivor that saw a
failure first: after a moment it calls ``shrink`` while every other rank waits in a psum
over the whole mesh (or over AXIS alone: then only rank 0's group along it waits for it,
the others' psum completes). Nobody died, so every rank must be in the new mesh. Each rank
prints one JSON line: the error its call in flight ended with (none where its psum
completed), the new mesh's shape and a psum on it.
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
    axes = sys.argv[2] if len(sys.argv) > 2 else names
    elastic = ElasticMesh(shape, names)
    rank = elastic.rank
    error: CommError | None = None
    if rank == 0:
        time.sleep(0.5)  # the others are waiting in their psum by now
        elastic.shrink()
    else:
        try:
            ops.psum(np.ones(4), axes, mesh=elastic.mesh)
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
