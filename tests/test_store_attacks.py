"""The attacks of issue 17 against a job with a secret: real ranks, real store, real sockets.

A foreign process that can reach the store port (no secret, or the wrong one) tried to read
the tcp backend's job token, overwrite the ranks' addresses, forge an abort ("rank 1 died"),
and claim a rank first. With the job's secret, each attempt fails at the handshake with
:class:`StoreAuthError`, nothing in the store changes, and the job's all_reduce is right.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshcomm.common.secret import SECRET_ENV, new_secret
from meshcomm.errors import StoreAuthError
from meshcomm.store import StoreServer, TCPStore, wire

HOST = "127.0.0.1"
TIMEOUT = 5.0
SCRIPT = str(Path(__file__).parent / "scripts" / "attack_rank.py")
# Where the first world's keys live (namespaces of meshcomm.rendezvous and the tcp backend).
WORLD = "meshcomm/world/0.0/"
TOKEN = WORLD + "meshcomm/tcp/token"
ABORT = WORLD + "meshcomm/tcp/abort"
ADDRESS = WORLD + "meshcomm/tcp/addr/1"
RANK_CLAIM = "meshcomm/rdzv/0.0/rank/1"


def _attackers() -> Iterator[str]:
    """The foreign clients' secrets: none at all, and a wrong one."""
    yield ""
    yield new_secret()


def _attempt(port: int, secret: str, action: str) -> None:
    with TCPStore(HOST, port, timeout=TIMEOUT, secret=secret) as store:
        if action == "read token":
            store.get(TOKEN)
        elif action == "overwrite address":
            store.set(ADDRESS, f"{HOST}:1")
        elif action == "forge abort":
            store.compare_set(ABORT, "", "rank 1 died (forged)")
        else:
            store.compare_set(RANK_CLAIM, "", "an impostor")


def _raw_attempt(port: int, frame: bytes) -> bytes:
    """Send a plain hello and a request at once; return whatever comes back."""
    with socket.create_connection((HOST, port), timeout=TIMEOUT) as sock:
        sock.sendall(wire.ClientConnection().hello() + frame)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass
        return data


def test_foreign_clients_cannot_touch_the_job() -> None:
    secret = new_secret()
    with StoreServer(HOST, 0, secret=secret) as server:
        port = server.port
        # Before the ranks start: claim rank 1 first.
        for wrong in _attackers():
            with pytest.raises(StoreAuthError):
                _attempt(port, wrong, "claim rank")
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        env.update(
            RANK="0",
            WORLD_SIZE="2",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR=HOST,
            MASTER_PORT=str(port),
            MESHCOMM_STORE_HOSTED="1",
        )
        env[SECRET_ENV] = secret
        ranks = []
        for rank in (0, 1):
            env.update(RANK=str(rank), LOCAL_RANK=str(rank))
            ranks.append(
                subprocess.Popen(
                    [sys.executable, SCRIPT],
                    env=dict(env),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        try:
            with TCPStore(HOST, port, timeout=60, secret=secret) as launcher:
                launcher.wait(["test/ready/0", "test/ready/1"])
                before = {key: launcher.get(key) for key in (TOKEN, ADDRESS, RANK_CLAIM)}
                assert len(before[TOKEN]) == 16  # the token the attacker wanted exists
                for wrong in _attackers():
                    for action in ("read token", "overwrite address", "forge abort", "claim"):
                        with pytest.raises(StoreAuthError):
                            _attempt(port, wrong, action)
                # Raw bytes, without the handshake's answer awaited: no response frame.
                for frame in (
                    wire.request(wire.OP_GET, 1, wire.body_get(1.0, TOKEN.encode())),
                    wire.request(
                        wire.OP_SET, 1, wire.body_key_value(ABORT.encode(), b"rank 1 died")
                    ),
                ):
                    answer = _raw_attempt(port, frame)
                    assert len(answer) <= wire.HELLO_SIZE, answer
                after = {key: launcher.get(key) for key in (TOKEN, ADDRESS, RANK_CLAIM)}
                assert after == before
                assert not launcher.check([ABORT])
                launcher.set("test/go", "1")
                outputs = [proc.communicate(timeout=60) for proc in ranks]
        finally:
            for proc in ranks:
                proc.kill()
                proc.wait()
    for rank, (proc, (out, err)) in enumerate(zip(ranks, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank}: {err[-3000:]}"
        assert out.strip().splitlines()[-1] == "sum 3.0", out


class _Recorder:
    """A TCP relay that records what the client sent (the attacker on the path)."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.target = port
        self.sent = bytearray()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection((HOST, self.target))

        def pump(src: socket.socket, dst: socket.socket, record: bool) -> None:
            try:
                while data := src.recv(65536):
                    if record:
                        self.sent += data
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                for sock in (src, dst):
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)

        back = threading.Thread(target=pump, args=(upstream, client, False), daemon=True)
        back.start()
        pump(client, upstream, True)
        back.join(TIMEOUT)
        client.close()
        upstream.close()

    def close(self) -> None:
        self.listener.close()
        self.thread.join(TIMEOUT)


def test_a_captured_session_replayed_does_nothing() -> None:
    secret = new_secret()
    with StoreServer(HOST, 0, secret=secret) as server:
        relay = _Recorder(server.port)
        try:
            with TCPStore(HOST, relay.port, timeout=TIMEOUT, secret=secret) as store:
                assert store.add("counter", 1) == 1
        finally:
            relay.close()
        captured = bytes(relay.sent)
        assert len(captured) > wire.HELLO_SIZE + 32 + 32
        for _ in range(3):
            with socket.create_connection((HOST, server.port), timeout=TIMEOUT) as sock:
                sock.sendall(captured)
                sock.settimeout(TIMEOUT)
                try:
                    while sock.recv(65536):
                        pass
                except ConnectionResetError:
                    pass
        time.sleep(0.1)
        with TCPStore(HOST, server.port, timeout=TIMEOUT, secret=secret) as store:
            assert store.get("counter") == b"1"  # the replayed ADD never ran
