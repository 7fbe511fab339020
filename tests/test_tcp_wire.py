"""The tcp backend's wire protocol, in memory: round trips, arbitrary splits, garbage."""

from __future__ import annotations

import contextlib
import itertools
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshcomm.backends.tcp import wire
from meshcomm.errors import ProtocolError

TOKEN = bytes(range(16))
DTYPES = [
    np.dtype(t)
    for t in (
        bool,
        np.int8,
        np.uint16,
        np.int32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
        ">i4",
        ml_dtypes.bfloat16,
        ml_dtypes.float8_e5m2,
        ml_dtypes.float8_e4m3fn,
        ml_dtypes.int4,
    )
]

# A frame in the tests: (kind, comm_id, tag, payload bytes, dtype or None, shape or None).
Frame = tuple[int, int, int, bytes, "np.dtype | None", "tuple[int, ...] | None"]


@st.composite
def frames(draw: st.DrawFn) -> Frame:
    kind = draw(st.sampled_from([wire.DATA, wire.DATA, wire.ARRAY, wire.GOODBYE]))
    comm_id = draw(st.integers(0, 2**64 - 1))
    tag = draw(st.integers(-(2**63), 2**63 - 1))
    if kind == wire.GOODBYE:
        return (kind, 0, 0, b"", None, None)
    if kind == wire.DATA:
        return (kind, comm_id, tag, draw(st.binary(max_size=300)), None, None)
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return (kind, comm_id, tag, draw(st.binary(min_size=nbytes, max_size=nbytes)), dtype, shape)


def encode(frame: Frame) -> bytes:
    kind, comm_id, tag, payload, dtype, shape = frame
    meta = b"" if dtype is None else wire.encode_array_meta(dtype, shape or ())
    return wire.encode_header(kind, comm_id=comm_id, tag=tag, length=len(payload), meta=meta)


def stream(hello_rank: int, items: list[Frame]) -> bytes:
    hello = wire.encode_hello(wire.HELLO, rank=hello_rank, world_size=8, token=TOKEN)
    return hello + b"".join(encode(f) + f[3] for f in items)


def drain(dec: wire.Decoder, out: list[object], limit: int = 1 << 20) -> None:
    """Pull every event, giving each frame a fresh target; append events and payloads."""
    pending = _targets.setdefault(id(dec), [])
    while True:
        ev = dec.next_event()
        if ev is wire.NEED_DATA:
            return
        if isinstance(ev, wire.FrameHeader):
            if ev.length > limit:
                raise OverflowError(ev.length)
            buf = bytearray(ev.length)
            pending.append(buf)
            out.append(ev)
            dec.set_target(memoryview(buf))
        elif ev is wire.PAYLOAD_DONE:
            out.append(bytes(pending.pop()))
        else:
            out.append(ev)


_targets: dict[int, list[bytearray]] = {}  # each decoder's payload target in flight


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def check_events(events: list[object], items: list[Frame]) -> None:
    hello = events[0]
    assert isinstance(hello, wire.Hello)
    assert (hello.kind, hello.rank, hello.world_size, hello.token) == (wire.HELLO, 3, 8, TOKEN)
    rest = events[1:]
    assert len(rest) == 2 * len(items)
    for (header, payload), (kind, comm_id, tag, data, dtype, shape) in zip(
        zip(rest[::2], rest[1::2], strict=True), items, strict=True
    ):
        assert isinstance(header, wire.FrameHeader)
        assert (header.kind, header.comm_id, header.tag, header.length) == (
            kind,
            comm_id,
            tag,
            len(data),
        )
        assert header.dtype == dtype
        assert header.shape == shape
        assert payload == data


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames(), max_size=8), st.lists(st.integers(0, 10_000), max_size=12))
def test_round_trip_in_any_split(items: list[Frame], cuts: list[int]) -> None:
    data = stream(3, items)
    dec = wire.Decoder(bufsize=64)
    events: list[object] = []
    for chunk in split(data, cuts):
        dec.receive_data(chunk)
        drain(dec, events)
    check_events(events, items)
    assert dec.buffered == 0 and not dec.in_frame


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(frames(), max_size=6),
    st.lists(st.integers(1, 200_000), min_size=1, max_size=20),
    st.integers(0, 3),
)
def test_recv_view_path_matches(items: list[Frame], sizes: list[int], big: int) -> None:
    # Large DATA payloads exercise the direct path (recv_into the target itself).
    items = [*items, *[(wire.DATA, 9, 9, bytes([i]) * 150_000, None, None) for i in range(big)]]
    sizes = [*sizes, 100_000]  # tiny chunks, but not only tiny ones (keeps the test fast)
    data = stream(3, items)
    dec = wire.Decoder()
    events: list[object] = []
    pos = 0
    i = 0
    while pos < len(data):
        view = dec.recv_view()
        n = min(len(view), sizes[i % len(sizes)], len(data) - pos)
        view[:n] = data[pos : pos + n]  # what recv_into would do
        dec.commit(n)
        pos += n
        i += 1
        drain(dec, events)
    check_events(events, items)


