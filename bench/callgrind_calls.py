"""Instructions per 8-byte all_reduce, counted by callgrind on rank 0 (world 2).

    python bench/callgrind_calls.py --backend tcp --layers group runner
    python bench/callgrind_calls.py --backend mpi --layers mpi4py runner group
    PYTHONPATH=/tmp/base python bench/callgrind_calls.py ...   # another tree, same method

Rank 0 runs under ``valgrind --tool=callgrind`` and rank 1 runs normally; each layer is
run twice, with ``--calls`` N1 and N2 timed calls after the same warm-up, and the difference
of rank 0's instruction totals over ``N2 - N1`` is the count of one call (start-up, imports
and the warm-up cancel out). Under valgrind rank 0 is some 50x slower than its peer, so it
almost never waits: on tcp the peer polls without sleeping, and rank 0 sleeps
``--pause-us`` before each call (the peer is then there first under load too), so the count
is the call's own work, not the polls of a wait. The ``pause`` layer (an empty call) counts
what the loop and the sleep cost; subtract it from the others. The
functions whose inclusive counts grew most per call are listed with ``--top``.

Layers (see ``bench/overhead.py``): ``group`` (``ProcessGroup.all_reduce``), ``runner``
(the backend's runner of the signature into a fixed buffer, else
``Communicator.all_reduce_out`` on flat arrays), ``comm`` (``Communicator.all_reduce`` in
place), ``mpi4py`` (raw ``Allreduce`` into a fixed buffer; mpi only), ``pause`` (nothing).

The child mode (``--child LAYER N``) is what each rank runs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["main"]

_WARMUP = 300


def _child(layer: str, calls: int, pause_us: float) -> None:
    """One rank: warm up, then ``calls`` calls of ``layer``, between two barriers; rank 0
    sleeps ``pause_us`` before each call."""
    import gc
    import time

    import numpy as np

    from meshcomm import world
    from meshcomm.reduction import ReduceOp

    group = world.init()
    comm = group._comm
    x = np.ones(2, np.float32)
    out = np.empty_like(x)
    run: Callable[[], object]
    if layer == "group":
        run = lambda: group.all_reduce(x)  # noqa: E731
    elif layer == "comm":
        buf = np.zeros_like(x)
        run = lambda: comm.all_reduce(buf, ReduceOp.SUM)  # noqa: E731
    elif layer == "runner":
        runner = comm.runner("all_reduce", x.dtype, ReduceOp.SUM)
        if runner is None:
            run = lambda: comm.all_reduce_out(x, out, ReduceOp.SUM)  # noqa: E731
        else:
            run = lambda: runner(x, out)  # noqa: E731
    elif layer == "mpi4py":
        mpi_comm = comm.mpi_comm
        run = lambda: mpi_comm.Allreduce(x, out)  # noqa: E731
    elif layer == "pause":
        run = lambda: None  # noqa: E731
    else:
        raise SystemExit(f"unknown layer {layer!r}")
    for _ in range(_WARMUP):
        run()
    # What the warm-up left moves out of the collector's reach, so that a full collection
    # that happens to fall in one of the two runs does not count as the calls' work.
    gc.collect()
    gc.freeze()
    group.barrier()
    if group.rank == 0 and pause_us > 0:
        sleep, seconds = time.sleep, pause_us * 1e-6
        for _ in range(calls):
            sleep(seconds)
            run()
    else:
        for _ in range(calls):
            run()
    group.barrier()
    world.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _valgrind(out: Path) -> list[str]:
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "-q"]


def _count(backend: str, layer: str, calls: int, pause_us: float, out: Path) -> None:
    """Run world 2 with rank 0 under callgrind, writing its profile to ``out``."""
    me = [sys.executable, str(Path(__file__).resolve()), "--child", layer, str(calls)]
    me += ["--pause-us", str(pause_us)]
    env = dict(os.environ, MESHCOMM_TIMEOUT="600", OMP_NUM_THREADS="1")
    if backend == "mpi":
        mpiexec = str(Path(sys.executable).parent / "mpiexec")
        command = [mpiexec, "-n", "1", *_valgrind(out), *me, ":", "-n", "1", *me]
        subprocess.run(command, check=True, env=env, timeout=1800)
        return
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    # The peer polls and never sleeps, so that it answers rank 0 within microseconds and rank
    # 0 (slowed down some 50x) finds it there: its count is then its own work, not a wait.
    peer = subprocess.Popen(me, env=dict(env, RANK="1", MESHCOMM_SHM_SPIN_US="1000000"))
    try:
        subprocess.run([*_valgrind(out), *me], check=True, env=dict(env, RANK="0"), timeout=1800)
    finally:
        peer.wait(timeout=120)


def _totals(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise SystemExit(f"no totals in {path}")


_ROW = re.compile(r"^\s*([\d,]+)\s+\([^)]*\)\s+(?:\*\s+)?(.+?)\s*$")


def _inclusive(path: Path) -> dict[str, int]:
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rows: dict[str, int] = {}
    for line in text.splitlines():
        m = _ROW.match(line)
        if m and ":" in m.group(2):
            rows[m.group(2)] = max(rows.get(m.group(2), 0), int(m.group(1).replace(",", "")))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["tcp", "mpi"], default="tcp")
    p.add_argument("--layers", nargs="+", default=["group", "runner"])
    p.add_argument("--calls", type=int, nargs=2, default=[200, 1200], metavar=("N1", "N2"))
    p.add_argument(
        "--pause-us",
        type=float,
        default=300.0,
        help="rank 0 sleeps this long before each call, so that its peer is there first",
    )
    p.add_argument("--top", type=int, default=0, help="list the N functions that grew most")
    p.add_argument("--keep", type=Path, default=None, help="keep the profiles in this folder")
    p.add_argument("--child", nargs=2, metavar=("LAYER", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), args.pause_us)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    folder = args.keep or Path(tempfile.mkdtemp(prefix="callgrind-"))
    folder.mkdir(parents=True, exist_ok=True)
    n1, n2 = args.calls
    for layer in args.layers:
        paths = [folder / f"{args.backend}-{layer}-{n}.out" for n in (n1, n2)]
        for n, path in zip((n1, n2), paths, strict=True):
            _count(args.backend, layer, n, args.pause_us, path)
        per_call = (_totals(paths[1]) - _totals(paths[0])) / (n2 - n1)
        print(f"{args.backend} {layer}: {per_call:,.0f} instructions per call", flush=True)
        if args.top:
            a, b = _inclusive(paths[0]), _inclusive(paths[1])
            grew = sorted(((b[k] - a.get(k, 0)) / (n2 - n1), k) for k in b)[::-1]
            for value, name in grew[: args.top]:
                print(f"    {value:>10,.0f}  {name}")


if __name__ == "__main__":
    main()
