"""The TCPStore wire protocol, sans-IO: bytes in, events out. No socket is touched here.

Handshake (version 2)::

    client -> server   magic b"MCKV" | u16 protocol version | u16 flags   (bit 0: register,
                       bit 1: authenticate, bit 2: frames carry MACs)
                       | [32-byte client nonce, with bit 1]
    server -> client   magic b"MCKV" | u16 protocol version | u16 status
                       | [32-byte server nonce | 32-byte server proof, with status 2 or 5]
    and with status 2 or 5:
    client -> server   32-byte client proof
    server -> client   magic b"MCKV" | u16 protocol version | u16 status (0 ok, 4 failed)

Statuses: 0 ok (no authentication), 1 bad version, 2 challenge (the server has a secret),
3 authentication required (the server has a secret, the client offered none), 4 the client's
proof was wrong, 5 challenge with frame MACs after it, 6 frame MACs required (the client
asked to authenticate without bit 2: a meshcomm older than frame MACs). Proofs are
``meshcomm._secret.proof(secret, role, b"store", client nonce, server nonce)`` with role
``b"server"`` / ``b"client"``: each side proves it knows the job's secret over both fresh
nonces, the secret never crosses the wire, and a recorded handshake is worthless on a new
connection (the other side's nonce differs). A client with a secret refuses a status-0
server; a server with a secret answers a client without one with status 3. A server that
sees a wrong magic closes the connection without a word; one that sees another version
answers with its own version and status 1, then closes. After the handshake every message is
a frame, big-endian::

    u32 body length | u32 request id | u8 opcode (request) or status (response) | body

The body length is checked against the opcode's bound (:data:`MAX_BODY_BYTES` at most) as soon
as the 9-byte header is in, before any of the body is buffered, so a huge length prefix costs
nothing. Keys (1 to ``MAX_KEY_BYTES``) and values (up to ``MAX_VALUE_BYTES``) are checked as
bodies are parsed. Any violation raises :class:`~meshcomm.errors.ProtocolError`.

Frame MACs. A client with a secret sets bit 2 as well as bit 1, and a server with a secret
answers status 5, not 2. Both sides insist: this server refuses a hello with bit 1 but not
bit 2 (status 6), and this client refuses a status-2 challenge, so an attacker who clears the
bit or rewrites the status gets a refusal, never an unprotected connection. After the
verdict every frame, in both directions, is followed by a :data:`TAG_BYTES`-byte tag::

    HMAC-SHA256(session key, direction | u64 frame counter | frame)[:16]

with the session key ``meshcomm._secret.session_key(secret, b"store", client nonce, server
nonce)``, direction ``0x01`` client-to-server and ``0x02`` server-to-client, and each
direction's counter starting at 0 and counting that direction's frames. The receiver checks
the tag before it parses the body, so a changed, replayed, reordered, dropped or reflected
frame raises :class:`MacError`. The header's length prefix counts the body alone and is
checked against the limits (and an unknown opcode refused) from the header, before the MAC
can be: bounded memory comes first. Connections without a secret carry no tags: their bytes
are what they were before frame MACs.

Request bodies (``key`` alone = the rest of the body; ``str`` = u32 length + bytes)::

    SET, APPEND     str key | value
    GET             f64 timeout | key   (seconds; NaN/negative -> 0, >= FOREVER -> no deadline)
    ADD             i64 amount | key
    COMPARE_SET     str key | str expected | desired
    WAIT, MULTI_GET f64 timeout | u32 n | n * str key
    CHECK           u32 n | n * str key
    DELETE          key
    MULTI_SET       u32 n | n * (str key | str value)
    NUM_KEYS, PING  (empty)

Response bodies: OK carries the value (GET, COMPARE_SET), an i64 (ADD, NUM_KEYS), a u8 (CHECK,
DELETE), ``u32 n | n * str value`` (MULTI_GET) or nothing; ERROR carries a UTF-8 message;
TIMEOUT carries the still-missing keys as ``u32 n | n * str key``.

Example:
    >>> client, server = ClientConnection(), ServerConnection()
    >>> server.receive_data(client.hello(FLAG_REGISTER))
    >>> server.next_event()
    Hello(version=2, flags=1, nonce=b'')
    >>> server.receive_data(request(OP_GET, 7, body_get(2.0, b"k")))
    >>> server.next_event()
    Request(rid=7, op=2, args=(2.0, b'k'))
    >>> client.receive_data(hello_reply(True) + ok_value(7, b"v"))
    >>> client.next_event(), client.next_event()
    (HelloReply(version=2, status=0, nonce=b'', proof=b''), Response(rid=7, status=0, body=b'v'))
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from meshcomm._secret import NONCE_BYTES, PROOF_BYTES
from meshcomm.errors import ProtocolError
from meshcomm.store.base import MAX_KEY_BYTES, MAX_VALUE_BYTES

__all__ = [
    "FLAG_REGISTER",
    "FOREVER",
    "ADMIT_THRESHOLD",
    "HEADER_SIZE",
    "FLAG_AUTH",
    "FLAG_MAC",
    "HELLO_AUTH_FAILED",
    "HELLO_AUTH_REQUIRED",
    "HELLO_BAD_VERSION",
    "HELLO_CHALLENGE",
    "HELLO_CHALLENGE_MAC",
    "HELLO_MAC_REQUIRED",
    "HELLO_OK",
    "HELLO_SIZE",
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
    "PROTOCOL_VERSION",
    "STATUS_ERROR",
    "STATUS_OK",
    "STATUS_TIMEOUT",
    "TAG_BYTES",
    "AuthResult",
    "ClientConnection",
    "ClientProof",
    "Hello",
    "HelloReply",
    "MacError",
    "Refused",
    "Request",
    "Response",
    "ServerConnection",
    "body_add",
    "body_compare_set",
    "body_get",
    "body_key_value",
    "body_keys",
    "body_multi_set",
    "body_wait",
    "error",
    "auth_result",
    "challenge",
    "hello_reply",
    "ok",
    "ok_bool",
    "ok_header",
    "ok_int",
    "ok_value",
    "ok_values",
    "parse_bool",
    "parse_int",
    "parse_keys",
    "parse_values",
    "request",
    "timed_out",
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
_STATUSES = frozenset((STATUS_OK, STATUS_ERROR, STATUS_TIMEOUT))

_HELLO = struct.Struct("!4sHH")
_HELLO_STAGE, _PROOF_STAGE, _FRAMES_STAGE = 0, 1, 2
HELLO_SIZE = _HELLO.size
_HEADER = struct.Struct("!IIB")
HEADER_SIZE = _HEADER.size
_HEADER_INT = struct.Struct("!IIBq")
_HEADER_BOOL = struct.Struct("!IIBB")
_U32 = struct.Struct("!I")
_I64 = struct.Struct("!q")
_F64 = struct.Struct("!d")
# The MAC input's prefix: the direction byte (a frame reflected back to its sender fails)
# and the frame's counter in that direction (a replayed, reordered or dropped frame fails).
_MAC_PREFIX = struct.Struct("!BQ")
_TO_SERVER = 1
_TO_CLIENT = 2
# Frames up to this size are joined with the MAC's prefix and hashed in one call.
_JOIN_BELOW = 4096

# Largest body each opcode may carry; checked before the body is buffered.
_REQUEST_LIMITS = {
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


class MacError(ProtocolError):
    """A frame of an authenticated connection failed its MAC: drop the connection.

    The frame was changed on the way, or replayed, reordered, dropped (the next frame's
    counter is then wrong) or reflected from the other direction.
    """


class _Mac:
    """One direction's frame MAC: the keyed HMAC-SHA256 state and the next frame's counter."""

    __slots__ = ("_base", "_counter", "_direction")

    def __init__(self, key: bytes, direction: int) -> None:
        # Keyed once: copy() per frame skips the HMAC key schedule (two SHA-256 blocks).
        self._base = hmac.new(key, digestmod=hashlib.sha256)
        self._direction = direction
        self._counter = 0

    def begin(self) -> Any:
        """A fresh HMAC over the direction and the next counter (then counted as used)."""
        mac = self._base.copy()
        mac.update(_MAC_PREFIX.pack(self._direction, self._counter))
        self._counter += 1
        return mac

    def tag(self, *parts: bytes | bytearray | memoryview) -> bytes:
        """The tag of the next frame, given as consecutive parts."""
        size = len(parts[0]) if len(parts) == 1 else sum(map(len, parts))
        if size > _JOIN_BELOW:  # a large frame is never copied for its MAC
            mac = self.begin()
            for part in parts:
                mac.update(part)
            return mac.digest()[:TAG_BYTES]
        # The common small frame: one update call instead of several, a measurable share
        # of a round trip of ~20 µs.
        mac = self._base.copy()
        mac.update(b"".join((_MAC_PREFIX.pack(self._direction, self._counter), *parts)))
        self._counter += 1
        return mac.digest()[:TAG_BYTES]


def _check_tag(expected: bytes, got: bytes | bytearray | memoryview, side: str) -> None:
    if not hmac.compare_digest(expected, bytes(got)):
        raise MacError(f"a frame from the {side} failed its MAC: the connection was tampered with")


class Refused(NamedTuple):
    """A request frame the server's ``admit`` callback refused; its body is skipped unread."""

    rid: int
    op: int
    reason: str


