"""Authenticated links against unauthenticated ones, side by side, on the tcp backend.

Run:  .venv/bin/python bench/link_auth.py [--rounds 5] [--small-repeats 2000] [--large-repeats 15]

Three parts:

1. What a per-frame MAC would cost: HMAC-SHA256 (and keyed BLAKE2b, the fastest keyed hash
   in the standard library) of an 8-byte and of a 64 MiB payload, in this process.
2. all_reduce of float32 at world 2 (8 B and 64 MiB), over sockets (``MESHCOMM_TRANSPORT=tcp``)
   and over shared memory (``auto``), with the job's secret set and not set. Every round
   starts a fresh world for each of the four configurations, in alternating order, and
   times ``--small-repeats`` / ``--large-repeats`` calls on rank 0 after a warm-up; the table
   shows the median over rounds of each round's median, and the median of the per-round
   ratios (auth on / auth off) — the machine is noisy, so only medians and ratios mean much.
3. Connection set-up per link: the first round trip of a fresh world, rank 0 to rank 1 and
   back (connect, handshake, with auth the AUTH round trip, and on ``auto`` the
   shared-memory set-up), median over rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import multiprocessing
import os
import statistics
import time
from typing import Any

import numpy as np

from meshcomm.backends.tcp import TcpCommunicator
from meshcomm.reduction import ReduceOp
from meshcomm.store import StoreServer, TCPStore

SECRET = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
SIZES = {"8 B": 2, "64 MiB": 16 << 20}  # float32 elements


def mac_costs() -> list[tuple[str, str, float]]:
    """Seconds per MAC of an 8-byte and a 64 MiB payload (median of several runs)."""
    key = bytes.fromhex(SECRET)
    rows = []
    for label, data, reps in (("8 B", b"x" * 8, 20000), ("64 MiB", b"x" * (64 << 20), 5)):
        for name, fn in (
            ("HMAC-SHA256", lambda d: hmac.new(key, d, hashlib.sha256).digest()),
            ("keyed BLAKE2b", lambda d: hashlib.blake2b(d, key=key[:64]).digest()),
        ):
            samples = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(reps):
                    fn(data)
                samples.append((time.perf_counter() - start) / reps)
            rows.append((name, label, statistics.median(samples)))
    return rows


def _rank(
    rank: int, port: int, transport: str, secret: str, repeats: dict[str, int], out: Any
) -> None:
    os.environ["MESHCOMM_TRANSPORT"] = transport
    store = TCPStore("127.0.0.1", port, timeout=60)
    comm = TcpCommunicator.create_world(rank, 2, store, 60.0, secret=secret)
    try:
        # Both ranks ready first, so the time is the link's, not the other rank's start-up.
        store.set(f"bench/ready/{rank}", b"1")
        store.wait(["bench/ready/0", "bench/ready/1"], timeout=60)
        byte = np.zeros(1, np.uint8)
        start = time.perf_counter()
        if rank == 0:  # only rank 0 connects: no simultaneous-connect dance
            comm.send(byte, 1, 0)
            comm.recv(1, 0)
        else:
            comm.recv(0, 0)
            comm.send(byte, 0, 0)
        timings: dict[str, float] = {"connect": time.perf_counter() - start}
        expect = "tcp" if transport == "tcp" else "shm"
        if comm.transport.channels.get(1 - rank) != expect:
            raise SystemExit(f"rank {rank}: channel {comm.transport.channels}, wanted {expect}")
        for label, n in SIZES.items():
            ones = np.ones(n, np.float32)
            buf = ones.copy()
            for _ in range(3):  # warm-up: the path agreements, page faults
                comm.all_reduce(buf, ReduceOp.SUM)
            samples = []
            for _ in range(repeats[label]):
                np.copyto(buf, ones)  # sums of sums would overflow
                comm.barrier()
                t0 = time.perf_counter()
                comm.all_reduce(buf, ReduceOp.SUM)
                samples.append(time.perf_counter() - t0)
            timings[label] = statistics.median(samples)
        if rank == 0:
            out.put(timings)
    finally:
        comm.close()
        store.close()


def one_world(transport: str, secret: str, repeats: dict[str, int]) -> dict[str, float]:
    """Start a world of 2; return rank 0's median timings."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with StoreServer("127.0.0.1", 0) as server:
        procs = [
            ctx.Process(target=_rank, args=(r, server.port, transport, secret, repeats, out))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        timings = out.get(timeout=600)
        for p in procs:
            p.join(60)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--small-repeats", type=int, default=2000)
    parser.add_argument("--large-repeats", type=int, default=15)
    args = parser.parse_args()
    repeats = {"8 B": args.small_repeats, "64 MiB": args.large_repeats}

    print("== a MAC per frame would cost (this process, one core) ==")
    for name, label, seconds in mac_costs():
        print(f"{name:14s} {label:>7s}  {seconds * 1e6:12.2f} us")

    configs = [(t, a) for t in ("tcp", "auto") for a in (False, True)]
    results: dict[tuple[str, bool], list[dict[str, float]]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for transport, auth in order:
            results[(transport, auth)].append(one_world(transport, SECRET if auth else "", repeats))
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    print("\n== all_reduce float32, world 2: median over rounds of per-round medians ==")
    print(f"{'channel':8s} {'size':>7s} {'auth off':>12s} {'auth on':>12s} {'on/off':>8s}")
    for transport in ("tcp", "auto"):
        channel = "sockets" if transport == "tcp" else "shm"
        for label in (*SIZES, "connect"):
            off = [t[label] for t in results[(transport, False)]]
            on = [t[label] for t in results[(transport, True)]]
            ratio = statistics.median(b / a for a, b in zip(off, on, strict=True))
            unit, scale = ("ms", 1e3) if label != "8 B" else ("us", 1e6)
            print(
                f"{channel:8s} {label:>7s} {statistics.median(off) * scale:9.2f} {unit} "
                f"{statistics.median(on) * scale:9.2f} {unit} {ratio:8.3f}"
            )


if __name__ == "__main__":
    main()
