"""The nccl backend: what runs without a GPU here, the GPU part where a GPU and cupy are.

Without a GPU (CI): the dtype/op table against numpy's meaning of each op, the error that
names the extra to install, the unique id's bytes through a real authenticated store, the
watchdog's bookkeeping. With a GPU (a lent machine, through the device tool):

    python -m pytest tests/test_nccl.py -v

runs every collective of :class:`NcclCommunicator` at world 1 against numpy (NCCL refuses
two ranks on one GPU), the stream contract (a result used on the caller's stream with no
host synchronization), and a member that never arrives named within the timeout.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from meshcomm.backends.nccl import _lib
from meshcomm.backends.nccl._watchdog import Watchdog
from meshcomm.errors import CommTimeout
from meshcomm.reduction import ReduceOp
from meshcomm.store import TCPStore


def _gpu_skip_reason() -> str:
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install 'meshcomm[cuda12]' or 'meshcomm[cuda13]')"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "cupy sees no CUDA GPU"
        _lib.load()
    except Exception as exc:  # no driver, no device, no NCCL
        return f"no usable CUDA GPU with NCCL ({type(exc).__name__}: {exc})"
    return ""


GPU_SKIP = _gpu_skip_reason()
needs_gpu = pytest.mark.skipif(bool(GPU_SKIP), reason=GPU_SKIP or "ok")

REDUCIBLE = ["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
             "float64"]  # fmt: skip
ARITHMETIC = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX]


# == the table, without a GPU ===============================================================
@pytest.mark.parametrize("name", [*REDUCIBLE, "bfloat16"])
@pytest.mark.parametrize("op", ARITHMETIC)
def test_numeric_dtypes_reduce_with_the_four_arithmetic_ops(name: str, op: ReduceOp) -> None:
    dtype = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    code, nccl_op, per = _lib.reduction_codes(dtype, op, "all_reduce")
    assert per == 1
    assert nccl_op == {ReduceOp.SUM: 0, ReduceOp.PROD: 1, ReduceOp.MAX: 2, ReduceOp.MIN: 3}[op]
    assert code == [*REDUCIBLE, "bfloat16"].index(name)  # nccl.h numbers them in this order


@pytest.mark.parametrize(
    ("op", "ufunc"),
    [(ReduceOp.SUM, np.add), (ReduceOp.PROD, np.multiply), (ReduceOp.MIN, np.minimum),
     (ReduceOp.MAX, np.maximum), (ReduceOp.BAND, np.logical_and), (ReduceOp.BOR, np.logical_or)],
)  # fmt: skip
def test_bool_ops_become_the_uint8_op_with_numpys_meaning(op: ReduceOp, ufunc: Any) -> None:
    code, nccl_op, _ = _lib.reduction_codes(np.dtype(bool), op, "all_reduce")
    assert code == 1  # uint8
    pairs = np.array([(a, b) for a in (0, 1) for b in (0, 1)], dtype=np.uint8)
    as_nccl = (np.maximum if nccl_op == 2 else np.minimum)(pairs[:, 0], pairs[:, 1])
    assert (as_nccl.astype(bool) == ufunc(pairs[:, 0] != 0, pairs[:, 1] != 0)).all()


@pytest.mark.parametrize(("name", "part"), [("complex64", 7), ("complex128", 8)])
def test_complex_sums_are_sums_of_the_float_pairs(name: str, part: int) -> None:
    assert _lib.reduction_codes(np.dtype(name), ReduceOp.SUM, "all_reduce") == (part, 0, 2)


@pytest.mark.parametrize(
    ("name", "op"),
    [("int16", ReduceOp.SUM), ("uint16", ReduceOp.MAX), ("int32", ReduceOp.BAND),
     ("uint64", ReduceOp.BXOR), ("bool", ReduceOp.BXOR), ("complex64", ReduceOp.PROD)],
)  # fmt: skip
def test_what_nccl_lacks_is_a_type_error_saying_so(name: str, op: ReduceOp) -> None:
    with pytest.raises(
        TypeError, match=f"reduce_scatter: NCCL has no {op.value} reduction for {name}"
    ):
        _lib.reduction_codes(np.dtype(name), op, "reduce_scatter")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_without_cupy_the_error_names_the_extra_to_install() -> None:
    from meshcomm.backends.nccl import NcclCommunicator
    from meshcomm.store import HashStore

    with pytest.raises(ImportError, match=r"pip install 'meshcomm\[cuda12\]'"):
        NcclCommunicator.create_world(0, 1, HashStore(), 5.0)


def test_a_host_world_of_nccl_says_it_pairs_with_tcp() -> None:
    from meshcomm.backends import create_world_communicator
    from meshcomm.errors import InvalidArgument
    from meshcomm.store import HashStore

    with pytest.raises(InvalidArgument, match=r"only: meshcomm.init\(backend='nccl'\)"):
        create_world_communicator("nccl", 0, 2, HashStore(), 5.0)


def test_the_unique_id_crosses_an_authenticated_store_unchanged() -> None:
    unique_id = tuple((i * 37) % 256 - 128 for i in range(128))  # every byte value a char holds
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=10, secret="job secret")
    try:
        peer = TCPStore("127.0.0.1", master.port, timeout=10, secret="job secret")
        master.set("meshcomm/nccl/uid", _lib.id_to_bytes(unique_id))
        assert _lib.id_from_bytes(peer.get("meshcomm/nccl/uid")) == _lib.id_to_bytes(unique_id)
        assert _lib.id_to_bytes(_lib.id_to_bytes(unique_id)) == _lib.id_to_bytes(unique_id)
        peer.close()
    finally:
        master.close()
    with pytest.raises(ValueError, match="128 bytes, got 3"):
        _lib.id_from_bytes(b"abc")


# == the watchdog, without a GPU ============================================================
class _Event:
    """What the watchdog reads of a CUDA event: whether it completed."""

    def __init__(self) -> None:
        self.done = False


class _Owner:
    """What the watchdog calls on a communicator: its async error, and fail()."""

    def __init__(self, error: str | None = None) -> None:
        self.error = error
        self.failures: list[tuple[str, bool]] = []
        self.failed = threading.Event()

    def async_error(self) -> str | None:
        return self.error

    def fail(self, reason: str, timed_out: bool) -> None:
        self.failures.append((reason, timed_out))
        self.failed.set()


def test_the_watchdog_fails_an_operation_past_its_deadline_once() -> None:
    dog, owner = Watchdog(), _Owner()
    late, other = _Event(), _Event()
    dog.watch(owner, late, 0.05, "all_reduce over 'tp'")
    dog.watch(owner, other, 0.05, "all_gather over 'tp'")
    assert owner.failed.wait(5)
    time.sleep(0.05)
    assert owner.failures == [("all_reduce over 'tp': not completed in time", True)]
    assert dog.pending() == 0  # the owner's other operations went with it


def test_the_watchdog_drops_completed_operations_and_its_thread_ends() -> None:
    dog, owner, event = Watchdog(), _Owner(), _Event()
    dog.watch(owner, event, 60.0, "broadcast on group 'world'")
    event.done = True
    deadline = time.monotonic() + 5
    while (dog.pending() or dog._thread is not None) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dog.pending() == 0 and dog._thread is None
    assert owner.failures == []


def test_the_watchdog_drops_the_completed_prefix_and_hands_its_events_back() -> None:
    dog, owner = Watchdog(), _Owner()
    events, spare = [_Event() for _ in range(5)], []
    for event in events:
        dog.watch(owner, event, 60.0, "all_reduce over 'tp'", spare)
    for event in events[:3]:  # one stream: they complete in order
        event.done = True
    deadline = time.monotonic() + 5
    while dog.pending() != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dog.pending() == 2 and spare == events[:3] and owner.failures == []
    for event in events[3:]:
        event.done = True
    while dog.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert spare == events


def test_the_watchdog_reports_nccls_asynchronous_error_at_once() -> None:
    dog, owner = Watchdog(), _Owner(error="NCCL_ERROR_REMOTE_ERROR: remote process exited")
    dog.watch(owner, _Event(), 60.0, "psum over 'dp'")
    assert owner.failed.wait(5)
    assert owner.failures == [
        ("psum over 'dp': NCCL reported NCCL_ERROR_REMOTE_ERROR: remote process exited", False)
    ]


# == on a GPU ===============================================================================
@pytest.fixture(params=["cupy", "native"])
def binding(request: Any, monkeypatch: Any) -> str:
    """Each GPU test runs with cupy's binding and with the native one (non-blocking init)."""
    if request.param == "native":
        monkeypatch.setenv("MESHCOMM_NCCL_NATIVE", "1")
    else:
        monkeypatch.delenv("MESHCOMM_NCCL_NATIVE", raising=False)
    return str(request.param)


