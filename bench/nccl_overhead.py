"""The nccl backend against raw ``cupy.cuda.nccl`` at world 1, and host staging costs.

Needs a GPU, cupy and NCCL (run it through the device tool; CI has none). Three tables:

- **per call**: host microseconds per float32 all_reduce, N calls queued then one stream
  synchronize, raw ``NcclCommunicator.allReduce`` on the current stream against
  :class:`meshcomm.backends.nccl.NcclCommunicator` (which adds its stream, two events and
  the watchdog). Rounds alternate raw / meshcomm; medians of the rounds.
- **busbw**: the same at >= 1 MiB, as bandwidth (world 1: NCCL's in-place copy).
- **through a group**: the group's 8-byte all_reduce (cupy, numpy, staged by hand, the
  native binding) against raw NCCL, then all_gather, reduce_scatter, broadcast and reduce
  (their device plans) each beside NCCL's own call.
- **staging**: one device-to-host plus one host-to-device copy of the array, pageable
  (``cupy.asnumpy`` / ``cupy.asarray``, what tcp and mpi staging do today) against a
  pinned host buffer (``cupy.cuda.alloc_pinned_memory``).

Usage (``--profile N``: where the host time of N group all_reduces goes)::

    python bench/nccl_overhead.py [--rounds 7] [--json out.json] [--profile 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _per_call(call: Callable[[], None], sync: Callable[[], None], iters: int) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    return (time.perf_counter() - start) / iters * 1e6


def _profile(call: Callable[[], Any], sync: Callable[[], None], calls: int) -> None:
    """Where the host time of ``calls`` calls goes: cProfile's top functions by own time."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        call()
    sync()
    profile.disable()
    print(f"\nprofile of {calls} calls, by own time")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


def _alternated(
    first: Callable[[], None],
    second: Callable[[], None],
    sync: Callable[[], None],
    iters: int,
    rounds: int,
    warmup: int,
) -> tuple[float, float]:
    """Median us per call of ``first`` and of ``second``, timed in alternating rounds."""
    for call in (first, second):
        _per_call(call, sync, warmup)
    ones, twos = [], []
    for _ in range(rounds):
        ones.append(_per_call(first, sync, iters))
        twos.append(_per_call(second, sync, iters))
    return statistics.median(ones), statistics.median(twos)


