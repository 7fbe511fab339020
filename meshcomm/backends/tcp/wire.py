"""The tcp backend's wire protocol, with no I/O at all (the h11 model).

A connection starts with one handshake message each way, then carries data frames::

    handshake (36 bytes + reason    magic "MCTP", version u16, kind u8 (HELLO, ACCEPT, REJECT,
      + auth block)                 AUTH), flags u8 (F_SHM, F_AUTH), sender's global rank u32,
                                    world size u32, reason length u16, 2 pad bytes, job token
                                    (16 bytes), then the reason: UTF-8 text of a REJECT, or
                                    the sender's host key in a HELLO that has F_SHM; then the
                                    auth block: a 32-byte nonce in a HELLO with F_AUTH, a
                                    32-byte nonce and a 32-byte proof in an AUTH
    frame header (32 bytes + meta)  marker "mc", kind u8, flags u8, meta length u16,
                                    2 reserved bytes, communicator id u64, tag i64,
                                    payload length u64; then the metadata, then the payload

Frame kinds: DATA (Link bytes), ARRAY (metadata: dtype name and shape, encoded by
:mod:`~meshcomm.backends.tcp.wire_arrays`), GOODBYE, SHM (a
shared-memory handshake message, tag says which), RTS (metadata: the u64 address of the
payload in the sender's memory; the payload does not follow, the receiver copies it with
``process_vm_readv``), FIN (an RTS's payload was copied; nothing follows).

Everything is little-endian. The connecting side sends HELLO; the accepting side answers
ACCEPT or REJECT (with a reason). A HELLO with F_SHM offers shared memory and names the
sender's host; an ACCEPT with F_SHM takes it (both then run the SHM frames' handshake before
any data). A HELLO with F_AUTH (the job has a secret) carries the connector's nonce; then
each side sends one AUTH (the acceptor first: its nonce and proof; the connector: its nonce
again and its proof, see :mod:`~meshcomm.backends.tcp.link_auth`) before the acceptor's
ACCEPT or REJECT. The decoder expects one handshake message unless told that another
follows (:meth:`Decoder.expect_handshake`). Negative tags are reserved for meshcomm's own
traffic.

:class:`Decoder` takes bytes in any split and returns events one at a time. After a
:class:`FrameHeader` event the caller names the buffer the payload goes to
(:meth:`Decoder.set_target`); :meth:`Decoder.recv_view` then hands out that buffer itself, so
large payloads are received with ``recv_into`` straight into their destination.

Example:
    >>> token = bytes(16)
    >>> dec = Decoder()
    >>> dec.receive_data(encode_hello(HELLO, rank=1, world_size=2, token=token))
    >>> dec.receive_data(encode_header(DATA, comm_id=7, tag=-1, length=3) + b"abc")
    >>> dec.next_event().rank
    1
    >>> header = dec.next_event(); (header.comm_id, header.tag, header.length)
    (7, -1, 3)
    >>> payload = bytearray(header.length); dec.set_target(memoryview(payload))
    >>> dec.next_event() is PAYLOAD_DONE, bytes(payload)
    (True, b'abc')
    >>> dec.next_event() is NEED_DATA
    True
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshcomm.backends.tcp.wire_arrays import (
    decode_array_meta,
    dtype_from_wire,
    dtype_to_wire,
    encode_array_meta,
)
from meshcomm.errors import ProtocolError

__all__ = [
    "ARRAY",
    "AUTH",
    "AUTH_SIZE",
    "HEADER",
    "DATA",
    "FIN",
    "FIN_FRAME",
    "F_AUTH",
    "F_SHM",
    "GOODBYE",
    "HANDSHAKE_SIZE",
    "HEADER_SIZE",
    "HELLO",
    "ACCEPT",
    "REJECT",
    "MAGIC",
    "MAX_META",
    "MAX_PAYLOAD",
    "MAX_REASON",
    "NONCE_SIZE",
    "NEED_DATA",
    "NO_TOKEN",
    "PAYLOAD_DONE",
    "RTS",
    "SHM",
    "SHM_ACK",
    "SHM_NO_OFFER",
    "SHM_OFFER",
    "TOKEN_SIZE",
    "VERSION",
    "Decoder",
    "FrameHeader",
    "Hello",
    "check_hello",
    "decode_array_meta",
    "dtype_from_wire",
    "dtype_to_wire",
    "encode_array_meta",
    "encode_auth",
    "encode_header",
    "encode_hello",
    "pack_data_header",
    "pack_rts_header",
]

MAGIC = b"MCTP"
# 2: F_AUTH and AUTH (link authentication); a version-1 peer is refused by its version.
VERSION = 2
TOKEN_SIZE = 16
#: The token field of every REJECT: a refusal, often to a stranger, tells nothing of the job
#: (the connector reads a REJECT's reason, never its token).
NO_TOKEN = bytes(TOKEN_SIZE)
#: Bytes of a handshake nonce and of a handshake proof (HMAC-SHA256).
NONCE_SIZE = 32
#: Bytes of an AUTH message's auth block: nonce, then proof.
AUTH_SIZE = 2 * NONCE_SIZE

# Handshake kinds.
HELLO = 1
ACCEPT = 2
REJECT = 3
AUTH = 4
_HANDSHAKE_KINDS = {HELLO: "HELLO", ACCEPT: "ACCEPT", REJECT: "REJECT", AUTH: "AUTH"}
#: Handshake flag: HELLO offers shared memory (reason = host key); ACCEPT takes it.
F_SHM = 1
#: Handshake flag: HELLO of a job with a secret; its nonce follows the reason.
F_AUTH = 2
# Flags each handshake kind may carry.
_KIND_FLAGS = {HELLO: F_SHM | F_AUTH, ACCEPT: F_SHM, REJECT: 0, AUTH: 0}

# Frame kinds.
DATA = 1  # raw bytes of a Link exchange
ARRAY = 2  # an array for send/recv: metadata carries dtype and shape
GOODBYE = 3  # the sender closed its communicator on purpose; EOF follows
SHM = 4  # a shared-memory handshake message (over the socket); the tag says which
RTS = 5  # "read my payload at this address" (metadata: u64 address); no payload follows
FIN = 6  # the oldest outstanding RTS of the receiver of this frame was read
_FRAME_KINDS = {
    DATA: "DATA",
    ARRAY: "ARRAY",
    GOODBYE: "GOODBYE",
    SHM: "SHM",
    RTS: "RTS",
    FIN: "FIN",
}
# SHM frame tags: an offer, "no offer" (payload: why), an ack or nack (shm.ShmHandshake).
SHM_OFFER = 1
SHM_NO_OFFER = 2
SHM_ACK = 3
#: Largest SHM frame payload.
MAX_SHM_MESSAGE = 4096

_HANDSHAKE = struct.Struct("<4sHBBIIH2x16s")
_HEADER = struct.Struct("<2sBBHHQqQ")
_FRAME_MARKER = b"mc"
_U64 = struct.Struct("<Q")
_RTS_HEADER = struct.Struct("<2sBBHHQqQQ")  # the frame header, then the u64 address

#: The frame header's layout (for decoding in place).
HEADER = _HEADER
HANDSHAKE_SIZE = _HANDSHAKE.size  # 36
HEADER_SIZE = _HEADER.size  # 32
#: Largest REJECT reason, in bytes.
MAX_REASON = 1024
#: Largest frame metadata, in bytes (a dtype name and up to 64 dimensions fit easily).
MAX_META = 1024
#: Largest payload a frame may announce (1 PiB): anything above is corruption.
MAX_PAYLOAD = 1 << 50

# Payloads whose unreceived rest is at least this long are received straight into the
# target; shorter ones go through the internal buffer with the frames that follow them.
_DIRECT_MIN = 64 * 1024
_MIN_FREE = 16 * 1024
_EMPTY = memoryview(bytearray(0))


class _Marker:
    """A named singleton returned by :meth:`Decoder.next_event`."""

    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: :meth:`Decoder.next_event` needs more bytes before it can return another event.
NEED_DATA = _Marker("NEED_DATA")
#: The payload of the last :class:`FrameHeader` is now complete in its target.
PAYLOAD_DONE = _Marker("PAYLOAD_DONE")


@dataclass(frozen=True)
class Hello:
    """A handshake message: HELLO (connector), ACCEPT or REJECT (acceptor's answer).

    Attributes:
        kind: HELLO, ACCEPT, REJECT or AUTH.
        version: the sender's protocol version.
        rank: the sender's global rank.
        world_size: the sender's world size.
        token: the sender's job token.
        reason: why a REJECT rejected; the sender's host key in a HELLO with F_SHM.
        flags: F_SHM, F_AUTH (HELLO only), both, or 0.
        nonce: the sender's nonce (HELLO with F_AUTH, AUTH), else empty.
        proof: the sender's proof (AUTH), else empty.
    """

    kind: int
    version: int
    rank: int
    world_size: int
    token: bytes
    reason: str = ""
    flags: int = 0
    nonce: bytes = b""
    proof: bytes = b""


class FrameHeader:
    """The header of a data frame; its payload follows (see :meth:`Decoder.set_target`).

    Attributes:
        kind: DATA, ARRAY or GOODBYE.
        comm_id: the communicator the frame belongs to.
        tag: the message tag (negative: meshcomm internal).
        length: payload bytes.
        dtype: the array's dtype (ARRAY frames), else None.
        shape: the array's shape (ARRAY frames), else None.
        address: where an RTS frame's payload is in the sender's memory (else 0).
    """

    __slots__ = ("address", "comm_id", "dtype", "kind", "length", "shape", "tag")

    def __init__(
        self,
        kind: int,
        comm_id: int,
        tag: int,
        length: int,
        dtype: np.dtype | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        self.kind = kind
        self.comm_id = comm_id
        self.tag = tag
        self.length = length
        self.dtype = dtype
        self.shape = shape
        self.address = 0

    def __repr__(self) -> str:
        kind = _FRAME_KINDS.get(self.kind, str(self.kind))
        extra = "" if self.dtype is None else f", dtype={self.dtype.name}, shape={self.shape}"
        return (
            f"FrameHeader({kind}, comm_id={self.comm_id}, tag={self.tag}, "
            f"length={self.length}{extra})"
        )


# -- encoding --------------------------------------------------------------------------------


def encode_hello(
    kind: int,
    *,
    rank: int,
    world_size: int,
    token: bytes,
    reason: str = "",
    flags: int = 0,
    nonce: bytes = b"",
) -> bytes:
    """Encode a handshake message (HELLO, ACCEPT, or REJECT with a reason).

    ``flags`` may be F_SHM on a HELLO (then ``reason`` is the sender's host key) or on an
    ACCEPT (no reason), and F_AUTH on a HELLO (then ``nonce`` is the connector's nonce).

    Example:
        >>> len(encode_hello(HELLO, rank=0, world_size=2, token=bytes(16)))
        36
        >>> len(encode_hello(HELLO, rank=0, world_size=2, token=bytes(16), flags=F_SHM,
        ...                  reason="host"))
        40
        >>> len(encode_hello(HELLO, rank=0, world_size=2, token=bytes(16), flags=F_AUTH,
        ...                  nonce=bytes(32)))
        68
    """
    if kind not in (HELLO, ACCEPT, REJECT):
        raise ValueError(f"handshake kind must be HELLO, ACCEPT or REJECT, got {kind}")
    if len(token) != TOKEN_SIZE:
        raise ValueError(f"job token must have {TOKEN_SIZE} bytes, got {len(token)}")
    if flags & ~_KIND_FLAGS[kind]:
        raise ValueError(
            f"handshake flags {flags} are not allowed on a {_HANDSHAKE_KINDS[kind]} "
            "(F_SHM on HELLO and ACCEPT, F_AUTH on HELLO, none on REJECT)"
        )
    if len(nonce) != (NONCE_SIZE if flags & F_AUTH else 0):
        raise ValueError(
            f"a HELLO with F_AUTH carries a {NONCE_SIZE}-byte nonce, nothing else does; "
            f"got {len(nonce)} bytes with flags {flags}"
        )
    with_reason = kind == REJECT or (kind == HELLO and flags & F_SHM)
    raw_reason = reason.encode()[:MAX_REASON] if with_reason else b""
    head = _HANDSHAKE.pack(MAGIC, VERSION, kind, flags, rank, world_size, len(raw_reason), token)
    return head + raw_reason + bytes(nonce)


def encode_auth(*, rank: int, world_size: int, token: bytes, nonce: bytes, proof: bytes) -> bytes:
    """Encode an AUTH message: the sender's nonce and its proof of the job's secret.

    Example:
        >>> len(encode_auth(rank=0, world_size=2, token=bytes(16), nonce=bytes(32),
        ...                 proof=bytes(32)))
        100
    """
    if len(token) != TOKEN_SIZE:
        raise ValueError(f"job token must have {TOKEN_SIZE} bytes, got {len(token)}")
    if len(nonce) != NONCE_SIZE or len(proof) != NONCE_SIZE:
        raise ValueError(
            f"AUTH needs a {NONCE_SIZE}-byte nonce and proof, got {len(nonce)} and {len(proof)}"
        )
    head = _HANDSHAKE.pack(MAGIC, VERSION, AUTH, 0, rank, world_size, 0, token)
    return head + bytes(nonce) + bytes(proof)


def encode_header(kind: int, *, comm_id: int, tag: int, length: int, meta: bytes = b"") -> bytes:
    """Encode a frame header and its metadata; the payload (``length`` bytes) follows it.

    Example:
        >>> len(encode_header(DATA, comm_id=1, tag=0, length=8))
        32
    """
    return _HEADER.pack(_FRAME_MARKER, kind, 0, len(meta), 0, comm_id, tag, length) + meta


def pack_data_header(comm_id: int, tag: int, length: int) -> bytes:
    """Encode a DATA frame header (the hot path of every Link exchange)."""
    return _HEADER.pack(_FRAME_MARKER, DATA, 0, 0, 0, comm_id, tag, length)


def pack_rts_header(comm_id: int, tag: int, length: int, address: int) -> bytes:
    """Encode an RTS frame: a DATA payload of ``length`` bytes to read at ``address``.

    Example:
        >>> dec = Decoder(handshake=False)
        >>> dec.receive_data(pack_rts_header(3, -1, 1 << 20, 0x7F00))
        >>> h = dec.next_event(); (h.kind == RTS, h.length, hex(h.address))
        (True, 1048576, '0x7f00')
        >>> dec.next_event() is NEED_DATA          # no payload follows an RTS
        True
    """
    return _RTS_HEADER.pack(_FRAME_MARKER, RTS, 0, 8, 0, comm_id, tag, length, address)


#: The whole FIN frame (it never varies).
FIN_FRAME = _HEADER.pack(_FRAME_MARKER, FIN, 0, 0, 0, 0, 0, 0)


def check_hello(
    hello: Hello,
    *,
    kinds: Sequence[int],
    token: bytes,
    world_size: int,
    peer: str,
    expect_rank: int | None = None,
) -> None:
    """Check a peer's handshake against this job; raise ``ProtocolError`` saying what differs.

    Args:
        hello: the decoded handshake.
        kinds: the handshake kinds allowed at this point.
        token: this job's token.
        world_size: this job's world size.
        peer: how to name the peer in messages (an address or a rank).
        expect_rank: the global rank the peer must have, if known.

    Example:
        >>> h = Hello(HELLO, VERSION, rank=1, world_size=2, token=bytes(16))
        >>> check_hello(h, kinds=[HELLO], token=bytes(16), world_size=2, peer="x")
    """
    if hello.kind not in kinds:
        wanted = " or ".join(_HANDSHAKE_KINDS[k] for k in kinds)
        got = _HANDSHAKE_KINDS.get(hello.kind, str(hello.kind))
        raise ProtocolError(f"handshake from {peer}: expected {wanted}, got {got}")
    if hello.token != token:
        # Only that it differs: this text goes back to the stranger in a REJECT.
        raise ProtocolError(
            f"handshake from {peer}: its job token differs from this job's (a process of "
            "another or an earlier job)"
        )
    if hello.world_size != world_size:
        raise ProtocolError(
            f"handshake from {peer}: world size {hello.world_size} differs from this "
            f"job's {world_size}"
        )
    if expect_rank is not None and hello.rank != expect_rank:
        raise ProtocolError(
            f"handshake from {peer}: it says it is rank {hello.rank}, expected rank {expect_rank}"
        )


# -- decoding --------------------------------------------------------------------------------

_S_HELLO = 0
_S_HEADER = 1
_S_TARGET = 2
_S_PAYLOAD = 3
_S_ERROR = 4


class Decoder:
    """Incremental decoder of one connection's incoming bytes: a handshake, then frames.

    Feed bytes with :meth:`receive_data` (copies) or :meth:`recv_view` + :meth:`commit`
    (``sock.recv_into`` with no copy), then call :meth:`next_event` until it returns
    :data:`NEED_DATA`. Events: :class:`Hello` (first), :class:`FrameHeader`, after which
    :meth:`set_target` must name the payload's buffer, and :data:`PAYLOAD_DONE`.

    Args:
        bufsize: initial size of the internal buffer.
        handshake: whether a handshake message comes first (False: frames only).

    Raises:
        ProtocolError: from :meth:`next_event` on malformed input; the decoder then stays
            broken and raises the same error again.
    """

    def __init__(self, bufsize: int = 64 * 1024, *, handshake: bool = True) -> None:
        self._buf = bytearray(
            max(bufsize, HANDSHAKE_SIZE + MAX_REASON + AUTH_SIZE, HEADER_SIZE + MAX_META)
        )
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._state = _S_HELLO if handshake else _S_HEADER
        self._header: FrameHeader | None = None
        self._target = _EMPTY
        self._filled = 0
        self._remaining = 0
        self._direct = False
        self._error: ProtocolError | None = None

    # -- feeding ---------------------------------------------------------------------------
    def recv_view(self) -> memoryview:
        """Return writable memory for the next ``recv_into``; then call :meth:`commit`.

        While a large payload is pending and no buffered bytes are left, this is the
        payload's own target buffer, so the bytes land where they belong.
        """
        if (
            self._state == _S_PAYLOAD
            and self._start == self._end
            and self._remaining >= _DIRECT_MIN
        ):
            self._direct = True
            return self._target[self._filled :]
        self._direct = False
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._buf) - self._end < _MIN_FREE:
            self._compact(_MIN_FREE)
        return self._view[self._end :]

    def commit(self, nbytes: int) -> None:
        """Record that ``nbytes`` were written into the last :meth:`recv_view`."""
        if self._direct:
            self._filled += nbytes
            self._remaining -= nbytes
            self._direct = False
        else:
            self._end += nbytes

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data`` to the bytes waiting to be decoded (copies it)."""
        data = memoryview(data).cast("B")
        if len(self._buf) - self._end < len(data):
            self._compact(len(data))
        self._view[self._end : self._end + len(data)] = data
        self._end += len(data)

    def _compact(self, free: int) -> None:
        # Move the unparsed bytes to the front, into a larger buffer when they would not fit.
        pending = self._end - self._start
        if len(self._buf) - pending >= free:
            self._view[:pending] = self._view[self._start : self._end]
        else:
            new = bytearray(max(2 * len(self._buf), pending + free))
            new[:pending] = self._view[self._start : self._end]
            self._view.release()
            self._buf = new
            self._view = memoryview(new)
        self._start = 0
        self._end = pending

    @property
    def buffered(self) -> int:
        """Bytes received but not yet decoded."""
        return self._end - self._start

    @property
    def idle(self) -> bool:
        """Whether no byte is buffered and no frame is partly decoded (frames may be parsed
        elsewhere, e.g. in place in a shared-memory ring)."""
        return self._state == _S_HEADER and self._end == self._start

    @property
    def in_frame(self) -> bool:
        """Whether a frame is partly decoded (EOF now would cut it)."""
        return self._state in (_S_TARGET, _S_PAYLOAD) or self._end > self._start

    def expect_handshake(self) -> None:
        """Say that another handshake message comes next (the AUTH exchange of a link).

        Raises:
            RuntimeError: a frame is partly decoded.
        """
        if self._state not in (_S_HELLO, _S_HEADER):
            raise RuntimeError("expect_handshake() is only valid between messages")
        self._state = _S_HELLO

    # -- payload target ----------------------------------------------------------------------
    def set_target(self, target: memoryview) -> None:
        """Name the buffer (exactly the frame's length, format "B") its payload goes to."""
        if self._state != _S_TARGET or self._header is None:
            raise RuntimeError("set_target() is only valid right after a FrameHeader event")
        if len(target) != self._header.length:
            raise ValueError(
                f"payload target has {len(target)} bytes, the frame has {self._header.length}"
            )
        self._target = target
        self._filled = 0
        self._remaining = self._header.length
        self._state = _S_PAYLOAD

    # -- events ------------------------------------------------------------------------------
    def next_event(self) -> Hello | FrameHeader | _Marker:
        """Decode the next event, or return :data:`NEED_DATA`.

        Raises:
            ProtocolError: the bytes are not a valid handshake or frame.
            RuntimeError: a FrameHeader's payload target was not set.
        """
        state = self._state
        if state == _S_PAYLOAD:
            return self._payload()
        if state == _S_HEADER:
            return self._frame_header()
        if state == _S_HELLO:
            return self._hello()
        if state == _S_TARGET:
            raise RuntimeError("call set_target() for the last FrameHeader before next_event()")
        raise self._error or ProtocolError("decoder is broken")

    def _fail(self, message: str) -> ProtocolError:
        self._state = _S_ERROR
        self._error = ProtocolError(message)
        return self._error

    def _payload(self) -> _Marker:
        avail = self._end - self._start
        if avail and self._remaining:
            n = min(avail, self._remaining)
            self._target[self._filled : self._filled + n] = self._view[
                self._start : self._start + n
            ]
            self._start += n
            self._filled += n
            self._remaining -= n
        if self._remaining:
            return NEED_DATA
        self._state = _S_HEADER
        self._target = _EMPTY
        self._header = None
        return PAYLOAD_DONE

    def _frame_header(self) -> FrameHeader | _Marker:
        start = self._start
        if self._end - start < HEADER_SIZE:
            if self._end - start >= 2 and self._buf[start : start + 2] != _FRAME_MARKER:
                raise self._fail(f"bad frame marker {bytes(self._buf[start : start + 2])!r}")
            return NEED_DATA
        marker, kind, flags, meta_len, reserved, comm_id, tag, length = _HEADER.unpack_from(
            self._buf, start
        )
        if marker != _FRAME_MARKER:
            raise self._fail(f"bad frame marker {marker!r}, expected {_FRAME_MARKER!r}")
        if kind not in _FRAME_KINDS:
            raise self._fail(f"unknown frame kind {kind}")
        if flags or reserved:
            raise self._fail(f"frame flags {flags} and reserved {reserved} must be 0")
        if meta_len > MAX_META:
            raise self._fail(f"frame metadata of {meta_len} bytes exceeds {MAX_META}")
        if length > MAX_PAYLOAD:
            raise self._fail(f"frame payload of {length} bytes exceeds {MAX_PAYLOAD}")
        if kind == RTS:
            if meta_len != 8:
                raise self._fail(f"RTS frames carry an 8-byte address, got {meta_len} bytes")
        elif kind != ARRAY and meta_len:
            raise self._fail(f"{_FRAME_KINDS[kind]} frames carry no metadata, got {meta_len}")
        if kind in (GOODBYE, FIN) and length:
            raise self._fail(f"{_FRAME_KINDS[kind]} frames carry no payload, got {length} bytes")
        if kind == SHM and length > MAX_SHM_MESSAGE:
            raise self._fail(f"SHM frame of {length} bytes exceeds {MAX_SHM_MESSAGE}")
        if self._end - start < HEADER_SIZE + meta_len:
            return NEED_DATA
        header = FrameHeader(kind, comm_id, tag, length)
        if kind in (RTS, FIN):
            # Nothing of the payload travels in the stream: the next frame follows at once.
            if kind == RTS:
                header.address = _U64.unpack_from(self._buf, start + HEADER_SIZE)[0]
            self._start = start + HEADER_SIZE + meta_len
            return header
        if kind == ARRAY:
            meta = self._view[start + HEADER_SIZE : start + HEADER_SIZE + meta_len]
            try:
                dtype, shape = decode_array_meta(meta)
            except ProtocolError as exc:
                raise self._fail(str(exc)) from None
            expected = math.prod(shape) * dtype.itemsize
            if expected != length:
                raise self._fail(
                    f"ARRAY frame of {dtype.name} {shape} needs {expected} bytes, "
                    f"header says {length}"
                )
            header.dtype = dtype
            header.shape = shape
        self._start = start + HEADER_SIZE + meta_len
        self._header = header
        self._state = _S_TARGET
        return header

    def _hello(self) -> Hello | _Marker:
        start = self._start
        avail = self._end - start
        have = min(avail, len(MAGIC))
        if self._buf[start : start + have] != MAGIC[:have]:
            got = bytes(self._buf[start : start + have])
            raise self._fail(f"bad magic {got!r}, expected {MAGIC!r}: not a meshcomm tcp peer")
        if avail < HANDSHAKE_SIZE:
            return NEED_DATA
        _, version, kind, flags, rank, world, reason_len, token = _HANDSHAKE.unpack_from(
            self._buf, start
        )
        if version != VERSION:
            raise self._fail(f"protocol version {version} differs from this side's {VERSION}")
        if kind not in _HANDSHAKE_KINDS:
            raise self._fail(f"unknown handshake kind {kind}")
        if flags & ~_KIND_FLAGS[kind]:
            raise self._fail(f"handshake flags {flags} are not allowed on this handshake")
        may_reason = kind == REJECT or (kind == HELLO and flags & F_SHM)
        if reason_len > MAX_REASON or (reason_len and not may_reason):
            raise self._fail(f"handshake reason of {reason_len} bytes is not allowed here")
        if world < 1 or rank >= world:
            raise self._fail(f"handshake rank {rank} is outside a world of {world}")
        extra = AUTH_SIZE if kind == AUTH else NONCE_SIZE if flags & F_AUTH else 0
        end = start + HANDSHAKE_SIZE + reason_len
        if avail < HANDSHAKE_SIZE + reason_len + extra:
            return NEED_DATA
        text = bytes(self._buf[start + HANDSHAKE_SIZE : end]).decode(errors="replace")
        nonce = bytes(self._buf[end : end + min(extra, NONCE_SIZE)])
        proof = bytes(self._buf[end + NONCE_SIZE : end + extra]) if kind == AUTH else b""
        self._start = end + extra
        self._state = _S_HEADER
        return Hello(kind, version, rank, world, bytes(token), text, flags, nonce, proof)
