"""ProcessGroup, Work and the progress engine in a world of one (the "self" backend).

Multi-rank behaviour is in tests/test_conformance.py; here every collective's shape
semantics, argument errors, async handles, sub-groups, fail-fast and close are checked
in-process, where a world of one makes each collective the identity.
"""

from __future__ import annotations

import doctest
import threading
from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest

import meshcomm.backends.base
import meshcomm.backends.local
import meshcomm.diagnostics.call_checks
import meshcomm.diagnostics.fingerprint
import meshcomm.group
import meshcomm.group.arrays
import meshcomm.group.issuing
import meshcomm.group.lower
import meshcomm.group.subgroups
import meshcomm.testing
import meshcomm.work
from meshcomm.backends.local import SelfCommunicator
from meshcomm.diagnostics.fingerprint import describe, encode
from meshcomm.errors import CommError, CommTimeout, InvalidArgument
from meshcomm.group import ProcessGroup, new_group
from meshcomm.group.arrays import ResultPool, ScratchPool
from meshcomm.reduction import ReduceOp
from meshcomm.testing import run_conformance
from meshcomm.work import ProgressEngine, Work

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def g() -> Iterator[ProcessGroup]:
    group = ProcessGroup(SelfCommunicator(timeout=10), name="world")
    yield group
    group.close()


# -- identity ---------------------------------------------------------------------------------
def test_identity(g: ProcessGroup) -> None:
    assert (g.rank, g.size, g.ranks, g.backend, g.name, g.store) == (
        0,
        1,
        (0,),
        "self",
        "world",
        None,
    )
    assert g.global_rank(0) == 0 and g.group_rank(0) == 0
    assert "world" in repr(g) and g.timeout == 10 and not g.closed
    with pytest.raises(InvalidArgument, match=r"group_rank must be in \[0, 1\), got 1"):
        g.global_rank(1)
    with pytest.raises(InvalidArgument, match="global rank 5 is not a member"):
        g.group_rank(5)


def test_constructor_matches_world_init_call() -> None:
    store = object()  # the group only keeps it
    group = ProcessGroup(SelfCommunicator(), store=store, name="world")  # type: ignore[arg-type]
    assert group.store is store
    group.close()


# -- all_reduce -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", meshcomm.group.arrays.SUPPORTED_DTYPES, ids=str)
def test_all_reduce_every_valid_op_is_identity(g: ProcessGroup, dtype: np.dtype) -> None:
    x = (np.arange(6) % 3).astype(dtype).reshape(2, 3)
    for op in ReduceOp:
        factor = 2 if op is ReduceOp.PREMUL_SUM else None
        try:
            meshcomm.reduction.check_op_dtype(op, dtype)
        except TypeError:
            with pytest.raises(TypeError, match=f"rank 0 in group 'world'.*{op.value}"):
                g.all_reduce(x, op, factor=factor)
            continue
        got = g.all_reduce(x, op.value.upper(), factor=factor)
        expected = x * np.asarray(2).astype(dtype) if factor else x
        assert got.dtype == dtype and got.shape == x.shape
        np.testing.assert_array_equal(got.astype(np.float64 if dtype == BF16 else dtype), expected)
        assert not np.shares_memory(got, x)


def test_all_reduce_accepts_scalars_lists_and_any_layout(g: ProcessGroup) -> None:
    assert g.all_reduce(3).shape == () and g.all_reduce(3) == 3
    np.testing.assert_array_equal(g.all_reduce([[1, 2], [3, 4]]), [[1, 2], [3, 4]])
    base = np.arange(24.0).reshape(4, 6)
    for x in (base[::2, ::3], base[::-1], np.asfortranarray(base), base.astype(">f8"), base[:0]):
        got = g.all_reduce(x, "max")
        np.testing.assert_array_equal(got, x)
        assert got.flags.c_contiguous and got.dtype.isnative


def test_all_reduce_does_not_touch_input_and_returns_fresh_arrays(g: ProcessGroup) -> None:
    x = np.arange(4.0)
    a, b = g.all_reduce(x), g.all_reduce(x)
    a[0] = 99
    assert x[0] == 0 and b[0] == 0 and not np.shares_memory(a, b)


