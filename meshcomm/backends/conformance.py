"""The conformance suite every backend passes: every collective against numpy oracles.

:func:`run_conformance` runs inside every rank of any world (any backend, any size) and
returns readable failure strings, so ``assert not failures`` shows exactly what broke.
:mod:`meshcomm.testing` exports it beside :func:`~meshcomm.testing.run_ranks`.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> with ProcessGroup(SelfCommunicator()) as g:
    ...     run_conformance(g, quick=True)
    []
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshcomm.errors import CommError, InvalidArgument
from meshcomm.group import ProcessGroup
from meshcomm.group.arrays import SUPPORTED_DTYPES, dtype_name
from meshcomm.reduction import ReduceOp, check_op_dtype

__all__ = ["run_conformance"]

_OPS = tuple(ReduceOp)
_QUICK_NAMES = ("bool", "int8", "int32", "uint64", "float16", "float32", "complex64", "bfloat16")
_QUICK_DTYPES = tuple(d for d in SUPPORTED_DTYPES if dtype_name(d) in _QUICK_NAMES)
_ORACLE_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PREMUL_SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
_FACTOR = 2.0


def _data(seed: int, rank: int, shape: tuple[int, ...], dtype: Any, op: Any = None) -> np.ndarray:
    """Deterministic small integers from (seed, rank), exact under any float sum or product."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng([seed, rank])
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    low, high = (1, 3) if op == ReduceOp.PROD else (-2, 4)
    if dt.kind == "u":
        low = max(low, 0)
    values = rng.integers(low, high, size=shape)
    if dt.kind == "c":
        values = values + 1j * rng.integers(low, high, size=shape)
    return np.asarray(values).astype(dt)


def _reduce_oracle(op: ReduceOp, xs: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
    stack = np.stack([np.asarray(x) for x in xs])
    if op is ReduceOp.PREMUL_SUM:
        stack = stack * np.asarray(_FACTOR).astype(dtype)
    out = _ORACLE_UFUNCS[op].reduce(stack, axis=0, dtype=dtype)
    if op is ReduceOp.AVG:
        out = np.true_divide(out, len(xs))
    return np.asarray(out).astype(dtype)


def _valid_ops(dtype: np.dtype) -> list[ReduceOp]:
    ops = []
    for op in _OPS:
        try:
            check_op_dtype(op, dtype)
        except TypeError:
            continue
        ops.append(op)
    return ops


def _layouts(x: np.ndarray) -> dict[str, np.ndarray]:
    """The same values as ``x`` in other memory layouts."""
    out = {"fortran": np.asfortranarray(x)}
    padded = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), dtype=x.dtype) if x.ndim else None
    if padded is not None:
        padded[..., ::2] = x
        out["strided"] = padded[..., ::2]
        out["reversed"] = np.ascontiguousarray(x[..., ::-1])[..., ::-1]
    if x.dtype.kind in "iuf" and x.dtype.itemsize > 1:
        out["byteswapped"] = x.astype(x.dtype.newbyteorder(">"))
    return out


class _Suite:
    """Runs the checks of :func:`run_conformance` on one group and collects failures."""

    def __init__(self, group: ProcessGroup, quick: bool) -> None:
        self.g = group
        self.quick = quick
        self.failures: list[str] = []
        self._seed = 0
        self.me = group.ranks[group.rank]
        self.dtypes = _QUICK_DTYPES if quick else SUPPORTED_DTYPES

    def seed(self) -> int:
        self._seed += 1
        return self._seed

    def fail(self, message: str) -> None:
        self.failures.append(f"rank {self.me}: {message}")

    def expect(self, what: str, got: Any, expected: Any) -> None:
        """Record a failure unless ``got`` is an array equal to ``expected`` (dtype included)."""
        if expected is None or got is None:
            if got is not expected:
                self.fail(f"{what}: got {got!r}, expected {expected!r}")
            return
        expected = np.asarray(expected)
        expected = expected.astype(expected.dtype.newbyteorder("="), copy=False)
        if not isinstance(got, np.ndarray):
            self.fail(f"{what}: got {type(got).__name__} {got!r}, expected an ndarray")
        elif got.dtype != expected.dtype or got.shape != expected.shape:
            self.fail(
                f"{what}: got dtype {dtype_name(got.dtype)} shape {got.shape}, expected "
                f"dtype {dtype_name(expected.dtype)} shape {expected.shape}"
            )
        elif not np.array_equal(got, expected):
            self.fail(f"{what}: got {got.tolist()!r}, expected {expected.tolist()!r}")

    def call(self, what: str, fn: Callable[..., Any], x: Any, *args: Any, **kw: Any) -> Any:
        """Call ``fn(x, ...)``; record a failure if ``x`` was modified."""
        before = np.array(x, copy=True) if isinstance(x, np.ndarray) else None
        result = fn(x, *args, **kw)
        if before is not None and not (
            np.array_equal(before, x) and before.dtype == np.asarray(x).dtype
        ):
            self.fail(f"{what}: the input was modified")
        return result

    def raises(self, what: str, exc_type: type[BaseException], fn: Callable[[], Any]) -> None:
        try:
            fn()
        except exc_type:
            return
        except Exception as exc:
            self.fail(f"{what}: raised {type(exc).__name__} ({exc}), expected {exc_type.__name__}")
            return
        self.fail(f"{what}: did not raise {exc_type.__name__}")


