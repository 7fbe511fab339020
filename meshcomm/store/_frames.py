"""The store protocol's frame layout: magic, version, flags, statuses, opcodes, limits, events.

What every other part of :mod:`meshcomm.store.wire` agrees on: the handshake's and the
frames' byte layout (big-endian ``struct`` formats), the opcodes and their body limits, the
handshake's stages, and the events the two connection objects return. No I/O, no parsing of
bodies (that is :mod:`meshcomm.store._codec`).

Example:
    >>> HELLO_STRUCT.pack(MAGIC, PROTOCOL_VERSION, FLAG_REGISTER)
    b'MCKV\\x00\\x02\\x00\\x01'
    >>> HEADER_SIZE, OP_NAMES[OP_GET], REQUEST_LIMITS[OP_PING]
    (9, 'GET', 0)
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from meshcomm.errors import ProtocolError
from meshcomm.store.base import MAX_KEY_BYTES, MAX_VALUE_BYTES

__all__ = [
    "ADMIT_THRESHOLD",
    "FLAG_AUTH",
    "FLAG_MAC",
    "FLAG_REGISTER",
    "FOREVER",
    "FRAMES_STAGE",
    "HEADER_SIZE",
    "HEADER_STRUCT",
    "HELLO_AUTH_FAILED",
    "HELLO_AUTH_REQUIRED",
    "HELLO_BAD_VERSION",
    "HELLO_CHALLENGE",
    "HELLO_CHALLENGE_MAC",
    "HELLO_MAC_REQUIRED",
    "HELLO_OK",
    "HELLO_SIZE",
    "HELLO_STAGE",
    "HELLO_STRUCT",
    "MAGIC",
    "MAX_BODY_BYTES",
    "MAX_ERROR_BYTES",
    "OP_ADD",
    "OP_APPEND",
    "OP_CHECK",
    "OP_COMPARE_SET",
    "OP_DELETE",
    "OP_GET",
    "OP_MULTI_GET",
    "OP_MULTI_SET",
    "OP_NAMES",
    "OP_NUM_KEYS",
    "OP_PING",
    "OP_SET",
    "OP_WAIT",
    "PROOF_STAGE",
    "PROTOCOL_VERSION",
    "REQUEST_LIMITS",
    "STATUS_ERROR",
    "STATUS_OK",
    "STATUS_TIMEOUT",
    "TAG_BYTES",
    "AuthResult",
    "ClientProof",
    "Hello",
    "HelloReply",
    "Refused",
    "Request",
    "Response",
    "check_magic",
]

MAGIC = b"MCKV"
PROTOCOL_VERSION = 2
#: Client hello flag: count this client towards the master's ``world_size``.
FLAG_REGISTER = 0x1
#: Client hello flag: the client has a secret; its nonce follows the hello.
FLAG_AUTH = 0x2
#: Client hello flag: frames after the handshake carry MACs (set with ``FLAG_AUTH``).
FLAG_MAC = 0x4
HELLO_OK = 0
HELLO_BAD_VERSION = 1
HELLO_CHALLENGE = 2
HELLO_AUTH_REQUIRED = 3
HELLO_AUTH_FAILED = 4
#: A challenge (nonce and proof follow, as with ``HELLO_CHALLENGE``), and frame MACs after it.
HELLO_CHALLENGE_MAC = 5
#: The client asked to authenticate without frame MACs; this server requires them.
HELLO_MAC_REQUIRED = 6
#: Bytes of the tag after each frame of an authenticated connection: HMAC-SHA256 truncated
#: to 128 bits, still far beyond guessing (one forgery in 2**128 tries, each one costing the
#: attacker the connection).
TAG_BYTES = 16
#: Largest frame body either side accepts: one maximal value plus room for keys and counts.
MAX_BODY_BYTES = MAX_VALUE_BYTES + 64 * 1024
#: Longest error message a server sends, in bytes.
MAX_ERROR_BYTES = 4096
#: Frames with a body up to this size are admitted without asking the ``admit`` callback.
ADMIT_THRESHOLD = 64 * 1024
#: A blocking request's timeout at or above this many seconds (about 31 years; ``inf``
#: included) parks it with no deadline. Parsed timeouts are clamped into ``[0, FOREVER]``.
FOREVER = 1e9

OP_SET = 1
OP_GET = 2
OP_ADD = 3
OP_COMPARE_SET = 4
OP_WAIT = 5
OP_CHECK = 6
OP_DELETE = 7
OP_NUM_KEYS = 8
OP_MULTI_GET = 9
OP_MULTI_SET = 10
OP_APPEND = 11
OP_PING = 12
OP_NAMES = {
    OP_SET: "SET",
    OP_GET: "GET",
    OP_ADD: "ADD",
    OP_COMPARE_SET: "COMPARE_SET",
    OP_WAIT: "WAIT",
    OP_CHECK: "CHECK",
    OP_DELETE: "DELETE",
    OP_NUM_KEYS: "NUM_KEYS",
    OP_MULTI_GET: "MULTI_GET",
    OP_MULTI_SET: "MULTI_SET",
    OP_APPEND: "APPEND",
    OP_PING: "PING",
}

STATUS_OK = 0
STATUS_ERROR = 1
STATUS_TIMEOUT = 2

#: The hello and each handshake answer: magic, version, flags (client) or status (server).
HELLO_STRUCT = struct.Struct("!4sHH")
HELLO_SIZE = HELLO_STRUCT.size
#: Every frame's header: body length, request id, opcode (request) or status (response).
HEADER_STRUCT = struct.Struct("!IIB")
HEADER_SIZE = HEADER_STRUCT.size
#: Where a connection is: waiting for the hello, for the client's proof, or in frames.
HELLO_STAGE, PROOF_STAGE, FRAMES_STAGE = 0, 1, 2

# Largest body each opcode may carry; checked before the body is buffered.
REQUEST_LIMITS = {
    OP_SET: 4 + MAX_KEY_BYTES + MAX_VALUE_BYTES,
    OP_APPEND: 4 + MAX_KEY_BYTES + MAX_VALUE_BYTES,
    OP_GET: 8 + MAX_KEY_BYTES,
    OP_ADD: 8 + MAX_KEY_BYTES,
    OP_DELETE: MAX_KEY_BYTES,
    OP_COMPARE_SET: MAX_BODY_BYTES,
    OP_WAIT: MAX_BODY_BYTES,
    OP_MULTI_GET: MAX_BODY_BYTES,
    OP_CHECK: MAX_BODY_BYTES,
    OP_MULTI_SET: MAX_BODY_BYTES,
    OP_NUM_KEYS: 0,
    OP_PING: 0,
}


class Hello(NamedTuple):
    """The client's handshake, as the server sees it (``nonce`` set with ``FLAG_AUTH``)."""

    version: int
    flags: int
    nonce: bytes = b""


