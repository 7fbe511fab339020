"""TCPStore and StoreServer over real sockets: hostile clients, errors, timeouts, many clients.

Every malformed-client test ends with proof that the server still serves: a client that
was connected before keeps working, and a new client connects and works.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from polling import wait_until

from meshcomm.errors import InvalidArgument, StoreError, StoreTimeout
from meshcomm.store import MAX_VALUE_BYTES, StoreServer, TCPStore, wire

TIMEOUT = 5.0
HOST = "127.0.0.1"


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with StoreServer(HOST, 0) as srv:
        yield srv


def _client(server: StoreServer, timeout: float = TIMEOUT) -> TCPStore:
    return TCPStore(HOST, server.port, timeout=timeout)


def _raw(server: StoreServer) -> socket.socket:
    sock = socket.create_connection((HOST, server.port), timeout=TIMEOUT)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _closed_by_peer(sock: socket.socket, within: float = 3.0) -> bool:
    """True if the peer closes ``sock`` (EOF or reset) within ``within`` seconds."""
    sock.settimeout(within)
    deadline = time.monotonic() + within
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


HELLO = wire.ClientConnection().hello()


def _frame(op: int, rid: int, body: bytes) -> bytes:
    return wire.request(op, rid, body)


MALFORMED = {
    "http-get": b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "garbage": random.Random(1234).randbytes(4096),
    "wrong-magic": b"XXXX" + HELLO[4:] + _frame(wire.OP_PING, 1, b""),
    "huge-length-prefix": HELLO + struct.pack("!IIB", 0xFFFFFFFF, 1, wire.OP_SET),
    "length-over-opcode-bound": HELLO + struct.pack("!IIB", 64 * 1024, 1, wire.OP_GET),
    "unknown-opcode": HELLO + struct.pack("!IIB", 0, 1, 250),
    "key-length-lies": HELLO + _frame(wire.OP_SET, 1, struct.pack("!I", 999) + b"k"),
    "empty-key": HELLO + _frame(wire.OP_DELETE, 1, b""),
    "stray-bytes": HELLO + _frame(wire.OP_NUM_KEYS, 1, b"extra"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_client_is_dropped_alone(server: StoreServer, name: str) -> None:
    good = _client(server)
    good.set("before", b"1")
    bad = _raw(server)
    try:
        bad.sendall(MALFORMED[name])
        # Dropped without the server waiting for any further bytes (the huge frame's body).
        assert _closed_by_peer(bad)
    finally:
        bad.close()
    assert good.get("before") == b"1"
    fresh = _client(server)
    fresh.set("after", b"2")
    assert good.get("after") == b"2"
    good.close()
    fresh.close()
    assert wait_until(lambda: server.num_connections == 0)


@pytest.mark.parametrize(
    "payload",
    [b"", HELLO[:5], HELLO + struct.pack("!IIB", 20, 1, wire.OP_SET)[:6], HELLO + b"\0" * 12],
    ids=["connect-close", "half-hello", "truncated-header", "truncated-body"],
)
def test_truncated_then_closed_client_is_forgotten(server: StoreServer, payload: bytes) -> None:
    good = _client(server)
    bad = _raw(server)
    bad.sendall(payload)
    bad.close()
    assert wait_until(lambda: server.num_connections == 1)
    good.set("k", b"v")
    assert good.get("k") == b"v"
    good.close()


def test_port_scan_burst_does_not_disturb(server: StoreServer) -> None:
    good = _client(server)
    for _ in range(50):
        socket.create_connection((HOST, server.port), timeout=TIMEOUT).close()
    good.set("k", b"v")
    assert good.get("k") == b"v"
    assert wait_until(lambda: server.num_connections == 1)
    good.close()


def test_wrong_version_gets_an_answer_then_is_dropped(server: StoreServer) -> None:
    bad = _raw(server)
    bad.sendall(wire.MAGIC + struct.pack("!HH", wire.PROTOCOL_VERSION + 7, 0))
    answer = bad.recv(wire.HELLO_SIZE)
    magic, version, status = struct.unpack("!4sHH", answer)
    assert (magic, version, status) == (wire.MAGIC, wire.PROTOCOL_VERSION, wire.HELLO_BAD_VERSION)
    assert _closed_by_peer(bad)
    bad.close()
    good = _client(server)
    assert good.add("n", 1) == 1
    good.close()


def test_flooding_client_that_never_reads_does_not_stall_others(server: StoreServer) -> None:
    good = _client(server)
    good.set("big", b"x" * (1 << 20))
    flood = _raw(server)
    flood.sendall(HELLO)
    request = _frame(wire.OP_GET, 1, wire.body_get(1.0, b"big"))
    flood.setblocking(False)
    sent = 0
    try:
        # Ask for far more replies (GiBs) than the server would buffer, never reading one.
        for _ in range(20000):
            sent += flood.send(request * 64)
    except BlockingIOError:
        pass  # the server stopped reading us: that is the backpressure under test
    # A stalled server would make these raise StoreTimeout.
    good.set_timeout(2.0)
    assert good.get("big") == b"x" * (1 << 20)
    good.set("small", b"1")
    assert good.get("small") == b"1"
    # Memory stays bounded while the flooder reads slowly: replies are made as they drain.
    flood.settimeout(TIMEOUT)
    for _ in range(20):
        flood.recv(1 << 20)
        assert server.buffered_bytes < 16 << 20
    flood.close()
    assert wait_until(lambda: server.num_connections == 1)
    good.close()
    assert sent > 0


def test_server_not_there_names_address() -> None:
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match=re.escape(f"{HOST}:{port}")):
        TCPStore(HOST, port, timeout=timedelta(milliseconds=500))
    assert time.monotonic() - start < 0.5 + 1.0


def test_client_waits_for_a_server_that_starts_late() -> None:
    port = _free_port()
    holder: list[StoreServer] = []

    def start_later() -> None:
        time.sleep(0.3)
        holder.append(StoreServer(HOST, port).start())

    thread = threading.Thread(target=start_later)
    thread.start()
    client = TCPStore(HOST, port, timeout=TIMEOUT)  # retries with backoff meanwhile
    thread.join()
    client.set("k", b"v")
    assert client.get("k") == b"v"
    client.close()
    holder[0].close()


def test_port_in_use_names_address(server: StoreServer) -> None:
    address = re.escape(f"{HOST}:{server.port}")
    with pytest.raises(StoreError, match=f"{address}.*in use"):
        StoreServer(HOST, server.port)
    with pytest.raises(StoreError, match=f"{address}.*in use"):
        TCPStore(HOST, server.port, is_master=True, timeout=1)


def test_server_binds_exactly_the_given_host() -> None:
    # Linux routes all of 127/8 to loopback: a server on 127.0.0.2 must not answer 127.0.0.1.
    try:
        srv = StoreServer("127.0.0.2", 0)
    except StoreError:
        pytest.skip("127.0.0.2 is not bindable here")
    with srv:
        client = TCPStore("127.0.0.2", srv.port, timeout=TIMEOUT)
        client.set("k", b"v")
        client.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((HOST, srv.port), timeout=1).close()


def test_invalid_addresses() -> None:
    with pytest.raises(InvalidArgument):
        StoreServer("", 0)
    with pytest.raises(InvalidArgument):
        StoreServer(HOST, 70000)
    with pytest.raises(InvalidArgument, match="port 0"):
        TCPStore(HOST, 0)
    with pytest.raises(InvalidArgument):
        TCPStore(HOST, 0, world_size=0, is_master=True)


def test_server_lifecycle_and_port_reuse() -> None:
    srv = StoreServer(HOST, 0)
    port = srv.port
    assert srv.address == f"{HOST}:{port}"
    srv.start()
    with pytest.raises(StoreError):
        srv.start()
    client = TCPStore(HOST, port, timeout=TIMEOUT)
    client.ping()
    client.set("k", b"v")
    assert "client" in repr(client) and str(port) in repr(srv)
    srv.close()
    srv.close()
    with pytest.raises(StoreError, match=re.escape(f"{HOST}:{port}")):
        client.get("k")
    client.close()
    # The port is free again at once (no TIME_WAIT trouble).
    again = StoreServer(HOST, port).start()
    fresh = TCPStore(HOST, port, timeout=TIMEOUT)
    assert fresh.add("n", 2) == 2
    fresh.close()
    again.close()
    StoreServer(HOST, 0).close()  # closing a server that never started


def test_master_waits_for_workers() -> None:
    port = _free_port()
    outcome: list[object] = []

    def master() -> None:
        try:
            outcome.append(TCPStore(HOST, port, world_size=3, is_master=True, timeout=TIMEOUT))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=master)
    thread.start()
    workers = [TCPStore(HOST, port, world_size=3, timeout=TIMEOUT) for _ in range(2)]
    thread.join(TIMEOUT + 1)
    assert len(outcome) == 1 and isinstance(outcome[0], TCPStore)
    master_store = outcome[0]
    assert master_store.port == port and master_store.host == HOST
    workers[0].set("k", b"v")
    assert master_store.get("k") == b"v"
    for store in [*workers, master_store]:
        store.close()


def test_master_times_out_waiting_for_workers() -> None:
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="1 of 2 clients"):
        TCPStore(HOST, 0, world_size=2, is_master=True, timeout=0.3)
    assert time.monotonic() - start < 0.3 + 0.5
    # wait_for_workers=False returns at once; port 0 picked a free port.
    master = TCPStore(HOST, 0, world_size=2, is_master=True, timeout=0.3, wait_for_workers=False)
    assert master.port > 0 and master.server is not None
    master.close()


def test_close_wakes_a_blocked_get(server: StoreServer) -> None:
    client = _client(server, timeout=30)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            client.get("never")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.1)
    client.close()
    thread.join(3)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], StoreError)
    with pytest.raises(StoreError, match="closed"):
        client.set("k", b"v")


def test_large_values_and_batches(server: StoreServer) -> None:
    a, b = _client(server), _client(server)
    big = os.urandom(8 << 20)
    a.set("big", big)
    assert b.get("big") == big
    a.append("big", b"tail")
    assert b.multi_get(["big"]) == [big + b"tail"]
    values = [os.urandom(1000) for _ in range(500)]
    a.multi_set([f"v{i}" for i in range(500)], values)
    assert b.multi_get([f"v{i}" for i in range(500)]) == values
    with pytest.raises(InvalidArgument, match="frame limit"):
        a.multi_set(["x", "y"], [big * 5, big * 5])
    with pytest.raises(InvalidArgument, match=str(MAX_VALUE_BYTES)):
        a.set("huge", bytes(MAX_VALUE_BYTES + 1))
    a.close()
    b.close()


def test_many_concurrent_clients_rendezvous(server: StoreServer) -> None:
    clients = 64
    errors: list[BaseException] = []
    seen: list[bytes] = []

    def rank(i: int) -> None:
        try:
            store = TCPStore(HOST, server.port, timeout=20)
            if store.add("arrived", 1) == clients:
                store.set("go", b"now")
            seen.append(store.get("go"))
            store.close()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert seen == [b"now"] * clients


# --- a scripted peer: what the client does when the server is slow or foreign -----------------


class ScriptedServer:
    """A real listening socket whose single connection ``script`` drives by hand."""

    def __init__(self, script: Callable[[socket.socket], None]) -> None:
        self.listener = socket.create_server((HOST, 0))
        self.port = int(self.listener.getsockname()[1])
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(script,), daemon=True)
        self.thread.start()

    def _run(self, script: Callable[[socket.socket], None]) -> None:
        try:
            conn, _ = self.listener.accept()
            with conn:
                conn.settimeout(TIMEOUT)
                script(conn)
        except BaseException as exc:
            self.errors.append(exc)

    def close(self) -> None:
        self.thread.join(TIMEOUT)
        self.listener.close()


def _read_request(conn: socket.socket, proto: wire.ServerConnection) -> wire.Request:
    while True:
        event = proto.next_event()
        if isinstance(event, wire.Request):
            return event
        if event is None:
            proto.receive_data(conn.recv(65536))


def test_late_answer_is_discarded_and_connection_stays_usable() -> None:
    def script(conn: socket.socket) -> None:
        proto = wire.ServerConnection()
        proto.receive_data(conn.recv(wire.HELLO_SIZE))
        assert isinstance(proto.next_event(), wire.Hello)
        conn.sendall(wire.hello_reply(True))
        first = _read_request(conn, proto)  # a GET the client will give up on
        second = _read_request(conn, proto)  # sent after the client's timeout
        # Answer the abandoned request first, late, then the live one.
        conn.sendall(wire.ok_value(first.rid, b"stale") + wire.ok_value(second.rid, b"fresh"))
        third = _read_request(conn, proto)
        conn.sendall(wire.ok_int(third.rid, 7))
        conn.recv(1)

    peer = ScriptedServer(script)
    client = TCPStore(HOST, peer.port, timeout=0.2)
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="'slow'"):
        client.get("slow")
    assert time.monotonic() - start < 0.2 + 0.5
    client.set_timeout(TIMEOUT)
    assert client.get("other") == b"fresh"
    assert client.add("n", 1) == 7
    client.close()
    peer.close()
    assert not peer.errors


def test_server_speaking_another_version_is_refused() -> None:
    def script(conn: socket.socket) -> None:
        conn.recv(wire.HELLO_SIZE)
        conn.sendall(wire.MAGIC + struct.pack("!HH", 99, wire.HELLO_BAD_VERSION))

    peer = ScriptedServer(script)
    with pytest.raises(StoreError, match=f"{HOST}:{peer.port}.*version 99"):
        TCPStore(HOST, peer.port, timeout=TIMEOUT)
    peer.close()


def test_foreign_server_is_refused() -> None:
    def script(conn: socket.socket) -> None:
        conn.recv(wire.HELLO_SIZE)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    peer = ScriptedServer(script)
    with pytest.raises(StoreError, match=f"{HOST}:{peer.port}.*not a meshcomm store"):
        TCPStore(HOST, peer.port, timeout=TIMEOUT)
    peer.close()


# --- the standalone server --------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_standalone_server_serves_and_stops_cleanly(sig: signal.Signals) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshcomm.store", "--host", HOST, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.fullmatch(r"meshcomm store listening on 127\.0\.0\.1:(\d+)\n", line)
        assert match, line
        client = TCPStore(HOST, int(match.group(1)), timeout=TIMEOUT)
        client.set("k", b"v")
        assert client.get("k") == b"v"
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 0
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_standalone_server_port_in_use(server: StoreServer) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "meshcomm.store", "--host", HOST, "--port", str(server.port)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1
    assert f"{HOST}:{server.port}" in result.stderr and "in use" in result.stderr
