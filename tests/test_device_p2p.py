"""Device point to point (:mod:`meshcomm.group.device_p2p`) at every world size, on numpy over a
real tcp world: the world's host communicator carries the headers and stands in for the
device one (its default payload routes, over ``permute``), as tests/test_device_lower.py
does for the collectives. NCCL refuses two ranks on one GPU, so this is where the protocol
runs between ranks; tests/test_nccl_groups.py runs it with cupy over nccl at world 1.
Also: ``recv(out=...)`` on groups without a device backend."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from meshcomm.backends.local import SelfCommunicator
from meshcomm.errors import CommError, InvalidArgument, ProtocolError
from meshcomm.group import ProcessGroup
from meshcomm.group import device_p2p as _device_p2p
from meshcomm.group.arrays import ScratchPool
from meshcomm.group.lower import Call
from meshcomm.testing import run_ranks

ARRAYS: list[Any] = [
    np.arange(6.0).reshape(2, 3),
    np.float32(2.5) * np.ones((), np.float32),  # 0-d
    np.zeros((0, 4), np.int16),  # zero-size
    np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],  # strided
    np.array([True, False, True]),
    (np.arange(4) + 1j).astype(np.complex64),
    np.arange(5).astype(ml_dtypes.bfloat16),
]


def _tagged(value: Any, rank: int) -> Any:
    return value + rank if value.dtype.kind in "iufc" else value


def _p2p(group: ProcessGroup) -> tuple[_device_p2p.DeviceP2P, Any]:
    comm = group._comm

    def call(op: str) -> Call:
        return Call(comm, ScratchPool(), f"{op}: rank {group.rank} in group 'world'")

    return _device_p2p.DeviceP2P(comm, comm, np), call


def ring_and_any_source(group: ProcessGroup) -> list[str]:
    """Every rank sends each array to the next rank (device messages, and a host message
    between them on the same tag), to itself, and to rank 0; receives check everything."""
    p2p, call = _p2p(group)
    n, me = group.size, group.rank
    nxt, prv = (me + 1) % n, (me - 1) % n
    problems: list[str] = []

    def expect(what: str, got: Any, want: Any) -> None:
        if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
            problems.append(f"rank {me}: {what}: got {got!r}, expected {want!r}")

    for k, value in enumerate(ARRAYS):
        p2p.send(call("send"), _tagged(value, me), nxt, k, False)[0]()
        group._comm.send(np.array([me, k]), nxt, k)  # a host message on the same tag
        p2p.send(call("send"), _tagged(value, me), me, 100 + k, True)[0]()
    for k, value in enumerate(ARRAYS):
        got, source = p2p.recv(call("recv"), prv, k, None, True)[0]()
        expect(f"array {k} from the previous rank", got, _tagged(value, prv))
        if source != prv:
            problems.append(f"rank {me}: array {k} came from {source}, not {prv}")
        expect(f"host message {k}", p2p.recv(call("recv"), prv, k, None, False)[0](),
               np.array([prv, k]))  # fmt: skip
        out = np.empty(value.shape, value.dtype)
        got = p2p.recv(call("recv"), me, 100 + k, out, False)[0]()
        if got is not out:
            problems.append(f"rank {me}: array {k} to itself was not received into out")
        expect(f"array {k} to itself", out, _tagged(value, me))
    # Any source: every rank sends rank 0 one array with tag 7.
    p2p.send(call("send"), np.full(3, me, np.int32), 0, 7, False)[0]()
    if me == 0:
        seen = set()
        for _ in range(n):
            got, source = p2p.recv(call("recv"), None, 7, None, True)[0]()
            expect(f"any source (from {source})", got, np.full(3, source, np.int32))
            seen.add(source)
        if seen != set(range(n)):
            problems.append(f"rank 0: any-source receives came from {sorted(seen)}")
    return problems


@pytest.mark.parametrize("size", [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_device_p2p_at_every_world_size(size: int) -> None:
    assert run_ranks(ring_and_any_source, size, timeout=120) == [[]] * size


def out_of_order(group: ProcessGroup) -> str:
    """Rank 1 sends tags 1 then 2; rank 0 receives tag 2 first."""
    p2p, call = _p2p(group)
    if group.rank == 1:
        for tag in (1, 2):
            p2p.send(call("send"), np.arange(3.0), 0, tag, False)[0]()
        return ""
    try:
        p2p.recv(call("recv"), 1, 2, None, False)[0]()
    except ProtocolError as exc:
        return str(exc)
    return "no error"


def test_device_arrays_received_out_of_order_raise() -> None:
    words = run_ranks(out_of_order, 2, timeout=60)[0]
    assert "from rank 1 are received in the order they were sent" in words
    assert "message #2, and #1 was not received yet" in words


def test_a_wrong_out_is_named_with_both_values() -> None:
    comm = SelfCommunicator()
    p2p, c = _device_p2p.DeviceP2P(comm, comm, np), Call(comm, ScratchPool(), "recv: rank 0")
    p2p.send(c, np.arange(3.0), 0, 1, False)[0]()
    with pytest.raises(
        InvalidArgument, match=r"out has shape \(2,\) and dtype float64; rank 0 sent shape \(3,\)"
    ):
        p2p.recv(c, 0, 1, np.empty(2), False)[0]()


def test_headers_cannot_be_sent_by_callers() -> None:
    g = ProcessGroup(SelfCommunicator())
    with pytest.raises(TypeError):
        g.send(np.zeros(2, _device_p2p.HEADER_DTYPE), dst=0)
    g.close()


def test_recv_into_out_without_a_device_backend() -> None:
    g = ProcessGroup(SelfCommunicator())
    buf = np.zeros((2, 2), np.float32)
    g.send(np.ones((2, 2), np.float32), dst=0, tag=3)
    assert g.recv(0, 3, out=buf) is buf and buf.sum() == 4
    g.send(np.ones(3), dst=0, tag=4)
    work = g.recv(0, 4, out=np.zeros(3), return_source=True, async_op=True)
    got, source = work.wait(timeout=10)
    assert source == 0 and got.tolist() == [1.0, 1.0, 1.0]
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    for bad, words in ((frozen, "read-only"), ([0.0], "out must be an array")):
        with pytest.raises(InvalidArgument, match=words):  # before any I/O
            g.recv(0, 6, out=bad)
    # A message of another shape is consumed, and the group fails (MPI's truncation error).
    g.send(np.ones(3), dst=0, tag=5)
    with pytest.raises(InvalidArgument, match="rank 0 sent shape"):
        g.recv(0, 5, out=np.zeros(4))
    with pytest.raises(CommError, match="failed earlier"):
        g.recv(0, 5)
    g.close()


@pytest.mark.parametrize(
    "words",
    [[1, 1, 0, 0], [0x6D73_6864_7631_0001, 1, 99, 0], [0x6D73_6864_7631_0001, 1, 0, 1, -4],
     [0x6D73_6864_7631_0001, 1, 0, 2, 3]],
    ids=["magic", "dtype index", "negative extent", "ndim"],
)  # fmt: skip
def test_a_malformed_header_is_a_protocol_error(words: list[int]) -> None:
    comm = SelfCommunicator()
    p2p, c = _device_p2p.DeviceP2P(comm, comm, np), Call(comm, ScratchPool(), "recv: rank 0")
    comm.send(np.array(words, np.int64).view(_device_p2p.HEADER_DTYPE), 0, 3)
    with pytest.raises(ProtocolError, match="a malformed device header came from rank 0"):
        p2p.recv(c, 0, 3, None, False)[0]()
