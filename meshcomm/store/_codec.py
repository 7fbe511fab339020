"""The bodies of the store's frames, both ways: encoders for each request and response, and
the parsers that check every length and bound as they read.

Example:
    >>> body = body_wait(2.0, [b"a", b"bc"])
    >>> REQUEST_PARSERS[OP_WAIT](body)
    (2.0, [b'a', b'bc'])
    >>> parse_int(ok_int(7, -3)[9:])  # after the 9-byte header
    -3
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

from meshcomm.common.secret import NONCE_BYTES, PROOF_BYTES
from meshcomm.errors import ProtocolError
from meshcomm.store._frames import (
    FOREVER,
    HEADER_STRUCT,
    HELLO_AUTH_FAILED,
    HELLO_BAD_VERSION,
    HELLO_CHALLENGE,
    HELLO_CHALLENGE_MAC,
    HELLO_OK,
    HELLO_STRUCT,
    MAGIC,
    MAX_ERROR_BYTES,
    OP_ADD,
    OP_APPEND,
    OP_CHECK,
    OP_COMPARE_SET,
    OP_DELETE,
    OP_GET,
    OP_MULTI_GET,
    OP_MULTI_SET,
    OP_NUM_KEYS,
    OP_PING,
    OP_SET,
    OP_WAIT,
    PROTOCOL_VERSION,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_TIMEOUT,
)
from meshcomm.store.base import MAX_KEY_BYTES, MAX_VALUE_BYTES

__all__ = [
    "REQUEST_PARSERS",
    "auth_result",
    "body_add",
    "body_compare_set",
    "body_get",
    "body_key_value",
    "body_keys",
    "body_multi_set",
    "body_wait",
    "challenge",
    "error",
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

_HEADER_INT = struct.Struct("!IIBq")
_HEADER_BOOL = struct.Struct("!IIBB")
_U32 = struct.Struct("!I")
_I64 = struct.Struct("!q")
_F64 = struct.Struct("!d")


# --- encoding --------------------------------------------------------------------------------


def request(op: int, rid: int, body: bytes) -> bytes:
    """Frame a request body (built by a ``body_*`` helper) with opcode ``op`` and id ``rid``."""
    return HEADER_STRUCT.pack(len(body), rid, op) + body


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
    return HELLO_STRUCT.pack(MAGIC, PROTOCOL_VERSION, status)


def challenge(nonce: bytes, proof: bytes, mac: bool = True) -> bytes:
    """The answer of a server with a secret: status 5 (2 without ``mac``), nonce and proof."""
    if len(nonce) != NONCE_BYTES or len(proof) != PROOF_BYTES:
        raise ValueError(f"a challenge needs a {NONCE_BYTES}-byte nonce and proof")
    status = HELLO_CHALLENGE_MAC if mac else HELLO_CHALLENGE
    return HELLO_STRUCT.pack(MAGIC, PROTOCOL_VERSION, status) + nonce + proof


def auth_result(ok: bool) -> bytes:
    """The server's verdict on a client's proof."""
    return HELLO_STRUCT.pack(MAGIC, PROTOCOL_VERSION, HELLO_OK if ok else HELLO_AUTH_FAILED)


def ok(rid: int) -> bytes:
    """An empty OK response."""
    return HEADER_STRUCT.pack(0, rid, STATUS_OK)


def ok_header(rid: int, length: int) -> bytes:
    """The header of an OK response whose ``length``-byte body the caller sends after it."""
    return HEADER_STRUCT.pack(length, rid, STATUS_OK)


def ok_value(rid: int, value: bytes) -> bytes:
    """An OK response carrying one value."""
    return HEADER_STRUCT.pack(len(value), rid, STATUS_OK) + value


def ok_int(rid: int, number: int) -> bytes:
    """An OK response carrying a signed 64-bit integer."""
    return _HEADER_INT.pack(8, rid, STATUS_OK, number)


def ok_bool(rid: int, flag: bool) -> bytes:
    """An OK response carrying one boolean byte."""
    return _HEADER_BOOL.pack(1, rid, STATUS_OK, 1 if flag else 0)


def ok_values(rid: int, values: Sequence[bytes]) -> bytes:
    """An OK response carrying a counted list of values."""
    body = b"".join(_strings(values))
    return HEADER_STRUCT.pack(len(body), rid, STATUS_OK) + body


def error(rid: int, message: str) -> bytes:
    """An ERROR response carrying a (truncated) UTF-8 message."""
    body = message.encode(errors="replace")[:MAX_ERROR_BYTES]
    return HEADER_STRUCT.pack(len(body), rid, STATUS_ERROR) + body


def timed_out(rid: int, missing: Sequence[bytes]) -> bytes:
    """A TIMEOUT response naming the keys still missing."""
    body = b"".join(_strings(missing))
    return HEADER_STRUCT.pack(len(body), rid, STATUS_TIMEOUT) + body


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


REQUEST_PARSERS: dict[int, Callable[[bytes], tuple[Any, ...]]] = {
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
