"""The host-aware algorithms (meshcomm.backends.algorithms.hierarchical) over in-memory links:
every host layout shape (even, uneven, interleaved ranks, one rank per host), sizes that the
hosts do not divide and 0, several dtypes and ops, all against numpy. Across real (simulated)
hosts: tests/test_hosts_hier.py."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from meshcomm.backends.algorithms import hierarchical as hier
from meshcomm.backends.memlink import MemLink, run_threads
from meshcomm.errors import InvalidArgument

# Host of each rank.
PLACEMENTS = [
    [0, 0, 1, 1],
    [0, 0, 1],
    [0, 1, 1],
    [0, 0, 1, 2],
    [0, 0, 0, 1, 1],
    [0, 1, 0, 1],  # hosts' ranks interleaved
    [0, 0, 1, 1, 2, 2, 2, 3],
    [0, 1, 2],  # one rank per host
]
SIZES = [0, 1, 2, 3, 7, 1001]
CASES = [
    (np.float64, "sum", np.add),
    (np.float32, "min", np.minimum),
    (np.int32, "max", np.maximum),
    (np.int64, "prod", np.multiply),
    (np.uint8, "bxor", np.bitwise_xor),
    (np.complex64, "sum", np.add),
    (np.bool_, "bor", np.logical_or),
]


def _inputs(p: int, n: int, dtype: type) -> list[np.ndarray]:
    return [((np.arange(n) * (r + 3)) % 5 + 1).astype(dtype) for r in range(p)]


def _all_reduce(
    link: MemLink, data: list[np.ndarray], op: str, hosts: hier.Layout, out_of_place: bool
) -> np.ndarray:
    mine = data[link.rank].copy()
    if not out_of_place:
        hier.all_reduce(link, mine, op, hosts)
        return mine
    out = np.full_like(mine, 9)
    hier.all_reduce(link, out, op, hosts, send=mine)
    assert np.array_equal(mine, data[link.rank])  # the input is left alone
    return out


def _broadcast(link: MemLink, data: list[np.ndarray], root: int, hosts: hier.Layout) -> np.ndarray:
    buf = data[link.rank].copy()
    hier.broadcast(link, buf, root, hosts)
    return buf


def _all_gather(link: MemLink, data: list[np.ndarray], hosts: hier.Layout) -> np.ndarray:
    out = np.empty(link.size * data[0].size, data[0].dtype)
    hier.all_gather(link, data[link.rank], out, hosts)
    return out


def _check_all_reduce(placement: list[int], sizes: list[int], cases: list[tuple]) -> None:
    """In and out of place, every size and (dtype, op, ufunc) case, against numpy."""
    hosts = hier.host_layout(placement)
    p = len(placement)
    for n in sizes:
        for dtype, op, ufunc in cases:
            data = _inputs(p, n, dtype)
            want = data[0]
            for d in data[1:]:
                want = ufunc(want, d).astype(dtype)
            for oop in (False, True):
                fn = functools.partial(_all_reduce, data=data, op=op, hosts=hosts, out_of_place=oop)
                for got in run_threads(p, fn):
                    assert got.dtype == dtype and np.array_equal(got, want), (n, dtype, op, oop)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=str)
def test_all_reduce_matches_numpy(placement: list[int]) -> None:
    _check_all_reduce(placement, SIZES, CASES)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=str)
def test_broadcast_and_all_gather_match_numpy(placement: list[int]) -> None:
    hosts = hier.host_layout(placement)
    p = len(placement)
    for n in SIZES:
        data = _inputs(p, n, np.float32)
        for root in range(p):
            fn = functools.partial(_broadcast, data=data, root=root, hosts=hosts)
            assert all(np.array_equal(b, data[root]) for b in run_threads(p, fn))
        fn = functools.partial(_all_gather, data=data, hosts=hosts)
        assert all(np.array_equal(g, np.concatenate(data)) for g in run_threads(p, fn))


def test_every_rank_ends_with_the_same_bytes() -> None:
    # Each element is combined on one rank and copied: bitwise equal results, even in float.
    hosts = hier.host_layout([0, 0, 1, 2, 2])
    rng = np.random.default_rng(5)
    data = [rng.standard_normal(999).astype(np.float32) for _ in range(5)]

    def run(link: object) -> bytes:
        buf = data[link.rank].copy()  # type: ignore[attr-defined]
        hier.all_reduce(link, buf, "sum", hosts)  # type: ignore[arg-type]
        return buf.tobytes()

    got = run_threads(5, run)
    assert len(set(got)) == 1
    assert np.allclose(np.frombuffer(got[0], np.float32), np.sum(data, axis=0), atol=1e-4)


def test_bad_arguments_raise_before_any_message() -> None:
    # One rank alone: a call that sent anything would wait for peers and time out.
    def bad_layout(link: object) -> str:
        with pytest.raises(InvalidArgument, match=r"hosts must hold each of the 2 ranks once"):
            hier.all_reduce(link, np.ones(4), "sum", ((0,), (0, 1)))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="bxor"):
            hier.all_reduce(link, np.ones(4), "bxor", ((0,), (1,)))  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="root"):
            hier.broadcast(link, np.ones(4), 5, ((0,), (1,)))  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match=r"recv must hold size \* len\(send\) = 2 \* 3"):
            hier.all_gather(link, np.ones(3), np.ones(5), ((0,), (1,)))  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match=r"send must hold size \* len\(recv\) = 2 \* 2"):
            hier.reduce_scatter(link, np.ones(3), np.ones(2), "sum", ((0,), (1,)))  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match=r"hosts must hold each of the 2 ranks once"):
            hier.all_gather(link, np.ones(1), np.ones(2), ((0, 1, 2),))  # type: ignore[arg-type]
        return "ok"

    assert run_threads(2, bad_layout, timeout=5)[0] == "ok"


def test_layout_helpers() -> None:
    assert hier.host_layout(["b", "a", "b"]) == ((0, 2), (1,))
    assert hier.worth_it(((0, 2), (1,)))
    assert not hier.worth_it(((0,), (1,), (2,)))  # one rank per host: flat is as good
    assert not hier.worth_it(((0, 1, 2),))  # one host: shared memory only


@pytest.mark.parametrize("piece_bytes", [1, 16, 200])
@pytest.mark.parametrize(
    "placement", [[0, 0, 1, 1], [0, 0, 1, 1, 2, 2], [0, 1, 0, 1, 2, 2]], ids=str
)
def test_pipelined_all_reduce_in_many_pieces(
    placement: list[int], piece_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hosts of equal rank counts pipeline in pieces; tiny pieces give many of them, and
    # more pieces than elements (empty ones) at the smallest sizes.
    monkeypatch.setattr(hier, "PIECE_BYTES", piece_bytes)
    _check_all_reduce(placement, [1, 5, 13, 1001], CASES[:3])


def _reduce_scatter(link: MemLink, data: list[np.ndarray], hosts: hier.Layout) -> np.ndarray:
    out = np.full(data[0].size // link.size, 7, data[0].dtype)
    hier.reduce_scatter(link, data[link.rank], out, "sum", hosts)
    return out


@pytest.mark.parametrize("placement", PLACEMENTS, ids=str)
def test_reduce_scatter_matches_numpy(placement: list[int]) -> None:
    hosts = hier.host_layout(placement)
    p = len(placement)
    for m in (0, 1, 3, 250):
        for dtype in (np.float64, np.int32):
            data = _inputs(p, p * m, dtype)
            want = np.sum(data, axis=0).astype(dtype)
            fn = functools.partial(_reduce_scatter, data=data, hosts=hosts)
            for r, got in enumerate(run_threads(p, fn)):
                assert np.array_equal(got, want[r * m : (r + 1) * m]), (m, dtype, r)