class Request(NamedTuple):
    """One decoded request: its id, opcode and parsed arguments (see the module docstring)."""

    rid: int
    op: int
    args: tuple[Any, ...]


class Response(NamedTuple):
    """One response frame; parse ``body`` with the ``parse_*`` helper its opcode needs."""

    rid: int
    status: int
    body: bytes


# --- encoding --------------------------------------------------------------------------------


def request(op: int, rid: int, body: bytes) -> bytes:
    """Frame a request body (built by a ``body_*`` helper) with opcode ``op`` and id ``rid``."""
    return _HEADER.pack(len(body), rid, op) + body


def body_key_value(key: bytes, value: bytes) -> bytes:
    """Body of SET and APPEND."""
    return _U32.pack(len(key)) + key + value


def body_get(timeout: float, key: bytes) -> bytes:
    """Body of GET: the seconds the server may park it, then the key."""
    return _F64.pack(timeout) + key


def body_add(amount: int, key: bytes) -> bytes:
    """Body of ADD."""
    return _I64.pack(amount) + key


def body_compare_set(key: bytes, expected: bytes, desired: bytes) -> bytes:
    """Body of COMPARE_SET."""
    return b"".join((_U32.pack(len(key)), key, _U32.pack(len(expected)), expected, desired))


def _strings(items: Sequence[bytes]) -> list[bytes]:
    parts = [_U32.pack(len(items))]
    pack = _U32.pack
    for item in items:
        parts.append(pack(len(item)))
        parts.append(item)
    return parts