def test_large_payload_goes_straight_to_target() -> None:
    dec = wire.Decoder(handshake=False)
    payload = np.arange(1 << 18, dtype=np.uint8).tobytes()
    dec.receive_data(wire.encode_header(wire.DATA, comm_id=1, tag=2, length=len(payload)))
    header = dec.next_event()
    assert isinstance(header, wire.FrameHeader)
    target = bytearray(len(payload))
    dec.set_target(memoryview(target))
    assert dec.next_event() is wire.NEED_DATA
    view = dec.recv_view()
    assert len(view) == len(payload)  # the target itself, not the internal buffer
    view[:] = payload
    dec.commit(len(payload))
    assert dec.next_event() is wire.PAYLOAD_DONE
    assert target == payload


@settings(max_examples=300)
@given(st.binary(min_size=1, max_size=200))
def test_garbage_raises_protocol_error_only(junk: bytes) -> None:
    for handshake in (True, False):
        dec = wire.Decoder(handshake=handshake)
        dec.receive_data(junk)
        with contextlib.suppress(ProtocolError, OverflowError):
            drain(dec, [], limit=1 << 16)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames(), min_size=1, max_size=4), st.data())
def test_corrupted_stream_never_crashes(items: list[Frame], data: st.DataObject) -> None:
    raw = bytearray(stream(3, items))
    index = data.draw(st.integers(0, len(raw) - 1))
    raw[index] ^= data.draw(st.integers(1, 255))
    dec = wire.Decoder()
    dec.receive_data(bytes(raw))
    with contextlib.suppress(ProtocolError, OverflowError):
        drain(dec, [], limit=1 << 16)


