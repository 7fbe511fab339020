"""The tcp transport: spawned ranks, plus in-process edge cases.

Spawned ranks use the default channels (shared memory between these same-host ranks); the
tests that move data in every shape also run with ``MESHCOMM_TRANSPORT=tcp`` (sockets).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from spawned import run_spawned

from meshcomm.backends.tcp import TcpCommunicator, wire
from meshcomm.backends.tcp.transport import ANY_SOURCE, Transport, addr_key
from meshcomm.errors import CommError, CommTimeout, InvalidArgument, PeerError, ProtocolError
from meshcomm.reduction import ReduceOp
from meshcomm.store import HashStore, StoreServer, TCPStore

TIMEOUT = 10.0
EXIT_NOW = "exit now"


@pytest.fixture(params=["auto", "tcp"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Shared memory ("auto") and sockets; spawned ranks inherit the variable."""
    monkeypatch.setenv("MESHCOMM_TRANSPORT", request.param)
    return str(request.param)


# -- harness: fn(comm, store, *args) on `size` spawned ranks ---------------------------------


def _child(
    name: str, rank: int, size: int, port: int, timeout: float, out: Any, args: tuple
) -> None:
    store = TCPStore("127.0.0.1", port, timeout=30)
    comm = TcpCommunicator.create_world(rank, size, store, timeout)
    try:
        result = globals()[name](comm, store, *args)
        out.put((rank, "ok", result))
        if result == EXIT_NOW:
            out.close()
            out.join_thread()
            os._exit(0)  # no close(): the OS closes the sockets, with no goodbye
    except BaseException as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        comm.close()
        store.close()


def run_ranks(name: str, size: int, *args: Any, timeout: float = TIMEOUT) -> list[Any]:
    """Run module function ``name`` on ``size`` spawned ranks; return results in rank order."""
    with StoreServer("127.0.0.1", 0) as server:
        port = server.port
        results = run_spawned(
            _child, size, lambda r, out: (name, r, size, port, timeout, out, args), seconds=90
        )
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(results.items()) if s != "ok"]
    assert not errors, "\n".join(errors)
    return [results[r][1] for r in range(size)]


# -- rank functions --------------------------------------------------------------------------


def ring_large(comm: TcpCommunicator, store: object) -> bool:
    # Every rank sends 8 MiB right while receiving 8 MiB from the left: blocking sends of
    # this size would deadlock, the progress engine must interleave them.
    n = 8 << 20
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for step in range(3):
        send = np.full(n, (comm.rank * 7 + step) % 251, np.uint8)
        send[::4096] = np.arange(send[::4096].size, dtype=np.uint8)
        recv = np.empty(n, np.uint8)
        comm.link.exchange([(right, send)], [(left, recv)])
        expect = np.full(n, (left * 7 + step) % 251, np.uint8)
        expect[::4096] = np.arange(expect[::4096].size, dtype=np.uint8)
        if not np.array_equal(recv, expect):
            return False
    return True


def all_pairs(comm: TcpCommunicator, store: object) -> bool:
    # The first operation connects every pair at once (simultaneous connects both ways).
    me = comm.rank
    for step in range(3):
        peers = [p for p in range(comm.size) if p != me]
        sends = [(p, np.full(1000 * (me + 1) + p + step, me, np.int16)) for p in peers]
        recvs = [(p, np.empty(1000 * (p + 1) + me + step, np.int16)) for p in peers]
        comm.link.exchange(sends, recvs)
        if not all((buf == p).all() for p, buf in recvs):
            return False
    comm.barrier()
    return True


def two_communicators(comm: TcpCommunicator, store: object) -> list[int]:
    twin = comm.sub(list(range(comm.size)), own_transport=False)  # same members, its own id
    pair = comm.sub([1, 0], own_transport=False) if comm.rank in (0, 1) else None
    got: list[int] = []
    if comm.rank == 1:
        for i in range(4):
            comm.link.exchange([(0, np.array([i], np.int64))], [])
            twin.link.exchange([(0, np.array([100 + i], np.int64))], [])
        assert pair is not None
        pair.link.exchange([(1, np.array([7], np.int64))], [])  # pair rank 1 is world rank 0
    elif comm.rank == 0:
        buf = np.empty(1, np.int64)
        assert pair is not None
        pair.link.exchange([], [(0, buf)])  # sent last, received first
        got.append(int(buf[0]))
        for _ in range(4):
            twin.link.exchange([], [(1, buf)])
            got.append(int(buf[0]))
        for _ in range(4):
            comm.link.exchange([], [(1, buf)])
            got.append(int(buf[0]))
    comm.barrier()
    twin.close()
    if pair is not None:
        pair.close()
    return got