def test_premul_sum_and_factor_errors(g: ProcessGroup) -> None:
    np.testing.assert_array_equal(g.all_reduce([1.0, 2.0], "premul_sum", factor=0.5), [0.5, 1.0])
    with pytest.raises(InvalidArgument, match="needs factor="):
        g.all_reduce([1.0], "premul_sum")
    with pytest.raises(InvalidArgument, match="only for 'premul_sum'"):
        g.all_reduce([1.0], "sum", factor=2)
    with pytest.raises(TypeError, match="complex factor"):
        g.all_reduce([1.0], "premul_sum", factor=1j)
    with pytest.raises(InvalidArgument, match="must be a number"):
        g.all_reduce([1.0], "premul_sum", factor=[1, 2])


@pytest.mark.parametrize(
    ("x", "op", "error", "match"),
    [
        (np.ones(2, complex), "min", TypeError, "complex numbers have no order"),
        (np.ones(2), "bxor", TypeError, "needs a bool or integer dtype, got float64"),
        (np.ones(2, int), "avg", TypeError, "needs a float or complex dtype"),
        (np.ones(2), "median", InvalidArgument, "unknown reduce op 'median'"),
        (np.array([None]), "sum", TypeError, "dtype object is not supported"),
        (np.array(["a"]), "sum", TypeError, "dtype <U1 is not supported"),
        (np.zeros(2, "i4,f4"), "sum", TypeError, "is not supported"),
        (np.zeros(2, "M8[s]"), "sum", TypeError, "dtype datetime64"),
    ],
)
def test_all_reduce_rejects_bad_dtypes_and_ops(
    g: ProcessGroup, x: np.ndarray, op: str, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        g.all_reduce(x, op)
    assert g.all_reduce(1.0) == 1.0  # argument errors leave the group usable


# -- all_gather / reduce_scatter / all_to_all shapes (JAX semantics at size 1) ---------------
@pytest.mark.parametrize(
    ("shape", "axis", "tiled", "out"),
    [
        ((), 0, False, (1,)),
        ((2, 3), 0, False, (1, 2, 3)),
        ((2, 3), 1, False, (2, 1, 3)),
        ((2, 3), 2, False, (2, 3, 1)),
        ((2, 3), -1, False, (2, 3, 1)),
        ((2, 3), 0, True, (2, 3)),
        ((2, 3), -1, True, (2, 3)),
        ((0, 3), 1, True, (0, 3)),
    ],
)
def test_all_gather_shapes(
    g: ProcessGroup, shape: tuple[int, ...], axis: int, tiled: bool, out: tuple[int, ...]
) -> None:
    x = np.arange(int(np.prod(shape)), dtype=np.int16).reshape(shape)
    got = g.all_gather(x, axis=axis, tiled=tiled)
    assert got.shape == out and got.flags.c_contiguous
    np.testing.assert_array_equal(got.reshape(shape), x)


def test_all_gather_bad_axis(g: ProcessGroup) -> None:
    with pytest.raises(InvalidArgument, match=r"rank 0 in group 'world'.*axis=3 is out of range"):
        g.all_gather(np.ones((2, 3)), axis=3)
    with pytest.raises(InvalidArgument, match="tiled all_gather needs at least 1 axis"):
        g.all_gather(np.float32(1), tiled=True)
    with pytest.raises(TypeError, match="axis must be an int"):
        g.all_gather(np.ones(2), axis=0.5)  # type: ignore[arg-type]


def test_reduce_scatter_shapes_and_errors(g: ProcessGroup) -> None:
    x = np.arange(6.0).reshape(1, 6)
    np.testing.assert_array_equal(g.reduce_scatter(x), x[0])
    np.testing.assert_array_equal(g.reduce_scatter(x.T, axis=1), x[0])
    assert g.reduce_scatter(x, axis=1, tiled=True).shape == (1, 6)
    assert g.reduce_scatter(x, "avg", axis=0, tiled=True).shape == (1, 6)
    with pytest.raises(InvalidArgument, match=r"must equal the group size 1, got 6 \(x.shape="):
        g.reduce_scatter(x, axis=1)
    with pytest.raises(InvalidArgument, match="at least 1 axis"):
        g.reduce_scatter(np.float64(2))


def test_all_to_all_shapes_and_errors(g: ProcessGroup) -> None:
    x = np.arange(6).reshape(1, 2, 3)
    assert g.all_to_all(x, 0, 0).shape == (1, 2, 3)
    assert g.all_to_all(x, 0, 2).shape == (2, 3, 1)
    np.testing.assert_array_equal(g.all_to_all(x, 0, 2)[..., 0], x[0])
    assert g.all_to_all(x, 1, 2, tiled=True).shape == (1, 2, 3)
    with pytest.raises(InvalidArgument, match=r"x.shape\[split_axis=1\] must equal the group size"):
        g.all_to_all(x, 1, 0)
    with pytest.raises(InvalidArgument, match="concat_axis=3 is out of range"):
        g.all_to_all(x, 0, 3)


# -- rooted collectives -----------------------------------------------------------------------
def test_broadcast_forms(g: ProcessGroup) -> None:
    x = np.arange(4, dtype=BF16)
    got = g.broadcast(x, root=0)
    assert got.dtype == BF16 and not np.shares_memory(got, x)
    with pytest.raises(InvalidArgument, match=r"root must be in \[0, 1\), got 1"):
        g.broadcast(x, root=1)
    with pytest.raises(InvalidArgument, match=r"the root \(rank 0\) must pass the array"):
        g.broadcast(None, root=0, shape=(4,), dtype=BF16)
    with pytest.raises(InvalidArgument, match=r"shape=\(5,\) disagrees with the array's \(4,\)"):
        g.broadcast(x, shape=(5,))
    with pytest.raises(InvalidArgument, match="dtype='int8' disagrees"):
        g.broadcast(x, dtype="int8")
    with pytest.raises(TypeError, match="root must be an int"):
        g.broadcast(x, root="0")  # type: ignore[arg-type]


def test_reduce_gather_scatter(g: ProcessGroup) -> None:
    x = np.array([[1, 2], [3, 4]], dtype=np.uint8)
    np.testing.assert_array_equal(g.reduce(x, 0, "bor"), x)
    np.testing.assert_array_equal(g.reduce(x.astype(np.float32), op="avg"), x)
    np.testing.assert_array_equal(g.gather(x), x[None])
    np.testing.assert_array_equal(g.scatter(x[None], 0), x)
    with pytest.raises(
        InvalidArgument, match=r"x must have shape \(group size 1, ...\), got \(2, 2\)"
    ):
        g.scatter(x, 0)
    with pytest.raises(InvalidArgument, match="must pass the array"):
        g.scatter(None, 0, shape=(2,), dtype=np.uint8)
    with pytest.raises(InvalidArgument, match=r"root must be in \[0, 1\), got -1"):
        g.gather(x, root=-1)


# -- point to point ---------------------------------------------------------------------------
def test_send_recv_and_permute(g: ProcessGroup) -> None:
    x = np.arange(6.0).reshape(2, 3)[:, ::2]
    g.send(x, 0, tag=3)
    g.send(np.int8(5), 0, tag=4)
    got, src = g.recv(None, tag=3, return_source=True)
    np.testing.assert_array_equal(got, x)
    assert src == 0 and g.recv(0, tag=4) == 5
    np.testing.assert_array_equal(g.permute(x, [(0, 0)]), x)
    np.testing.assert_array_equal(g.permute(x, ()), np.zeros_like(x))
    with pytest.raises(InvalidArgument, match="appears twice as a source"):
        g.permute(x, [(0, 0), (0, 0)])
    with pytest.raises(InvalidArgument, match=r"perm destination 1 is out of range \[0, 1\)"):
        g.permute(x, [(0, 1)])
    with pytest.raises(InvalidArgument, match="sequence of \\(src, dst\\) int pairs"):
        g.permute(x, [0])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match=r"tag must be in \[0, 2\*\*31\)"):
        g.send(x, 0, tag=-1)


