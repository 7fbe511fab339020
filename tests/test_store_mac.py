"""Frame MACs of authenticated store connections: in memory, and through a tampering relay.

After an authenticated handshake every frame, both ways, carries a 16-byte HMAC-SHA256 tag
over its direction, its counter and its bytes (``meshcomm.store.wire``). Here: any flipped
bit, a replayed, reordered, dropped or reflected frame is refused, in memory under any
split of the stream; and over real sockets, a relay that forwards the handshake untouched and
then changes one byte gets the connection dropped (the server refuses a changed request and
stores nothing; the client refuses a changed answer with ``StoreAuthError``), while a relay
that changes nothing goes unnoticed. Unauthenticated connections carry no tags at all.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshcomm.common.secret import new_secret, session_key
from meshcomm.errors import ProtocolError, StoreAuthError, StoreError
from meshcomm.store import StoreServer, TCPStore, wire

settings.register_profile(
    "store-mac", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("store-mac")

HOST = "127.0.0.1"
TIMEOUT = 5.0
KEY = session_key(b"secret", b"store", b"c" * 32, b"s" * 32)
# The handshake's bytes: client hello (8) + nonce (32) + proof (32); server challenge
# (8 + 32 + 32) + verdict (8).
CLIENT_HANDSHAKE = 72
SERVER_HANDSHAKE = 80


def _pair(
    key: bytes = KEY, admit: Callable[[int, int, int], str | None] | None = None
) -> tuple[wire.ClientConnection, wire.ServerConnection]:
    """A client and a server connection past an authenticated handshake (proofs not checked)."""
    client, server = wire.ClientConnection(), wire.ServerConnection(admit)
    server.receive_data(client.hello(0, b"c" * 32))
    hello = server.next_event()
    assert isinstance(hello, wire.Hello) and hello.flags & wire.FLAG_MAC
    server.expect_proof(key)
    client.receive_data(wire.challenge(b"s" * 32, b"p" * 32))
    reply = client.next_event()
    assert isinstance(reply, wire.HelloReply) and reply.status == wire.HELLO_CHALLENGE_MAC
    server.receive_data(client.answer(b"q" * 32, key))
    assert server.next_event() == wire.ClientProof(b"q" * 32)
    client.receive_data(wire.auth_result(True))
    assert client.next_event() == wire.AuthResult(wire.PROTOCOL_VERSION, wire.HELLO_OK)
    assert client.authenticated and server.authenticated
    return client, server


def _drain(conn: wire.ServerConnection | wire.ClientConnection, data: bytes) -> list[object]:
    conn.receive_data(data)
    events = []
    while (event := conn.next_event()) is not None:
        events.append(event)
    return events


_REQUESTS = [
    (wire.OP_SET, wire.body_key_value(b"k", b"value" * 20)),
    (wire.OP_GET, wire.body_get(1.0, b"k")),
    (wire.OP_ADD, wire.body_add(5, b"n")),
    (wire.OP_CHECK, wire.body_keys([b"k", b"n"])),
    (wire.OP_MULTI_SET, wire.body_multi_set([b"a", b"b"], [b"1", b"22"])),
    (wire.OP_PING, b""),
]


def _requests(client: wire.ClientConnection) -> list[bytes]:
    return [client.request(op, rid, body) for rid, (op, body) in enumerate(_REQUESTS)]


def _responses(server: wire.ServerConnection) -> list[bytes]:
    frames = []
    for parts in (
        (wire.ok(0),),
        (wire.ok_header(1, 100), b"v" * 100),
        (wire.ok_int(2, 5),),
        (wire.error(3, "no such thing"),),
        (wire.timed_out(4, [b"k"]),),
        (wire.ok_bool(5, True),),
    ):
        out = bytearray()
        server.frame(out, *parts)
        frames.append(bytes(out))
    return frames


# --- in memory -------------------------------------------------------------------------------


@given(st.lists(st.integers(0, 4000), max_size=6))
def test_tagged_frames_round_trip_under_any_split(cuts: list[int]) -> None:
    client, server = _pair()
    stream = b"".join(_requests(client))
    events: list[object] = []
    last = 0
    for cut in [*sorted({min(c, len(stream)) for c in cuts}), len(stream)]:
        events += _drain(server, stream[last:cut])
        last = cut
    assert [(e.rid, e.op) for e in events] == [(i, op) for i, (op, _) in enumerate(_REQUESTS)]
    answers = _drain(client, b"".join(_responses(server)))
    assert [a.rid for a in answers] == [0, 1, 2, 3, 4, 5]
    assert answers[1].body == b"v" * 100


def _refused(conn: wire.ServerConnection | wire.ClientConnection, stream: bytes) -> list[object]:
    """Feed ``stream``; return the events before the connection refused it (or stalled)."""
    events: list[object] = []
    conn.receive_data(stream)
    with contextlib.suppress(ProtocolError):
        while (event := conn.next_event()) is not None:
            events.append(event)
    return events


@given(st.data())
def test_any_flipped_bit_in_a_request_is_refused(data: st.DataObject) -> None:
    client, server = _pair()
    frames = _requests(client)
    index = data.draw(st.integers(0, len(frames) - 1))
    bit = data.draw(st.integers(0, 8 * len(frames[index]) - 1))
    changed = bytearray(frames[index])
    changed[bit // 8] ^= 1 << (bit % 8)
    frames[index] = bytes(changed)
    events = _refused(server, b"".join(frames))
    # Every frame before the changed one, and nothing from it or after it: a changed length
    # fails the MAC or leaves the server waiting for bytes that never make a valid frame.
    assert [e.rid for e in events] == list(range(index))


@given(st.data())
def test_any_flipped_bit_in_a_response_is_refused(data: st.DataObject) -> None:
    client, server = _pair()
    frames = _responses(server)
    index = data.draw(st.integers(0, len(frames) - 1))
    bit = data.draw(st.integers(0, 8 * len(frames[index]) - 1))
    changed = bytearray(frames[index])
    changed[bit // 8] ^= 1 << (bit % 8)
    frames[index] = bytes(changed)
    events = _refused(client, b"".join(frames))
    assert [e.rid for e in events] == list(range(index))


@pytest.mark.parametrize("attack", ["replay", "swap", "drop"])
def test_replayed_swapped_or_dropped_frames_are_refused(attack: str) -> None:
    client, server = _pair()
    frames = _requests(client)
    if attack == "replay":
        stream = [*frames[:3], frames[1], *frames[3:]]
    elif attack == "swap":
        stream = [*frames[:2], frames[3], frames[2], *frames[4:]]
    else:
        stream = frames[:2] + frames[3:]
    server.receive_data(b"".join(stream))
    assert [server.next_event().rid for _ in range(2)] == [0, 1]  # type: ignore[union-attr]
    with pytest.raises(wire.MacError, match="failed its MAC"):
        while server.next_event() is not None:
            pass


def test_frames_reflected_to_their_sender_are_refused() -> None:
    _client, server = _pair()
    # A server's answer sent back to the server: right key, wrong direction.
    out = bytearray()
    server.frame(out, wire.error(1, "x" * 40))  # status 1 reads as SET: a header that passes
    server.receive_data(bytes(out))
    with pytest.raises(wire.MacError):
        server.next_event()
    # A client's request sent back to the client (its counter 0 matches; its direction not).
    client2, _ = _pair()
    client2.receive_data(client2.request(wire.OP_SET, 1, wire.body_key_value(b"k", b"v")))
    with pytest.raises(wire.MacError):
        client2.next_event()


def test_a_frame_from_another_connection_is_refused() -> None:
    other_client, _ = _pair(session_key(b"secret", b"store", b"c" * 32, b"t" * 32))
    _, server = _pair()
    server.receive_data(other_client.request(wire.OP_PING, 1, b""))
    with pytest.raises(wire.MacError):
        server.next_event()


def test_a_refused_large_frame_is_authenticated_before_it_is_answered() -> None:
    body = wire.body_key_value(b"big", b"b" * (wire.ADMIT_THRESHOLD + 1000))
    for tamper in (False, True):
        client, server = _pair(admit=lambda rid, op, length: "over budget")
        frame = bytearray(client.request(wire.OP_SET, 9, body))
        if tamper:
            frame[len(frame) // 2] ^= 0x40  # inside the body, which is skipped unread
        events: list[object] = []
        for start in range(0, len(frame), 4096):  # the body arrives while it is skipped
            server.receive_data(bytes(frame[start : start + 4096]))
            if tamper:
                with contextlib.suppress(wire.MacError):
                    events += iter(server.next_event, None)
            else:
                events += iter(server.next_event, None)
        if tamper:
            assert events == []
        else:
            assert events == [wire.Refused(9, wire.OP_SET, "over budget")]
            assert server.buffered == 0
            # In step afterwards: the next frame's tag checks out.
            server.receive_data(client.request(wire.OP_PING, 10, b""))
            assert server.next_event() == wire.Request(10, wire.OP_PING, ())


def test_the_size_limits_apply_before_the_mac() -> None:
    _, server = _pair()
    server.receive_data(struct.pack("!IIB", 2**31, 1, wire.OP_SET))
    with pytest.raises(ProtocolError, match="limit"):
        server.next_event()
    client, _ = _pair()
    client.receive_data(struct.pack("!IIB", 2**31, 1, wire.STATUS_OK))
    with pytest.raises(ProtocolError, match="limit"):
        client.next_event()


def test_unauthenticated_frames_carry_no_tag() -> None:
    client, server = wire.ClientConnection(), wire.ServerConnection()
    assert not client.authenticated and not server.authenticated
    body = wire.body_key_value(b"k", b"v")
    assert client.request(wire.OP_SET, 3, body) == wire.request(wire.OP_SET, 3, body)
    assert client.hello(wire.FLAG_REGISTER) == b"MCKV\x00\x02\x00\x01"
    out = bytearray()
    server.frame(out, wire.ok_header(3, 1), b"v")
    assert bytes(out) == wire.ok_value(3, b"v")


# --- over sockets, through a relay -----------------------------------------------------------


Tamper = Callable[[int, bytearray], None]


class _Relay:
    """A TCP relay between clients and a store: the attacker on the path.

    ``up`` and ``down`` may change the bytes going to the server and to the client: each is
    called with the offset of a chunk in its connection's stream and the chunk (a bytearray
    to change in place).
    """

    def __init__(self, port: int, up: Tamper | None = None, down: Tamper | None = None) -> None:
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self.target = port
        self.up, self.down = up, down
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection((HOST, self.target))
            for src, dst, tamper in ((client, upstream, self.up), (upstream, client, self.down)):
                threading.Thread(target=_pump, args=(src, dst, tamper), daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # shutdown wakes the accept(); close alone does not
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(TIMEOUT)


def _pump(src: socket.socket, dst: socket.socket, tamper: Tamper | None) -> None:
    offset = 0
    try:
        while data := src.recv(65536):
            chunk = bytearray(data)
            if tamper is not None:
                tamper(offset, chunk)
            offset += len(chunk)
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _flip_at(position: int) -> Tamper:
    """Flip one bit of the byte at ``position`` of the stream."""

    def tamper(offset: int, chunk: bytearray) -> None:
        if offset <= position < offset + len(chunk):
            chunk[position - offset] ^= 0x01

    return tamper


def _set_at(position: int, value: int) -> Tamper:
    def tamper(offset: int, chunk: bytearray) -> None:
        if offset <= position < offset + len(chunk):
            chunk[position - offset] = value

    return tamper


@pytest.fixture
def served() -> Iterator[tuple[StoreServer, str]]:
    secret = new_secret()
    with StoreServer(HOST, 0, secret=secret) as server:
        yield server, secret


def test_a_relay_that_changes_nothing_goes_unnoticed(served: tuple[StoreServer, str]) -> None:
    server, secret = served
    relay = _Relay(server.port)
    try:
        with TCPStore(HOST, relay.port, timeout=TIMEOUT, secret=secret) as store:
            store.set("k", b"v" * 1000)
            assert store.get("k") == b"v" * 1000
            assert store.add("n", 2) == 2
            assert store.multi_get(["k", "n"]) == [b"v" * 1000, b"2"]
    finally:
        relay.close()


def test_a_changed_set_value_is_refused_and_not_stored(
    served: tuple[StoreServer, str], caplog: pytest.LogCaptureFixture
) -> None:
    server, secret = served
    value = b"v" * 1000
    # The SET frame: header (9) | key length (4) | key (1) | value; flip a byte mid-value.
    relay = _Relay(server.port, up=_flip_at(CLIENT_HANDSHAKE + 9 + 4 + 1 + 500))
    try:
        with caplog.at_level(logging.WARNING, logger="meshcomm.store"):
            with (
                TCPStore(HOST, relay.port, timeout=TIMEOUT, secret=secret) as store,
                pytest.raises(StoreError, match="closed the connection during SET"),
            ):
                store.set("k", value)
            with TCPStore(HOST, server.port, timeout=TIMEOUT, secret=secret) as direct:
                assert not direct.check(["k"])
                direct.ping()  # the server serves on
    finally:
        relay.close()
    assert "failed its MAC: the connection was tampered with" in caplog.text


def test_a_changed_answer_raises_store_auth_error(served: tuple[StoreServer, str]) -> None:
    server, secret = served
    # After the handshake the client sees: the SET's OK (9 + 16 bytes), then the GET's answer
    # header (9) and value; flip a byte of the value.
    relay = _Relay(server.port, down=_flip_at(SERVER_HANDSHAKE + 25 + 9 + 10))
    try:
        with TCPStore(HOST, relay.port, timeout=TIMEOUT, secret=secret) as store:
            store.set("k", b"v" * 100)
            with pytest.raises(StoreAuthError, match="a store frame failed its MAC"):
                store.get("k")
    finally:
        relay.close()


def test_a_downgrade_to_no_frame_macs_is_refused(served: tuple[StoreServer, str]) -> None:
    server, secret = served
    # The hello's flags without bit 2 (register | authenticate): the server refuses it.
    relay = _Relay(server.port, up=_set_at(7, wire.FLAG_REGISTER | wire.FLAG_AUTH))
    try:
        with pytest.raises(StoreError, match="requires frame MACs"):
            TCPStore(HOST, relay.port, timeout=TIMEOUT, secret=secret)
    finally:
        relay.close()
    # The challenge's status rewritten to the one without MACs: the client refuses it.
    relay = _Relay(server.port, down=_set_at(7, wire.HELLO_CHALLENGE))
    try:
        with pytest.raises(StoreError, match="without frame MACs"):
            TCPStore(HOST, relay.port, timeout=TIMEOUT, secret=secret)
    finally:
        relay.close()