ARRAYS = [
    np.arange(6, dtype=np.float32).reshape(2, 3),
    np.array([[True, False]]),
    np.array(3.5 + 1j, np.complex128),
    np.arange(5, dtype=ml_dtypes.bfloat16),
    np.zeros((0, 4), np.int8),
    np.arange(4, dtype=">i4"),
]


def any_source(comm: TcpCommunicator, store: object) -> list[Any]:
    me = comm.rank
    if me != 0:
        comm.send(ARRAYS[me % len(ARRAYS)], dst=0, tag=4)
        comm.send(np.array([me]), dst=0, tag=5)
        comm.barrier()
        return []
    got = []
    for _ in range(comm.size - 1):
        arr, src = comm.recv(None, 4)
        want = ARRAYS[src % len(ARRAYS)]
        got.append(
            (src, arr.dtype == want.dtype, arr.shape == want.shape, arr.tobytes() == want.tobytes())
        )
    for src in reversed(range(1, comm.size)):  # specific sources, in another order
        arr, who = comm.recv(src, 5)
        got.append((who, int(arr[0])))
    comm.send(ARRAYS[3], dst=0, tag=6)  # to itself
    arr, who = comm.recv(0, 6)
    got.append((who, arr.dtype.name, arr.tolist() == ARRAYS[3].tolist()))
    comm.barrier()
    return got


def unexpected(comm: TcpCommunicator, store: object) -> list[int]:
    if comm.rank == 1:
        for tag in (3, 2, 1):
            comm.send(np.array([tag]), dst=0, tag=tag)
        for i in range(5):
            comm.send(np.array([10 + i]), dst=0, tag=9)
        big = np.arange(1 << 20, dtype=np.int64)
        comm.send(big, dst=0, tag=8)
        comm.barrier()
        return []
    if comm.rank == 0:
        comm.barrier()  # everything from rank 1 is buffered by now (it came before its barrier)
        got = [int(comm.recv(1, tag)[0][0]) for tag in (1, 2, 3)]
        got += [int(comm.recv(None, 9)[0][0]) for _ in range(5)]
        big, _ = comm.recv(1, 8)
        got.append(int(big.sum() == np.arange(1 << 20).sum()))
        return got
    comm.barrier()
    return []