def test_comm_failure_poisons_its_group_only(g: ProcessGroup) -> None:
    sub = g.split(0)
    assert sub is not None
    with pytest.raises(CommTimeout, match="tag 9 that nobody sent"):
        g.recv(0, tag=9)  # nothing can ever arrive in a world of one
    with pytest.raises(CommError, match=r"failed earlier.*first failure was in recv.*CommTimeout"):
        g.all_reduce(1.0)
    assert sub.all_reduce(1.0) == 1.0  # a group of its own: the world's failure is not its
    work_error = None
    try:
        g.barrier(async_op=True)
    except CommError as exc:
        work_error = exc
    assert work_error is not None  # refused at issue time, nothing queued


def _every_op(g: ProcessGroup, x: np.ndarray, async_op: bool) -> dict[str, object]:
    """Every collective that reads ``x``, at a world of one, plus a send to self."""
    out = {
        "all_reduce": g.all_reduce(x, async_op=async_op),
        "all_gather": g.all_gather(x, async_op=async_op),
        "reduce_scatter": g.reduce_scatter(x, async_op=async_op),
        "all_to_all": g.all_to_all(x, async_op=async_op),
        "gather": g.gather(x, async_op=async_op),
        "scatter": g.scatter(x, async_op=async_op),
        "permute": g.permute(x, [(0, 0)], async_op=async_op),
        "reduce": g.reduce(x, async_op=async_op),
        "broadcast": g.broadcast(x, async_op=async_op),
    }
    g.send(x, dst=0, tag=3, async_op=async_op)
    out["recv"] = g.recv(0, tag=3, async_op=async_op)
    return out


