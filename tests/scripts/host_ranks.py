"""Ranks on simulated hosts (tests/test_hosts.py): one JSON line per rank on stdout.

``conformance``: meshcomm's conformance suite (every collective against numpy) on the
world. ``check``: psum along each axis of a (hosts, ranks per host) mesh, the host names seen, and
each peer's channel (shm on the same host, tcp across). ``loop``: psums until one fails,
then the error. ``hier`` (``hier-mesh``): the host-aware collectives (psum, reduce_scatter,
all_gather, broadcast at sizes that take the hierarchy and below, several dtypes and ops)
against numpy on the world, and the bytes host 0's link carried per 8 MiB psum, all_gather
result and reduce_scatter input (over the world; with ``hier-mesh``, the psum also over the
axis of a (hosts, ranks per host) mesh that stays inside hosts).
"""

import json
import os
import socket
import sys
import time

import numpy as np

import meshcomm
from meshcomm import ops
from meshcomm.errors import CommError


def _emit(row: dict) -> None:
    # One write: ranks started side by side share the launcher's stdout pipe, and a write
    # of at most PIPE_BUF bytes is never interleaved with another's.
    os.write(1, ("RESULT " + json.dumps(row) + "\n").encode())


def _link_bytes() -> int:
    """Bytes this host's link (eth0) sent plus received so far."""
    total = 0
    for way in ("tx", "rx"):
        with open(f"/sys/class/net/eth0/statistics/{way}_bytes") as fh:
            total += int(fh.read())
    return total


def _bytes_per_psum(world: object, psum: object, size: int, reps: int = 2) -> float:
    """Host link bytes per call of ``psum`` on ``size`` bytes, over ``size``. World barriers
    around each read of the counters: no rank's other traffic (the warm-up, the next
    measurement) crosses the link between two reads."""
    x = np.ones(size // 4, np.float32)
    psum(x)  # connections, the layout agreement
    world.barrier()
    before = _link_bytes()
    world.barrier()
    for _ in range(reps):
        psum(x)
    world.barrier()
    moved = _link_bytes() - before
    world.barrier()
    return moved / (reps * size)


def _hier(world: meshcomm.ProcessGroup, with_mesh: bool) -> dict:
    rank, size = world.rank, world.size
    failures = []
    reductions = {"sum": np.add, "max": np.maximum, "prod": np.multiply}
    for n in (0, 7, 100_003, 300_001):
        for dtype, op in (
            ("float32", "sum"),
            ("int64", "max"),
            ("float64", "sum"),
            ("int32", "prod"),
        ):
            mine = (np.arange(n) % 13 + rank + 1).astype(dtype)
            want = (np.arange(n) % 13 + 1).astype(dtype)
            for r in range(1, size):
                want = reductions[op](want, (np.arange(n) % 13 + r + 1).astype(dtype))
            got = world.all_reduce(mine, op)
            # Small integers: every float sum is exact, whatever the order of combines.
            if not np.array_equal(got, want):
                failures.append(f"all_reduce {n} {dtype} {op}")
        whole = (np.arange(size * n) % 13 + rank + 1).astype(np.int64)
        got = np.asarray(world.reduce_scatter(whole, "sum", tiled=True))
        want = sum((np.arange(size * n) % 13 + r + 1) for r in range(size))
        if not np.array_equal(got, want[rank * n : (rank + 1) * n]):
            failures.append(f"reduce_scatter {n}")
        block = (np.arange(n) + 1000 * rank).astype(np.float64)
        got = np.asarray(world.all_gather(block, tiled=True))
        want = np.concatenate([np.arange(n) + 1000.0 * r for r in range(size)])
        if not np.array_equal(got, want):
            failures.append(f"all_gather {n}")
        for root in range(size):
            sent = np.arange(n, dtype=np.int16) + root if rank == root else None
            got = world.broadcast(sent, root, shape=(n,), dtype=np.int16)
            if not np.array_equal(got, np.arange(n, dtype=np.int16) + root):
                failures.append(f"broadcast {n} root {root}")
    out: dict = {"rank": rank, "failures": failures}
    out["world_bytes"] = _bytes_per_psum(world, world.all_reduce, 8 << 20)
    # The same count for an all_gather of an 8 MiB result and a reduce_scatter of an 8 MiB
    # input (each rank's block is a quarter of the buffer on 4 ranks).
    out["gather_bytes"] = _bytes_per_psum(
        world, lambda x: world.all_gather(x[: x.size // size], tiled=True), 8 << 20
    )
    out["scatter_bytes"] = _bytes_per_psum(
        world, lambda x: world.reduce_scatter(x, "sum", tiled=True), 8 << 20
    )
    if with_mesh:  # every host holds LOCAL_WORLD_SIZE ranks
        n_local = int(os.environ["LOCAL_WORLD_SIZE"])
        mesh = meshcomm.init_device_mesh((size // n_local, n_local), ("host", "local"))
        out["local_bytes"] = _bytes_per_psum(
            world, lambda x: ops.psum(x, "local", mesh=mesh), 8 << 20
        )
    return out


def main(mode: str) -> None:
    world = meshcomm.init()
    if mode in ("hier", "hier-mesh"):
        out = _hier(world, mode == "hier-mesh")
        _emit(out)
        meshcomm.shutdown()
        return
    if mode == "conformance":
        from meshcomm.testing import run_conformance

        failures = run_conformance(world, quick=True)
        _emit({"rank": world.rank, "failures": failures})
        meshcomm.shutdown()
        return
    n_local = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = meshcomm.init_device_mesh((world.size // n_local, n_local), ("host", "local"))
    out: dict = {"rank": world.rank, "hostname": socket.gethostname()}
    if mode == "check":
        x = np.float64(world.rank)
        out["local"] = float(ops.psum(x, "local", mesh=mesh))
        out["host"] = float(ops.psum(x, "host", mesh=mesh))
        out["all"] = float(ops.psum(np.ones(1 << 16), ("host", "local"), mesh=mesh)[0])
        out["channels"] = {str(k): v for k, v in world._comm.transport.channels.items()}
    else:
        started = time.monotonic()
        try:
            for _ in range(100_000):
                ops.psum(np.ones(1024), ("host", "local"), mesh=mesh)
                time.sleep(0.01)
            out["error"] = None
        except CommError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["rank_named"] = getattr(exc, "rank", None)
        out["seconds"] = time.monotonic() - started
    _emit(out)
    if mode == "check":
        meshcomm.shutdown()
    elif out["error"] is not None:
        # The node's other ranks time out on their own clock; leaving at once would let meshrun
        # stop them (SIGTERM) before they report what they saw.
        time.sleep(float(os.environ.get("MESHCOMM_TIMEOUT", "3")) + 2.0)
        sys.exit(1)  # as a training script would: meshrun then stops the node, non-zero


if __name__ == "__main__":
    main(sys.argv[1])