def _sections() -> list[Callable[[_Suite, ProcessGroup], None]]:
    return [
        _check_all_reduce,
        _check_layouts,
        _check_all_gather,
        _check_reduce_scatter,
        _check_all_to_all,
        _check_rooted,
        _check_p2p,
        _check_permute,
        _check_async,
        _check_repeated_calls,
        _check_many_in_flight,
        _check_argument_errors,
        _check_groups,
        _check_closed_group,
    ]


def run_conformance(group: ProcessGroup, *, quick: bool = False) -> list[str]:
    """Check every collective of ``group`` against numpy; run on every rank of the group.

    Covers every collective x dtype x reduce op (and every root), ``axis``/``tiled``
    variants, async variants, 1000 async operations in flight, sub-groups (split by parity,
    ``new_group`` of a subset, interleaved collectives on different groups), 0-d, zero-size,
    strided, reversed, Fortran-order and byte-swapped inputs, that inputs are never
    modified, that bad arguments raise before any I/O, that a signature called again
    (which most backends answer from a cached route) still matches numpy, and that a
    closed group refuses every collective on every route. Data are small integers from
    ``(seed, rank)``, so float sums are exact and every rank can compute every oracle.

    Args:
        group: the group under test (every rank of it must call this).
        quick: fewer dtypes (8 of 15) for a faster run.

    Returns:
        Readable failures (collective, dtype, op, root, shape, got vs expected); empty
        when everything conforms. A section that raises is reported and the suite goes on,
        unless the raise was a CommError (the world then fails fast, so the suite stops).

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> run_conformance(ProcessGroup(SelfCommunicator()), quick=True)
        []
    """
    suite = _Suite(group, quick)
    for section in _sections():
        try:
            section(suite, group)
        except CommError as exc:
            suite.fail(f"{section.__name__}: {type(exc).__name__}: {exc}")
            break
        except Exception as exc:
            suite.fail(f"{section.__name__}: raised {type(exc).__name__}: {exc}")
    return suite.failures


# -- sections ---------------------------------------------------------------------------------
def _check_all_reduce(s: _Suite, g: ProcessGroup) -> None:
    for dt in s.dtypes:
        for op in _valid_ops(dt):
            seed, shape = s.seed(), (5,)
            xs = [_data(seed, r, shape, dt, op) for r in g.ranks]
            factor = _FACTOR if op is ReduceOp.PREMUL_SUM else None
            what = f"all_reduce dtype={dtype_name(dt)} op={op.value} shape={shape}"
            got = s.call(what, g.all_reduce, xs[g.rank], op.value, factor=factor)
            s.expect(what, got, _reduce_oracle(op, xs, dt))
        invalid = [op for op in _OPS if op not in _valid_ops(dt)]
        if invalid:
            x, bad = _data(0, s.me, (2,), dt), invalid[0]
            what = f"all_reduce dtype={dtype_name(dt)} op={bad.value}"
            s.raises(what, TypeError, functools.partial(g.all_reduce, x, bad))