def test_async_calls_snapshot_inputs_and_sync_calls_return_fresh_arrays(g: ProcessGroup) -> None:
    x = np.arange(6.0).reshape(1, 6)  # a leading axis of the group size: every op takes it
    expected = x.copy()
    gate = threading.Event()
    g._engine.submit(lambda: gate.wait(10), "blocker", async_op=True)  # hold the queue
    works = _every_op(g, x, async_op=True)
    x[...] = -1  # issued but not run yet: the results must not see this
    gate.set()
    for name, work in works.items():
        got = work.wait(timeout=10)  # type: ignore[attr-defined]
        np.testing.assert_array_equal(np.ravel(got), expected.ravel(), err_msg=name)
    x[...] = expected
    for name, got in _every_op(g, x, async_op=False).items():
        np.testing.assert_array_equal(np.ravel(got), expected.ravel(), err_msg=name)
        assert not np.shares_memory(got, x), name
    np.testing.assert_array_equal(x, expected)


def test_queued_ops_after_a_failure_fail_fast() -> None:
    group = ProcessGroup(SelfCommunicator(timeout=10))
    gate = threading.Event()
    group._engine.submit(lambda: gate.wait(10), "blocker", async_op=True)  # queue, don't run
    works = [group.recv(0, tag=1, async_op=True)] + [
        group.all_reduce(np.ones(2), async_op=True) for _ in range(3)
    ]
    gate.set()
    assert isinstance(_wait_exc(works[0]), CommTimeout)
    for work in works[1:]:
        with pytest.raises(CommError, match="failed earlier"):
            work.wait(timeout=10)
    group.close()


def _wait_exc(work: Work[object]) -> BaseException | None:
    try:
        work.wait(timeout=10)
    except BaseException as exc:
        return exc
    return None


# -- async ------------------------------------------------------------------------------------
def test_async_returns_work_and_snapshots_input(g: ProcessGroup) -> None:
    x = np.arange(3.0)
    works = [g.all_reduce(x, async_op=True), g.all_gather(x, async_op=True)]
    x[:] = -1
    np.testing.assert_array_equal(works[0].wait(timeout=10), [0, 1, 2])
    np.testing.assert_array_equal(works[1].wait(), [[0, 1, 2]])
    assert works[0].is_completed() and works[0].exception() is None
    fut = g.barrier(async_op=True).get_future()
    assert fut.result(timeout=10) is None and not fut.cancel()
    assert "completed" in repr(works[0])


def test_thousand_async_ops_complete_in_issue_order(g: ProcessGroup) -> None:
    order: list[int] = []
    works = []
    for i in range(1000):
        work = g.all_reduce(np.array([i]), async_op=True)
        work.get_future().add_done_callback(lambda _f, i=i: order.append(i))
        works.append(work)
    assert [int(w.wait(timeout=30)[0]) for w in works] == list(range(1000))
    sync = g.all_reduce(np.array([7]))  # queued behind anything still pending
    assert sync[0] == 7 and order == list(range(1000))


def test_sync_call_from_a_future_callback_is_refused(g: ProcessGroup) -> None:
    errors: list[BaseException] = []

    def callback(_fut: object) -> None:
        try:
            g.barrier()
        except CommError as exc:
            errors.append(exc)

    gate = threading.Event()
    g._engine.submit(lambda: gate.wait(10), "blocker", async_op=True)  # hold the queue
    work = g.barrier(async_op=True)
    work.get_future().add_done_callback(callback)  # so it runs on the progress thread
    gate.set()
    work.wait(timeout=10)
    g.barrier()
    assert len(errors) == 1 and "would wait on itself" in str(errors[0])