def body_keys(keys: Sequence[bytes]) -> bytes:
    """Body of CHECK: a counted list of keys."""
    return b"".join(_strings(keys))


def body_wait(timeout: float, keys: Sequence[bytes]) -> bytes:
    """Body of WAIT and MULTI_GET: the seconds the server may park it, then the keys."""
    return _F64.pack(timeout) + b"".join(_strings(keys))


def body_multi_set(keys: Sequence[bytes], values: Sequence[bytes]) -> bytes:
    """Body of MULTI_SET (``keys`` and ``values`` have the same length)."""
    parts = [_U32.pack(len(keys))]
    pack = _U32.pack
    for key, value in zip(keys, values, strict=True):
        parts += (pack(len(key)), key, pack(len(value)), value)
    return b"".join(parts)


def hello_reply(ok: bool, status: int | None = None) -> bytes:
    """The server's 8-byte handshake answer: OK, bad version, or another ``status``."""
    if status is None:
        status = HELLO_OK if ok else HELLO_BAD_VERSION
    return _HELLO.pack(MAGIC, PROTOCOL_VERSION, status)


def challenge(nonce: bytes, proof: bytes, mac: bool = True) -> bytes:
    """The answer of a server with a secret: status 5 (2 without ``mac``), nonce and proof."""
    if len(nonce) != NONCE_BYTES or len(proof) != PROOF_BYTES:
        raise ValueError(f"a challenge needs a {NONCE_BYTES}-byte nonce and proof")
    status = HELLO_CHALLENGE_MAC if mac else HELLO_CHALLENGE
    return _HELLO.pack(MAGIC, PROTOCOL_VERSION, status) + nonce + proof


def auth_result(ok: bool) -> bytes:
    """The server's verdict on a client's proof."""
    return _HELLO.pack(MAGIC, PROTOCOL_VERSION, HELLO_OK if ok else HELLO_AUTH_FAILED)


def ok(rid: int) -> bytes:
    """An empty OK response."""
    return _HEADER.pack(0, rid, STATUS_OK)


def ok_header(rid: int, length: int) -> bytes:
    """The header of an OK response whose ``length``-byte body the caller sends after it."""
    return _HEADER.pack(length, rid, STATUS_OK)


def ok_value(rid: int, value: bytes) -> bytes:
    """An OK response carrying one value."""
    return _HEADER.pack(len(value), rid, STATUS_OK) + value


def ok_int(rid: int, number: int) -> bytes:
    """An OK response carrying a signed 64-bit integer."""
    return _HEADER_INT.pack(8, rid, STATUS_OK, number)


