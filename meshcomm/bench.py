"""``meshcomm-bench``: nccl-tests-style tables for every collective.

Run it on its own and it launches the ranks itself::

    meshcomm-bench -n 4 --op all_reduce --min-bytes 8 --max-bytes 64M --backend tcp

or inside a launcher that already started the ranks (``meshrun``, ``mpiexec``), where it
uses the world it finds. ``--backend mpi`` launches its ranks as one MPI job (``meshrun
--backend mpi``, i.e. ``mpiexec``); under ``mpiexec`` the mpi backend is the default.
Rank 0 prints one row per size:

    size  count  type  redop  root  time(us)  algbw(GB/s)  busbw(GB/s)  #wrong

``algbw`` is bytes / time; ``busbw`` applies nccl-tests' bus factors (all_reduce 2(n-1)/n;
all_gather, reduce_scatter, all_to_all (n-1)/n; the rest 1), so figures compare across world
sizes and with nccl-tests. Time is the slowest rank's mean over the timed iterations. Every
size's result is checked against a numpy oracle; ``#wrong`` counts wrong elements.

Example:
    >>> parse_size("64M"), parse_size("8"), parse_size("1K")
    (67108864, 8, 1024)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from meshcomm.errors import InvalidArgument
from meshcomm.reduction import ReduceOp, combine, parse_op

__all__ = ["BUS_FACTORS", "OPS", "BenchRow", "bus_factor", "main", "parse_size"]

OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "sendrecv",
)

#: nccl-tests' bus-bandwidth factors, as functions of the world size n.
BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "sendrecv": lambda n: 1.0,
}

_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_CHILD_ENV = "MESHCOMM_BENCH_CHILD"


def parse_size(text: str) -> int:
    """Parse a byte count such as ``8``, ``64K``, ``64M`` or ``1G`` (powers of 1024)."""
    raw = text.strip().upper().removesuffix("B")
    suffix = raw[-1:] if raw[-1:] in _SUFFIXES else ""
    number = raw[: len(raw) - len(suffix)]
    if not number.isdigit():
        raise InvalidArgument(f"size must look like 8, 64K, 64M or 1G, got {text!r}")
    return int(number) * _SUFFIXES[suffix]


def bus_factor(op: str, world: int) -> float:
    """Return nccl-tests' bus-bandwidth factor of ``op`` at world size ``world``."""
    return BUS_FACTORS[op](world) if world > 1 else 1.0


@dataclass(frozen=True)
class BenchRow:
    """One row of the table."""

    op: str
    world: int
    size: int
    count: int
    dtype: str
    redop: str
    root: int
    time_us: float
    algbw: float
    busbw: float
    wrong: int
    backend: str = ""


def _sizes(min_bytes: int, max_bytes: int, factor: int, itemsize: int) -> list[int]:
    sizes = []
    size = max(min_bytes, itemsize)
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def _default_iters(size: int) -> int:
    if size <= 64 << 10:
        return 200
    if size <= 1 << 20:
        return 50
    if size <= 16 << 20:
        return 10
    return 5


def _rank_data(rank: int, count: int, dtype: np.dtype) -> np.ndarray:
    # Small integers keep float sums exact, so the oracle can demand exact equality.
    return ((np.arange(count) + rank) % 7 + 1).astype(dtype)


_REDUCING = ("all_reduce", "reduce_scatter", "reduce")


def _reduce(stacked: np.ndarray, redop: str) -> np.ndarray:
    """The oracle of reduce op ``redop`` over the ranks' inputs (axis 0 of ``stacked``)."""
    op = parse_op(redop)
    if op is ReduceOp.AVG:
        # In float64 (exact for the small integers of _rank_data), then rounded once.
        mean = np.sum(stacked.astype(np.complex128), axis=0) / stacked.shape[0]
        return (mean if stacked.dtype.kind == "c" else mean.real).astype(stacked.dtype)
    acc = stacked[0].copy()
    for other in stacked[1:]:
        combine(op, acc, other)  # premul_sum: no factor to check against, so it raises
    return acc


