"""Collective algorithms over in-memory links on real threads, checked against numpy oracles.

Every collective runs at world sizes 1-9 with every algorithm forced, with the automatic
choice, and with the automatic choice under tiny thresholds (so it picks the large-message
algorithms). Inputs are small integers, so float results are exact and compared exactly.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshcomm.backends import algorithms as algo
from meshcomm.backends.algorithms._common import block_bounds, rel_pieces, tree_children
from meshcomm.backends.memlink import MemLink, make_memlinks, run_threads
from meshcomm.errors import CommTimeout, InvalidArgument, PeerError, ProtocolError
from meshcomm.reduction import ReduceOp, check_op_dtype

SIZES = [1, 2, 3, 4, 5, 7, 8]
SIZES_WITH_9 = [*SIZES, 9]
COUNTS = [0, 1, 7, 1000, 3001]  # 3001 spans many chunks at SMALL_CHUNK
SMALL_CHUNK = 256  # bytes: forces pipelining at test sizes

DTYPES = [
    np.dtype(t)
    for t in (
        bool,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
        ml_dtypes.bfloat16,
    )
]
MOVE_DTYPES = [np.dtype(bool), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
PRIMITIVE_OPS = [
    ReduceOp.SUM,
    ReduceOp.PROD,
    ReduceOp.MIN,
    ReduceOp.MAX,
    ReduceOp.BAND,
    ReduceOp.BOR,
    ReduceOp.BXOR,
]
UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


def _defined(op: ReduceOp, dtype: np.dtype) -> bool:
    try:
        check_op_dtype(op, dtype)
    except TypeError:
        return False
    return True


OP_DTYPES = [(op, dt) for op in PRIMITIVE_OPS for dt in DTYPES if _defined(op, dt)]
COUNT_CASES = [(ReduceOp.SUM, np.dtype(np.float64)), (ReduceOp.MIN, np.dtype(np.int32))]
COUNT_CASES += [(ReduceOp.PROD, np.dtype(ml_dtypes.bfloat16))]

# Thresholds that make the automatic choice pick the large-message algorithms at test sizes.
LOW_THRESHOLDS = {
    "CHUNK_BYTES": SMALL_CHUNK,
    "ALL_REDUCE_RING_MIN_BYTES": 64,
    "ALL_GATHER_RING_MIN_BYTES": 64,
    "REDUCE_SCATTER_RING_MIN_BYTES": 64,
    "ALL_TO_ALL_PAIRWISE_MIN_BYTES": 64,
    "BROADCAST_TREE_MAX_BYTES": 32,
    "REDUCE_TREE_MAX_BYTES": 32,
    "GATHER_TREE_MAX_BYTES": 32,
}
CHUNKED = {"all_reduce", "reduce_scatter", "broadcast", "reduce"}


def variants(collective: str) -> list[str]:
    return [*algo.ALGORITHMS[collective], "auto", "auto-low"]


def options(collective: str, variant: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Keyword arguments that run ``variant``; "auto-low" lowers the module's thresholds."""
    if variant == "auto":
        return {}
    if variant == "auto-low":
        for name, value in LOW_THRESHOLDS.items():
            monkeypatch.setattr(algo, name, value)
        return {}
    kwargs: dict[str, Any] = {"algorithm": variant}
    if collective in CHUNKED:
        kwargs["chunk_bytes"] = SMALL_CHUNK
    return kwargs


def make_input(seed: int, rank: int, count: int, dtype: np.dtype, op: ReduceOp) -> np.ndarray:
    """Small integer-valued data: every float result below is exact."""
    rng = np.random.default_rng([seed, rank, count])
    if dtype.kind == "b":
        return rng.integers(0, 2, count).astype(bool)
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8).view(dtype)
    if op is ReduceOp.PROD:
        vals = rng.choice([1, 2] if dtype.kind == "u" else [1, -1, 2], count)
        imag = rng.choice([0, 1, -1], count)
    else:
        vals = rng.integers(0, 9, count) if dtype.kind == "u" else rng.integers(-4, 5, count)
        imag = rng.integers(-4, 5, count)
    if dtype.kind == "c":
        return (vals + 1j * imag).astype(dtype)
    return vals.astype(dtype)


def oracle(op: ReduceOp, inputs: list[np.ndarray]) -> np.ndarray:
    stacked = np.stack(inputs)
    acc = stacked[0].copy()
    for row in stacked[1:]:
        acc = UFUNCS[op](acc, row)
    return acc