def _world(timeout: float = 30.0) -> Any:
    from meshcomm.backends.nccl import NcclCommunicator
    from meshcomm.store import HashStore

    return NcclCommunicator.create_world(0, 1, HashStore(), timeout)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", [*REDUCIBLE, "bool", "complex64", "bfloat16"])
def test_every_collective_at_world_one_equals_numpy(name: str, binding: str) -> None:
    import cupy as cp

    dtype = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    host = (np.arange(1, 8) % 3).astype(dtype)
    comm = _world()
    try:
        ops = [ReduceOp.SUM] if dtype.kind == "c" else [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN]
        for op in ops:
            buf = cp.asarray(host)
            comm.all_reduce(buf, op)
            np.testing.assert_array_equal(cp.asnumpy(buf), host)
            out = cp.empty_like(buf)
            comm.reduce_scatter(cp.asarray(host), out, op)
            np.testing.assert_array_equal(cp.asnumpy(out), host)
            buf = cp.asarray(host)
            comm.reduce(buf, 0, op)
            np.testing.assert_array_equal(cp.asnumpy(buf), host)
        for move in ("all_gather", "all_to_all", "gather", "scatter"):
            out = cp.zeros(host.size, dtype=dtype)
            getattr(comm, move)(cp.asarray(host), out, *(() if move.startswith("all") else (0,)))
            np.testing.assert_array_equal(cp.asnumpy(out), host)
        buf = cp.asarray(host)
        comm.broadcast(buf, 0)
        out = cp.zeros_like(buf)
        comm.permute(cp.asarray(host), 0, out, 0)
        np.testing.assert_array_equal(cp.asnumpy(out), host)
        comm.barrier()
        comm.send(cp.asarray(host.reshape(7, 1)), 0, 5)  # to itself: kept until received
        got, src = comm.recv(0, 5)
        assert src == 0 and got.shape == (7, 1) and got.dtype == dtype
        np.testing.assert_array_equal(cp.asnumpy(got).ravel(), host)
        kind = type(comm._nccl).__name__
        assert kind == ("NativeComm" if binding == "native" else "NcclCommunicator")
    finally:
        comm.close()


