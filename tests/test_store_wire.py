"""The store's wire protocol in memory (no sockets): round trips, stream splits, garbage."""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshcomm.errors import MeshCommError, ProtocolError
from meshcomm.store import wire
from meshcomm.store.base import MAX_KEY_BYTES

settings.register_profile(
    "store-wire", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("store-wire")

keys = st.binary(min_size=1, max_size=64)
values = st.binary(max_size=256)
rids = st.integers(0, 2**32 - 1)
timeouts = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
key_lists = st.lists(keys, max_size=8)


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, wire.Request]:
    """A request frame and the Request it must decode to."""
    rid = draw(rids)
    op = draw(st.sampled_from(sorted(wire.OP_NAMES)))
    args: tuple[Any, ...]
    if op in (wire.OP_SET, wire.OP_APPEND):
        args = (draw(keys), draw(values))
        body = wire.body_key_value(*args)
    elif op == wire.OP_GET:
        timeout, key = draw(timeouts), draw(keys)
        args, body = (timeout, key), wire.body_get(timeout, key)
    elif op == wire.OP_ADD:
        key, amount = draw(keys), draw(st.integers(-(2**63), 2**63 - 1))
        args, body = (key, amount), wire.body_add(amount, key)
    elif op == wire.OP_COMPARE_SET:
        args = (draw(keys), draw(values), draw(values))
        body = wire.body_compare_set(*args)
    elif op in (wire.OP_WAIT, wire.OP_MULTI_GET):
        timeout, ks = draw(timeouts), draw(key_lists)
        args, body = (timeout, ks), wire.body_wait(timeout, ks)
    elif op == wire.OP_CHECK:
        ks = draw(key_lists)
        args, body = (ks,), wire.body_keys(ks)
    elif op == wire.OP_DELETE:
        key = draw(keys)
        args, body = (key,), key
    elif op == wire.OP_MULTI_SET:
        pairs = draw(st.lists(st.tuples(keys, values), max_size=6))
        ks, vs = [k for k, _ in pairs], [v for _, v in pairs]
        args, body = (ks, vs), wire.body_multi_set(ks, vs)
    else:  # NUM_KEYS, PING
        args, body = (), b""
    return wire.request(op, rid, body), wire.Request(rid, op, args)


@st.composite
def responses(draw: st.DrawFn) -> tuple[bytes, wire.Response, Any]:
    """A response frame, the Response it decodes to, and what its body parses to."""
    rid = draw(rids)
    kind = draw(st.sampled_from(["ok", "value", "int", "bool", "values", "error", "timeout"]))
    parsed: Any
    if kind == "ok":
        frame, status, parsed = wire.ok(rid), wire.STATUS_OK, b""
    elif kind == "value":
        parsed = draw(values)
        frame, status = wire.ok_value(rid, parsed), wire.STATUS_OK
    elif kind == "int":
        parsed = draw(st.integers(-(2**63), 2**63 - 1))
        frame, status = wire.ok_int(rid, parsed), wire.STATUS_OK
    elif kind == "bool":
        parsed = draw(st.booleans())
        frame, status = wire.ok_bool(rid, parsed), wire.STATUS_OK
    elif kind == "values":
        parsed = draw(st.lists(values, max_size=6))
        frame, status = wire.ok_values(rid, parsed), wire.STATUS_OK
    elif kind == "error":
        parsed = draw(st.text(max_size=50))
        frame, status = wire.error(rid, parsed), wire.STATUS_ERROR
    else:
        parsed = draw(key_lists)
        frame, status = wire.timed_out(rid, parsed), wire.STATUS_TIMEOUT
    body = frame[wire.HEADER_SIZE :]
    return frame, wire.Response(rid, status, body), (kind, parsed)


def _parse(kind: str, body: bytes) -> Any:
    parsers = {
        "ok": lambda b: b,
        "value": lambda b: b,
        "int": wire.parse_int,
        "bool": wire.parse_bool,
        "values": wire.parse_values,
        "error": lambda b: b.decode(),
        "timeout": wire.parse_keys,
    }
    return parsers[kind](body)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[last:point])
        last = point
    return pieces


def _server_events(chunks: list[bytes]) -> list[Any]:
    conn = wire.ServerConnection()
    events = []
    for chunk in chunks:
        conn.receive_data(chunk)
        while (event := conn.next_event()) is not None:
            events.append(event)
    assert conn.buffered == 0
    return events


