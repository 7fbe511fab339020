"""Fuzz the store server over real sockets: it never crashes, memory stays bounded.

The server runs in its own process (``python -m meshcomm.store``, with a secret and a 64 MiB
budget) while this process drives frames at it: valid requests of every opcode (timeouts of
any float, keys from a small pool), mutated valid frames, truncated frames, oversized length
prefixes, random bytes, mangled handshakes, slowloris and half-open connections. Frames are
tagged with the connection's MAC as a member's would be (mutated before tagging, so the
parser behind the MAC is fuzzed), and some are changed after tagging (the MAC). Afterwards
the server must still be running, have logged no internal error, have stayed within its
budget (peak RSS), and serve a well-behaved client. ``make test`` drives 300,000 frames; the
``slow`` test drives 10**6.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from meshcomm.common.secret import (
    NONCE_BYTES,
    SECRET_ENV,
    new_nonce,
    new_secret,
    proof,
    session_key,
)
from meshcomm.store import TCPStore, wire

HOST = "127.0.0.1"
BUDGET_MIB = 64
# Above the process's baseline: the budget plus transient copies of frames being parsed.
RSS_SLACK_MIB = 64
_KEYS = [f"k{i}".encode() for i in range(64)] + [b"x" * 4096]
_FLOATS = [0.0, 0.001, -1.0, float("nan"), float("inf"), -float("inf"), 3e6, 1e308, 5e-324]


def _valid(rng: random.Random) -> bytes:
    """One well-formed request of a random opcode."""
    op = rng.choice(list(wire.OP_NAMES))
    key = rng.choice(_KEYS)
    value = rng.randbytes(rng.choice((0, 1, 8, 100, 1000)))
    # Waits mostly answer at once (0 s); some use hostile timeouts and stay parked.
    timeout = 0.0 if rng.random() < 0.9 else rng.choice(_FLOATS)
    keys = rng.sample(_KEYS[:64], rng.randint(1, 4))
    if op in (wire.OP_SET, wire.OP_APPEND):
        body = wire.body_key_value(key, value)
    elif op == wire.OP_GET:
        body = wire.body_get(timeout, key)
    elif op == wire.OP_ADD:
        body = wire.body_add(rng.randint(-(2**63), 2**63 - 1), key)
    elif op == wire.OP_COMPARE_SET:
        body = wire.body_compare_set(key, rng.choice((b"", value)), value)
    elif op in (wire.OP_WAIT, wire.OP_MULTI_GET):
        body = wire.body_wait(timeout, keys)
    elif op == wire.OP_CHECK:
        body = wire.body_keys(keys)
    elif op == wire.OP_DELETE:
        body = key
    elif op == wire.OP_MULTI_SET:
        body = wire.body_multi_set(keys, [value] * len(keys))
    else:
        body = b""
    return wire.request(op, rng.getrandbits(32), body)


def _mutated(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(data))
        data[pos] = (
            rng.getrandbits(8) if rng.random() < 0.5 else data[pos] ^ (1 << rng.randrange(8))
        )
    return bytes(data)


def _oversized(rng: random.Random) -> bytes:
    op = rng.choice([*wire.OP_NAMES, 0, 13, 255])
    return struct.pack("!IIB", rng.choice((2**32 - 1, 2**31, 64 * 2**20 + 2**17)), 1, op)


def _handshake(sock: socket.socket, secret: bytes) -> wire.ClientConnection | None:
    """Authenticate as a member of the job; None if the server closed the connection.

    The connection returned tags (``seal``) the frames sent after it, as a member's would.
    """
    conn = wire.ClientConnection()
    mine = new_nonce()
    sock.sendall(conn.hello(0, mine))
    reply = sock.recv(wire.HELLO_SIZE + 2 * NONCE_BYTES, socket.MSG_WAITALL)
    if len(reply) < wire.HELLO_SIZE + 2 * NONCE_BYTES:
        return None
    theirs = reply[wire.HELLO_SIZE : wire.HELLO_SIZE + NONCE_BYTES]
    key = session_key(secret, b"store", mine, theirs)
    sock.sendall(conn.answer(proof(secret, b"client", b"store", mine, theirs), key))
    if len(sock.recv(wire.HELLO_SIZE, socket.MSG_WAITALL)) != wire.HELLO_SIZE:
        return None
    return conn


def _drain(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 20):
            pass
    except OSError:
        pass  # reset: the server dropped us, as it should for a broken frame


def _session(rng: random.Random, port: int, secret: bytes, pool: list[bytes]) -> int:
    """One connection of one kind; return how many frames it sent."""
    kind = rng.random()
    with socket.create_connection((HOST, port), timeout=30) as sock:
        if kind < 0.05:  # a mangled handshake, then garbage
            hello = _mutated(rng, wire.ClientConnection().hello(0, new_nonce()))
            sock.sendall(hello + rng.randbytes(rng.randint(0, 200)))
            _drain(sock)
            return 1
        conn = _handshake(sock, secret)
        if conn is None:
            return 0
        # Frames are tagged as a member would, so the parser behind the MAC is what is
        # fuzzed; the mutated-after-tagging, oversized and random kinds test the MAC itself.
        seal = conn.seal
        if kind < 0.70:  # a long run of valid frames: they all get answers
            frames = [seal(frame) for frame in rng.choices(pool, k=2000)]
        elif kind < 0.80:  # valid frames with mutated ones among them: dropped at the first bad
            frames = rng.choices(pool, k=200)
            for i in rng.sample(range(len(frames)), 3):
                frames[i] = _mutated(rng, frames[i])
            frames = [seal(frame) for frame in frames]
        elif kind < 0.85:  # a bit or byte changed after tagging: dropped there (MAC)
            frames = [seal(frame) for frame in rng.choices(pool, k=200)]
            i = rng.randrange(len(frames))
            frames[i] = _mutated(rng, frames[i])
        elif kind < 0.92:  # a truncated frame at the end, then the connection closes
            frames = [seal(frame) for frame in rng.choices(pool, k=100)]
            last = seal(rng.choice(pool))
            frames.append(last[: rng.randrange(1, len(last))])
        elif kind < 0.96:  # an oversized length prefix
            frames = [*(seal(frame) for frame in rng.choices(pool, k=50)), _oversized(rng)]
        elif kind < 0.97:  # large values: the memory budget refuses what would not fit
            big = rng.randbytes(1024) * (rng.choice((1, 4, 8)) * 1024)
            frames = [
                conn.request(wire.OP_SET, i, wire.body_key_value(f"big{i}".encode(), big))
                for i in range(rng.randint(1, 12))
            ]
        else:  # random bytes
            frames = [rng.randbytes(rng.randint(1, 4096))]
        sock.sendall(b"".join(frames))
        _drain(sock)
        return len(frames)


def _slowloris(port: int, count: int) -> list[socket.socket]:
    socks = []
    for i in range(count):
        sock = socket.create_connection((HOST, port), timeout=30)
        if i % 2:
            sock.sendall(wire.MAGIC[:2])  # a hello that never ends; the rest send nothing
        socks.append(sock)
    return socks


def _rss_mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for pid {pid}")


@pytest.fixture
def fuzzed_server() -> Iterator[tuple[subprocess.Popen[str], int, str]]:
    secret = new_secret()
    env = {**os.environ, SECRET_ENV: secret}
    argv = ["-m", "meshcomm.store", "--port", "0", "--memory-limit", f"{BUDGET_MIB}M"]
    proc = subprocess.Popen(
        [sys.executable, *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().rsplit(":", 1)[1])
        yield proc, port, secret
    finally:
        proc.terminate()
        proc.wait(10)


def _fuzz(
    server: tuple[subprocess.Popen[str], int, str], frames: int, seconds: float, seed: int
) -> None:
    proc, port, secret = server
    rng = random.Random(seed)
    pool = [_valid(rng) for _ in range(5000)]
    base = _rss_mib(proc.pid, "VmRSS")
    sent = 0
    loris = _slowloris(port, 100)
    started = time.monotonic()
    try:
        while sent < frames and time.monotonic() - started < seconds:
            sent += _session(rng, port, secret.encode(), pool)
            assert proc.poll() is None, f"the server died after {sent} frames"
    finally:
        for sock in loris:
            sock.close()
    elapsed = time.monotonic() - started
    assert sent >= frames, f"drove only {sent} of {frames} frames in {elapsed:.0f} s"
    assert proc.poll() is None
    with TCPStore(HOST, port, timeout=10, secret=secret) as good:
        good.set("after-the-fuzz", b"ok")
        assert good.get("after-the-fuzz") == b"ok"
        assert good.add("n-after", 2) == 2
    peak = _rss_mib(proc.pid, "VmHWM") - base
    assert peak < BUDGET_MIB + RSS_SLACK_MIB, f"server RSS grew by {peak:.0f} MiB"
    proc.terminate()
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "error serving" not in err, err[-3000:]
    print(f"fuzz: {sent} frames in {elapsed:.1f} s, server RSS +{peak:.0f} MiB at peak")


def test_fuzz_store_server(fuzzed_server: tuple[subprocess.Popen[str], int, str]) -> None:
    _fuzz(fuzzed_server, frames=300_000, seconds=60.0, seed=17)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fuzz_store_server_a_million_frames(
    fuzzed_server: tuple[subprocess.Popen[str], int, str],
) -> None:
    _fuzz(fuzzed_server, frames=1_000_000, seconds=240.0, seed=1017)


def test_fuzz_leaves_the_accounting_exact() -> None:
    """After a fuzz in-process, every byte counted against the budget is accounted for."""
    from meshcomm.store import StoreServer

    secret = new_secret()
    with StoreServer(HOST, 0, secret=secret, memory_limit="16M") as server:
        rng = random.Random(5)
        pool = [_valid(rng) for _ in range(2000)]
        sent = 0
        while sent < 30_000:
            sent += _session(rng, server.port, secret.encode(), pool)
        deadline = time.monotonic() + 10
        while server.num_connections and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.num_connections == 0
        with TCPStore(HOST, server.port, timeout=10, secret=secret) as good:
            keys = good.num_keys()
            assert keys > 0
        time.sleep(0.1)
        state = server._state.data
        stored = sum(len(k) + len(v) + 128 for k, v in state.items())  # 128: per-entry overhead
        assert server.memory_used == stored, (server.memory_used, stored)
        assert server.memory_used <= server.memory_limit