class HelloReply(NamedTuple):
    """The server's handshake answer, as the client sees it (a challenge carries the rest)."""

    version: int
    status: int
    nonce: bytes = b""
    proof: bytes = b""


class ClientProof(NamedTuple):
    """The client's answer to a challenge, as the server sees it."""

    proof: bytes


class AuthResult(NamedTuple):
    """The server's verdict on the client's proof: ``HELLO_OK`` or ``HELLO_AUTH_FAILED``."""

    version: int
    status: int


class Refused(NamedTuple):
    """A request frame the server's ``admit`` callback refused; its body is skipped unread."""

    rid: int
    op: int
    reason: str


class Request(NamedTuple):
    """One decoded request: its id, opcode and parsed arguments (see :mod:`meshcomm.store.wire`)."""

    rid: int
    op: int
    args: tuple[Any, ...]


class Response(NamedTuple):
    """One response frame; parse ``body`` with the ``parse_*`` helper its opcode needs."""

    rid: int
    status: int
    body: bytes


def check_magic(buf: bytearray, side: str) -> None:
    """Raise unless ``buf`` starts like the magic (a prefix of it is fine: more may come)."""
    head = bytes(buf[:4])
    if not MAGIC.startswith(head):
        raise ProtocolError(f"{side} sent {head!r}, not the meshcomm store magic {MAGIC!r}")
