"""Spawned test ranks that answer through a queue: start them, collect, always clean up.

The tcp transport tests drive transports directly (no ``meshcomm.init``), so they cannot use
:func:`meshcomm.testing.run_ranks`; each rank function puts ``(rank, status, value)`` on the
queue it is given. This module owns the part every such test repeats: start the processes,
wait for every answer within a deadline, name the ranks that never answered, and join (then
kill) every process whatever happened.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["run_spawned"]


def run_spawned(
    target: Callable[..., None],
    size: int,
    args_for: Callable[[int, Any], tuple[Any, ...]],
    *,
    seconds: float = 120.0,
    join: float = 15.0,
) -> dict[int, tuple[str, Any]]:
    """Run ``target(*args_for(rank, out_queue))`` on ``size`` spawned processes.

    Args:
        target: a module-level function that puts ``(rank, status, value)`` on the queue.
        size: how many processes.
        args_for: the arguments of rank ``r``'s process, given ``r`` and the result queue.
        seconds: how long all answers together may take; then the test fails naming the
            ranks that did not answer.
        join: how long each process may take to exit after answering before it is killed.

    Returns:
        ``{rank: (status, value)}`` for every rank.
    """
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=args_for(r, out)) for r in range(size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + seconds
    try:
        while len(results) < size:
            rank, status, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
            results[rank] = (status, value)
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(size)) - set(results))} never answered")
    finally:
        for p in procs:
            p.join(join)
            if p.is_alive():
                p.kill()
    return results