def ok_bool(rid: int, flag: bool) -> bytes:
    """An OK response carrying one boolean byte."""
    return _HEADER_BOOL.pack(1, rid, STATUS_OK, 1 if flag else 0)


def ok_values(rid: int, values: Sequence[bytes]) -> bytes:
    """An OK response carrying a counted list of values."""
    body = b"".join(_strings(values))
    return _HEADER.pack(len(body), rid, STATUS_OK) + body


def error(rid: int, message: str) -> bytes:
    """An ERROR response carrying a (truncated) UTF-8 message."""
    body = message.encode(errors="replace")[:MAX_ERROR_BYTES]
    return _HEADER.pack(len(body), rid, STATUS_ERROR) + body


def timed_out(rid: int, missing: Sequence[bytes]) -> bytes:
    """A TIMEOUT response naming the keys still missing."""
    body = b"".join(_strings(missing))
    return _HEADER.pack(len(body), rid, STATUS_TIMEOUT) + body


# --- parsing ---------------------------------------------------------------------------------


def _take(body: bytes, pos: int, limit: int, low: int, what: str) -> tuple[bytes, int]:
    """Read one ``u32 length | bytes`` field at ``pos``; return it and the next position."""
    if pos + 4 > len(body):
        raise ProtocolError(f"truncated {what} length at byte {pos} of a {len(body)}-byte body")
    (size,) = _U32.unpack_from(body, pos)
    if not low <= size <= limit:
        raise ProtocolError(f"{what} of {size} bytes; the protocol allows {low} to {limit}")
    pos += 4
    end = pos + size
    if end > len(body):
        raise ProtocolError(f"{what} of {size} bytes overruns a {len(body)}-byte body")
    return body[pos:end], end


def _take_list(body: bytes, pos: int, limit: int, low: int, what: str) -> list[bytes]:
    """Read ``u32 n | n * str`` filling the rest of ``body``."""
    if pos + 4 > len(body):
        raise ProtocolError(f"truncated {what} count in a {len(body)}-byte body")
    (count,) = _U32.unpack_from(body, pos)
    pos += 4
    if count > (len(body) - pos) // 4:
        raise ProtocolError(f"{count} {what}s cannot fit in a {len(body)}-byte body")
    items = []
    for _ in range(count):
        item, pos = _take(body, pos, limit, low, what)
        items.append(item)
    if pos != len(body):
        raise ProtocolError(f"{len(body) - pos} stray bytes after {count} {what}s")
    return items


def _check_key(key: bytes) -> bytes:
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ProtocolError(f"key of {len(key)} bytes; the protocol allows 1 to {MAX_KEY_BYTES}")
    return key


def _check_value(value: bytes) -> bytes:
    if len(value) > MAX_VALUE_BYTES:
        raise ProtocolError(f"value of {len(value)} bytes exceeds {MAX_VALUE_BYTES}")
    return value


def _timeout(body: bytes) -> float:
    if len(body) < 8:
        raise ProtocolError(f"truncated timeout in a {len(body)}-byte body")
    (seconds,) = _F64.unpack_from(body, 0)
    # Any float is accepted and clamped (a client's "forever" is not a protocol error):
    # NaN and negatives mean "do not wait", anything from FOREVER up means no deadline.
    if math.isnan(seconds) or seconds < 0:
        return 0.0
    return min(float(seconds), FOREVER)


def _parse_key_value(body: bytes) -> tuple[Any, ...]:
    key, pos = _take(body, 0, MAX_KEY_BYTES, 1, "key")
    return key, _check_value(body[pos:])


def _parse_get(body: bytes) -> tuple[Any, ...]:
    return _timeout(body), _check_key(body[8:])


def _parse_add(body: bytes) -> tuple[Any, ...]:
    if len(body) < 8:
        raise ProtocolError(f"truncated ADD amount in a {len(body)}-byte body")
    (amount,) = _I64.unpack_from(body, 0)
    return _check_key(body[8:]), amount


def _parse_compare_set(body: bytes) -> tuple[Any, ...]:
    key, pos = _take(body, 0, MAX_KEY_BYTES, 1, "key")
    expected, pos = _take(body, pos, MAX_VALUE_BYTES, 0, "value")
    return key, expected, _check_value(body[pos:])


def _parse_wait(body: bytes) -> tuple[Any, ...]:
    return _timeout(body), _take_list(body, 8, MAX_KEY_BYTES, 1, "key")