def _rounds(redop: str, dtype: np.dtype) -> bool:
    """Whether ``redop`` over ``dtype`` may round differently in another order."""
    return parse_op(redop) in (ReduceOp.PROD, ReduceOp.AVG) and dtype.kind in "fcV"


def _eps(dtype: np.dtype) -> float:
    try:
        return float(np.finfo(dtype).eps)
    except ValueError:  # ml_dtypes' bfloat16 and float8 types have their own finfo
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).eps)


class _Case:
    """Builds inputs, runs one collective, and checks its result for one size."""

    def __init__(self, group: Any, op: str, count: int, dtype: np.dtype, redop: str, root: int):
        self.group, self.op, self.redop, self.root = group, op, redop, root
        n, rank = group.size, group.rank
        self.world = n
        # all_gather / gather send count/n each; reduce_scatter, all_to_all, scatter split count.
        per_rank = count // n if op in ("all_gather", "gather") else count
        self.inputs = [_rank_data(r, per_rank, dtype) for r in range(n)]
        self.x = self.inputs[rank]
        if op in ("reduce_scatter", "all_to_all", "scatter"):
            self.x = self.x[: (per_rank // n) * n]
            self.inputs = [inp[: (per_rank // n) * n] for inp in self.inputs]
        if op == "scatter":
            self.x = self.x.reshape(n, -1)

        # A group with a device backend ("cpu:tcp,cuda:nccl") is timed on cupy arrays, and
        # each timed loop ends with a stream synchronize (a call only queues its work).
        self.device = group.device_backend is not None
        self.sync: Callable[[], Any] = lambda: None
        if self.device:
            import cupy

            self.x = cupy.asarray(self.x)
            self.sync = cupy.cuda.get_current_stream().synchronize
        self.run: Callable[[], Any] = self._runner()

    def _runner(self) -> Callable[[], Any]:
        """The timed call, bound once: the loop then pays for the collective only."""
        g, x, redop, root = self.group, self.x, self.redop, self.root
        if self.op == "all_reduce":
            return lambda: g.all_reduce(x, redop)
        if self.op == "all_gather":
            return lambda: g.all_gather(x, tiled=True)
        if self.op == "reduce_scatter":
            return lambda: g.reduce_scatter(x, redop, tiled=True)
        if self.op == "all_to_all":
            return lambda: g.all_to_all(x, tiled=True)
        if self.op == "broadcast":
            return lambda: g.broadcast(x, root)
        if self.op == "reduce":
            return lambda: g.reduce(x, root, redop)
        if self.op == "gather":
            return lambda: g.gather(x, root)
        if self.op == "scatter":
            if g.rank == root:
                return lambda: g.scatter(x, root)
            shape, dtype = x.shape[1:], x.dtype  # off root: one entry's shape and dtype
            return lambda: g.scatter(None, root, shape=shape, dtype=dtype)
        if self.op == "sendrecv":
            n = g.size
            perm = [(r, (r + 1) % n) for r in range(n)]
            return lambda: g.permute(x, perm)
        raise InvalidArgument(f"unknown op {self.op!r}; valid: {', '.join(OPS)}")

    def expected(self) -> np.ndarray | None:
        n, rank, inputs = self.world, self.group.rank, self.inputs
        # Only the reducing ops name a reduction; the others' redop need not fit their dtype.
        reduced = _reduce(np.stack(inputs), self.redop) if self.op in _REDUCING else inputs[0]
        if self.op == "all_reduce":
            return reduced
        if self.op == "all_gather":
            return np.concatenate(inputs)
        if self.op == "reduce_scatter":
            return np.split(reduced, n)[rank]
        if self.op == "all_to_all":
            return np.concatenate([np.split(inp, n)[rank] for inp in inputs])
        if self.op == "broadcast":
            return inputs[self.root]
        if self.op == "reduce":
            return reduced if rank == self.root else None
        if self.op == "gather":
            return np.stack(inputs) if rank == self.root else None
        if self.op == "scatter":
            return inputs[self.root].reshape(n, -1)[rank]
        return inputs[(rank - 1) % n]  # sendrecv

    def wrong(self, result: Any) -> int:
        expected = self.expected()
        if expected is None:
            return 0 if result is None else 1
        if self.device:
            import cupy

            result = cupy.asnumpy(result)
        got = np.asarray(result).reshape(-1)
        want = expected.reshape(-1)
        if got.shape != want.shape:
            return max(got.size, want.size)
        wrong = got != want
        if self.op in _REDUCING and _rounds(self.redop, want.dtype):
            # The ranks multiply (or divide) in an order of the algorithm's choosing, so a
            # product or mean may differ from the oracle's in its last bits, never by more
            # than one rounding per rank.
            tol = self.world * _eps(want.dtype) * np.abs(want.astype(np.complex128))
            wrong &= ~(np.abs(got.astype(np.complex128) - want.astype(np.complex128)) <= tol)
        return int(np.count_nonzero(wrong))


def _bench_size(group: Any, case: _Case, size: int, iters: int, warmup: int) -> BenchRow:
    run = case.run
    wrong = case.wrong(run())
    for _ in range(warmup):
        run()
    case.sync()
    group.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    case.sync()
    elapsed = (time.perf_counter() - start) / iters
    slowest = float(group.all_reduce(np.array([elapsed]), op="max")[0])
    wrong = int(group.all_reduce(np.array([wrong], dtype=np.int64), op="sum")[0])
    algbw = size / slowest / 1e9
    return BenchRow(
        op=case.op,
        world=group.size,
        size=size,
        count=size // case.x.dtype.itemsize,
        dtype=case.x.dtype.name,
        redop=case.redop if case.op in ("all_reduce", "reduce_scatter", "reduce") else "none",
        root=case.root if case.op in ("broadcast", "reduce", "gather", "scatter") else -1,
        time_us=slowest * 1e6,
        algbw=algbw,
        busbw=algbw * bus_factor(case.op, group.size),
        wrong=wrong,
        backend=group.backend,
    )


_HEADER = (
    f"{'size':>12} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} "
    f"{'time(us)':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}"
)


def format_row(row: BenchRow) -> str:
    """Format one row in nccl-tests' columns."""
    return (
        f"{row.size:>12} {row.count:>12} {row.dtype:>8} {row.redop:>6} {row.root:>5} "
        f"{row.time_us:>10.1f} {row.algbw:>8.3f} {row.busbw:>8.3f} {row.wrong:>7}"
    )


def run_sweep(group: Any, args: argparse.Namespace) -> list[BenchRow]:
    """Run the sweep of ``args`` on ``group``; rank 0 prints the table and returns the rows."""
    dtype = np.dtype(args.dtype)
    sizes = _sizes(args.min_bytes, args.max_bytes, args.step_factor, dtype.itemsize)
    rows: list[BenchRow] = []
    lead = group.rank == 0
    if lead and not args.json:
        print(f"# meshcomm-bench: op {args.op}, world {group.size}, backend {group.backend}")
        print(f"# {'(bytes)':>10} {'(elements)':>12}{'':>22}{'':>10} {'(GB/s)':>8} {'(GB/s)':>8}")
        print("#" + _HEADER[1:], flush=True)
    for index, size in enumerate(sizes):
        count = max(1, size // dtype.itemsize)
        case = _Case(group, args.op, count, dtype, args.redop, args.root)
        iters = args.iters or _default_iters(size)
        row = _bench_size(group, case, size, iters, args.warmup)
        rows.append(row)
        if lead:
            if not args.json:
                print(format_row(row), flush=True)
            if sys.stderr.isatty():
                done = int(20 * (index + 1) / len(sizes))
                print(f"\r[{'#' * done}{'.' * (20 - done)}] {size} B", end="", file=sys.stderr)
    if lead:
        if sys.stderr.isatty():
            print(file=sys.stderr)
        if args.json:
            print(json.dumps([asdict(r) for r in rows]))
        else:
            avg = sum(r.busbw for r in rows) / max(1, len(rows))
            wrong = sum(r.wrong for r in rows)
            print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
            print(f"# Avg bus bandwidth    : {avg:.4f} GB/s")
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshcomm-bench",
        description="nccl-tests-style tables for every collective: one row per message size "
        "(time, algbw, busbw, wrong elements). Run alone, it launches its ranks; inside "
        "meshrun or mpiexec it uses the world it finds.",
        epilog="Sizes take K, M, G suffixes (powers of 1024). nccl-tests' long names "
        "(--minbytes, --maxbytes, --stepfactor, --datatype, --warmup_iters) work too; -n is "
        "the number of ranks here, not nccl-tests' iteration count (use --iters).",
    )
    p.add_argument(
        "-n",
        "--nprocs",
        type=int,
        default=None,
        help="ranks to launch when run alone (default 2; nccl: one per GPU)",
    )
    p.add_argument(
        "--op",
        choices=OPS,
        default="all_reduce",
        help="the collective to time (default all_reduce)",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="tcp (the default on CPU), mpi (launched through mpiexec), nccl (cupy arrays over "
        "NCCL, one rank per GPU; same as cpu:tcp,cuda:nccl)",
    )
    p.add_argument(
        "-b",
        "--min-bytes",
        "--minbytes",
        type=parse_size,
        default=parse_size("8"),
        help="smallest message size (default 8)",
    )
    p.add_argument(
        "-e",
        "--max-bytes",
        "--maxbytes",
        type=parse_size,
        default=parse_size("64M"),
        help="largest message size (default 64M)",
    )
    p.add_argument(
        "-f",
        "--step-factor",
        "--stepfactor",
        type=int,
        default=2,
        help="multiply the size by this from one row to the next (default 2)",
    )
    p.add_argument(
        "-d",
        "--dtype",
        "--datatype",
        default="float32",
        help="element type: float32 (default), float64, float16, bfloat16, int8..int64, ...",
    )
    p.add_argument(
        "-o",
        "--redop",
        default="sum",
        help="reduction of all_reduce, reduce_scatter and reduce: sum (default), prod, min, "
        "max, avg",
    )
    p.add_argument(
        "-r", "--root", type=int, default=0, help="root rank of broadcast, reduce, gather, scatter"
    )
    p.add_argument("--iters", type=int, default=0, help="timed iterations (default: by size)")
    p.add_argument(
        "-w",
        "--warmup",
        "--warmup_iters",
        type=int,
        default=3,
        help="untimed iterations before the timed ones (default 3)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead")
    return p


def _device_backend(backend: str | None) -> bool:
    """Whether ``backend`` names a device backend (nccl)."""
    return backend is not None and "nccl" in backend.lower()


def _inside_launcher() -> bool:
    launcher_vars = ("RANK", "MESHCOMM_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", _CHILD_ENV)
    return any(v in os.environ for v in launcher_vars)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``meshcomm-bench``; returns the process exit code."""
    args = _parser().parse_args(argv)
    if args.step_factor < 2:
        raise SystemExit("meshcomm-bench: --step-factor must be at least 2")
    if not _inside_launcher():
        # NCCL takes one GPU per rank: by default as many ranks as GPUs.
        nprocs = args.nprocs or ("gpu" if _device_backend(args.backend) else 2)
        forwarded = [a for a in (sys.argv[1:] if argv is None else list(argv))]
        # The mpi backend's ranks are one MPI job: meshrun starts them through mpiexec.
        launch = ["--backend", "mpi"] if args.backend == "mpi" else []
        command = [
            sys.executable, "-m", "meshcomm.run", *launch, "--nproc-per-node", str(nprocs),
            "--no-prefix", "-m", "meshcomm.bench", *forwarded,
        ]  # fmt: skip
        env = dict(os.environ, **{_CHILD_ENV: "1"})
        return subprocess.call(command, env=env)
    from meshcomm import world

    group = world.init(backend=args.backend)
    try:
        rows = run_sweep(group, args)
    finally:
        world.shutdown()
    return 1 if any(r.wrong for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