def _check_layouts(s: _Suite, g: ProcessGroup) -> None:
    """0-d, zero-size, python scalars and lists, non-contiguous and Fortran inputs."""
    for shape in ((), (0,), (3, 0), (2, 3), (3, 1, 2)):
        seed = s.seed()
        xs = [_data(seed, r, shape, np.float64) for r in g.ranks]
        s.expect(f"all_reduce shape={shape}", g.all_reduce(xs[g.rank]), np.sum(xs, axis=0))
        expected = np.stack(xs)
        s.expect(f"all_gather shape={shape}", g.all_gather(xs[g.rank]), expected)
        if shape:
            for name, x in _layouts(xs[g.rank]).items():
                what = f"all_reduce layout={name} shape={shape}"
                layouts = [_layouts(v)[name] for v in xs]
                s.expect(what, s.call(what, g.all_reduce, x, "max"), np.maximum.reduce(layouts))
                what = f"all_gather layout={name} shape={shape}"
                s.expect(what, s.call(what, g.all_gather, x, axis=-1), np.stack(layouts, -1))
                what = f"broadcast layout={name} shape={shape} root={g.size - 1}"
                s.expect(what, s.call(what, g.broadcast, x, root=g.size - 1), layouts[-1])
    n, me = g.size, g.rank
    seed = s.seed()
    xs = [_data(seed, r, (2 * n, 3), np.float32) for r in g.ranks]
    for name, x in _layouts(xs[me]).items():
        what = f"reduce_scatter layout={name} shape={x.shape} axis=0 tiled=True"
        got = s.call(what, g.reduce_scatter, x, "sum", 0, True)
        s.expect(what, got, np.split(np.sum(xs, axis=0), n)[me])
        what = f"all_to_all layout={name} shape={x.shape} split=0 concat=1 tiled=True"
        got = s.call(what, g.all_to_all, x, 0, 1, True)
        s.expect(what, got, np.concatenate([np.split(v, n)[me] for v in xs], axis=1))
    s.expect("all_reduce python int", g.all_reduce(3), np.asarray(3 * g.size))
    s.expect("all_reduce python list", g.all_reduce([1.5, 2]), np.array([1.5, 2.0]) * g.size)


def _check_all_gather(s: _Suite, g: ProcessGroup) -> None:
    for dt in s.dtypes:
        seed = s.seed()
        xs = [_data(seed, r, (3,), dt) for r in g.ranks]
        what = f"all_gather dtype={dtype_name(dt)} shape=(3,)"
        s.expect(what, s.call(what, g.all_gather, xs[g.rank]), np.stack(xs))
    shape = (2, 3, 2)
    seed = s.seed()
    xs = [_data(seed, r, shape, np.int32) for r in g.ranks]
    for tiled in (False, True):
        ndim = len(shape) if tiled else len(shape) + 1
        for axis in range(-ndim, ndim):
            what = f"all_gather dtype=int32 shape={shape} axis={axis} tiled={tiled}"
            got = s.call(what, g.all_gather, xs[g.rank], axis=axis, tiled=tiled)
            s.expect(what, got, np.concatenate(xs, axis) if tiled else np.stack(xs, axis))


def _check_reduce_scatter(s: _Suite, g: ProcessGroup) -> None:
    n = g.size
    cases = [((n, 3), 0, False), ((2, n), 1, False), ((2, n, 2), -2, False)]
    cases += [
        ((2 * n, 3), 0, True),
        ((3, 2 * n), 1, True),
        ((2, 2, n), -1, True),
        ((0, n), 1, True),
    ]
    dtypes = ("float32", "int64") if s.quick else ("float32", "int64", "complex128", "bfloat16")
    for dt in (np.dtype(d) if d != "bfloat16" else SUPPORTED_DTYPES[-1] for d in dtypes):
        for op in _valid_ops(dt):
            if op in (ReduceOp.BAND, ReduceOp.BXOR, ReduceOp.PROD) and s.quick:
                continue
            for shape, axis, tiled in cases:
                seed = s.seed()
                xs = [_data(seed, r, shape, dt, op) for r in g.ranks]
                total = _reduce_oracle(op, xs, dt)
                ax = axis % len(shape)
                if tiled:
                    expected = np.split(total, n, axis=ax)[g.rank]
                else:
                    expected = np.take(total, g.rank, axis=ax)
                factor = _FACTOR if op is ReduceOp.PREMUL_SUM else None
                what = (
                    f"reduce_scatter dtype={dtype_name(dt)} op={op.value} shape={shape} "
                    f"axis={axis} tiled={tiled}"
                )
                got = s.call(
                    what, g.reduce_scatter, xs[g.rank], op.value, axis, tiled, factor=factor
                )
                s.expect(what, got, expected)