def test_engine_wait_timeout_and_order() -> None:
    engine = ProgressEngine("rank 0 in world 'test'")
    gate = threading.Event()
    blocker = engine.submit(lambda: gate.wait(10), "blocker", async_op=True)
    later = engine.submit(lambda: "later", "later", async_op=True)
    with pytest.raises(CommTimeout, match=r"later: not completed within 0\.05 s"):
        later.wait(timeout=0.05)
    assert not later.is_completed() and later.exception() is None
    gate.set()
    assert blocker.wait(timeout=10) is True and later.wait(timeout=10) == "later"
    engine.close()
    with pytest.raises(CommError, match="closed"):
        engine.submit(lambda: None, "after close", async_op=False)


def test_engine_close_runs_queued_operations() -> None:
    engine = ProgressEngine("rank 0 in world 'test'")
    gate = threading.Event()
    engine.submit(lambda: gate.wait(10), "blocker", async_op=True)
    queued = engine.submit(lambda: 42, "queued", async_op=True)
    threading.Timer(0.05, gate.set).start()
    engine.close(timeout=10)
    assert queued.wait(timeout=1) == 42


def test_work_from_threads(g: ProcessGroup) -> None:
    results: list[np.ndarray] = []

    def worker() -> None:
        for _ in range(50):
            results.append(g.all_reduce(np.ones(3), async_op=bool(len(results) % 2)))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    values = [r.wait(10) if isinstance(r, Work) else r for r in results]
    assert len(values) == 200 and all((v == 1).all() for v in values)


# -- groups -----------------------------------------------------------------------------------
def test_split_and_new_group(g: ProcessGroup) -> None:
    sub = g.split(color=3, key=-1)
    assert sub is not None and sub.ranks == (0,) and sub.name == "world/split1:3"
    assert g.split(None) is None
    assert sub.split(0) is not None
    half = g.new_group([0])
    assert half is not None and half.name == "world/group3" and half.backend == "self"
    assert new_group(None, group=g) is not None
    with pytest.raises(InvalidArgument, match=r"ranks \[4\] are not members"):
        g.new_group([0, 4])
    with pytest.raises(InvalidArgument, match="duplicate ranks"):
        g.new_group([0, 0])
    with pytest.raises(InvalidArgument, match="at least one rank"):
        g.new_group([])
    with pytest.raises(TypeError, match="color must be an int"):
        g.split("red")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="must fit in int64"):
        g.split(2**70)


def test_close_semantics() -> None:
    world = ProcessGroup(SelfCommunicator(timeout=10))
    sub = world.split(0)
    assert sub is not None
    sub.close()
    sub.close()
    with pytest.raises(CommError, match="the group was closed"):
        sub.all_reduce(1.0)
    assert world.all_reduce(2.0) == 2.0  # closing a sub-group leaves the world alone
    other = world.split(0)
    assert other is not None
    with world:
        pass
    assert world.closed
    with pytest.raises(CommError, match="the group was closed"):
        world.barrier()
    assert other.closed  # closing a group closes the groups made from it
    with pytest.raises(CommError, match=r"group 'world/split2:0'.*the group was closed"):
        other.barrier()
    other.close()  # idempotent


