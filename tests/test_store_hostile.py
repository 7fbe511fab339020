"""Hostile input against a real store server over real sockets: it must keep serving.

Timeouts of any float value, memory pressure from many clients at once, and (in
``test_store_fuzz.py``) random frames. Each test checks that a well-behaved client is still
served afterwards.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from meshcomm.errors import StoreTimeout
from meshcomm.store import StoreServer, TCPStore, wire

HOST = "127.0.0.1"
TIMEOUT = 5.0


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with StoreServer(HOST, 0) as srv:
        yield srv


def _raw(server: StoreServer) -> socket.socket:
    """A raw connection that has done the plain (unauthenticated) handshake."""
    sock = socket.create_connection((HOST, server.port), timeout=TIMEOUT)
    sock.sendall(wire.ClientConnection().hello())
    reply = b""
    while len(reply) < wire.HELLO_SIZE:
        chunk = sock.recv(wire.HELLO_SIZE - len(reply))
        assert chunk, "the server closed the connection during the handshake"
        reply += chunk
    return sock


def _wait_until(predicate: Callable[[], bool], within: float = 3.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


@pytest.mark.parametrize(
    "seconds", [3e6, float("inf"), float("nan"), -1.0, 1e308, 2.2e6, 5e-324, -float("inf")]
)
@pytest.mark.parametrize("op", ["get", "wait", "multi_get"])
def test_any_timeout_float_leaves_the_server_serving(
    server: StoreServer, seconds: float, op: str
) -> None:
    # The 23-byte GET of issue 17 (timeout 3e6 s crashed the selector) and its relatives.
    if op == "get":
        body = wire.body_get(seconds, b"absent")
        frame = wire.request(wire.OP_GET, 1, body)
        assert len(frame) == 23
    else:
        code = wire.OP_WAIT if op == "wait" else wire.OP_MULTI_GET
        frame = wire.request(code, 1, wire.body_wait(seconds, [b"absent"]))
    hostile = _raw(server)
    try:
        hostile.sendall(frame)
        time.sleep(0.05)  # let the server park (or answer) it and go round its loop
        with TCPStore(HOST, server.port, timeout=TIMEOUT) as good:
            good.set("k", b"v")
            assert good.get("k") == b"v"
            assert good.num_keys() == 1
        if not seconds >= 1:
            # NaN and negatives mean "do not wait": the answer is TIMEOUT at once.
            hostile.settimeout(TIMEOUT)
            header = hostile.recv(wire.HEADER_SIZE, socket.MSG_WAITALL)
            _, rid, status = struct.unpack("!IIB", header)
            assert (rid, status) == (1, wire.STATUS_TIMEOUT)
        else:
            # Still parked: the key appears, the answer comes.
            with TCPStore(HOST, server.port, timeout=TIMEOUT) as good:
                good.set("absent", b"here")
            hostile.settimeout(TIMEOUT)
            header = hostile.recv(wire.HEADER_SIZE, socket.MSG_WAITALL)
            _, rid, status = struct.unpack("!IIB", header)
            assert (rid, status) == (1, wire.STATUS_OK)
    finally:
        hostile.close()
    assert _wait_until(lambda: server.num_connections == 0)
    with TCPStore(HOST, server.port, timeout=TIMEOUT) as good:
        good.set("after", b"1")


def test_thirty_day_timeout_client_works(server: StoreServer) -> None:
    store = TCPStore(HOST, server.port, timeout=timedelta(days=30))
    try:
        answers: list[bytes] = []
        waiter = threading.Thread(target=lambda: answers.append(store.get("late")))
        waiter.start()
        time.sleep(0.1)
        with TCPStore(HOST, server.port, timeout=TIMEOUT) as other:
            other.set("late", b"x")
            other.set("k", b"1")
        waiter.join(TIMEOUT)
        assert answers == [b"x"]
        store.wait(["k"], timeout=timedelta(days=3650))
        assert store.multi_get(["k", "late"]) == [b"1", b"x"]
        with pytest.raises(StoreTimeout):
            store.wait(["never"], timeout=0.05)
    finally:
        store.close()


def test_thirty_day_master_and_env_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHCOMM_TIMEOUT", "3000000")
    master = TCPStore(HOST, 0, world_size=2, is_master=True, wait_for_workers=False)
    try:
        with TCPStore(HOST, master.port) as worker:
            assert master.timeout == 3e6 and worker.timeout == 3e6
            threading.Timer(0.1, lambda: master.set("go", b"1")).start()
            assert worker.get("go") == b"1"
    finally:
        master.close()