def test_error_is_sticky() -> None:
    dec = wire.Decoder()
    dec.receive_data(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(ProtocolError, match="bad magic"):
        dec.next_event()
    with pytest.raises(ProtocolError, match="bad magic"):
        dec.next_event()


def test_bad_magic_detected_from_first_bytes() -> None:
    dec = wire.Decoder()
    dec.receive_data(b"GE")
    with pytest.raises(ProtocolError, match="not a meshcomm tcp peer"):
        dec.next_event()


def test_version_and_fields_checked() -> None:
    good = wire.encode_hello(wire.HELLO, rank=1, world_size=2, token=TOKEN)
    bad_version = good[:4] + struct.pack("<H", wire.VERSION + 1) + good[6:]
    dec = wire.Decoder()
    dec.receive_data(bad_version)
    with pytest.raises(
        ProtocolError, match=f"version {wire.VERSION + 1} differs from this side.s {wire.VERSION}"
    ):
        dec.next_event()
    bad_rank = wire.encode_hello(wire.HELLO, rank=5, world_size=2, token=TOKEN)
    dec = wire.Decoder()
    dec.receive_data(bad_rank)
    with pytest.raises(ProtocolError, match="rank 5 is outside a world of 2"):
        dec.next_event()


def test_reject_carries_reason() -> None:
    dec = wire.Decoder()
    dec.receive_data(
        wire.encode_hello(wire.REJECT, rank=0, world_size=2, token=TOKEN, reason="go away")
    )
    hello = dec.next_event()
    assert isinstance(hello, wire.Hello)
    assert (hello.kind, hello.reason) == (wire.REJECT, "go away")


def test_check_hello_names_what_differs() -> None:
    hello = wire.Hello(wire.HELLO, wire.VERSION, rank=1, world_size=4, token=TOKEN)
    wire.check_hello(hello, kinds=[wire.HELLO], token=TOKEN, world_size=4, peer="p")
    with pytest.raises(ProtocolError, match=r"its job token differs from this job.s \(a process"):
        wire.check_hello(hello, kinds=[wire.HELLO], token=bytes(16), world_size=4, peer="p")
    with pytest.raises(ProtocolError, match="world size 4 differs from this job's 8"):
        wire.check_hello(hello, kinds=[wire.HELLO], token=TOKEN, world_size=8, peer="p")
    with pytest.raises(ProtocolError, match="it says it is rank 1, expected rank 2"):
        wire.check_hello(
            hello, kinds=[wire.HELLO], token=TOKEN, world_size=4, peer="p", expect_rank=2
        )
    with pytest.raises(ProtocolError, match="expected ACCEPT or REJECT, got HELLO"):
        wire.check_hello(
            hello, kinds=[wire.ACCEPT, wire.REJECT], token=TOKEN, world_size=4, peer="p"
        )


def test_frame_checks() -> None:
    cases = {
        "unknown frame kind 9": wire.encode_header(9, comm_id=0, tag=0, length=0),
        "exceeds": wire.encode_header(wire.DATA, comm_id=0, tag=0, length=wire.MAX_PAYLOAD + 1),
        "carry no payload": wire.encode_header(wire.GOODBYE, comm_id=0, tag=0, length=4),
        "carry no metadata": wire.encode_header(wire.DATA, comm_id=0, tag=0, length=0, meta=b"x"),
        "needs 24 bytes, header says 8": wire.encode_header(
            wire.ARRAY, comm_id=0, tag=0, length=8, meta=wire.encode_array_meta("<f8", (3,))
        ),
        "bad frame marker": b"xx" + bytes(30),
    }
    for message, raw in cases.items():
        dec = wire.Decoder(handshake=False)
        dec.receive_data(raw)
        with pytest.raises(ProtocolError, match=message):
            dec.next_event()


def test_set_target_misuse() -> None:
    dec = wire.Decoder(handshake=False)
    with pytest.raises(RuntimeError, match="only valid right after a FrameHeader"):
        dec.set_target(memoryview(bytearray(1)))
    dec.receive_data(wire.encode_header(wire.DATA, comm_id=0, tag=0, length=4))
    dec.next_event()
    with pytest.raises(ValueError, match="target has 3 bytes, the frame has 4"):
        dec.set_target(memoryview(bytearray(3)))
    with pytest.raises(RuntimeError, match="call set_target"):
        dec.next_event()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_names_round_trip(dtype: np.dtype) -> None:
    name = wire.dtype_to_wire(dtype)
    assert wire.dtype_from_wire(name) == dtype
    assert wire.decode_array_meta(wire.encode_array_meta(dtype, (2, 0, 5))) == (dtype, (2, 0, 5))


def test_dtypes_that_cannot_travel() -> None:
    for bad in (object, "U4", "S3", "M8[s]", np.dtype([("a", "<i4")]), "V8"):
        with pytest.raises(TypeError, match="cannot be sent"):
            wire.dtype_to_wire(bad)
    for name in ("|O8", "<f1", "<V2", "float8", "<i99", "<U4", "", "<f4 "):
        with pytest.raises(ProtocolError, match="unknown dtype"):
            wire.dtype_from_wire(name)
    assert wire.dtype_to_wire(ml_dtypes.bfloat16) == "bfloat16"  # its .str says '<V2'


# -- shared-memory kinds: SHM (set-up messages), RTS (payload by address), FIN ---------------

Expected = tuple[object, ...]


@st.composite
def shm_frames(draw: st.DrawFn) -> tuple[bytes, Expected]:
    """One frame of a shared-memory stream: its bytes and the events it must decode to."""
    kind = draw(st.sampled_from([wire.SHM, wire.RTS, wire.FIN, wire.DATA]))
    comm_id = draw(st.integers(0, 2**64 - 1))
    tag = draw(st.integers(-(2**63), 2**63 - 1))
    if kind == wire.RTS:
        length = draw(st.integers(0, wire.MAX_PAYLOAD))
        address = draw(st.integers(0, 2**64 - 1))
        return wire.pack_rts_header(comm_id, tag, length, address), (
            "rts",
            comm_id,
            tag,
            length,
            address,
        )
    if kind == wire.FIN:
        return wire.FIN_FRAME, ("fin",)
    payload = draw(st.binary(max_size=200))
    if kind == wire.SHM:
        step = draw(st.sampled_from([wire.SHM_OFFER, wire.SHM_NO_OFFER, wire.SHM_ACK]))
        raw = wire.encode_header(wire.SHM, comm_id=0, tag=step, length=len(payload)) + payload
        return raw, ("shm", step, payload)
    raw = wire.pack_data_header(comm_id, tag, len(payload)) + payload
    return raw, ("data", comm_id, tag, payload)


def drain_shm(
    dec: wire.Decoder, out: list[Expected], pending: list[tuple[Expected, bytearray]]
) -> None:
    while True:
        ev = dec.next_event()
        if ev is wire.NEED_DATA:
            return
        if ev is wire.PAYLOAD_DONE:
            kind, buf = pending.pop()
            out.append((*kind, bytes(buf)))
            continue
        assert isinstance(ev, wire.FrameHeader)
        if ev.kind == wire.RTS:
            out.append(("rts", ev.comm_id, ev.tag, ev.length, ev.address))
        elif ev.kind == wire.FIN:
            out.append(("fin",))
        else:
            buf = bytearray(ev.length)
            head: Expected = (
                ("shm", ev.tag) if ev.kind == wire.SHM else ("data", ev.comm_id, ev.tag)
            )
            pending.append((head, buf))
            dec.set_target(memoryview(buf))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(shm_frames(), max_size=10), st.lists(st.integers(0, 10_000), max_size=12))