def _client_events(chunks: list[bytes]) -> list[Any]:
    conn = wire.ClientConnection()
    events = []
    for chunk in chunks:
        conn.receive_data(memoryview(chunk))
        while (event := conn.next_event()) is not None:
            events.append(event)
    return events


@given(st.lists(requests(), max_size=8), st.integers(0, 3), st.lists(st.integers(0, 10**6)))
def test_requests_round_trip_under_any_split(
    reqs: list[tuple[bytes, wire.Request]], flags: int, cuts: list[int]
) -> None:
    hello = wire.ClientConnection().hello(flags)
    stream = hello + b"".join(frame for frame, _ in reqs)
    events = _server_events(_split(stream, cuts))
    # Without a nonce the hello never asks for authentication, whatever the flags say.
    greeting = wire.Hello(wire.PROTOCOL_VERSION, flags & ~wire.FLAG_AUTH)
    assert events == [greeting, *(req for _, req in reqs)]


@given(st.lists(responses(), max_size=8), st.lists(st.integers(0, 10**6)))
def test_responses_round_trip_under_any_split(
    resps: list[tuple[bytes, wire.Response, Any]], cuts: list[int]
) -> None:
    stream = wire.hello_reply(True) + b"".join(frame for frame, _, _ in resps)
    events = _client_events(_split(stream, cuts))
    assert events[0] == wire.HelloReply(wire.PROTOCOL_VERSION, wire.HELLO_OK)
    assert events[1:] == [resp for _, resp, _ in resps]
    for event, (_, _, (kind, parsed)) in zip(events[1:], resps, strict=True):
        assert _parse(kind, event.body) == parsed


@given(st.binary(max_size=600), st.booleans(), st.lists(st.integers(0, 10**6), max_size=4))
def test_garbage_only_ever_raises_protocol_error(data: bytes, greet: bool, cuts: list[int]) -> None:
    # With ``greet``, the garbage comes after a valid handshake, where frames are parsed.
    server_side = (wire.ServerConnection(), wire.ClientConnection().hello() if greet else b"")
    client_side = (wire.ClientConnection(), wire.hello_reply(True) if greet else b"")
    conn: wire.ServerConnection | wire.ClientConnection
    for conn, prefix in (server_side, client_side):
        try:
            for chunk in _split(prefix + data, cuts):
                conn.receive_data(chunk)
                while conn.next_event() is not None:
                    pass
        except ProtocolError:
            pass


@given(st.binary(max_size=300))
def test_body_parsers_only_ever_raise_protocol_error(body: bytes) -> None:
    for parse in (wire.parse_int, wire.parse_bool, wire.parse_values, wire.parse_keys):
        with contextlib.suppress(ProtocolError):
            parse(body)
    for op in wire.OP_NAMES:
        frame = struct.pack("!IIB", len(body), 1, op) + body
        try:
            _server_events([wire.ClientConnection().hello(), frame])
        except ProtocolError:
            pass
        except AssertionError:
            pytest.fail(f"{wire.OP_NAMES[op]} left bytes unparsed")


def test_oversized_length_is_refused_from_the_header_alone() -> None:
    conn = wire.ServerConnection()
    conn.receive_data(wire.ClientConnection().hello())
    assert isinstance(conn.next_event(), wire.Hello)
    conn.receive_data(struct.pack("!IIB", 0xFFFFFFFF, 9, wire.OP_SET))  # no body follows
    with pytest.raises(ProtocolError, match="limit"):
        conn.next_event()
    client = wire.ClientConnection()
    client.receive_data(wire.hello_reply(True) + struct.pack("!IIB", wire.MAX_BODY_BYTES + 1, 1, 0))
    client.next_event()
    with pytest.raises(ProtocolError, match="limit"):
        client.next_event()


def test_per_opcode_bounds() -> None:
    conn = wire.ServerConnection()
    conn.receive_data(wire.ClientConnection().hello())
    conn.next_event()
    conn.receive_data(struct.pack("!IIB", 8 + MAX_KEY_BYTES + 1, 1, wire.OP_GET))
    with pytest.raises(ProtocolError, match="GET"):
        conn.next_event()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (struct.pack("!I", 0) + b"v", "key of 0 bytes"),
        (struct.pack("!I", MAX_KEY_BYTES + 1) + b"k", "key of"),
        (struct.pack("!I", 5) + b"k", "overruns"),
        (b"\x00\x00", "truncated"),
    ],
)
def test_bad_set_bodies(body: bytes, message: str) -> None:
    conn = wire.ServerConnection()
    conn.receive_data(wire.ClientConnection().hello() + wire.request(wire.OP_SET, 1, body))
    conn.next_event()
    with pytest.raises(ProtocolError, match=message):
        conn.next_event()


