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
``meshcomm.common.secret.proof(secret, role, b"store", client nonce, server nonce)`` with role
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

with the session key ``meshcomm.common.secret.session_key(secret, b"store", client nonce, server
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

The layout lives in :mod:`meshcomm.store._frames`, the frame MACs in
:mod:`meshcomm.store._mac`, the bodies' encoders and parsers in :mod:`meshcomm.store._codec`,
and the two ends of a connection in :mod:`meshcomm.store._server_conn` and
:mod:`meshcomm.store._client_conn`; this module is the protocol's one name for all of them.

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

from meshcomm.store._client_conn import ClientConnection
from meshcomm.store._codec import (
    auth_result,
    body_add,
    body_compare_set,
    body_get,
    body_key_value,
    body_keys,
    body_multi_set,
    body_wait,
    challenge,
    error,
    hello_reply,
    ok,
    ok_bool,
    ok_header,
    ok_int,
    ok_value,
    ok_values,
    parse_bool,
    parse_int,
    parse_keys,
    parse_values,
    request,
    timed_out,
)
from meshcomm.store._frames import (
    ADMIT_THRESHOLD,
    FLAG_AUTH,
    FLAG_MAC,
    FLAG_REGISTER,
    FOREVER,
    HEADER_SIZE,
    HELLO_AUTH_FAILED,
    HELLO_AUTH_REQUIRED,
    HELLO_BAD_VERSION,
    HELLO_CHALLENGE,
    HELLO_CHALLENGE_MAC,
    HELLO_MAC_REQUIRED,
    HELLO_OK,
    HELLO_SIZE,
    MAGIC,
    MAX_BODY_BYTES,
    MAX_ERROR_BYTES,
    OP_ADD,
    OP_APPEND,
    OP_CHECK,
    OP_COMPARE_SET,
    OP_DELETE,
    OP_GET,
    OP_MULTI_GET,
    OP_MULTI_SET,
    OP_NAMES,
    OP_NUM_KEYS,
    OP_PING,
    OP_SET,
    OP_WAIT,
    PROTOCOL_VERSION,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_TIMEOUT,
    TAG_BYTES,
    AuthResult,
    ClientProof,
    Hello,
    HelloReply,
    Refused,
    Request,
    Response,
)
from meshcomm.store._mac import MacError
from meshcomm.store._server_conn import ServerConnection

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