def _check_all_to_all(s: _Suite, g: ProcessGroup) -> None:
    n, me = g.size, g.rank
    shapes = {False: [(n,), (n, 3), (2, n), (2, n, 3)], True: [(2 * n,), (2 * n, 3), (3, n, 2)]}
    for tiled, cases in shapes.items():
        for shape in cases:
            split = (
                shape.index(n) if not tiled else next(i for i, d in enumerate(shape) if d % n == 0)
            )
            seed = s.seed()
            xs = [_data(seed, r, shape, np.int16) for r in g.ranks]
            for concat in range(len(shape)):
                if tiled:
                    parts = [np.split(x, n, axis=split)[me] for x in xs]
                    expected = np.concatenate(parts, axis=concat)
                else:
                    expected = np.stack([np.take(x, me, axis=split) for x in xs], axis=concat)
                what = f"all_to_all shape={shape} split={split} concat={concat} tiled={tiled}"
                got = s.call(what, g.all_to_all, xs[me], split, concat, tiled)
                s.expect(what, got, expected)
    for dt in s.dtypes:
        seed = s.seed()
        xs = [_data(seed, r, (n, 2), dt) for r in g.ranks]
        what = f"all_to_all dtype={dtype_name(dt)} shape={(n, 2)}"
        s.expect(what, g.all_to_all(xs[me]), np.stack([x[me] for x in xs]))


def _check_rooted(s: _Suite, g: ProcessGroup) -> None:
    """broadcast, reduce, gather, scatter at every root."""
    n, me = g.size, g.rank
    for root in range(n):
        for dt in (np.dtype(np.float32), SUPPORTED_DTYPES[-1], np.dtype(np.int8)):
            seed = s.seed()
            xs = [_data(seed, r, (2, 3), dt) for r in g.ranks]
            name = dtype_name(dt)
            what = f"broadcast dtype={name} root={root} shape=(2, 3)"
            if me == root or me % 2:
                got = s.call(what, g.broadcast, xs[me], root)
            else:
                got = g.broadcast(None, root, shape=(2, 3), dtype=dt)
            s.expect(what, got, xs[root])
            ops = [ReduceOp.SUM, ReduceOp.MAX] + ([ReduceOp.AVG] if dt.kind != "i" else [])
            for op in ops:
                what = f"reduce dtype={name} op={op.value} root={root} shape=(2, 3)"
                got = s.call(what, g.reduce, xs[me], root, op.value)
                s.expect(what, got, _reduce_oracle(op, xs, dt) if me == root else None)
            what = f"gather dtype={name} root={root} shape=(2, 3)"
            got = s.call(what, g.gather, xs[me], root)
            s.expect(what, got, np.stack(xs) if me == root else None)
            stacked = [_data(seed, r, (n, 3), dt) for r in g.ranks]
            what = f"scatter dtype={name} root={root} shape=({n}, 3)"
            if me == root or me % 2:
                got = s.call(what, g.scatter, stacked[me], root)
            else:
                got = g.scatter(None, root, shape=(3,), dtype=dt)
            s.expect(what, got, stacked[root][me])
    for dt in s.dtypes:
        seed, root = s.seed(), n - 1
        x = _data(seed, root, (4,), dt)
        what = f"broadcast dtype={dtype_name(dt)} root={root} shape=(4,)"
        s.expect(what, g.broadcast(x if me == root else None, root, shape=4, dtype=dt), x)