def test_magic_is_checked_on_the_first_bytes() -> None:
    conn = wire.ServerConnection()
    conn.receive_data(b"M")  # a prefix of the magic: wait for more
    assert conn.next_event() is None
    conn.receive_data(b"X")
    with pytest.raises(ProtocolError, match="magic"):
        conn.next_event()
    client = wire.ClientConnection()
    client.receive_data(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(ProtocolError, match="magic"):
        client.next_event()


def test_protocol_error_is_a_meshcomm_error() -> None:
    assert issubclass(ProtocolError, MeshCommError)


def test_unknown_response_status() -> None:
    conn = wire.ClientConnection()
    conn.receive_data(wire.hello_reply(True) + struct.pack("!IIB", 0, 1, 77))
    conn.next_event()
    with pytest.raises(ProtocolError, match="status 77"):
        conn.next_event()


def test_error_messages_are_bounded() -> None:
    frame = wire.error(3, "x" * 100_000)
    assert len(frame) == wire.HEADER_SIZE + wire.MAX_ERROR_BYTES


# --- the authenticated handshake (sans-IO) ----------------------------------------------------


@given(
    st.binary(min_size=32, max_size=32),
    st.binary(min_size=32, max_size=32),
    st.binary(min_size=32, max_size=32),
    st.binary(min_size=32, max_size=32),
    st.lists(requests(), max_size=4),
    st.lists(st.integers(0, 10**6)),
)
def test_authenticated_handshake_under_any_split(
    client_nonce: bytes,
    server_nonce: bytes,
    server_proof: bytes,
    client_proof: bytes,
    reqs: list[tuple[bytes, wire.Request]],
    cuts: list[int],
) -> None:
    client, server = wire.ClientConnection(), wire.ServerConnection()
    # Client to server: the hello with its nonce, in any pieces.
    for chunk in _split(client.hello(wire.FLAG_REGISTER, client_nonce), cuts):
        server.receive_data(chunk)
    hello = server.next_event()
    assert hello == wire.Hello(
        wire.PROTOCOL_VERSION, wire.FLAG_REGISTER | wire.FLAG_AUTH | wire.FLAG_MAC, client_nonce
    )
    server.expect_proof()
    assert server.in_handshake
    # Server to client: the challenge, then (after the proof) the verdict and responses.
    for chunk in _split(wire.challenge(server_nonce, server_proof), cuts):
        client.receive_data(chunk)
    assert client.next_event() == wire.HelloReply(
        wire.PROTOCOL_VERSION, wire.HELLO_CHALLENGE_MAC, server_nonce, server_proof
    )
    # The proof alone (nothing may follow it before the verdict), then requests.
    events = _events(server, _split(client.answer(client_proof), cuts))
    assert events == [wire.ClientProof(client_proof)]
    assert not server.in_handshake
    frames = b"".join(frame for frame, _ in reqs)
    assert _events(server, _split(frames, cuts)) == [req for _, req in reqs]
    client.receive_data(wire.auth_result(True) + wire.ok(1))
    assert client.next_event() == wire.AuthResult(wire.PROTOCOL_VERSION, wire.HELLO_OK)
    assert client.next_event() == wire.Response(1, wire.STATUS_OK, b"")


def _events(conn: wire.ServerConnection, chunks: list[bytes]) -> list[Any]:
    events = []
    for chunk in chunks:
        conn.receive_data(chunk)
        while (event := conn.next_event()) is not None:
            events.append(event)
    return events


def test_bytes_after_the_hello_before_the_proof_are_refused() -> None:
    server = wire.ServerConnection()
    nonce = b"n" * 32
    server.receive_data(wire.ClientConnection().hello(0, nonce))
    assert server.next_event() == wire.Hello(
        wire.PROTOCOL_VERSION, wire.FLAG_AUTH | wire.FLAG_MAC, nonce
    )
    server.expect_proof()
    server.receive_data(b"p" * 32 + wire.request(wire.OP_PING, 1, b""))
    with pytest.raises(ProtocolError, match="where a 32-byte proof was expected"):
        server.next_event()


def test_a_short_nonce_or_proof_is_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        wire.ClientConnection().hello(0, b"short")
    with pytest.raises(ValueError, match="32 bytes"):
        wire.ClientConnection().answer(b"short")
    with pytest.raises(ValueError, match="32-byte"):
        wire.challenge(b"n" * 32, b"short")