def assert_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.array_equal(got, want), f"{what}:\n got {got}\nwant {want}"


def assert_bitwise_same(results: list[np.ndarray], what: str) -> None:
    first = results[0].tobytes()
    for rank, res in enumerate(results):
        assert res.tobytes() == first, f"{what}: rank {rank} differs bitwise from rank 0"


def run(size: int, fn: Callable[[MemLink], Any]) -> list[Any]:
    return run_threads(size, fn, timeout=20)


def roots(size: int) -> Iterator[int]:
    return iter(range(size))


# -- reducing collectives -----------------------------------------------------------------


@pytest.mark.parametrize("variant", variants("all_reduce"))
@pytest.mark.parametrize("size", SIZES)
def test_all_reduce_ops_dtypes(size: int, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = options("all_reduce", variant, monkeypatch)
    count = 13

    def fn(link: MemLink) -> list[np.ndarray]:
        out = []
        for op, dt in OP_DTYPES:
            buf = make_input(1, link.rank, count, dt, op)
            algo.all_reduce(link, buf, op, **kw)
            out.append(buf)
        return out

    results = run(size, fn)
    for i, (op, dt) in enumerate(OP_DTYPES):
        want = oracle(op, [make_input(1, r, count, dt, op) for r in range(size)])
        per_rank = [res[i] for res in results]
        assert_bitwise_same(per_rank, f"{op.value} {dt}")
        assert_equal(per_rank[0], want, f"{op.value} {dt}")


@pytest.mark.parametrize("variant", variants("all_reduce"))
@pytest.mark.parametrize("size", SIZES_WITH_9)
def test_all_reduce_counts(size: int, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = options("all_reduce", variant, monkeypatch)
    cases = [(c, op, dt) for c in COUNTS for op, dt in COUNT_CASES]

    def fn(link: MemLink) -> list[np.ndarray]:
        out = []
        for count, op, dt in cases:
            buf = make_input(2, link.rank, count, dt, op)
            algo.all_reduce(link, buf, op, **kw)
            out.append(buf)
        return out

    results = run(size, fn)
    for i, (count, op, dt) in enumerate(cases):
        want = oracle(op, [make_input(2, r, count, dt, op) for r in range(size)])
        per_rank = [res[i] for res in results]
        assert_bitwise_same(per_rank, f"count {count} {op.value} {dt}")
        assert_equal(per_rank[0], want, f"count {count} {op.value} {dt}")


@pytest.mark.parametrize("variant", ["recursive_doubling", "ring"])
@pytest.mark.parametrize("size", [3, 5, 6, 8])
def test_all_reduce_inexact_floats_are_bitwise_identical(size: int, variant: str) -> None:
    """Rounding depends on combine order; every rank must still end with the same bits."""
    dtypes = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(ml_dtypes.bfloat16)]
    cases = [(op, dt) for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN) for dt in dtypes]

    def data(rank: int, op: ReduceOp, dt: np.dtype) -> np.ndarray:
        rng = np.random.default_rng([3, rank])
        x = rng.normal(size=301) * 10.0 ** rng.integers(-3, 4, 301)
        if op is ReduceOp.MIN:
            x[::3] = 0.0 if rank % 2 else -0.0  # min(+0, -0) depends on operand order
        return x.astype(dt)

    def fn(link: MemLink) -> list[np.ndarray]:
        out = []
        for op, dt in cases:
            buf = data(link.rank, op, dt)
            algo.all_reduce(link, buf, op, algorithm=variant, chunk_bytes=SMALL_CHUNK)
            out.append(buf)
        return out

    results = run(size, fn)
    for i, (op, dt) in enumerate(cases):
        per_rank = [res[i] for res in results]
        assert_bitwise_same(per_rank, f"{op.value} {dt}")
        exact = [data(r, op, dt).astype(np.float64) for r in range(size)]
        want = oracle(op, exact)
        # Each combine rounds once: error <= size * eps * (sum of |terms|, or |product|).
        scale = np.sum(np.abs(exact), axis=0) if op is ReduceOp.SUM else np.abs(want)
        eps = float(ml_dtypes.finfo(dt).eps)
        err = np.abs(per_rank[0].astype(np.float64) - want)
        assert np.all(err <= 2 * size * eps * scale), f"{op.value} {dt}: max error {err.max()}"


