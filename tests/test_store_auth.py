"""Store authentication over real sockets: the job's secret, mutual challenge-response.

Both sides prove they know the secret with HMAC-SHA256 over fresh nonces; a client without
the secret (or with another) reads and writes nothing, a recorded handshake cannot be
replayed, and a connection that never finishes its handshake is dropped.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from polling import wait_until

from meshcomm.common.secret import NONCE_BYTES, SECRET_ENV, new_nonce, proof
from meshcomm.errors import StoreAuthError, StoreError
from meshcomm.store import StoreServer, TCPStore, wire

HOST = "127.0.0.1"
TIMEOUT = 5.0
SECRET = "correct horse battery staple"


@pytest.fixture
def server() -> Iterator[StoreServer]:
    with StoreServer(HOST, 0, secret=SECRET) as srv:
        yield srv


def _recv(sock: socket.socket, size: int) -> bytes:
    sock.settimeout(TIMEOUT)
    data = sock.recv(size, socket.MSG_WAITALL)
    assert len(data) == size, f"got {len(data)} of {size} bytes"
    return data


def _closed_by_peer(sock: socket.socket, within: float = 3.0) -> bool:
    sock.settimeout(within)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_same_secret_both_sides(server: StoreServer) -> None:
    assert server.authenticated
    with TCPStore(HOST, server.port, timeout=TIMEOUT, secret=SECRET) as store:
        assert store.authenticated
        store.set("k", "v")
        assert store.get("k") == b"v"
        assert store.add("n", 2) == 2


def test_secret_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "from-env")
    master = TCPStore(HOST, 0, is_master=True, timeout=TIMEOUT)
    try:
        assert master.authenticated and master.server is not None
        assert master.server.authenticated
        with TCPStore(HOST, master.port, timeout=TIMEOUT) as worker:
            worker.set("k", b"1")
        with pytest.raises(StoreAuthError, match="could not prove it knows"):
            TCPStore(HOST, master.port, timeout=TIMEOUT, secret="another")
        # An explicit empty secret means "unauthenticated", whatever the environment says.
        with pytest.raises(StoreAuthError, match="requires authentication"):
            TCPStore(HOST, master.port, timeout=TIMEOUT, secret="")
    finally:
        master.close()


def test_wrong_secret_fails_fast_and_the_server_serves_on(
    server: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    started = time.monotonic()
    with (
        caplog.at_level(logging.WARNING, logger="meshcomm.store"),
        pytest.raises(StoreAuthError, match="secrets differ"),
    ):
        TCPStore(HOST, server.port, timeout=30, secret="wrong")
    assert time.monotonic() - started < 2.0  # not retried until the timeout
    # The server logs the attempt: the client left without a proof.
    assert wait_until(lambda: "left during authentication" in caplog.text)
    with TCPStore(HOST, server.port, timeout=TIMEOUT, secret=SECRET) as store:
        store.set("still", "serving")
        assert store.get("still") == b"serving"


def test_client_with_a_secret_refuses_an_unauthenticated_server() -> None:
    with StoreServer(HOST, 0, secret="") as plain:
        assert not plain.authenticated
        with pytest.raises(StoreAuthError, match="has no secret"):
            TCPStore(HOST, plain.port, timeout=TIMEOUT, secret=SECRET)
        with TCPStore(HOST, plain.port, timeout=TIMEOUT, secret="") as store:
            store.set("k", "v")  # torch-style, no secret anywhere: works as before


def test_client_without_a_secret_is_refused(
    server: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="meshcomm.store"),
        pytest.raises(StoreAuthError, match=r"requires authentication.*MESHCOMM_SECRET"),
    ):
        TCPStore(HOST, server.port, timeout=TIMEOUT, secret="")
    assert wait_until(lambda: "has no secret" in caplog.text)


def _handshake(sock: socket.socket, secret: str, register: bool = False) -> tuple[bytes, bytes]:
    """Do the client's side of the handshake by hand; return the bytes it sent."""
    conn = wire.ClientConnection()
    mine = new_nonce()
    hello = conn.hello(wire.FLAG_REGISTER if register else 0, mine)
    sock.sendall(hello)
    head = _recv(sock, wire.HELLO_SIZE)
    assert struct.unpack("!4sHH", head)[2] == wire.HELLO_CHALLENGE_MAC
    rest = _recv(sock, 2 * NONCE_BYTES)
    theirs = rest[:NONCE_BYTES]
    answer = proof(secret.encode(), b"client", b"store", mine, theirs)
    sock.sendall(answer)
    return hello, answer


def test_wrong_proof_is_refused_and_logged(
    server: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="meshcomm.store"):
        sock = socket.create_connection((HOST, server.port), timeout=TIMEOUT)
        try:
            _handshake(sock, "not the secret")
            verdict = struct.unpack("!4sHH", _recv(sock, wire.HELLO_SIZE))
            assert verdict[2] == wire.HELLO_AUTH_FAILED
            assert _closed_by_peer(sock)
        finally:
            sock.close()
        assert wait_until(lambda: "wrong proof" in caplog.text)