@needs_gpu
@pytest.mark.gpu
def test_a_result_is_ready_on_the_callers_stream_without_a_host_sync(binding: str) -> None:
    import cupy as cp

    comm = _world()
    try:
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            x = cp.full(1 << 22, 2.0, dtype=cp.float32)
            comm.all_reduce(x, ReduceOp.SUM)
            y = x * 3  # queued on the caller's stream, after the all_reduce
            total = float(y.sum())  # the only synchronization
        assert total == 6.0 * (1 << 22)
        empty = cp.zeros(0, dtype=cp.float32)
        comm.all_reduce(empty, ReduceOp.SUM)  # zero elements are fine
    finally:
        comm.close()


@needs_gpu
@pytest.mark.gpu
def test_calls_on_two_streams_run_in_the_order_they_were_made(binding: str) -> None:
    """A call runs on the caller's stream; one on another stream than the last waits for
    the last (NCCL runs a communicator's calls in one order on every rank)."""
    import cupy as cp

    comm = _world()
    try:
        first, second = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
        with first:
            slow = cp.full((2048, 2048), 1e-3, dtype=cp.float32)
            for _ in range(30):  # milliseconds of work before the first call
                slow = slow @ slow
            a = cp.ones(4, dtype=cp.float32)
            comm.all_reduce(a, ReduceOp.SUM)
            first_done = comm._last_done
        with second:
            b = cp.full(4, 2.0, dtype=cp.float32)
            comm.all_reduce(b, ReduceOp.SUM)
            second_done = comm._last_done
        assert comm._last_stream == second.ptr
        second_done.synchronize()
        assert first_done.done, "the call on the second stream ended before the first"
        with first:
            c = cp.full(4, 3.0, dtype=cp.float32)
            comm.all_reduce(c, ReduceOp.SUM)  # back on the first: waits for the second
            assert float(c.sum()) == 12.0
        assert float(a.sum()) == 4.0 and float(b.sum()) == 8.0
    finally:
        comm.close()


@needs_gpu
@pytest.mark.gpu
def test_a_member_that_never_arrives_is_named_within_the_timeout(binding: str) -> None:
    import cupy as cp

    from meshcomm.backends.nccl import NcclCommunicator
    from meshcomm.store import HashStore

    def stuck() -> int:  # cupy's blocking init leaves its thread inside NCCL for good
        return sum(t.name == "meshcomm-nccl-init" for t in threading.enumerate())

    before = stuck()
    comm = NcclCommunicator.create_world(0, 2, HashStore(), 3.0)  # rank 1 never starts
    started = time.monotonic()
    with pytest.raises(CommTimeout, match=r"ncclCommInitRank\w* .*ranks \[1\] never arrived"):
        comm.all_reduce(cp.ones(4, dtype=cp.float32), ReduceOp.SUM)
    assert time.monotonic() - started < 3.0 + 5.0
    if binding == "native":  # the non-blocking init was aborted: no new thread left in NCCL
        assert stuck() == before


@needs_gpu
@pytest.mark.gpu
def test_a_native_split_at_world_one_makes_a_working_communicator(monkeypatch: Any) -> None:
    import cupy as cp

    monkeypatch.setenv("MESHCOMM_NCCL_NATIVE", "1")
    comm = _world()
    try:
        x = cp.arange(5, dtype=cp.float32)
        comm.all_reduce(x, ReduceOp.SUM)  # makes the NCCL communicator: now it can split
        assert comm.can_split()
        child = comm.split_sub([0])
        assert child is not None and type(child._nccl).__name__ == "NativeComm"
        child.all_reduce(x, ReduceOp.MAX)
        out = cp.zeros(5, dtype=cp.float32)
        child.all_gather(x, out)
        np.testing.assert_array_equal(cp.asnumpy(x), np.arange(5, dtype=np.float32))
        np.testing.assert_array_equal(cp.asnumpy(out), np.arange(5, dtype=np.float32))
        assert comm.split_sub(None) is None  # joining none is a call all the same
        child.close()
    finally:
        comm.close()