def test_shared_memory_frames_round_trip_in_any_split(
    items: list[tuple[bytes, Expected]], cuts: list[int]
) -> None:
    data = b"".join(raw for raw, _ in items)
    dec = wire.Decoder(bufsize=64, handshake=False)
    events: list[Expected] = []
    pending: list[tuple[Expected, bytearray]] = []
    for chunk in split(data, cuts):
        dec.receive_data(chunk)
        drain_shm(dec, events, pending)
    assert events == [want for _, want in items]
    assert dec.idle and not dec.in_frame  # an RTS or FIN leaves nothing half decoded


def test_rts_has_no_payload_in_the_stream() -> None:
    dec = wire.Decoder(handshake=False)
    dec.receive_data(wire.pack_rts_header(5, -1, 3 << 30, 0xDEADBEEF) + wire.FIN_FRAME)
    rts = dec.next_event()
    assert isinstance(rts, wire.FrameHeader)
    assert (rts.kind, rts.comm_id, rts.tag, rts.length, rts.address) == (
        wire.RTS,
        5,
        -1,
        3 << 30,
        0xDEADBEEF,
    )
    fin = dec.next_event()
    assert isinstance(fin, wire.FrameHeader) and fin.kind == wire.FIN
    assert dec.next_event() is wire.NEED_DATA and dec.idle


def test_shared_memory_frame_checks() -> None:
    cases = {
        "8-byte address, got 0": wire.encode_header(wire.RTS, comm_id=0, tag=0, length=9),
        "8-byte address, got 9": wire.encode_header(
            wire.RTS, comm_id=0, tag=0, length=9, meta=bytes(9)
        ),
        "FIN frames carry no payload": wire.encode_header(wire.FIN, comm_id=0, tag=0, length=1),
        "FIN frames carry no metadata": wire.encode_header(
            wire.FIN, comm_id=0, tag=0, length=0, meta=b"x"
        ),
        "SHM frame of 4097 bytes": wire.encode_header(wire.SHM, comm_id=0, tag=1, length=4097),
    }
    for message, raw in cases.items():
        dec = wire.Decoder(handshake=False)
        dec.receive_data(raw)
        with pytest.raises(ProtocolError, match=message):
            dec.next_event()