def _check_p2p(s: _Suite, g: ProcessGroup) -> None:
    n, me = g.size, g.rank
    right, left = (me + 1) % n, (me - 1) % n
    for dt in s.dtypes:
        seed = s.seed()
        shape = (2, 3) if dt.kind != "b" else ()
        mine = _data(seed, g.ranks[me], shape, dt)
        what = f"send/recv dtype={dtype_name(dt)} shape={shape}"
        work = s.call(what, g.send, mine, right, tag=5, async_op=True)
        got = g.recv(left, tag=5)
        work.wait()
        s.expect(what, got, _data(seed, g.ranks[left], shape, dt))
    # Any-source receive, tags kept apart, strided input.
    seed = s.seed()
    base = _data(seed, g.ranks[me], (4, 6), np.float64)
    w1 = g.send(base[:, ::2], right, tag=1, async_op=True)
    w2 = g.send(base[::-1], right, tag=2, async_op=True)
    got2, src2 = g.recv(None, tag=2, return_source=True)
    got1 = g.recv(left, tag=1)
    w1.wait()
    w2.wait()
    theirs = _data(seed, g.ranks[left], (4, 6), np.float64)
    s.expect("recv tag=1 strided", got1, theirs[:, ::2])
    s.expect("recv tag=2 reversed src=None", got2, theirs[::-1])
    if src2 != left:
        s.fail(f"recv src=None return_source: got source {src2}, expected {left}")


def _check_permute(s: _Suite, g: ProcessGroup) -> None:
    n, me = g.size, g.rank
    seed = s.seed()
    xs = [_data(seed, r, (3,), np.float32) for r in g.ranks]
    perms = {
        "shift": [(i, (i + 1) % n) for i in range(n)],
        "one": [(0, n - 1)],
        "none": [],
        "identity": [(i, i) for i in range(n)],
    }
    for name, perm in perms.items():
        src = next((a for a, b in perm if b == me), None)
        expected = np.zeros(3, np.float32) if src is None else xs[src]
        what = f"permute perm={name} {perm}"
        s.expect(what, s.call(what, g.permute, xs[me], perm), expected)
    s.raises("permute duplicate dst", InvalidArgument, lambda: g.permute(xs[me], [(0, 0), (0, 0)]))
    s.raises("permute out of range", InvalidArgument, lambda: g.permute(xs[me], [(0, n)]))


def _check_async(s: _Suite, g: ProcessGroup) -> None:
    n, me = g.size, g.rank
    seed = s.seed()
    xs = [_data(seed, r, (n, 2), np.float64) for r in g.ranks]
    x = xs[me].copy()
    works = {
        "all_reduce": g.all_reduce(x, "sum", async_op=True),
        "all_gather": g.all_gather(x, axis=1, async_op=True),
        "reduce_scatter": g.reduce_scatter(x, "max", async_op=True),
        "all_to_all": g.all_to_all(x, async_op=True),
        "broadcast": g.broadcast(x, 0, async_op=True),
        "reduce": g.reduce(x, n - 1, async_op=True),
        "gather": g.gather(x, 0, async_op=True),
        "scatter": g.scatter(x, n - 1, async_op=True),
        "permute": g.permute(x, [(i, (i + 1) % n) for i in range(n)], async_op=True),
        "barrier": g.barrier(async_op=True),
    }
    x[...] = -99  # the inputs were snapshotted when the ops were issued
    expected = {
        "all_reduce": np.sum(xs, axis=0),
        "all_gather": np.stack(xs, axis=1),
        "reduce_scatter": np.max(xs, axis=0)[me],
        "all_to_all": np.stack([v[me] for v in xs]),
        "broadcast": xs[0],
        "reduce": np.sum(xs, axis=0) if me == n - 1 else None,
        "gather": np.stack(xs) if me == 0 else None,
        "scatter": xs[n - 1][me],
        "permute": xs[(me - 1) % n],
        "barrier": None,
    }
    for name, work in works.items():
        s.expect(f"{name} async_op=True", work.wait(timeout=g.timeout), expected[name])
        if not work.is_completed() or work.exception() is not None:
            s.fail(f"{name} async_op=True: is_completed/exception wrong after wait")
    future = g.all_reduce(np.ones(2), async_op=True).get_future()
    s.expect("Work.get_future().result()", future.result(timeout=g.timeout), np.full(2, n, float))