# -- debug fingerprints -----------------------------------------------------------------------
@pytest.mark.parametrize("var", ["MESHCOMM_DEBUG", "TORCH_DISTRIBUTED_DEBUG"])
def test_debug_env_read_at_creation(monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    monkeypatch.setenv(var, "detail")
    group = ProcessGroup(SelfCommunicator(timeout=10))
    monkeypatch.delenv(var)
    assert group.debug and ProcessGroup(SelfCommunicator()).debug is False
    sub = group.split(0)
    assert sub is not None and sub.debug  # inherited
    assert run_conformance(group, quick=True) == []
    assert group.seq > 100
    group.close()


def test_fingerprint_describe() -> None:
    row = encode("reduce_scatter", 7, dtype=BF16, shape=(1, 2, 3, 4, 5, 6, 7), reduce=ReduceOp.MAX,
                 axis=1, tiled=True)  # fmt: skip
    text = describe(row)
    assert text.startswith("reduce_scatter(seq=7, dtype=bfloat16, shape=(1, 2, 3, 4, 5, 6, ...)")
    assert "op=max" in text and "axis=1" in text and "tiled=True" in text
    assert (
        describe(encode("broadcast", 1, shape=(3,), root=2))
        == "broadcast(seq=1, shape=(3,), root=2)"
    )
    assert not np.array_equal(encode("permute", 1, args=((0, 1),)), encode("permute", 1, args=()))
    gpu, host = encode("all_reduce", 2, on_device=True), encode("all_reduce", 2, on_device=False)
    assert not np.array_equal(gpu, host)
    assert describe(gpu) == "all_reduce(seq=2, on a GPU)"
    assert describe(host) == "all_reduce(seq=2, on the host)"


# -- memory -----------------------------------------------------------------------------------
def test_scratch_pool_reuses_buffers() -> None:
    pool = ScratchPool(max_bytes=1 << 20)
    base, _ = pool.take(np.dtype(np.float64), (100,))
    pool.give(base)
    again, view2 = pool.take(np.dtype(np.int32), (3, 5))
    assert again is base and view2.shape == (3, 5) and view2.flags.c_contiguous
    big, _ = pool.take(np.dtype(np.uint8), (2 << 20,))
    pool.give(big)  # over max_bytes: dropped, not kept
    assert pool.take(np.dtype(np.uint8), (2 << 20,))[0] is not big


class _OutOfPlaceSelf(SelfCommunicator):
    """A world of one that also offers ``all_reduce_out`` (as backends may, see _lower)."""

    calls = 0

    def all_reduce_out(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
        self.calls += 1
        np.copyto(recv, send)


def test_all_reduce_reads_the_input_in_place_only_when_safe() -> None:
    comm = _OutOfPlaceSelf(timeout=10)
    g = ProcessGroup(comm, name="world")
    x = np.arange(6.0).reshape(2, 3)
    got = g.all_reduce(x, "avg")
    assert comm.calls == 1 and not np.shares_memory(got, x)
    np.testing.assert_array_equal(got, x)
    # Async: the input is copied into the result at issue (so x may change at once) and
    # reduced there in place (the plan's in-place runner): all_reduce_out is not called.
    work = g.all_reduce(x, async_op=True)
    x[...] = -1
    np.testing.assert_array_equal(work.wait(timeout=10), np.arange(6.0).reshape(2, 3))
    # A strided input is copied into the result the same way.
    np.testing.assert_array_equal(g.all_reduce(x[:, ::2]), x[:, ::2])
    assert comm.calls == 1
    # A byte-swapped input: the plan's runner reads a native copy (out of place).
    np.testing.assert_array_equal(g.all_reduce(x.astype(">f8")), x)
    assert comm.calls == 2
    # A scaled input is copied into the result first (premul_sum: the lowered route).
    np.testing.assert_array_equal(g.all_reduce(x, "premul_sum", factor=2.0), x * 2)
    assert comm.calls == 2
    g.close()


class _FailingOutOfPlaceSelf(_OutOfPlaceSelf):
    """Fails its third ``all_reduce_out`` as a broken peer would."""

    def all_reduce_out(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
        super().all_reduce_out(send, recv, op)
        if self.calls == 3:
            raise CommTimeout("peer went away")


def test_all_reduce_plans_match_the_lowered_route() -> None:
    comm = _OutOfPlaceSelf(timeout=10)
    g = ProcessGroup(comm, name="world")
    for x in (np.arange(6, dtype=np.int32).reshape(2, 3), np.float32(2.5), np.zeros((0, 4))):
        for _ in range(3):  # the first call makes the plan, the others find it
            got = g.all_reduce(x, "max")
            assert got.shape == np.shape(x) and got.dtype == np.asarray(x).dtype
            assert not np.shares_memory(got, x)
            np.testing.assert_array_equal(got, x)
    assert comm.calls == 9 and g.seq == 9
    # Issue order holds: behind queued work a synchronous call waits its turn.
    x = np.ones(4)
    gate, order = threading.Event(), []
    g._engine.submit(lambda: (gate.wait(10), order.append("blocker")), "blocker", async_op=True)
    caller = threading.Thread(target=lambda: order.append(float(g.all_reduce(x).sum())))
    caller.start()
    caller.join(0.2)
    assert caller.is_alive() and not order
    gate.set()
    caller.join(10)
    assert order == ["blocker", 4.0]
    g.close()
    with pytest.raises(CommError, match="closed"):
        g.all_reduce(x)


def test_a_failing_plan_poisons_the_group() -> None:
    g = ProcessGroup(_FailingOutOfPlaceSelf(timeout=10), name="world")
    x = np.ones(3, np.float32)
    g.all_reduce(x)
    g.all_reduce(x)  # its plan, found
    with pytest.raises(CommTimeout, match="peer went away"):
        g.all_reduce(x)
    with pytest.raises(CommError, match=r"failed earlier.*all_reduce \(op #3\)"):
        g.all_reduce(x)
    g.close()


def test_debug_mode_checks_every_planned_call(monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[str] = []
    real = meshcomm.diagnostics.fingerprint.check
    monkeypatch.setattr(
        meshcomm.diagnostics.fingerprint, "check", lambda *a: (checked.append(a[-1]), real(*a))
    )
    comm = _CountingSelf(timeout=10)
    g = ProcessGroup(comm, name="world", debug=True)
    for _ in range(3):
        np.testing.assert_array_equal(g.all_reduce(np.ones(2)), np.ones(2))
        g.all_gather(np.ones(2), tiled=True)
        g.reduce_scatter(np.ones(2), tiled=True)
        g.all_to_all(np.ones(2), tiled=True)
        g.broadcast(np.ones(2), 0)
    assert len(checked) == 15 and g.seq == 15
    assert comm.scatters == comm.exchanges == comm.broadcasts == 3  # the plans' runners
    g.close()


class _CountingSelf(SelfCommunicator):
    """A world of one that counts all_gather / reduce_scatter / all_to_all / broadcast_out
    calls."""

    gathers = scatters = exchanges = broadcasts = 0

    def all_gather(self, send: np.ndarray, recv: np.ndarray) -> None:
        self.gathers += 1
        super().all_gather(send, recv)

    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
        self.scatters += 1
        super().reduce_scatter(send, recv, op)

    def all_to_all(self, send: np.ndarray, recv: np.ndarray) -> None:
        self.exchanges += 1
        super().all_to_all(send, recv)

    def broadcast_out(self, send: np.ndarray | None, recv: np.ndarray, root: int) -> None:
        self.broadcasts += 1
        if send is not None:  # this rank is the root (the only rank)
            np.copyto(recv, send)


def test_gather_scatter_and_all_to_all_plans_match_the_lowered_route() -> None:
    comm = _CountingSelf(timeout=10)
    g = ProcessGroup(comm, name="world")
    for x in (np.arange(6, dtype=np.int32).reshape(2, 3), np.float32(2.5), np.zeros((0, 4))):
        for _ in range(3):  # the first call makes the plan, the others find it
            got = g.all_gather(x)
            assert got.shape == (1, *np.shape(x)) and not np.shares_memory(got, x)
            np.testing.assert_array_equal(got[0], x)
            if np.ndim(x):
                got = g.all_gather(x, tiled=True)
                assert got.shape == np.shape(x) and not np.shares_memory(got, x)
                np.testing.assert_array_equal(got, x)
                got = g.reduce_scatter(x, "max", tiled=True)
                assert got.shape == np.shape(x) and not np.shares_memory(got, x)
                np.testing.assert_array_equal(got, x)
                got = g.all_to_all(x, 0, 0, tiled=True)
                assert got.shape == np.shape(x) and not np.shares_memory(got, x)
                np.testing.assert_array_equal(got, x)
    assert comm.gathers == 15 and comm.scatters == 6 and comm.exchanges == 6 and g.seq == 27
    assert g.all_to_all(np.ones((2, 1)), 1, 0).shape == (1, 2)  # other axes: lowered
    # What the plans leave to the lowering: other axes, async; errors come from either.
    x = np.arange(6.0).reshape(3, 2)
    assert g.all_gather(x, axis=1).shape == (3, 1, 2)
    np.testing.assert_array_equal(g.all_gather(x, tiled=True, async_op=True).wait(10), x)
    with pytest.raises(InvalidArgument, match="tiled all_gather needs at least 1 axis"):
        g.all_gather(np.float64(1.0), tiled=True)
    with pytest.raises(InvalidArgument):
        g.reduce_scatter(x, "max")  # not tiled: axis 0 must equal the size (1)
    g.close()
    with pytest.raises(CommError, match="closed"):
        g.all_gather(x, tiled=True)


def test_broadcast_plans_match_the_lowered_route() -> None:
    comm = _CountingSelf(timeout=10)
    g = ProcessGroup(comm, name="world")
    for x in (np.arange(6, dtype=np.int32).reshape(2, 3), np.float32(2.5), np.zeros((0, 4))):
        for _ in range(3):  # the first call makes the plan, the others find it
            got = g.broadcast(x, 0)
            assert got.shape == np.shape(x) and got.dtype == np.asarray(x).dtype
            assert not np.shares_memory(got, x)
            np.testing.assert_array_equal(got, x)
    assert comm.broadcasts == 9 and g.seq == 9
    # What the plans leave to the lowering: a root spelled otherwise, shape and dtype
    # given, async, strided inputs; errors come from either.
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(g.broadcast(x, np.int64(0)), x)
    np.testing.assert_array_equal(g.broadcast(x, 0, shape=(2, 3), dtype=np.float64), x)
    np.testing.assert_array_equal(g.broadcast(x[:, ::2], 0), x[:, ::2])
    work = g.broadcast(x, 0, async_op=True)
    x[...] = -1  # async snapshots the input when issued
    np.testing.assert_array_equal(work.wait(10), np.arange(6.0).reshape(2, 3))
    with pytest.raises(InvalidArgument, match="root must be in"):
        g.broadcast(x, 1)
    with pytest.raises(InvalidArgument, match="must pass the array"):
        g.broadcast(None, 0, shape=(2,), dtype=np.float64)
    assert g.seq == 13
    g.close()
    with pytest.raises(CommError, match="closed"):
        g.broadcast(x, 0)


def test_result_pool_recycles_only_dropped_results() -> None:
    pool = ResultPool(max_bytes=64 << 20)
    dt = np.dtype(np.float32)
    n = ResultPool.MIN_BYTES  # elements: 4 * MIN_BYTES bytes, pooled
    a = pool.take(dt, n)
    b = pool.take(dt, n)
    assert not np.shares_memory(a, b)
    view = a[10:20]  # a view keeps a's buffer alive ...
    address = a.ctypes.data
    del a
    c = pool.take(dt, n)
    assert not np.shares_memory(c, view) and not np.shares_memory(c, b)
    mv = memoryview(c)  # ... and so does an exported buffer
    del view, c
    d = pool.take(np.dtype(np.int64), n // 2)  # a's buffer again, as another dtype
    assert d.dtype == np.int64 and d.ctypes.data == address
    del mv
    assert not np.shares_memory(pool.take(dt, n), b)  # b is alive: never handed out again
    small = pool.take(dt, 4)
    assert small.base is None  # small results come from numpy directly
    pool.clear()


def test_result_pool_bounds_what_it_keeps() -> None:
    pool = ResultPool(max_bytes=4 * ResultPool.MIN_BYTES)
    dt = np.dtype(np.uint8)
    kept = [pool.take(dt, 2 * ResultPool.MIN_BYTES) for _ in range(3)]
    assert len(pool._tracked) == 2 and pool._bytes == 4 * ResultPool.MIN_BYTES
    big = pool.take(dt, 8 * ResultPool.MIN_BYTES)  # over max_bytes: never tracked
    assert big.base is None and len(pool._tracked) == 2
    del kept
    for _ in range(ResultPool.MAX_BUFFERS + 3):
        pool.take(dt, ResultPool.MIN_BYTES)
    assert len(pool._tracked) <= ResultPool.MAX_BUFFERS


def test_large_results_reuse_memory_in_a_loop(g: ProcessGroup) -> None:
    x = np.ones(1 << 18, np.float32)  # 1 MiB: pooled
    y = g.all_reduce(x)
    first = y.ctypes.data  # an address: holds no reference
    y = g.all_reduce(x)  # the first result is still alive while this one is made
    assert y.ctypes.data != first
    y = g.all_reduce(x)  # ... and dropped by now: its buffer comes back
    assert y.ctypes.data == first and not np.shares_memory(y, x)
    np.testing.assert_array_equal(y, x)


def test_all_gather_axis0_result_is_the_receive_buffer(g: ProcessGroup) -> None:
    for x in (np.ones((2, 3)), np.ones((2, 3))[:, ::2]):  # its plan's route; the lowered one
        got = g.all_gather(x)
        # The receive buffer itself, or a view of it (the flat buffer): no copy after.
        assert (got.base if got.base is not None else got).size == x.size


# -- docs -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "module",
    [
        meshcomm.group,
        meshcomm.work,
        meshcomm.group.arrays,
        meshcomm.group.lower,
        meshcomm.diagnostics.fingerprint,
        meshcomm.diagnostics.call_checks,
        meshcomm.group.issuing,
        meshcomm.group.subgroups,
        meshcomm.backends.base,
        meshcomm.backends.local,
    ],
    ids=lambda m: m.__name__,
)
def test_doctests(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert result.failed == 0 and result.attempted > 0


def test_conformance_suite_in_process(g: ProcessGroup) -> None:
    assert run_conformance(g) == []
    assert meshcomm.testing.run_conformance(g, quick=True) == []