def test_handshake_offers_shared_memory_with_the_host_key() -> None:
    hello = wire.encode_hello(
        wire.HELLO, rank=1, world_size=2, token=TOKEN, flags=wire.F_SHM, reason="boot/shm/ns"
    )
    accept = wire.encode_hello(wire.ACCEPT, rank=0, world_size=2, token=TOKEN, flags=wire.F_SHM)
    plain = wire.encode_hello(wire.ACCEPT, rank=0, world_size=2, token=TOKEN, reason="ignored")
    dec = wire.Decoder()
    dec.receive_data(hello)
    got = dec.next_event()
    assert isinstance(got, wire.Hello)
    assert (got.flags, got.reason) == (wire.F_SHM, "boot/shm/ns")
    for raw, flags in ((accept, wire.F_SHM), (plain, 0)):
        dec = wire.Decoder()
        dec.receive_data(raw)
        got = dec.next_event()
        assert isinstance(got, wire.Hello) and (got.flags, got.reason) == (flags, "")
    with pytest.raises(ValueError, match="flags"):
        wire.encode_hello(wire.REJECT, rank=0, world_size=2, token=TOKEN, flags=wire.F_SHM)
    bad = {
        "flags 4 are not allowed": hello[:7] + b"\x04" + hello[8:],
        "flags 1 are not allowed": wire.encode_hello(
            wire.REJECT, rank=0, world_size=2, token=TOKEN, reason="x"
        )[:7]
        + b"\x01"
        + bytes(28)
        + b"x",
        "reason of 4 bytes is not allowed": accept[:16]
        + struct.pack("<H", 4)
        + accept[18:]
        + b"abcd",
    }
    for message, raw in bad.items():
        dec = wire.Decoder()
        dec.receive_data(raw)
        with pytest.raises(ProtocolError, match=message):
            dec.next_event()


def test_authenticated_handshake_round_trips() -> None:
    nonce, proof = bytes(range(32)), bytes(range(32, 64))
    hello = wire.encode_hello(
        wire.HELLO,
        rank=1,
        world_size=2,
        token=TOKEN,
        flags=wire.F_SHM | wire.F_AUTH,
        reason="boot/shm/ns",
        nonce=nonce,
    )
    auth = wire.encode_auth(rank=0, world_size=2, token=TOKEN, nonce=nonce, proof=proof)
    accept = wire.encode_hello(wire.ACCEPT, rank=0, world_size=2, token=TOKEN)
    dec = wire.Decoder()
    for i in range(len(hello + auth)):  # any split
        dec.receive_data((hello + auth)[i : i + 1])
        got = dec.next_event()
        if got is wire.NEED_DATA:
            continue
        assert isinstance(got, wire.Hello)
        if got.kind == wire.HELLO:
            assert (got.flags, got.reason, got.nonce, got.proof) == (3, "boot/shm/ns", nonce, b"")
            dec.expect_handshake()
        else:
            assert (got.kind, got.nonce, got.proof) == (wire.AUTH, nonce, proof)
    dec = wire.Decoder()
    dec.receive_data(accept + wire.encode_header(wire.DATA, comm_id=1, tag=0, length=0))
    assert isinstance(dec.next_event(), wire.Hello)
    assert isinstance(dec.next_event(), wire.FrameHeader)  # one handshake unless told
    with pytest.raises(ValueError, match="nonce"):
        wire.encode_hello(wire.HELLO, rank=1, world_size=2, token=TOKEN, flags=wire.F_AUTH)
    with pytest.raises(ValueError, match="not allowed on a ACCEPT"):
        wire.encode_hello(wire.ACCEPT, rank=1, world_size=2, token=TOKEN, flags=wire.F_AUTH)
    bad_auth = auth[:7] + b"\x01" + auth[8:]
    dec = wire.Decoder()
    dec.receive_data(bad_auth)
    with pytest.raises(ProtocolError, match="flags 1 are not allowed"):
        dec.next_event()