def _check_repeated_calls(s: _Suite, g: ProcessGroup) -> None:
    """The same call signature three times in a row, with fresh data each time.

    A group runs a repeated signature through the plan it made on the first call (the
    backend's runner for it, or its primitive on flat views), so the calls after the first
    take the fast case of that route: each must still match numpy, for every collective a
    plan serves (all_reduce with every op but premul_sum, avg included; all_gather,
    reduce_scatter and all_to_all at axis 0, stacked and tiled; broadcast from every root),
    dtype, op and root, synchronous and asynchronous.
    """
    n, me = g.size, g.rank
    for dt in s.dtypes:
        for op in _valid_ops(dt):
            if op is ReduceOp.PREMUL_SUM:
                continue  # its factor changes per call: lowered each time, never planned
            for shape in ((5,), (5,), (2, 3)):  # a new shape is a new signature
                seed = s.seed()
                xs = [_data(seed, r, shape, dt, op) for r in g.ranks]
                what = f"repeated all_reduce dtype={dtype_name(dt)} op={op.value} shape={shape}"
                expected = _reduce_oracle(op, xs, dt)
                s.expect(what, s.call(what, g.all_reduce, xs[me], op), expected)
                work = s.call(what, g.all_reduce, xs[me], op, async_op=True)
                s.expect(f"{what} async", work.wait(), expected)
                strided = np.stack([xs[me], xs[me]], axis=-1)[..., 0]  # the same values, strided
                s.expect(f"{what} strided", s.call(what, g.all_reduce, strided, op), expected)
        ordered = ReduceOp.MAX in _valid_ops(dt)
        for _ in range(3):
            seed = s.seed()
            xs = [_data(seed, r, (n, 2), dt) for r in g.ranks]
            name = dtype_name(dt)
            what = f"repeated all_gather dtype={name} shape={(n, 2)}"
            s.expect(what, s.call(what, g.all_gather, xs[me], tiled=True), np.concatenate(xs))
            what = f"repeated stacked all_gather dtype={name} shape={(n, 2)}"
            s.expect(what, s.call(what, g.all_gather, xs[me]), np.stack(xs))
            work = s.call(what, g.all_gather, xs[me], async_op=True)
            s.expect(f"{what} async", work.wait(), np.stack(xs))
            what = f"repeated all_to_all dtype={name} shape={(n, 2)}"
            s.expect(what, s.call(what, g.all_to_all, xs[me]), np.stack([x[me] for x in xs]))
            what = f"repeated tiled all_to_all dtype={name} shape={(n, 2)}"
            got = s.call(what, g.all_to_all, xs[me], tiled=True)
            s.expect(what, got, np.concatenate([x[me : me + 1] for x in xs]))
            if dt.kind != "b":
                total = _reduce_oracle(ReduceOp.SUM, xs, dt)
                what = f"repeated reduce_scatter dtype={name} shape={(n, 2)}"
                got = s.call(what, g.reduce_scatter, xs[me], "sum", 0, True)
                s.expect(what, got, total[me : me + 1])
            if ordered:
                top = _reduce_oracle(ReduceOp.MAX, xs, dt)
                what = f"repeated stacked reduce_scatter max dtype={name} shape={(n, 2)}"
                s.expect(what, s.call(what, g.reduce_scatter, xs[me], "max"), top[me])
            for root in range(n):
                what = f"repeated broadcast dtype={name} root={root}"
                s.expect(what, s.call(what, g.broadcast, xs[me], root), xs[root])


