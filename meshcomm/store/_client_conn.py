"""The client's side of one store connection, sans-IO: requests framed (and tagged) out,
bytes in, a :class:`HelloReply` (then an :class:`AuthResult`, with a secret) and
:class:`Response` events out.
"""

from __future__ import annotations

from meshcomm.common.secret import NONCE_BYTES, PROOF_BYTES
from meshcomm.errors import ProtocolError
from meshcomm.store._frames import (
    FLAG_AUTH,
    FLAG_MAC,
    FRAMES_STAGE,
    HEADER_SIZE,
    HEADER_STRUCT,
    HELLO_CHALLENGE,
    HELLO_CHALLENGE_MAC,
    HELLO_SIZE,
    HELLO_STAGE,
    HELLO_STRUCT,
    MAGIC,
    MAX_BODY_BYTES,
    PROOF_STAGE,
    PROTOCOL_VERSION,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_TIMEOUT,
    TAG_BYTES,
    AuthResult,
    HelloReply,
    Response,
    check_magic,
)
from meshcomm.store._mac import TO_CLIENT, TO_SERVER, FrameMac, check_tag

__all__ = ["ClientConnection"]

# Response statuses a client accepts; any other ends the connection.
_STATUSES = frozenset((STATUS_OK, STATUS_ERROR, STATUS_TIMEOUT))


class ClientConnection:
    """The client's view of one connection: a :class:`HelloReply`, then :class:`Response` s.

    After a challenge, :meth:`answer` makes the proof to send, and the next event is the
    server's :class:`AuthResult`. Given a session key there, :meth:`request` tags every
    request and every response must carry its tag (:class:`MacError` otherwise).

    Example:
        >>> from meshcomm.store.wire import hello_reply, ok_int, parse_int
        >>> conn = ClientConnection()
        >>> conn.receive_data(hello_reply(True) + ok_int(3, 42))
        >>> conn.next_event()
        HelloReply(version=2, status=0, nonce=b'', proof=b'')
        >>> rid, status, body = conn.next_event()
        >>> rid, status, parse_int(body)
        (3, 0, 42)
    """

    __slots__ = ("_buf", "_mac_in", "_mac_out", "_stage")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._stage = HELLO_STAGE
        self._mac_in: FrameMac | None = None
        self._mac_out: FrameMac | None = None

    def hello(self, flags: int = 0, nonce: bytes | None = None) -> bytes:
        """The handshake this client sends first; with ``nonce``, it asks to authenticate.

        An authenticating hello also asks for frame MACs (``FLAG_MAC``): this client accepts
        no authenticated connection without them.
        """
        if nonce is None:
            return HELLO_STRUCT.pack(MAGIC, PROTOCOL_VERSION, flags & ~(FLAG_AUTH | FLAG_MAC))
        if len(nonce) != NONCE_BYTES:
            raise ValueError(f"a nonce has {NONCE_BYTES} bytes, got {len(nonce)}")
        return HELLO_STRUCT.pack(MAGIC, PROTOCOL_VERSION, flags | FLAG_AUTH | FLAG_MAC) + nonce

    def answer(self, proof: bytes, key: bytes | None = None) -> bytes:
        """The client's proof, sent after a challenge; the server's verdict comes next.

        Args:
            proof: this client's proof.
            key: the session key (``meshcomm.common.secret.session_key``) after a
                ``HELLO_CHALLENGE_MAC``: the frames after the verdict then carry MACs.
        """
        if len(proof) != PROOF_BYTES:
            raise ValueError(f"a proof has {PROOF_BYTES} bytes, got {len(proof)}")
        self._stage = PROOF_STAGE
        if key is not None:
            self._mac_in = FrameMac(key, TO_CLIENT)
            self._mac_out = FrameMac(key, TO_SERVER)
        return bytes(proof)

    @property
    def authenticated(self) -> bool:
        """True when frames carry MACs (a session key was given to :meth:`answer`)."""
        return self._mac_in is not None

    def seal(self, frame: bytes) -> bytes:
        """A request already framed by :func:`request`, with its tag if authenticated.

        For frames built ahead (tests, fuzzers); :meth:`request` saves a copy of the body.
        """
        if self._mac_out is None:
            return bytes(frame)
        return frame + self._mac_out.tag(frame)

    def request(self, op: int, rid: int, body: bytes) -> bytes:
        """Frame a request like :func:`request`, and tag it on an authenticated connection.

        Every request sent after the handshake must be framed here (or by :meth:`seal`), in
        the order sent: the tags count frames.
        """
        header = HEADER_STRUCT.pack(len(body), rid, op)
        if self._mac_out is None:
            return header + body
        return b"".join((header, body, self._mac_out.tag(header, body)))

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Add bytes received from the server (copied: the caller may reuse ``data``)."""
        self._buf += data

    def next_event(self) -> HelloReply | AuthResult | Response | None:
        """Return the next complete event, or None if more bytes are needed.

        Raises:
            ProtocolError: the server's bytes break the protocol.
        """
        buf = self._buf
        if self._stage != FRAMES_STAGE:
            check_magic(buf, "server")
            if len(buf) < HELLO_SIZE:
                return None
            _, version, status = HELLO_STRUCT.unpack_from(buf, 0)
            if self._stage == PROOF_STAGE:
                del buf[:HELLO_SIZE]
                self._stage = FRAMES_STAGE
                return AuthResult(version, status)
            nonce = proof = b""
            if version == PROTOCOL_VERSION and status in (HELLO_CHALLENGE, HELLO_CHALLENGE_MAC):
                end = HELLO_SIZE + NONCE_BYTES + PROOF_BYTES
                if len(buf) < end:
                    return None
                nonce = bytes(buf[HELLO_SIZE : HELLO_SIZE + NONCE_BYTES])
                proof = bytes(buf[HELLO_SIZE + NONCE_BYTES : end])
                del buf[:end]
            else:
                del buf[:HELLO_SIZE]
            self._stage = FRAMES_STAGE
            return HelloReply(version, status, nonce, proof)
        if len(buf) < HEADER_SIZE:
            return None
        length, rid, status = HEADER_STRUCT.unpack_from(buf, 0)
        mac = self._mac_in
        # Without a MAC, a bad status ends the connection at once; with one, a changed
        # status byte is reported as what it is, tampering (the length bounds memory first).
        if mac is None and status not in _STATUSES:
            raise ProtocolError(f"unknown response status {status} for request {rid}")
        if length > MAX_BODY_BYTES:
            raise ProtocolError(
                f"response {rid} announces a {length}-byte body; the limit is {MAX_BODY_BYTES}"
            )
        end = HEADER_SIZE + length
        if mac is None:
            if len(buf) < end:
                return None
            body = bytes(buf[HEADER_SIZE:end])
            del buf[:end]
            return Response(rid, status, body)
        if len(buf) < end + TAG_BYTES:
            return None
        with memoryview(buf) as view:
            check_tag(mac.tag(view[:end]), view[end : end + TAG_BYTES], "server")
            body = bytes(view[HEADER_SIZE:end])
        del buf[: end + TAG_BYTES]
        if status not in _STATUSES:
            raise ProtocolError(f"unknown response status {status} for request {rid}")
        return Response(rid, status, body)