def collectives(comm: TcpCommunicator, store: object) -> bool:
    me, size = comm.rank, comm.size
    for c in (comm, comm.sub(list(reversed(range(size))))):
        r, p = c.rank, c.size
        buf = np.arange(5, dtype=np.int64) + r
        c.all_reduce(buf, ReduceOp.SUM)
        assert buf.tolist() == [p * i + p * (p - 1) // 2 for i in range(5)]
        recv = np.empty(2 * p, np.int32)
        c.all_gather(np.array([r, -r], np.int32), recv)
        assert recv.tolist() == [v for i in range(p) for v in (i, -i)]
        out = np.empty(2, np.int64)
        c.reduce_scatter(np.arange(2 * p, dtype=np.int64), out, ReduceOp.MAX)
        assert out.tolist() == [2 * r, 2 * r + 1]
        a2a = np.empty(p, np.int64)
        c.all_to_all(np.arange(p, dtype=np.int64) + 10 * r, a2a)
        assert a2a.tolist() == [10 * i + r for i in range(p)]
        for root in range(p):
            b = np.full(3, r, np.float64)
            c.broadcast(b, root)
            assert b.tolist() == [root] * 3
            red = np.array([r + 1], np.int64)
            c.reduce(red, root, ReduceOp.PROD)
            if r == root:
                assert int(red[0]) == int(np.prod(np.arange(1, p + 1)))
            g = np.empty(p, np.int64) if r == root else None
            c.gather(np.array([r * r]), g, root)
            if g is not None:
                assert g.tolist() == [i * i for i in range(p)]
            s = np.empty(1, np.int64)
            c.scatter(np.arange(p) * 3 if r == root else None, s, root)
            assert int(s[0]) == 3 * r
        perm = np.empty(1, np.int64)
        c.permute(np.array([r]), (r + 1) % p, perm, (r - 1) % p)
        assert int(perm[0]) == (r - 1) % p
        c.barrier()
    half = comm.sub([i for i in range(size) if i % 2 == me % 2])
    v = np.array([me])
    half.all_reduce(v, ReduceOp.SUM)
    assert int(v[0]) == sum(i for i in range(size) if i % 2 == me % 2)
    comm.barrier()
    return True


def peer_closed(comm: TcpCommunicator, store: object) -> str:
    comm.barrier()  # connects the pair
    if comm.rank == 1:
        comm.close()
        return ""
    try:
        comm.recv(1, 3)
    except PeerError as exc:
        return f"{exc.rank}: {exc}"
    return "no error"


def exit_without_goodbye(comm: TcpCommunicator, store: Any) -> str:
    comm.barrier()  # every pair is connected
    if comm.rank == 2:
        return EXIT_NOW
    # The others keep working while rank 2's connections hit EOF: not an error for them...
    pair = comm.sub(
        [0, 1], own_transport=False
    )  # the world's transport sees the EOF while pair runs
    connected = np.empty(1, np.int64)
    # Until both have seen rank 2 go (about 0.1 s; up to 30 s on a loaded machine): the
    # sum makes both ranks leave the loop at the same call.
    for _ in range(300):
        connected[0] = int(2 in comm.transport.connected_peers)
        pair.all_reduce(connected, ReduceOp.SUM)
        if connected[0] == 0:
            break
        time.sleep(0.1)
    pair.barrier()
    if 2 in comm.transport.connected_peers:
        return "rank 2 still connected"
    if comm.rank == 1:
        return "fine"
    # ... until one needs rank 2.
    try:
        comm.recv(2, 0)
    except PeerError as exc:
        return f"{exc.rank}: {exc}"
    return "no error"


# -- tests over spawned ranks ------------------------------------------------------------------


def test_ring_of_large_messages(transport: str) -> None:
    assert run_ranks("ring_large", 3) == [True] * 3


def test_all_pairs_connect_at_once() -> None:
    assert run_ranks("all_pairs", 4) == [True] * 4


def test_two_communicators_interleaved() -> None:
    results = run_ranks("two_communicators", 3)
    assert results[0] == [7, 100, 101, 102, 103, 0, 1, 2, 3]


def test_recv_from_any_source_and_dtypes(transport: str) -> None:
    got = run_ranks("any_source", 4)[0]
    assert sorted(got[:3]) == [(s, True, True, True) for s in (1, 2, 3)]
    assert got[3:6] == [(3, 3), (2, 2), (1, 1)]
    assert got[6] == (0, "bfloat16", True)


def test_unexpected_messages_are_buffered_in_order(transport: str) -> None:
    assert run_ranks("unexpected", 3)[0] == [1, 2, 3, 10, 11, 12, 13, 14, 1]


def test_collectives_on_world_and_sub_communicators(transport: str) -> None:
    assert run_ranks("collectives", 3) == [True] * 3


def test_peer_that_exited_is_an_error_only_when_needed() -> None:
    results = run_ranks("exit_without_goodbye", 3)
    assert results[0].startswith("2: ") and "without a goodbye" in results[0], results[0]
    assert results[1] == "fine"


def test_peer_that_closed_is_reported() -> None:
    message = run_ranks("peer_closed", 2)[0]
    assert message.startswith("1: ") and "closed its communicator" in message


# -- in-process edge cases (real sockets, no spawned peer needed) -------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_handshake_from_strangers_is_rejected() -> None:
    store = HashStore(timeout=TIMEOUT)
    zero = Transport.start(0, 2, store, TIMEOUT)
    one = Transport.start(1, 2, store, TIMEOUT)
    got: list[Any] = []
    worker = threading.Thread(target=lambda: got.append(zero.recv_array(5, 1, ANY_SOURCE)))
    worker.start()
    host, port = zero.address.rsplit(":", 1)
    token = store.get("meshcomm/tcp/token")
    attempts = {
        "token": wire.encode_hello(wire.HELLO, rank=1, world_size=2, token=bytes(16)),
        "bad magic": b"GET / HTTP/1.1\r\n\r\n" + bytes(40),
        "world size 3": wire.encode_hello(wire.HELLO, rank=1, world_size=3, token=token),
        "is this process": wire.encode_hello(wire.HELLO, rank=0, world_size=2, token=token),
    }
    try:
        for reason, hello in attempts.items():
            with socket.create_connection((host, int(port)), timeout=TIMEOUT) as raw:
                raw.sendall(hello)
                raw.settimeout(TIMEOUT)
                answer = b""
                while chunk := raw.recv(4096):
                    answer += chunk
            dec = wire.Decoder()
            dec.receive_data(answer)
            event = dec.next_event()
            assert isinstance(event, wire.Hello) and event.kind == wire.REJECT, answer
            assert reason in event.reason
        one.send_array(5, 1, 0, np.arange(3))  # the real peer still gets through
        worker.join(TIMEOUT)
        array, source = got[0]
        assert source == 1 and array.tolist() == [0, 1, 2]
        assert len(zero.rejected) == len(attempts)
    finally:
        worker.join(TIMEOUT)
        zero.close()
        one.close()


def test_listener_of_another_job_is_refused() -> None:
    store = HashStore(timeout=TIMEOUT)
    with socket.socket() as fake:
        fake.bind(("127.0.0.1", 0))
        fake.listen(1)
        store.set(addr_key(1), f"127.0.0.1:{fake.getsockname()[1]}")

        def answer() -> None:
            conn, _ = fake.accept()
            with conn:
                conn.recv(64)
                conn.sendall(wire.encode_hello(wire.ACCEPT, rank=1, world_size=2, token=bytes(16)))
                time.sleep(1)

        server = threading.Thread(target=answer)
        server.start()
        zero = Transport.start(0, 2, store, TIMEOUT)
        try:
            with pytest.raises(ProtocolError, match=r"job token differs"):
                zero.send_array(0, 0, 1, np.arange(3))
            with pytest.raises(ProtocolError, match="already failed"):
                zero.exchange(0, -1, [], [(1, memoryview(bytearray(4)))])
        finally:
            zero.close()
            server.join(TIMEOUT)


def test_silent_peer_times_out_within_bounds() -> None:
    timeout = 2.0
    zero = Transport.start(0, 2, HashStore(timeout=timeout), timeout)
    try:
        start = time.monotonic()
        with pytest.raises(CommTimeout, match=r"no progress for 2 s.*not connected to ranks \[1\]"):
            zero.recv_array(0, 1, 1)
        assert timeout <= time.monotonic() - start <= timeout + 2
        start = time.monotonic()
        with pytest.raises(CommTimeout, match="already failed"):
            zero.send_array(0, 1, 0, np.arange(2))
        assert time.monotonic() - start < 0.5
    finally:
        zero.close()


def test_connect_to_dead_address_names_rank_and_address() -> None:
    timeout = 2.0
    store = HashStore(timeout=timeout)
    port = _free_port()
    store.set(addr_key(1), f"127.0.0.1:{port}")
    zero = Transport.start(0, 2, store, timeout)
    try:
        start = time.monotonic()
        with pytest.raises(PeerError, match=f"rank 1 at 127.0.0.1:{port}") as info:
            zero.send_array(0, 1, 1, np.arange(2))
        assert info.value.rank == 1
        assert time.monotonic() - start <= timeout + 2
    finally:
        zero.close()


def test_bad_arguments_fail_before_io() -> None:
    comm = TcpCommunicator.create_world(0, 1, HashStore(timeout=5), 5.0)
    try:
        with pytest.raises(InvalidArgument, match="tag must be an int in"):
            comm.send(np.arange(2), 0, -1)
        with pytest.raises(InvalidArgument, match=r"rank must be in \[0, 1\), got 3"):
            comm.send(np.arange(2), 3, 0)
        with pytest.raises(TypeError, match="cannot be sent"):
            comm.send(np.array([object()]), 0, 0)
        with pytest.raises(InvalidArgument, match="exchange peers"):
            comm.link.exchange([(2, np.arange(2))], [])
        with pytest.raises(InvalidArgument, match="not in"):
            comm.sub([])
        comm.send(np.arange(3), 0, 1)  # a world of one still talks to itself
        assert comm.recv(None, 1)[0].tolist() == [0, 1, 2]
        assert comm.failure is None
    finally:
        comm.close()
    with pytest.raises(CommError, match="closed"):
        comm.barrier()


def test_transport_kind_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHCOMM_TRANSPORT", "carrier-pigeon")
    with pytest.raises(InvalidArgument, match="MESHCOMM_TRANSPORT"):
        Transport.start(0, 1, HashStore(timeout=5), 5.0)