def test_replayed_handshake_fails(server: StoreServer) -> None:
    first = socket.create_connection((HOST, server.port), timeout=TIMEOUT)
    try:
        hello, answer = _handshake(first, SECRET)
        assert struct.unpack("!4sHH", _recv(first, wire.HELLO_SIZE))[2] == wire.HELLO_OK
    finally:
        first.close()
    # The recorded bytes, sent again: the server's fresh nonce makes the old proof wrong.
    replay = socket.create_connection((HOST, server.port), timeout=TIMEOUT)
    try:
        replay.sendall(hello)
        assert struct.unpack("!4sHH", _recv(replay, wire.HELLO_SIZE))[2] == wire.HELLO_CHALLENGE_MAC
        _recv(replay, 2 * NONCE_BYTES)
        replay.sendall(answer + wire.request(wire.OP_GET, 1, wire.body_get(1.0, b"k")))
        assert _closed_by_peer(replay)
    finally:
        replay.close()
    replay = socket.create_connection((HOST, server.port), timeout=TIMEOUT)
    try:
        replay.sendall(hello)
        _recv(replay, wire.HELLO_SIZE + 2 * NONCE_BYTES)
        replay.sendall(answer)
        assert struct.unpack("!4sHH", _recv(replay, wire.HELLO_SIZE))[2] == wire.HELLO_AUTH_FAILED
    finally:
        replay.close()


def test_no_request_is_read_before_authentication(server: StoreServer) -> None:
    with TCPStore(HOST, server.port, timeout=TIMEOUT, secret=SECRET) as store:
        store.set("secret-key", b"private")
    attempts = [
        wire.ClientConnection().hello() + wire.request(wire.OP_GET, 1, wire.body_get(1.0, b"k")),
        wire.ClientConnection().hello(0, new_nonce())
        + wire.request(wire.OP_SET, 1, wire.body_key_value(b"secret-key", b"forged" * 8)),
    ]
    for attempt in attempts:
        sock = socket.create_connection((HOST, server.port), timeout=TIMEOUT)
        try:
            sock.sendall(attempt)
            sock.settimeout(TIMEOUT)
            data = b""
            while chunk := _recv_some(sock):
                data += chunk
            # At most the handshake answer (a reset may discard even that), never a response.
            assert len(data) in (0, wire.HELLO_SIZE, wire.HELLO_SIZE + 2 * NONCE_BYTES), data
        finally:
            sock.close()
    with TCPStore(HOST, server.port, timeout=TIMEOUT, secret=SECRET) as store:
        assert store.get("secret-key") == b"private"


def _recv_some(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def test_half_open_and_slowloris_connections_are_dropped() -> None:
    with StoreServer(HOST, 0, secret=SECRET, handshake_timeout=0.5) as server:
        base = server.memory_used
        socks = []
        # Nothing, a partial hello, or a hello whose nonce never comes.
        stalls = [b"", b"MC", wire.ClientConnection().hello(0, new_nonce())[:20]]
        try:
            for i in range(200):
                sock = socket.create_connection((HOST, server.port), timeout=TIMEOUT)
                sock.sendall(stalls[i % 3])
                socks.append(sock)
            assert wait_until(lambda: server.num_connections == 200)
            assert server.memory_used - base < 200 * 64
            with TCPStore(HOST, server.port, timeout=TIMEOUT, secret=SECRET) as store:
                store.set("k", "v")  # served meanwhile
            assert wait_until(lambda: server.num_connections == 0, within=5.0)
            assert all(_closed_by_peer(sock, 1.0) for sock in socks[:10])
        finally:
            for sock in socks:
                sock.close()
        # A legitimate client that is slow to authenticate would also be dropped; ours is not.
        with TCPStore(HOST, server.port, timeout=TIMEOUT, secret=SECRET) as store:
            time.sleep(1.0)
            assert store.get("k") == b"v"


def test_store_errors_are_store_errors() -> None:
    assert issubclass(StoreAuthError, StoreError)


_TWO_INITS = """
import socket, meshcomm
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
for _ in range(2):
    meshcomm.init(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=10)
    print("authenticated:", meshcomm.get_world_info().raw_store.authenticated)
    meshcomm.shutdown()
"""


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_unauthenticated_job_warns_once_per_process(secret: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    if secret is not None:
        env[SECRET_ENV] = secret
    done = subprocess.run(
        [sys.executable, "-c", _TWO_INITS],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(f"authenticated: {secret is not None}") == 2
    warnings = done.stderr.count("this job is unauthenticated")
    assert warnings == (1 if secret is None else 0), done.stderr
