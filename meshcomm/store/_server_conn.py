"""The server's side of one store connection, sans-IO: bytes in, :class:`Hello`, then
:class:`ClientProof` (with a secret), then :class:`Request` or :class:`Refused` events out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshcomm.common.secret import NONCE_BYTES, PROOF_BYTES
from meshcomm.errors import ProtocolError
from meshcomm.store._codec import REQUEST_PARSERS
from meshcomm.store._frames import (
    ADMIT_THRESHOLD,
    FLAG_AUTH,
    FRAMES_STAGE,
    HEADER_SIZE,
    HEADER_STRUCT,
    HELLO_SIZE,
    HELLO_STAGE,
    HELLO_STRUCT,
    OP_NAMES,
    PROOF_STAGE,
    PROTOCOL_VERSION,
    REQUEST_LIMITS,
    TAG_BYTES,
    ClientProof,
    Hello,
    Refused,
    Request,
    check_magic,
)
from meshcomm.store._mac import TO_CLIENT, TO_SERVER, FrameMac, check_tag

__all__ = ["ServerConnection"]


class ServerConnection:
    """The server's view of one connection: a :class:`Hello`, then :class:`Request` events.

    With authentication, the server calls :meth:`expect_proof` after the hello; the next
    event is then the client's :class:`ClientProof`, and no request is parsed before it.
    Given a session key there, every later request must carry its tag (checked before its
    body is parsed; :class:`MacError` otherwise), and :meth:`frame` tags every response.

    Feed received bytes with :meth:`receive_data`, then call :meth:`next_event` until it
    returns None. Memory stays bounded: a frame's length is judged before its body is kept.

    Args:
        admit: called once per request frame whose body exceeds :data:`ADMIT_THRESHOLD`, as
            ``admit(rid, op, body_length)`` once its header is in and before its body is kept;
            a returned reason refuses the frame: its body is skipped as it arrives and
            :meth:`next_event` returns a :class:`Refused` (the server answers ERROR).

    Example:
        >>> conn = ServerConnection()
        >>> conn.receive_data(b"GET / HTTP/1.1\\r\\n")
        >>> conn.next_event()
        Traceback (most recent call last):
        ...
        meshcomm.errors.ProtocolError: client sent b'GET ', not the meshcomm store magic b'MCKV'
    """

    __slots__ = (
        "_admit",
        "_admitted",
        "_buf",
        "_key",
        "_mac_in",
        "_mac_out",
        "_refused",
        "_skip",
        "_skipped_mac",
        "_stage",
    )

    def __init__(self, admit: Callable[[int, int, int], str | None] | None = None) -> None:
        self._buf = bytearray()
        self._stage = HELLO_STAGE
        self._admit = admit
        self._admitted = False
        self._skip = 0
        # Frame MACs (None without a session key), and for a refused frame whose body is
        # being skipped on an authenticated connection: its running MAC and the event that
        # is returned once its tag has checked out.
        self._key: bytes | None = None
        self._mac_in: FrameMac | None = None
        self._mac_out: FrameMac | None = None
        self._skipped_mac: Any = None
        self._refused: Refused | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as events."""
        return len(self._buf)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Add bytes received from the client (copied: the caller may reuse ``data``)."""
        if self._skip:
            dropped = min(self._skip, len(data))
            self._skip -= dropped
            data = memoryview(data)
            if self._skipped_mac is not None:  # a refused frame is authenticated all the same
                self._skipped_mac.update(data[:dropped])
            data = data[dropped:]
        self._buf += data

    @property
    def authenticated(self) -> bool:
        """True once frames carry MACs (a session key was given to :meth:`expect_proof`)."""
        return self._mac_in is not None

    @property
    def in_handshake(self) -> bool:
        """True until the hello (and, when asked for, the proof) has been returned."""
        return self._stage != FRAMES_STAGE

    def expect_proof(self, key: bytes | None = None) -> None:
        """After a :class:`Hello`: the next event must be the client's :class:`ClientProof`.

        Until it is in, no request is parsed and at most a proof's bytes are buffered.

        Args:
            key: the session key (``meshcomm.common.secret.session_key``); every frame after the
                proof, both ways, then carries a MAC under it. The caller must still check
                the proof and drop the connection if it is wrong.
        """
        self._stage = PROOF_STAGE
        self._key = key

    def frame(self, out: bytearray, *parts: bytes | bytearray | memoryview) -> None:
        """Append one response frame, given as consecutive ``parts``, to ``out``.

        On an authenticated connection its tag follows it. Every frame sent after the
        handshake must go through here, in the order sent: the tags count frames.
        """
        for part in parts:
            out += part
        if self._mac_out is not None:
            out += self._mac_out.tag(*parts)

    def next_event(self) -> Hello | ClientProof | Request | Refused | None:
        """Return the next complete event, or None if more bytes are needed.

        Raises:
            ProtocolError: the bytes break the protocol; drop the connection.
        """
        buf = self._buf
        if self._stage != FRAMES_STAGE:
            return self._handshake_event()
        if self._refused is not None:
            return self._refused_event()
        if len(buf) < HEADER_SIZE:
            return None
        length, rid, op = HEADER_STRUCT.unpack_from(buf, 0)
        limit = REQUEST_LIMITS.get(op)
        if limit is None:
            raise ProtocolError(f"unknown opcode {op} in request {rid}")
        if length > limit:
            raise ProtocolError(
                f"{OP_NAMES[op]} request {rid} announces a {length}-byte body; the limit is "
                f"{limit} bytes"
            )
        end = HEADER_SIZE + length
        if length > ADMIT_THRESHOLD and not self._admitted and self._admit is not None:
            reason = self._admit(rid, op, length)
            if reason is not None:
                kept = min(len(buf), end)
                refused = Refused(rid, op, reason)
                if self._mac_in is None:  # answered at once, while its body is skipped
                    del buf[:kept]
                    self._skip = end - kept
                    return refused
                # Authenticated: answered once the skipped body's tag has checked out, so
                # that nothing is done for a frame that was changed on the way.
                self._skipped_mac = self._mac_in.begin()
                self._skipped_mac.update(memoryview(buf)[:kept])
                del buf[:kept]
                self._skip = end - kept
                self._refused = refused
                return self._refused_event()
            self._admitted = True
        mac = self._mac_in
        if mac is None:
            if len(buf) < end:
                return None
            self._admitted = False
            with memoryview(buf) as view:  # one copy of a large body, not two
                body = bytes(view[HEADER_SIZE:end])
            del buf[:end]
            return Request(rid, op, REQUEST_PARSERS[op](body))
        if len(buf) < end + TAG_BYTES:
            return None
        self._admitted = False
        with memoryview(buf) as view:
            check_tag(mac.tag(view[:end]), view[end : end + TAG_BYTES], "client")
            body = bytes(view[HEADER_SIZE:end])
        del buf[: end + TAG_BYTES]
        return Request(rid, op, REQUEST_PARSERS[op](body))

    def _refused_event(self) -> Refused | None:
        """The pending :class:`Refused` once its body is skipped (and its tag checked)."""
        refused = self._refused
        if self._skip or refused is None:
            return None
        if self._skipped_mac is not None:
            buf = self._buf
            if len(buf) < TAG_BYTES:
                return None
            expected = bytes(self._skipped_mac.digest()[:TAG_BYTES])
            check_tag(expected, buf[:TAG_BYTES], "client")
            del buf[:TAG_BYTES]
            self._skipped_mac = None
        self._refused = None
        return refused

    def _handshake_event(self) -> Hello | ClientProof | None:
        buf = self._buf
        if self._stage == PROOF_STAGE:
            # Nothing may follow the proof before the verdict: a request pipelined ahead of
            # authentication is refused, so an unauthenticated peer can buffer 32 bytes.
            if len(buf) > PROOF_BYTES:
                raise ProtocolError(
                    f"client sent {len(buf)} bytes where a {PROOF_BYTES}-byte proof was expected"
                )
            if len(buf) < PROOF_BYTES:
                return None
            proof = bytes(buf)
            buf.clear()
            self._stage = FRAMES_STAGE
            if self._key is not None:
                self._mac_in = FrameMac(self._key, TO_SERVER)
                self._mac_out = FrameMac(self._key, TO_CLIENT)
                self._key = None
            return ClientProof(proof)
        check_magic(buf, "client")
        if len(buf) < HELLO_SIZE:
            return None
        _, version, flags = HELLO_STRUCT.unpack_from(buf, 0)
        nonce = b""
        # Another version's hello ends here, whatever its flags: the answer is "bad version".
        if version == PROTOCOL_VERSION and flags & FLAG_AUTH:
            if len(buf) < HELLO_SIZE + NONCE_BYTES:
                return None
            nonce = bytes(buf[HELLO_SIZE : HELLO_SIZE + NONCE_BYTES])
            del buf[: HELLO_SIZE + NONCE_BYTES]
        else:
            del buf[:HELLO_SIZE]
        self._stage = FRAMES_STAGE
        return Hello(version, flags, nonce)
