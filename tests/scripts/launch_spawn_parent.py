"""A parent that spawns two sleeping ranks, prints their pids, and waits (to be SIGKILLed)."""

from __future__ import annotations

import time

from meshcomm.spawn import SpawnContext, spawn


def sleeper(rank: int, seconds: float) -> None:
    time.sleep(seconds)


if __name__ == "__main__":
    ctx = spawn(sleeper, args=(120.0,), nprocs=2, join=False)
    assert isinstance(ctx, SpawnContext)
    print(" ".join(str(pid) for pid in ctx.pids()), flush=True)
    ctx.join(timeout=300)