def _check_many_in_flight(s: _Suite, g: ProcessGroup) -> None:
    n = g.size
    count = 200 if s.quick else 1000
    works = [g.all_reduce(np.array([i, g.rank]), async_op=True) for i in range(count)]
    bad = []
    for i, work in enumerate(works):
        got = work.wait(timeout=g.timeout)
        if got.tolist() != [i * n, n * (n - 1) // 2]:
            bad.append((i, got.tolist()))
    if bad:
        s.fail(f"{count} async all_reduce in flight: {len(bad)} wrong, first {bad[:3]}")


def _check_argument_errors(s: _Suite, g: ProcessGroup) -> None:
    """Every rank raises the same error before any I/O; the group stays usable."""
    n = g.size
    x, y = np.ones((n, 2), np.float32), np.ones((n, n + 1), np.float32)
    cases: list[tuple[str, type[BaseException], Callable[[], Any]]] = [
        ("all_gather axis out of range", InvalidArgument, lambda: g.all_gather(x, axis=3)),
        ("all_gather tiled 0-d", InvalidArgument, lambda: g.all_gather(1.0, tiled=True)),
        ("reduce_scatter indivisible", InvalidArgument, lambda: g.reduce_scatter(y, axis=1)),
        ("all_to_all bad concat_axis", InvalidArgument, lambda: g.all_to_all(x, 0, 2)),
        ("broadcast root out of range", InvalidArgument, lambda: g.broadcast(x, root=n)),
        ("reduce negative root", InvalidArgument, lambda: g.reduce(x, root=-1)),
        ("scatter wrong leading dim", InvalidArgument, lambda: g.scatter(np.ones(n + 1), 0)),
        ("broadcast None without shape", InvalidArgument, lambda: g.broadcast(None, root=0)),
        ("all_reduce unknown op", InvalidArgument, lambda: g.all_reduce(x, "median")),
        ("all_reduce complex max", TypeError, lambda: g.all_reduce(np.ones(2, complex), "max")),
        ("all_reduce int avg", TypeError, lambda: g.all_reduce(np.ones(2, int), "avg")),
        ("premul_sum without factor", InvalidArgument, lambda: g.all_reduce(x, "premul_sum")),
        ("object dtype", TypeError, lambda: g.all_reduce(np.array([None, 1]))),
        ("str dtype", TypeError, lambda: g.all_gather(np.array(["a"]))),
        ("send dst out of range", InvalidArgument, lambda: g.send(x, n)),
        ("recv negative tag", InvalidArgument, lambda: g.recv(0, tag=-1)),
    ]
    if n > 1:
        indivisible = np.ones(n + 1)
        cases.append(
            (
                "reduce_scatter tiled indivisible",
                InvalidArgument,
                lambda: g.reduce_scatter(indivisible, tiled=True),
            )
        )
    for what, exc_type, fn in cases:
        s.raises(what, exc_type, fn)
    s.expect("all_reduce after argument errors", g.all_reduce(np.ones(2)), np.full(2, float(n)))


def _check_groups(s: _Suite, g: ProcessGroup) -> None:
    n, me = g.size, g.rank
    # Seeds are drawn up front: which sub-group checks run depends on membership.
    seeds = [s.seed() for _ in range(4)]
    # Split by parity, reversed order inside each part.
    parity = g.split(me % 2, key=-me)
    members = sorted((r for r in range(n) if r % 2 == me % 2), reverse=True)
    if parity is None:
        s.fail("split by parity returned None")
        return
    expected_ranks = tuple(g.ranks[r] for r in members)
    if parity.ranks != expected_ranks or parity.rank != members.index(me):
        s.fail(
            f"split by parity: got ranks {parity.ranks} rank {parity.rank}, expected "
            f"{expected_ranks} rank {members.index(me)}"
        )
    _check_subgroup(s, parity, "split parity", seeds[0])
    # color None: this rank joins no group.
    single = g.split(None if me == 0 else 1)
    if (single is None) != (me == 0) or (single is not None and single.size != n - 1):
        s.fail(f"split color=None on rank 0: got {single!r}")
    elif single is not None:
        _check_subgroup(s, single, "split none0", seeds[1])
    # new_group of the first half (torch: called by all, members ordered by global rank).
    chosen = list(g.ranks[: max(1, n // 2)])
    half = g.new_group(reversed(chosen))
    if (half is None) == (g.ranks[me] in chosen) or (
        half is not None and half.ranks != tuple(chosen)
    ):
        s.fail(f"new_group {chosen}: got {half!r}")
    elif half is not None:
        _check_subgroup(s, half, "new_group half", seeds[2])
    # Interleaved async collectives on the world and the parity group.
    works = []
    for i in range(20):
        works.append((g, i, g.all_reduce(np.array([i]), async_op=True)))
        works.append((parity, i, parity.all_reduce(np.array([i]), async_op=True)))
    for grp, i, work in works:
        s.expect(
            f"interleaved all_reduce #{i} on {grp.name}",
            work.wait(g.timeout),
            np.array([i * grp.size]),
        )
    # A sub-group of a sub-group.
    inner = parity.split(0)
    if inner is not None:
        _check_subgroup(s, inner, "split of split", seeds[3])
        inner.close()
    for sub in (parity, single, half):
        if sub is not None:
            sub.close()
            s.raises(f"{sub.name} used after close", CommError, sub.barrier)
    s.expect("world after sub-groups closed", g.all_reduce(np.ones(1)), np.full(1, float(n)))


def _check_subgroup(s: _Suite, sub: ProcessGroup, label: str, seed: int) -> None:
    xs = [_data(seed, r, (sub.size, 2), np.float32) for r in sub.ranks]
    me = sub.rank
    s.expect(f"{label} all_reduce", sub.all_reduce(xs[me]), np.sum(xs, axis=0))
    s.expect(f"{label} all_gather", sub.all_gather(xs[me], axis=1), np.stack(xs, axis=1))
    s.expect(f"{label} reduce_scatter", sub.reduce_scatter(xs[me]), np.sum(xs, axis=0)[me])
    s.expect(f"{label} all_to_all", sub.all_to_all(xs[me]), np.stack([x[me] for x in xs]))
    root = sub.size - 1
    s.expect(f"{label} broadcast root={root}", sub.broadcast(xs[me], root), xs[root])
    s.expect(
        f"{label} gather root={root}",
        sub.gather(xs[me], root),
        np.stack(xs) if me == root else None,
    )
    right, left = (me + 1) % sub.size, (me - 1) % sub.size
    work = sub.send(xs[me], right, tag=3, async_op=True)
    s.expect(f"{label} send/recv", sub.recv(left, tag=3), xs[left])
    work.wait()
    sub.barrier()


def _check_closed_group(s: _Suite, g: ProcessGroup) -> None:
    """A closed group refuses every collective at once with CommError, on every route: a
    signature whose plan it had (called before), one it never saw, lowered calls (other
    axes, ``avg``, async, strided inputs), rooted and point-to-point calls, sub-groups."""
    sub = g.new_group()
    if sub is None:
        s.fail("new_group() of every rank returned None")
        return
    n = sub.size
    x = _data(s.seed(), s.me, (n, 2), np.float32)
    fresh = _data(s.seed(), s.me, (n, 3), np.float32)  # no call ever had this signature
    calls: dict[str, Callable[[np.ndarray], Any]] = {
        "all_reduce": lambda y: sub.all_reduce(y, "sum"),
        "all_reduce max": lambda y: sub.all_reduce(y, "max"),
        "all_reduce avg": lambda y: sub.all_reduce(y, "avg"),
        "all_reduce async": lambda y: sub.all_reduce(y, async_op=True).wait(),
        "all_reduce strided": lambda y: sub.all_reduce(y[:, ::2]),
        "all_gather": sub.all_gather,
        "all_gather tiled": lambda y: sub.all_gather(y, tiled=True),
        "all_gather axis 1": lambda y: sub.all_gather(y, axis=1),
        "reduce_scatter": lambda y: sub.reduce_scatter(y, "sum", 0, True),
        "reduce_scatter stacked": lambda y: sub.reduce_scatter(y, "max"),
        "all_to_all": sub.all_to_all,
        "all_to_all tiled": lambda y: sub.all_to_all(y, tiled=True),
        "broadcast": lambda y: sub.broadcast(y, 0),
        "broadcast last root": lambda y: sub.broadcast(y, n - 1),
        "reduce": lambda y: sub.reduce(y, 0),
        "gather": lambda y: sub.gather(y, 0),
        "scatter": lambda y: sub.scatter(y, 0),
        "permute": lambda y: sub.permute(y, [(r, (r + 1) % n) for r in range(n)]),
        "barrier": lambda y: sub.barrier(),
    }
    for _ in range(2):  # a signature's second call finds its plan
        for call in calls.values():
            call(x)
    sub.close()
    refused: dict[str, Callable[[], Any]] = {}
    for name, call in calls.items():
        refused[f"{name} (seen)"] = functools.partial(call, x)
        refused[f"{name} (new)"] = functools.partial(call, fresh)
    refused |= {
        "send": lambda: sub.send(x, 0),
        "recv": lambda: sub.recv(0),
        "split": lambda: sub.split(0),
        "new_group": sub.new_group,
    }
    # Refusing must not wait for anything: half the group's timeout tells a refusal from a
    # call that waited (for peers, a queue, a timeout) without timing a fast path.
    limit = sub.timeout / 2
    for name, refuse in refused.items():
        what = f"{name} on a closed group"
        start = time.monotonic()
        s.raises(what, CommError, refuse)
        if time.monotonic() - start > limit:
            s.fail(f"{what}: took {time.monotonic() - start:.1f} s to refuse (limit {limit:g} s)")