def main() -> None:
    """Print the three tables (and write them as JSON if asked)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default="")
    parser.add_argument("--profile", type=int, default=0, help="profile this many calls")
    args = parser.parse_args()

    import cupy as cp
    from cupy.cuda import nccl

    from meshcomm.backends.nccl import NcclCommunicator
    from meshcomm.reduction import ReduceOp
    from meshcomm.store import HashStore

    raw = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    ours = NcclCommunicator.create_world(0, 1, HashStore(), 60.0)
    stream = cp.cuda.get_current_stream()
    results: dict[str, Any] = {"nccl_version": nccl.get_version(), "rows": []}
    print(f"NCCL {nccl.get_version()}, cupy {cp.__version__}, "
          f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")  # fmt: skip
    print(f"{'bytes':>10} {'place':>6} {'raw us':>9} {'ours us':>9} {'added us':>9}"
          f" {'ours/raw':>9} {'raw GB/s':>9} {'ours GB/s':>9}")  # fmt: skip
    cases = [(n, p) for n in (8, 1024, 1 << 20, 16 << 20, 64 << 20) for p in ("in", "out")]
    for nbytes, place in cases:
        x = cp.ones(nbytes // 4, dtype=cp.float32)
        y = x if place == "in" else cp.empty_like(x)
        src, dst, count = x.data.ptr, y.data.ptr, x.size
        iters = 2000 if nbytes <= 1 << 20 else 50

        def call_raw(src: int = src, dst: int = dst, count: int = count) -> None:
            raw.allReduce(src, dst, count, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)

        def call_ours(x: Any = x, y: Any = y) -> None:
            if x is y:
                ours.all_reduce(x, ReduceOp.SUM)
            else:
                ours.all_reduce_out(x, y, ReduceOp.SUM)

        r, m = _alternated(call_raw, call_ours, stream.synchronize, iters, args.rounds, 20)
        row = {"bytes": nbytes, "place": place, "raw_us": r, "ours_us": m, "added_us": m - r}
        results["rows"].append(row)
        print(f"{nbytes:>10} {place:>6} {r:>9.2f} {m:>9.2f} {m - r:>9.2f} {m / r:>9.3f}"
              f" {nbytes / r / 1e3:>9.2f} {nbytes / m / 1e3:>9.2f}")  # fmt: skip

    print("\nthrough a group, world 1, 8 B float32 all_reduce: us per call")
    import meshcomm

    group = meshcomm.init(backend="cpu:tcp,cuda:nccl", world_size=1, rank=0)
    x8, out8 = cp.ones(2, dtype=cp.float32), cp.empty(2, dtype=cp.float32)
    host8 = np.ones(2, np.float32)
    src8, dst8 = x8.data.ptr, out8.data.ptr

    def raw_out() -> None:
        raw.allReduce(src8, dst8, 2, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)

    def staged() -> None:
        cp.asarray(group.all_reduce(cp.asnumpy(x8)))

    from meshcomm.backends.nccl import _native

    lib = _native.load_library()
    native = _native.NativeComm.init_rank(lib, 1, lib.unique_id(), 0, 60.0)

    def native_out() -> None:  # the ctypes binding's call, against cupy's above
        native.allReduce(src8, dst8, 2, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)

    paths: dict[str, Callable[[], Any]] = {
        "raw nccl, out of place": raw_out,
        "native binding, out of place": native_out,
        "group.all_reduce(cupy)": lambda: group.all_reduce(x8),
        "group.all_reduce(numpy)": lambda: group.all_reduce(host8),
        "staged by hand": staged,
    }
    results["group"] = {}

    def time_paths(paths: dict[str, Callable[[], Any]]) -> None:
        for path in paths.values():
            _per_call(path, stream.synchronize, 50)
        for name, path in paths.items():
            times = [_per_call(path, stream.synchronize, 500) for _ in range(args.rounds)]
            results["group"][name] = statistics.median(times)
            print(f"{name:>30} {statistics.median(times):8.2f}")

    time_paths(paths)
    # Every device collective's plan against NCCL's own call, at 8 bytes (world 1).
    x12, out12 = cp.ones((1, 2), dtype=cp.float32), cp.empty((1, 2), dtype=cp.float32)
    src12, dst12 = x12.data.ptr, out12.data.ptr
    f32, add = nccl.NCCL_FLOAT32, nccl.NCCL_SUM
    collectives: dict[str, Callable[[], Any]] = {
        "raw allGather": lambda: raw.allGather(src8, dst8, 2, f32, stream.ptr),
        "group.all_gather(cupy)": lambda: group.all_gather(x8),
        "raw reduceScatter": lambda: raw.reduceScatter(src12, dst12, 2, f32, add, stream.ptr),
        "group.reduce_scatter(cupy)": lambda: group.reduce_scatter(x12),
        "raw broadcast": lambda: raw.broadcast(src8, dst8, 2, f32, 0, stream.ptr),
        "group.broadcast(cupy)": lambda: group.broadcast(x8, 0),
        "raw reduce": lambda: raw.reduce(src8, dst8, 2, f32, add, 0, stream.ptr),
        "group.reduce(cupy)": lambda: group.reduce(x8, 0),
    }
    time_paths(collectives)
    if args.profile:
        _profile(lambda: group.all_reduce(x8), stream.synchronize, args.profile)
    meshcomm.shutdown()
    os.environ["MESHCOMM_NCCL_NATIVE"] = "1"  # the same group path on the native binding
    group = meshcomm.init(backend="cpu:tcp,cuda:nccl", world_size=1, rank=0)
    time_paths({"group.all_reduce(cupy), native": lambda: group.all_reduce(x8)})
    if args.profile:
        _profile(lambda: group.all_reduce(x8), stream.synchronize, args.profile)
    meshcomm.shutdown()
    del os.environ["MESHCOMM_NCCL_NATIVE"]
    native.destroy()

    print("\nparts of a call, us each (1000 in a row)")
    results["parts"] = {}
    event = cp.cuda.Event(block=False, disable_timing=True)
    other = cp.cuda.Stream(non_blocking=True)
    parts: dict[str, Callable[[], Any]] = {
        "get_current_stream": cp.cuda.get_current_stream,
        "Event()": lambda: cp.cuda.Event(block=False, disable_timing=True),
        "Event() timed": cp.cuda.Event,
        "event.record": lambda: event.record(stream),
        "stream.wait_event": lambda: other.wait_event(event),
        "event.done": lambda: event.done,
        "cupy.ndarray((2,))": lambda: cp.ndarray((2,), dtype=np.float32),
        "x.flags.c_contiguous": lambda: x8.flags.c_contiguous,
        "x.data.ptr": lambda: x8.data.ptr,
        "x.shape, x.dtype": lambda: (x8.shape, x8.dtype),
    }
    for name, part in parts.items():
        times = [_per_call(part, stream.synchronize, 1000) for _ in range(args.rounds)]
        results["parts"][name] = statistics.median(times)
        print(f"{name:>20} {statistics.median(times):8.2f}")

    print("\nstaging: one device-to-host and one host-to-device copy")
    print(f"{'bytes':>10} {'pageable us':>12} {'pinned us':>10} {'pinned/pageable':>16}")
    results["staging"] = []
    for nbytes in (8, 64 << 10, 1 << 20, 16 << 20, 64 << 20):
        x = cp.ones(nbytes // 4, dtype=cp.float32)
        memory = cp.cuda.alloc_pinned_memory(nbytes)
        pinned = np.frombuffer(memory, np.float32, x.size)
        back = cp.empty_like(x)

        def pageable(x: Any = x, back: Any = back) -> None:
            back.set(cp.asnumpy(x))

        def pinned_copy(x: Any = x, back: Any = back, pinned: Any = pinned) -> None:
            x.get(out=pinned)
            back.set(pinned)

        iters = 200 if nbytes <= 1 << 20 else 10
        p, q = _alternated(pageable, pinned_copy, stream.synchronize, iters, args.rounds, 3)
        results["staging"].append({"bytes": nbytes, "pageable_us": p, "pinned_us": q})
        print(f"{nbytes:>10} {p:>12.1f} {q:>10.1f} {q / p:>16.3f}")
    ours.close()
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