@pytest.mark.parametrize("variant", ["recursive_doubling", "ring"])
@pytest.mark.parametrize("size", SIZES_WITH_9)
def test_all_reduce_out_of_place_matches_in_place_bitwise(size: int, variant: str) -> None:
    """``send=``: the input is untouched and the result has the in-place call's exact bits."""
    cases = [(c, op, dt) for c in COUNTS for op, dt in COUNT_CASES]
    cases += [(301, ReduceOp.SUM, np.dtype(np.float32)), (301, ReduceOp.MIN, np.dtype(np.float64))]

    def data(seed: int, rank: int, count: int, op: ReduceOp, dt: np.dtype) -> np.ndarray:
        if dt.kind == "f":  # inexact sums: rounding depends on the operand order
            x = np.random.default_rng([seed, rank]).normal(size=count) * 1e3
            if op is ReduceOp.MIN:
                x[::3] = 0.0 if rank % 2 else -0.0
            return x.astype(dt)
        return make_input(seed, rank, count, dt, op)

    def fn(link: MemLink) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for i, (count, op, dt) in enumerate(cases):
            x = data(i, link.rank, count, op, dt)
            keep = x.copy()
            res = np.full(count, 7, dt)  # stale contents must not matter
            algo.all_reduce(link, res, op, send=x, algorithm=variant, chunk_bytes=SMALL_CHUNK)
            assert np.array_equal(x.view(np.uint8), keep.view(np.uint8)), "send was modified"
            ref = keep.copy()
            algo.all_reduce(link, ref, op, algorithm=variant, chunk_bytes=SMALL_CHUNK)
            out.append((res, ref))
        return out

    results = run(size, fn)
    for i, (count, op, dt) in enumerate(cases):
        got = [res[i][0] for res in results]
        assert_bitwise_same(got, f"count {count} {op.value} {dt}")
        assert got[0].tobytes() == results[0][i][1].tobytes(), f"count {count} {op.value} {dt}"


def test_all_reduce_out_of_place_edge_cases() -> None:
    def fn(link: MemLink) -> list[list[float]]:
        x = np.arange(4.0) + link.rank
        same = x.copy()
        algo.all_reduce(link, same, "sum", send=same)  # send is buf: in place
        overlap = np.arange(5.0) + link.rank
        algo.all_reduce(link, overlap[1:], "sum", send=overlap[:4])  # read from a copy
        return [same.tolist(), overlap.tolist()]

    got = run(2, fn)
    assert got[0][0] == [1.0, 3.0, 5.0, 7.0]
    assert got[0][1] == [0.0, 1.0, 3.0, 5.0, 7.0]
    out = np.zeros(2)
    algo.all_reduce(make_memlinks(1)[0], out, "sum", send=np.ones(2))  # a world of one: a copy
    assert out.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("variant", variants("reduce_scatter"))
