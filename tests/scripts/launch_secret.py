"""A rank that reports the job's secret (as a digest) and whether its store authenticates.

Prints one JSON line: rank, sha256 of MESHCOMM_SECRET (None if unset), whether the world's
store is authenticated, and the sum of an all_reduce of ones.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

import meshcomm


def main() -> None:
    secret = os.environ.get("MESHCOMM_SECRET")
    group = meshcomm.init(timeout=60)
    info = meshcomm.get_world_info()
    total = float(group.all_reduce(np.ones(1))[0])
    record = {
        "rank": group.rank,
        "secret": hashlib.sha256(secret.encode()).hexdigest() if secret else None,
        "authenticated": getattr(info.raw_store, "authenticated", None),
        "sum": total,
    }
    print(json.dumps(record), flush=True)
    meshcomm.shutdown()


if __name__ == "__main__":
    main()