def _parse_check(body: bytes) -> tuple[Any, ...]:
    return (_take_list(body, 0, MAX_KEY_BYTES, 1, "key"),)


def _parse_delete(body: bytes) -> tuple[Any, ...]:
    return (_check_key(body),)


def _parse_empty(body: bytes) -> tuple[Any, ...]:
    if body:
        raise ProtocolError(f"expected an empty body, got {len(body)} bytes")
    return ()


def _parse_multi_set(body: bytes) -> tuple[Any, ...]:
    if len(body) < 4:
        raise ProtocolError(f"truncated MULTI_SET count in a {len(body)}-byte body")
    (count,) = _U32.unpack_from(body, 0)
    pos = 4
    if count > (len(body) - pos) // 8:
        raise ProtocolError(f"{count} pairs cannot fit in a {len(body)}-byte body")
    keys, values = [], []
    for _ in range(count):
        key, pos = _take(body, pos, MAX_KEY_BYTES, 1, "key")
        value, pos = _take(body, pos, MAX_VALUE_BYTES, 0, "value")
        keys.append(key)
        values.append(value)
    if pos != len(body):
        raise ProtocolError(f"{len(body) - pos} stray bytes after {count} MULTI_SET pairs")
    return keys, values


_PARSERS: dict[int, Callable[[bytes], tuple[Any, ...]]] = {
    OP_SET: _parse_key_value,
    OP_APPEND: _parse_key_value,
    OP_GET: _parse_get,
    OP_ADD: _parse_add,
    OP_COMPARE_SET: _parse_compare_set,
    OP_WAIT: _parse_wait,
    OP_MULTI_GET: _parse_wait,
    OP_CHECK: _parse_check,
    OP_DELETE: _parse_delete,
    OP_NUM_KEYS: _parse_empty,
    OP_PING: _parse_empty,
    OP_MULTI_SET: _parse_multi_set,
}


def parse_int(body: bytes) -> int:
    """Parse the i64 body of an OK answer to ADD or NUM_KEYS."""
    if len(body) != 8:
        raise ProtocolError(f"expected an 8-byte integer body, got {len(body)} bytes")
    return int(_I64.unpack(body)[0])


def parse_bool(body: bytes) -> bool:
    """Parse the one-byte body of an OK answer to CHECK or DELETE."""
    if len(body) != 1 or body[0] > 1:
        raise ProtocolError(f"expected a one-byte boolean body, got {body[:16]!r}")
    return body[0] == 1


def parse_values(body: bytes) -> list[bytes]:
    """Parse the counted value list of an OK answer to MULTI_GET."""
    return _take_list(body, 0, MAX_VALUE_BYTES, 0, "value")


def parse_keys(body: bytes) -> list[bytes]:
    """Parse the counted key list of a TIMEOUT answer."""
    return _take_list(body, 0, MAX_KEY_BYTES, 1, "key")


# --- connections -----------------------------------------------------------------------------


