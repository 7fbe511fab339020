"""meshcomm's errors through torch.distributed on backend "meshcomm" (test_c10d_backend.py).

Started once per rank by the test with torch's env:// variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT)::

    python c10d_errors.py MODE OUT_DIR

Modes:

- ``die``: after one good all-reduce, rank 1 leaves with ``os._exit(0)`` while the others
  enter an all-reduce (the group's timeout is 10 s); the survivors record the error.
- ``mismatch``: rank 0 all-reduces float32 while rank 1 all-reduces float64 (on one
  subgroup), then shapes differ (on another); both ranks record each error.

Each surviving rank writes ``OUT_DIR/rank<N>.json``: per case, the error's class names (its
MRO), its message, whether it is torch's ``DistError`` / ``DistBackendError`` /
``DistNetworkError`` and meshcomm's ``CommError`` / ``PeerError`` / ``MismatchError``, and
how many seconds it took to come.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import meshcomm
import meshcomm.c10d

TIMEOUT = 10.0


def _describe(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn``; describe the error it raises (or say it raised none)."""
    start = time.monotonic()
    try:
        fn()
    except BaseException as exc:  # every error is described, none swallowed
        return {
            "raised": True,
            "mro": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
            "seconds": time.monotonic() - start,
            "DistError": isinstance(exc, dist.DistError),
            "DistBackendError": isinstance(exc, dist.DistBackendError),
            "DistNetworkError": isinstance(exc, dist.DistNetworkError),
            "CommError": isinstance(exc, meshcomm.CommError),
            "PeerError": isinstance(exc, meshcomm.PeerError),
            "MismatchError": isinstance(exc, meshcomm.MismatchError),
        }
    return {"raised": False, "seconds": time.monotonic() - start}


def die(rank: int, size: int) -> dict[str, Any]:
    """Rank 1 exits after a good all-reduce; the others all-reduce and record the error."""
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t.tolist() == [float(size)] * 4
    if rank == 1:
        sys.stdout.flush()
        os._exit(0)
    big = torch.ones(1 << 18, dtype=torch.float64)
    return {"dead peer": _describe(lambda: dist.all_reduce(big))}


def mismatch(rank: int, size: int) -> dict[str, Any]:
    """Different dtypes, then different shapes, each on its own subgroup of every rank."""
    everyone = list(range(size))
    by_dtype, by_shape = dist.new_group(everyone), dist.new_group(everyone)
    dtype = torch.float32 if rank == 0 else torch.float64
    shape = (3,) if rank == 0 else (5,)
    return {
        "dtype": _describe(lambda: dist.all_reduce(torch.ones(4, dtype=dtype), group=by_dtype)),
        "shape": _describe(lambda: dist.all_reduce(torch.ones(shape), group=by_shape)),
    }


def main() -> None:
    """Run the mode of argv[1]; write this rank's findings under argv[2]."""
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("meshcomm", timeout=timedelta(seconds=TIMEOUT))
    rank, size = dist.get_rank(), dist.get_world_size()
    found = {"die": die, "mismatch": mismatch}[mode](rank, size)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(found))
    # The group may have failed (that is the point): leave without a collective goodbye.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