@pytest.mark.parametrize("size", SIZES)
def test_reduce_scatter_ops_dtypes(
    size: int, variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kw = options("reduce_scatter", variant, monkeypatch)
    n = 5

    def fn(link: MemLink) -> list[tuple[np.ndarray, bool]]:
        out = []
        for op, dt in OP_DTYPES:
            send = make_input(4, link.rank, n * size, dt, op)
            before = send.copy()
            recv = np.empty(n, dt)
            algo.reduce_scatter(link, send, recv, op, **kw)
            out.append((recv, send.tobytes() == before.tobytes()))
        return out

    results = run(size, fn)
    for i, (op, dt) in enumerate(OP_DTYPES):
        full = oracle(op, [make_input(4, r, n * size, dt, op) for r in range(size)])
        for r in range(size):
            recv, untouched = results[r][i]
            assert untouched, f"rank {r}: reduce_scatter modified send"
            assert_equal(recv, full[r * n : (r + 1) * n], f"rank {r} {op.value} {dt}")


@pytest.mark.parametrize("variant", variants("reduce_scatter"))
@pytest.mark.parametrize("size", SIZES_WITH_9)
def test_reduce_scatter_counts(size: int, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = options("reduce_scatter", variant, monkeypatch)
    cases = [(c, op, dt) for c in COUNTS for op, dt in COUNT_CASES]

    def fn(link: MemLink) -> list[np.ndarray]:
        out = []
        for n, op, dt in cases:
            recv = np.empty(n, dt)
            algo.reduce_scatter(link, make_input(5, link.rank, n * size, dt, op), recv, op, **kw)
            out.append(recv)
        return out

    results = run(size, fn)
    for i, (n, op, dt) in enumerate(cases):
        full = oracle(op, [make_input(5, r, n * size, dt, op) for r in range(size)])
        for r in range(size):
            assert_equal(results[r][i], full[r * n : (r + 1) * n], f"rank {r} n {n} {op.value}")


@pytest.mark.parametrize("variant", variants("reduce"))
@pytest.mark.parametrize("size", SIZES)
def test_reduce_ops_dtypes(size: int, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = options("reduce", variant, monkeypatch)
    count = 11

    def fn(link: MemLink) -> list[np.ndarray]:
        out = []
        for i, (op, dt) in enumerate(OP_DTYPES):
            buf = make_input(6, link.rank, count, dt, op)
            algo.reduce(link, buf, i % size, op, **kw)
            out.append(buf)
        return out

    results = run(size, fn)
    for i, (op, dt) in enumerate(OP_DTYPES):
        want = oracle(op, [make_input(6, r, count, dt, op) for r in range(size)])
        assert_equal(results[i % size][i], want, f"root {i % size} {op.value} {dt}")


@pytest.mark.parametrize("variant", variants("reduce"))
@pytest.mark.parametrize("size", SIZES_WITH_9)
def test_reduce_counts_every_root(size: int, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = options("reduce", variant, monkeypatch)
    op, dt = ReduceOp.SUM, np.dtype(np.float32)
    cases = [(c, root) for c in COUNTS for root in roots(size)]

    def fn(link: MemLink) -> list[np.ndarray]:
        out = []
        for count, root in cases:
            buf = make_input(7, link.rank, count, dt, op)
            algo.reduce(link, buf, root, op, **kw)
            out.append(buf)
        return out

    results = run(size, fn)
    for i, (count, root) in enumerate(cases):
        want = oracle(op, [make_input(7, r, count, dt, op) for r in range(size)])
        assert_equal(results[root][i], want, f"count {count} root {root}")


# -- data movement ------------------------------------------------------------------------


def move_input(seed: int, rank: int, count: int, dtype: np.dtype) -> np.ndarray:
    return make_input(
        seed, rank, count, dtype, ReduceOp.BXOR if dtype.kind in "biu" else ReduceOp.SUM
    )


MOVE_CASES = [(c, dt) for c in COUNTS for dt in MOVE_DTYPES]
MOVE_CASES += [(7, dt) for dt in DTYPES if dt not in MOVE_DTYPES]


@pytest.mark.parametrize("variant", variants("all_gather"))
@pytest.mark.parametrize("size", SIZES_WITH_9)
def test_all_gather(size: int, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = options("all_gather", variant, monkeypatch)

    def fn(link: MemLink) -> list[np.ndarray]:
        out = []
        for n, dt in MOVE_CASES:
            recv = np.empty(n * size, dt)
            algo.all_gather(link, move_input(8, link.rank, n, dt), recv, **kw)
            out.append(recv)
        return out

    results = run(size, fn)
    for i, (n, dt) in enumerate(MOVE_CASES):
        want = np.concatenate([move_input(8, r, n, dt) for r in range(size)])
        for r in range(size):
            assert_equal(results[r][i], want, f"rank {r} n {n} {dt}")


@pytest.mark.parametrize("variant", variants("all_to_all"))
@pytest.mark.parametrize("size", SIZES_WITH_9)
def test_all_to_all(size: int, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = options("all_to_all", variant, monkeypatch)

    def fn(link: MemLink) -> list[np.ndarray]:
        out = []
        for n, dt in MOVE_CASES:
            recv = np.empty(n * size, dt)
            algo.all_to_all(link, move_input(9, link.rank, n * size, dt), recv, **kw)
            out.append(recv)
        return out

    results = run(size, fn)
    for i, (n, dt) in enumerate(MOVE_CASES):
        sends = [move_input(9, r, n * size, dt) for r in range(size)]
        for r in range(size):
            want = np.concatenate([sends[j][r * n : (r + 1) * n] for j in range(size)])
            assert_equal(results[r][i], want.astype(dt), f"rank {r} n {n} {dt}")


@pytest.mark.parametrize("variant", variants("broadcast"))
@pytest.mark.parametrize("size", SIZES_WITH_9)
def test_broadcast_every_root(size: int, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = options("broadcast", variant, monkeypatch)
    cases = [(n, dt, root) for n, dt in MOVE_CASES for root in roots(size)]

    def fn(link: MemLink) -> list[np.ndarray]:
        out = []
        for n, dt, root in cases:
            buf = move_input(10 + root, link.rank, n, dt)
            algo.broadcast(link, buf, root, **kw)
            out.append(buf)
        return out

    results = run(size, fn)
    for i, (n, dt, root) in enumerate(cases):
        want = move_input(10 + root, root, n, dt)
        for r in range(size):
            assert_equal(results[r][i], want, f"rank {r} n {n} {dt} root {root}")


@pytest.mark.parametrize("variant", variants("gather"))
@pytest.mark.parametrize("size", SIZES_WITH_9)
def test_gather_every_root(size: int, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = options("gather", variant, monkeypatch)
    cases = [(n, dt, root) for n, dt in MOVE_CASES for root in roots(size)]

    def fn(link: MemLink) -> list[np.ndarray | None]:
        out = []
        for n, dt, root in cases:
            recv = np.empty(n * size, dt) if link.rank == root else None
            algo.gather(link, move_input(11, link.rank, n, dt), recv, root, **kw)
            out.append(recv)
        return out

    results = run(size, fn)
    for i, (n, dt, root) in enumerate(cases):
        want = np.concatenate([move_input(11, r, n, dt) for r in range(size)])
        got = results[root][i]
        assert got is not None
        assert_equal(got, want, f"n {n} {dt} root {root}")


@pytest.mark.parametrize("variant", variants("scatter"))
@pytest.mark.parametrize("size", SIZES_WITH_9)
def test_scatter_every_root(size: int, variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kw = options("scatter", variant, monkeypatch)
    cases = [(n, dt, root) for n, dt in MOVE_CASES for root in roots(size)]

    def fn(link: MemLink) -> list[np.ndarray]:
        out = []
        for n, dt, root in cases:
            send = move_input(12, root, n * size, dt) if link.rank == root else None
            recv = np.empty(n, dt)
            algo.scatter(link, send, recv, root, **kw)
            out.append(recv)
        return out

    results = run(size, fn)
    for i, (n, dt, root) in enumerate(cases):
        full = move_input(12, root, n * size, dt)
        for r in range(size):
            assert_equal(results[r][i], full[r * n : (r + 1) * n], f"rank {r} n {n} root {root}")


@pytest.mark.parametrize("size", SIZES_WITH_9)
def test_barrier_waits_for_every_rank(size: int) -> None:
    events: list[str] = []
    lock = threading.Lock()

    def fn(link: MemLink) -> None:
        for round_ in range(3):
            if link.rank == round_ % size:
                time.sleep(0.01)  # a late rank: nobody may leave before it arrives
            with lock:
                events.append(f"enter{round_}")
            algo.barrier(link)
            with lock:
                events.append(f"exit{round_}")

    run(size, fn)
    for round_ in range(3):
        last_enter = max(i for i, e in enumerate(events) if e == f"enter{round_}")
        first_exit = min(i for i, e in enumerate(events) if e == f"exit{round_}")
        assert last_enter < first_exit, f"round {round_}: a rank left before all entered"


# -- aliasing, scratch reuse, and property test -------------------------------------------


@pytest.mark.parametrize("variant", algo.ALGORITHMS["all_gather"])
def test_all_gather_in_place(variant: str) -> None:
    size, n = 5, 3

    def fn(link: MemLink) -> np.ndarray:
        recv = np.zeros(n * size, np.int64)
        recv[link.rank * n : (link.rank + 1) * n] = link.rank + 1
        algo.all_gather(link, recv[link.rank * n : (link.rank + 1) * n], recv, algorithm=variant)
        return recv

    for got in run(size, fn):
        assert_equal(got, np.repeat(np.arange(1, size + 1), n), "in-place all_gather")


def test_repeated_calls_reuse_scratch_correctly() -> None:
    """The per-link scratch is reused across calls of different dtypes and sizes."""

    def fn(link: MemLink) -> list[np.ndarray]:
        out = []
        for count, dt in [(50, np.float64), (3, np.int8), (200, np.complex128), (9, np.uint16)]:
            buf = np.full(count, link.rank + 1, dt)
            algo.all_reduce(link, buf, ReduceOp.SUM, algorithm="recursive_doubling")
            out.append(buf)
        return out

    for res in run(6, fn):
        assert [int(np.real(b[0])) for b in res] == [21, 21, 21, 21]


@settings(max_examples=25, deadline=None)
@given(
    size=st.integers(1, 9),
    count=st.integers(0, 40),
    case=st.sampled_from(OP_DTYPES),
    root_seed=st.integers(0, 1000),
    picks=st.lists(st.integers(0, 2), min_size=9, max_size=9),
    chunk=st.sampled_from([1, 8, 64, None]),
)
def test_property_every_collective(
    size: int,
    count: int,
    case: tuple[ReduceOp, np.dtype],
    root_seed: int,
    picks: list[int],
    chunk: int | None,
) -> None:
    op, dt = case
    root = root_seed % size
    names = {c: v[p % len(v)] for (c, v), p in zip(algo.ALGORITHMS.items(), picks, strict=True)}
    ck = {"chunk_bytes": chunk}

    def fn(link: MemLink) -> dict[str, Any]:
        r = link.rank
        x = make_input(13, r, count, dt, op)
        xs = make_input(14, r, count * size, dt, op)
        out: dict[str, Any] = {}
        buf = x.copy()
        algo.all_reduce(link, buf, op, algorithm=names["all_reduce"], **ck)
        out["all_reduce"] = buf
        buf = x.copy()
        algo.reduce(link, buf, root, op, algorithm=names["reduce"], **ck)
        out["reduce"] = buf
        out["reduce_scatter"] = np.empty(count, dt)
        algo.reduce_scatter(
            link, xs, out["reduce_scatter"], op, algorithm=names["reduce_scatter"], **ck
        )
        out["all_gather"] = np.empty(count * size, dt)
        algo.all_gather(link, x, out["all_gather"], algorithm=names["all_gather"])
        out["all_to_all"] = np.empty(count * size, dt)
        algo.all_to_all(link, xs, out["all_to_all"], algorithm=names["all_to_all"])
        buf = x.copy()
        algo.broadcast(link, buf, root, algorithm=names["broadcast"], **ck)
        out["broadcast"] = buf
        out["gather"] = np.empty(count * size, dt) if r == root else None
        algo.gather(link, x, out["gather"], root, algorithm=names["gather"])
        out["scatter"] = np.empty(count, dt)
        algo.scatter(
            link, xs if r == root else None, out["scatter"], root, algorithm=names["scatter"]
        )
        algo.barrier(link, algorithm=names["barrier"])
        return out

    res = run(size, fn)
    xs = [make_input(13, r, count, dt, op) for r in range(size)]
    xss = [make_input(14, r, count * size, dt, op) for r in range(size)]
    total = oracle(op, xs)
    assert_bitwise_same([o["all_reduce"] for o in res], "all_reduce")
    assert_equal(res[0]["all_reduce"], total, "all_reduce")
    assert_equal(res[root]["reduce"], total, "reduce")
    assert_equal(res[root]["gather"], np.concatenate(xs), "gather")
    full = oracle(op, xss)
    for r in range(size):
        blk = slice(r * count, (r + 1) * count)
        assert_equal(res[r]["reduce_scatter"], full[blk], "reduce_scatter")
        assert_equal(res[r]["all_gather"], np.concatenate(xs), "all_gather")
        a2a = np.concatenate([xss[j][blk] for j in range(size)]).astype(dt)
        assert_equal(res[r]["all_to_all"], a2a, "all_to_all")
        assert_equal(res[r]["broadcast"], xs[root], "broadcast")
        assert_equal(res[r]["scatter"], xss[root][blk], "scatter")


# -- selection ----------------------------------------------------------------------------


def test_auto_selection_follows_size_rules() -> None:
    big, small = 1 << 30, 8
    assert algo.select_algorithm("all_reduce", small, 8) == "recursive_doubling"
    assert algo.select_algorithm("all_reduce", big, 8) == "ring"
    assert algo.select_algorithm("all_gather", small, 8) == "recursive_doubling"
    assert algo.select_algorithm("all_gather", small, 6) == "bruck"
    assert algo.select_algorithm("all_gather", big, 6) == "ring"
    assert algo.select_algorithm("reduce_scatter", big, 3) == "ring"
    assert algo.select_algorithm("broadcast", small, 8) == "binomial"
    assert algo.select_algorithm("broadcast", big, 8) == "chain"
    assert algo.select_algorithm("broadcast", 8 * algo.CHUNK_BYTES - 1, 8) == "scatter_allgather"
    assert algo.select_algorithm("reduce", big, 8) == "reduce_scatter_gather"
    assert algo.select_algorithm("gather", big, 8) == "linear"
    assert algo.select_algorithm("barrier", 0, 8) == "dissemination"


def test_env_overrides_auto_and_keyword_overrides_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHCOMM_ALGO_ALL_REDUCE", "Ring")
    assert algo.select_algorithm("all_reduce", 8, 4) == "ring"
    assert algo.select_algorithm("all_reduce", 8, 4, "recursive_doubling") == "recursive_doubling"
    monkeypatch.setenv("MESHCOMM_ALGO_ALL_REDUCE", "auto")
    assert algo.select_algorithm("all_reduce", 8, 4) == "recursive_doubling"
    monkeypatch.setenv("MESHCOMM_ALGO_BROADCAST", "tree")
    with pytest.raises(InvalidArgument, match=r"MESHCOMM_ALGO_BROADCAST.*'tree'.*binomial"):
        algo.select_algorithm("broadcast", 8, 4)


def test_env_is_read_once_then_on_select_or_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    def all_reduce(link: MemLink) -> str:
        algo.all_reduce(link, np.zeros(1), "sum")
        return "ok"

    monkeypatch.delenv("MESHCOMM_ALGO_ALL_REDUCE", raising=False)
    algo.reload_environment()
    assert run(2, all_reduce) == ["ok", "ok"]
    monkeypatch.setenv("MESHCOMM_ALGO_ALL_REDUCE", "bogus")
    assert run(2, all_reduce) == ["ok", "ok"]  # read at first use: a later change is unseen
    algo.reload_environment()
    with pytest.raises(InvalidArgument, match=r"MESHCOMM_ALGO_ALL_REDUCE.*'bogus'"):
        algo.all_reduce(_lonely_link(), np.zeros(1), "sum")
    monkeypatch.setenv("MESHCOMM_ALGO_ALL_REDUCE", "ring")
    assert algo.select_algorithm("all_reduce", 8, 2) == "ring"  # re-reads, and remembers
    assert algo._choose("all_reduce", 8, 2, None) == "ring"
    monkeypatch.delenv("MESHCOMM_ALGO_ALL_REDUCE")
    algo.reload_environment()
    assert algo._choose("all_reduce", 8, 2, None) == "recursive_doubling"


def test_unknown_names_are_rejected() -> None:
    with pytest.raises(InvalidArgument, match="unknown collective"):
        algo.select_algorithm("allreduce", 8, 4)
    with pytest.raises(InvalidArgument, match="choose from auto, recursive_doubling, ring"):
        algo.select_algorithm("all_reduce", 8, 4, "rabenseifner")


# -- bad input raises before any I/O --------------------------------------------------------


def _lonely_link() -> MemLink:
    # Rank 0 of 3 with no peers running: any I/O would time out instead of raising.
    return make_memlinks(3, timeout=0.5)[0]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda lk: algo.all_reduce(lk, np.zeros(3), "avg"), InvalidArgument, "composed"),
        (lambda lk: algo.all_reduce(lk, np.zeros(3, complex), "max"), TypeError, "no order"),
        (lambda lk: algo.all_reduce(lk, np.zeros(3), "band"), TypeError, "bool or integer"),
        (lambda lk: algo.all_reduce(lk, np.zeros(3), "nope"), InvalidArgument, "unknown reduce"),
        (lambda lk: algo.all_reduce(lk, np.zeros((2, 2)), "sum"), InvalidArgument, "flat"),
        (lambda lk: algo.all_reduce(lk, np.zeros(6)[::2], "sum"), InvalidArgument, "contiguous"),
        (lambda lk: algo.all_reduce(lk, [1.0], "sum"), TypeError, "numpy array"),
        (
            lambda lk: algo.all_reduce(lk, np.zeros(3), "sum", send=np.zeros(2)),
            InvalidArgument,
            "sizes differ: 2 and 3",
        ),
        (
            lambda lk: algo.all_reduce(lk, np.zeros(3), "sum", send=np.zeros(3, np.float32)),
            TypeError,
            "float32 and float64",
        ),
        (
            lambda lk: algo.all_reduce(lk, np.zeros(3), "sum", send=np.zeros(6)[::2]),
            InvalidArgument,
            "send must be a flat C-contiguous",
        ),
        (
            lambda lk: algo.all_reduce(lk, np.zeros(3), "sum", algorithm="x"),
            InvalidArgument,
            "unknown all_reduce algorithm",
        ),
        (
            lambda lk: algo.all_reduce(lk, np.zeros(3), "sum", chunk_bytes=0),
            InvalidArgument,
            "chunk_bytes",
        ),
        (
            lambda lk: algo.all_gather(lk, np.zeros(2), np.zeros(5)),
            InvalidArgument,
            r"3 \* 2 = 6 elements, got 5",
        ),
        (
            lambda lk: algo.all_gather(lk, np.zeros(2), np.zeros(6, np.float32)),
            TypeError,
            "float64 and float32",
        ),
        (
            lambda lk: algo.reduce_scatter(lk, np.zeros(7), np.zeros(2), "sum"),
            InvalidArgument,
            "got 7",
        ),
        (lambda lk: algo.all_to_all(lk, np.zeros(4), np.zeros(4)), InvalidArgument, "size 3"),
        (lambda lk: algo.broadcast(lk, np.zeros(2), 3), InvalidArgument, r"\[0, 3\), got 3"),
        (lambda lk: algo.reduce(lk, np.zeros(2), -1, "sum"), InvalidArgument, "got -1"),
        (lambda lk: algo.gather(lk, np.zeros(2), None, 0), InvalidArgument, "recv buffer"),
        (lambda lk: algo.scatter(lk, None, np.zeros(2), 0), InvalidArgument, "send buffer"),
        (
            lambda lk: algo.broadcast(lk, np.zeros(2), 0, algorithm="ring"),
            InvalidArgument,
            "choose from",
        ),
    ],
)
def test_bad_input_raises_before_io(
    call: Callable[[MemLink], None], error: type, match: str
) -> None:
    link = _lonely_link()
    with pytest.raises(error, match=match):
        call(link)


def test_read_only_output_is_rejected() -> None:
    buf = np.zeros(3)
    buf.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        algo.all_reduce(_lonely_link(), buf, "sum")


# -- pure helpers -------------------------------------------------------------------------


@pytest.mark.parametrize("size", range(1, 18))
def test_binomial_tree_covers_every_rank_once(size: int) -> None:
    seen = [0]
    frontier = [0]
    while frontier:
        v = frontier.pop()
        kids = tree_children(v, size)
        seen += kids
        frontier += kids
    assert sorted(seen) == list(range(size))


def test_block_bounds_match_array_split() -> None:
    for count in range(0, 30):
        for parts in range(1, 10):
            sizes = [len(b) for b in np.array_split(np.arange(count), parts)]
            bounds = block_bounds(count, parts)
            assert [b - a for a, b in itertools.pairwise(bounds)] == sizes


def test_rel_pieces_split_only_at_wrap() -> None:
    assert rel_pieces(0, 5, root=0, size=5) == [(0, 5)]
    assert rel_pieces(2, 5, root=2, size=5) == [(2, 3), (3, 5)]
    assert rel_pieces(3, 5, root=2, size=5) == [(3, 5)]


# -- the in-memory link itself ------------------------------------------------------------


def test_memlink_receive_times_out_within_bound() -> None:
    links = make_memlinks(2, timeout=0.2)
    start = time.monotonic()
    with pytest.raises(CommTimeout, match="rank 0: no message from rank 1"):
        links[0].exchange([], [(1, np.empty(1))])
    assert time.monotonic() - start < 0.2 + 5


def test_memlink_closed_peer_raises_peer_error() -> None:
    links = make_memlinks(2, timeout=5)
    links[1].close()
    with pytest.raises(PeerError, match="rank 1 closed") as info:
        links[0].exchange([], [(1, np.empty(1))])
    assert info.value.rank == 1
    with pytest.raises(PeerError):
        links[0].exchange([(1, np.zeros(1))], [])


def test_memlink_size_mismatch_is_a_protocol_error() -> None:
    links = make_memlinks(2, timeout=5)
    links[1].exchange([(0, np.zeros(3, np.int32))], [])
    with pytest.raises(ProtocolError, match="12 bytes, receive buffer has 16"):
        links[0].exchange([], [(1, np.empty(2, np.int64))])


def test_memlink_copies_sends_and_keeps_pair_order() -> None:
    links = make_memlinks(2, timeout=5)
    data = np.arange(4)
    links[0].exchange([(1, data), (1, data[:2])], [])
    data[:] = -1  # the sender may reuse its buffer at once
    a, b = np.empty(4, np.int64), np.empty(2, np.int64)
    links[1].exchange([], [(0, a), (0, b)])
    assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [0, 1]


def test_memlink_rejects_bad_peer() -> None:
    with pytest.raises(InvalidArgument, match=r"peer must be in \[0, 2\), got 2"):
        make_memlinks(2, timeout=5)[0].exchange([(2, np.zeros(1))], [])


def test_run_threads_reraises_the_root_cause_fast() -> None:
    def fn(link: MemLink) -> None:
        if link.rank == 1:
            raise RuntimeError("boom on rank 1")
        algo.barrier(link)

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom on rank 1"):
        run_threads(4, fn, timeout=30)
    assert time.monotonic() - start < 10  # peers fail fast with PeerError, not after 30 s
