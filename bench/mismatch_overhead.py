"""What the default mismatch checks cost: a small all_reduce with stamps and without, side by side.

Run under a launcher (two or more ranks)::

    .venv/bin/meshrun --nproc-per-node 2 bench/mismatch_overhead.py [--iters 2000] [--repeats 7]
    MESHCOMM_TRANSPORT=tcp .venv/bin/meshrun --nproc-per-node 4 bench/mismatch_overhead.py

Under mpi (``meshrun --backend mpi``) the default is the first-call check and the running
hash of the calls (:mod:`meshcomm.diagnostics.mpi_history`): what differs per call is the direct
path's
look-up of the call's signature among the checked ones and the hash's update; every 128th
call also finishes one 8-byte comparison of it and starts the next (no wait for the
others). ``--history`` compares with and without the running hash and its comparisons (the
first-call checks on in both)::

    .venv/bin/meshrun --backend mpi --nproc-per-node 2 bench/mismatch_overhead.py --history

Times (microseconds per call) a float32 ``ProcessGroup.all_reduce`` of ``--bytes`` bytes
(default 8; the direct path; ``--op broadcast reduce gather scatter``: those from rank 0 too,
each in turn; ``--op rooted``: all five) on two groups: the world (on one host: the
shared-memory board) and a group of the same ranks made with ``subgroup`` (shared-memory
rings, or sockets with ``MESHCOMM_TRANSPORT=tcp``). For each group, loops of ``--iters``
calls alternate between the default checks (every call stamped,
:mod:`meshcomm.diagnostics.fingerprint`) and none (what ``MESHCOMM_DEBUG=OFF`` makes: the group has
no
stamp holder and the link sends the plain tag), ``--repeats`` times each, in alternating
order, after a barrier; rank 0 prints each median and the ratio default / OFF. The
environment must leave the checks at their default.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np

from meshcomm import world
from meshcomm.group import ProcessGroup


def _checks(group: ProcessGroup, state: list[Any], on: bool, history_only: bool) -> None:
    """Turn the checks of ``group`` on (its stamp holder, or on mpi its set of checked
    signatures and its running hash, back) or off (as OFF makes it: none; ``history_only``:
    the running hash alone). ``state``: the three as they were, the hash kept while off
    (every rank turns it off and on after the same calls)."""
    holder, seen, _ = state
    issuer = group._issuer  # where a group's calls read them
    if not on and issuer.history is not None:
        state[2] = issuer.history
    issuer.history = state[2] if on else None
    if history_only:
        return
    issuer._stamper = holder if on else None
    issuer._seen = seen if on else None
    if not on and holder is not None:
        holder.stamp = None  # the link then sends the plain tag, as under OFF


#: The ops ``--op`` may name, each one call of the group on ``x`` (scatter: one entry each).
OPS = ("all_reduce", "broadcast", "reduce", "gather", "scatter")


def _call(group: ProcessGroup, op: str, x: np.ndarray) -> Any:
    if op == "scatter":  # one entry of x's size for each rank
        stacked = np.zeros((group.size, *x.shape), x.dtype)
        return lambda: group.scatter(stacked, 0)
    return lambda: getattr(group, op)(x)


def _loop(group: ProcessGroup, x: np.ndarray, iters: int, op: str) -> float:
    call = _call(group, op, x)
    group.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - start) / iters * 1e6


def _side_by_side(
    group: ProcessGroup,
    name: str,
    x: np.ndarray,
    op: str,
    iters: int,
    repeats: int,
    history_only: bool = False,
) -> tuple[float, float]:
    """Medians (us per call) of ``op`` on ``group`` with the default checks and without
    (``history_only``: with the running hash and without)."""
    issuer = group._issuer
    state = [issuer._stamper, issuer._seen, issuer.history]
    if state[:2] == [None, None]:
        raise SystemExit(f"{name}: no checks (MESHCOMM_DEBUG is set)")
    if history_only and state[2] is None:
        raise SystemExit(f"{name}: no running hash (--history is for the mpi backend)")
    times: dict[bool, list[float]] = {True: [], False: []}
    for on in (True, False):  # warm both: the direct path is learned, channels opened
        _checks(group, state, on, history_only)
        _loop(group, x, max(1, iters // 10), op)
    for r in range(repeats):
        for on in (True, False) if r % 2 == 0 else (False, True):
            _checks(group, state, on, history_only)
            times[on].append(_loop(group, x, iters, op))
    _checks(group, state, True, history_only)
    return statistics.median(times[True]), statistics.median(times[False])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--op", nargs="+", choices=[*OPS, "rooted"], default=["all_reduce"])
    p.add_argument("--history", action="store_true", help="mpi: the running hash alone")
    args = p.parse_args()
    ops = list(OPS) if "rooted" in args.op else args.op

    top = world.init()
    sub = top.subgroup(list(top.ranks), "world/bench")
    x = np.zeros(max(1, args.bytes // 4), np.float32)  # stays 0 however often it is reduced
    rows = []
    for op in ops:
        for name, group in (("world", top), ("subgroup", sub)):
            on_us, off_us = _side_by_side(
                group, name, x, op, args.iters, args.repeats, args.history
            )
            comm: Any = group._comm
            kinds = (
                sorted(set(comm.transport.channels.values())) if comm.backend_name == "tcp" else []
            )
            if getattr(comm, "_board", False) and op == "all_reduce":
                kinds = ["board"]
            rows.append((op, name, ",".join(kinds), on_us, off_us))
    if top.rank == 0:
        print(f"float32 {args.bytes} B, world {top.size}, {args.repeats} x {args.iters}")
        off = "no hash us" if args.history else "OFF us"
        print(
            f"{'op':<11} {'group':<10} {'channels':<10} {'default us':>11} {off:>9} "
            f"{'ratio':>7} {'+us':>7}"
        )
        for op, name, kinds, on_us, off_us in rows:
            print(
                f"{op:<11} {name:<10} {kinds:<10} {on_us:>11.2f} {off_us:>9.2f} "
                f"{on_us / off_us:>7.3f} {on_us - off_us:>+7.2f}"
            )
    world.shutdown()


if __name__ == "__main__":
    main()