def _check_magic(buf: bytearray, side: str) -> None:
    head = bytes(buf[:4])
    if not MAGIC.startswith(head):
        raise ProtocolError(f"{side} sent {head!r}, not the meshcomm store magic {MAGIC!r}")


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
        self._stage = _HELLO_STAGE
        self._admit = admit
        self._admitted = False
        self._skip = 0
        # Frame MACs (None without a session key), and for a refused frame whose body is
        # being skipped on an authenticated connection: its running MAC and the event that
        # is returned once its tag has checked out.
        self._key: bytes | None = None
        self._mac_in: _Mac | None = None
        self._mac_out: _Mac | None = None
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
        return self._stage != _FRAMES_STAGE

    def expect_proof(self, key: bytes | None = None) -> None:
        """After a :class:`Hello`: the next event must be the client's :class:`ClientProof`.

        Until it is in, no request is parsed and at most a proof's bytes are buffered.

        Args:
            key: the session key (``meshcomm._secret.session_key``); every frame after the
                proof, both ways, then carries a MAC under it. The caller must still check
                the proof and drop the connection if it is wrong.
        """
        self._stage = _PROOF_STAGE
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
        if self._stage != _FRAMES_STAGE:
            return self._handshake_event()
        if self._refused is not None:
            return self._refused_event()
        if len(buf) < HEADER_SIZE:
            return None
        length, rid, op = _HEADER.unpack_from(buf, 0)
        limit = _REQUEST_LIMITS.get(op)
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
            return Request(rid, op, _PARSERS[op](body))
        if len(buf) < end + TAG_BYTES:
            return None
        self._admitted = False
        with memoryview(buf) as view:
            _check_tag(mac.tag(view[:end]), view[end : end + TAG_BYTES], "client")
            body = bytes(view[HEADER_SIZE:end])
        del buf[: end + TAG_BYTES]
        return Request(rid, op, _PARSERS[op](body))

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
            _check_tag(expected, buf[:TAG_BYTES], "client")
            del buf[:TAG_BYTES]
            self._skipped_mac = None
        self._refused = None
        return refused

    def _handshake_event(self) -> Hello | ClientProof | None:
        buf = self._buf
        if self._stage == _PROOF_STAGE:
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
            self._stage = _FRAMES_STAGE
            if self._key is not None:
                self._mac_in = _Mac(self._key, _TO_SERVER)
                self._mac_out = _Mac(self._key, _TO_CLIENT)
                self._key = None
            return ClientProof(proof)
        _check_magic(buf, "client")
        if len(buf) < HELLO_SIZE:
            return None
        _, version, flags = _HELLO.unpack_from(buf, 0)
        nonce = b""
        # Another version's hello ends here, whatever its flags: the answer is "bad version".
        if version == PROTOCOL_VERSION and flags & FLAG_AUTH:
            if len(buf) < HELLO_SIZE + NONCE_BYTES:
                return None
            nonce = bytes(buf[HELLO_SIZE : HELLO_SIZE + NONCE_BYTES])
            del buf[: HELLO_SIZE + NONCE_BYTES]
        else:
            del buf[:HELLO_SIZE]
        self._stage = _FRAMES_STAGE
        return Hello(version, flags, nonce)


class ClientConnection:
    """The client's view of one connection: a :class:`HelloReply`, then :class:`Response` s.

    After a challenge, :meth:`answer` makes the proof to send, and the next event is the
    server's :class:`AuthResult`. Given a session key there, :meth:`request` tags every
    request and every response must carry its tag (:class:`MacError` otherwise).

    Example:
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
        self._stage = _HELLO_STAGE
        self._mac_in: _Mac | None = None
        self._mac_out: _Mac | None = None

    def hello(self, flags: int = 0, nonce: bytes | None = None) -> bytes:
        """The handshake this client sends first; with ``nonce``, it asks to authenticate.

        An authenticating hello also asks for frame MACs (``FLAG_MAC``): this client accepts
        no authenticated connection without them.
        """
        if nonce is None:
            return _HELLO.pack(MAGIC, PROTOCOL_VERSION, flags & ~(FLAG_AUTH | FLAG_MAC))
        if len(nonce) != NONCE_BYTES:
            raise ValueError(f"a nonce has {NONCE_BYTES} bytes, got {len(nonce)}")
        return _HELLO.pack(MAGIC, PROTOCOL_VERSION, flags | FLAG_AUTH | FLAG_MAC) + nonce

    def answer(self, proof: bytes, key: bytes | None = None) -> bytes:
        """The client's proof, sent after a challenge; the server's verdict comes next.

        Args:
            proof: this client's proof.
            key: the session key (``meshcomm._secret.session_key``) after a
                ``HELLO_CHALLENGE_MAC``: the frames after the verdict then carry MACs.
        """
        if len(proof) != PROOF_BYTES:
            raise ValueError(f"a proof has {PROOF_BYTES} bytes, got {len(proof)}")
        self._stage = _PROOF_STAGE
        if key is not None:
            self._mac_in = _Mac(key, _TO_CLIENT)
            self._mac_out = _Mac(key, _TO_SERVER)
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
        header = _HEADER.pack(len(body), rid, op)
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
        if self._stage != _FRAMES_STAGE:
            _check_magic(buf, "server")
            if len(buf) < HELLO_SIZE:
                return None
            _, version, status = _HELLO.unpack_from(buf, 0)
            if self._stage == _PROOF_STAGE:
                del buf[:HELLO_SIZE]
                self._stage = _FRAMES_STAGE
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
            self._stage = _FRAMES_STAGE
            return HelloReply(version, status, nonce, proof)
        if len(buf) < HEADER_SIZE:
            return None
        length, rid, status = _HEADER.unpack_from(buf, 0)
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
            _check_tag(mac.tag(view[:end]), view[end : end + TAG_BYTES], "server")
            body = bytes(view[HEADER_SIZE:end])
        del buf[: end + TAG_BYTES]
        if status not in _STATUSES:
            raise ProtocolError(f"unknown response status {status} for request {rid}")
        return Response(rid, status, body)
