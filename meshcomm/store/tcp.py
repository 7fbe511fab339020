"""TCPStore: the client of the store server (and, on the master, the server's host too).

The client holds one connection and a lock around each request/response, so threads may
share it (a blocking ``get`` holds the lock until it returns, as in torch). Every request
carries an id; after a client-side timeout, a late answer to the abandoned request is read
and discarded by the next call, so the connection stays usable. Blocking requests carry
their timeout, so the server answers TIMEOUT itself a moment before the client would give
up; the client's own deadline (``_SLACK`` later) covers a server that stopped answering.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from meshcomm.common.secret import SECRET_ENV, job_secret, matches, new_nonce, proof, session_key
from meshcomm.common.timeout import Timeout, to_seconds
from meshcomm.errors import (
    InvalidArgument,
    ProtocolError,
    StoreAuthError,
    StoreError,
    StoreTimeout,
)
from meshcomm.store import wire
from meshcomm.store.base import (
    Store,
    Value,
    check_amount,
    encode_key,
    encode_keys,
    encode_value,
    show_keys,
)
from meshcomm.store.server import StoreServer, check_host_port, format_address

__all__ = ["TCPStore"]

_T = TypeVar("_T")

# How much longer than a blocking request's own timeout the client waits for the server's
# TIMEOUT answer before it gives up on its own (still within timeout + 0.5 s).
_SLACK = 0.3
_RECV_BYTES = 64 * 1024
# Sockets refuse timeouts beyond a few centuries; a year is "forever" here.
_MAX_SOCKET_TIMEOUT = 365 * 24 * 3600.0
_BACKOFF_FIRST = 0.01
_BACKOFF_MAX = 0.5
#: Seconds a leaving client (:meth:`TCPStore.stop_reconnecting`) spends on its one attempt to
#: re-make a lost connection: a live store answers well within it, a dead host's port refuses
#: at once, and an unreachable host costs this much, not the timeout.
_FINAL_CONNECT = 1.0


class TCPStore(Store):
    """A store served over TCP; the master process runs the server in a daemon thread.

    Args:
        host: the server's address; the master binds exactly this address.
        port: the server's port; the master may pass 0 for a free port (see :attr:`port`).
        world_size: the number of clients (ranks) of the job, the master's own included.
        is_master: run the server in this process.
        timeout: seconds (or ``timedelta``) for connecting, for ``get``/``wait``, and for the
            master's wait for workers; default :func:`~meshcomm.common.timeout.default_timeout`.
        wait_for_workers: on the master with ``world_size`` set, block in the constructor
            until ``world_size`` clients have connected.
        memory_limit: on the master, the server's memory budget (see :class:`StoreServer`);
            default ``MESHCOMM_STORE_MEMORY``, else 256 MiB. Ignored by clients.
        secret: the job's secret (str or bytes). Client and server prove to each other that
            they know it (HMAC-SHA256 over fresh nonces; it never crosses the wire), and a
            client with a secret refuses a server without one, and vice versa. None (the
            default) reads ``MESHCOMM_SECRET``; ``""`` (or no secret anywhere) connects
            without authentication, like torch's TCPStore. The master's server uses it too.

    Raises:
        InvalidArgument: bad host, port, or world_size; port 0 on a non-master.
        StoreError: the master cannot bind (port in use); the server speaks another protocol.
        StoreAuthError: the server and this client do not share the secret (or only one has
            one); not retried.
        StoreTimeout: no server answered within the timeout, or too few workers connected.

    Example:
        >>> master = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=5)
        >>> worker = TCPStore("127.0.0.1", master.port, timeout=5)
        >>> worker.add("ready", 1), master.get("ready")
        (1, b'1')
        >>> worker.close(); master.close()
    """

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: Timeout | None = None,
        wait_for_workers: bool = True,
        *,
        memory_limit: int | str | None = None,
        secret: str | bytes | None = None,
    ) -> None:
        super().__init__(timeout)
        self._secret = job_secret(secret)
        check_host_port(host, port)
        if world_size is not None and (
            not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1
        ):
            raise InvalidArgument(f"TCPStore world_size must be a positive int, got {world_size!r}")
        if not is_master and port == 0:
            raise InvalidArgument(
                f"a TCPStore client needs the server's port; got port 0 for host {host!r} "
                "(only the master may pass 0 to pick a free port)"
            )
        self._host = host
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._conn = wire.ClientConnection()
        # recv_into one reused buffer: a fresh large bytes per recv costs an mmap/munmap.
        self._rbuf = bytearray(_RECV_BYTES)
        self._rview = memoryview(self._rbuf)
        self._sock_timeout: float | None = None
        self._rid = 0
        self._closed = False
        self._final = False  # stop_reconnecting(): a lost connection stays lost
        self._server: StoreServer | None = None
        started = time.monotonic()
        if is_master:
            self._server = StoreServer(
                host,
                port,
                memory_limit=memory_limit,
                secret=b"" if not self._secret else self._secret,
            )
            self._server.start()
            port = self._server.port
        self._port = port
        self._address = format_address(host, port)
        try:
            with self._lock:
                self._connect(register=True)
            if self._server is not None and world_size is not None and wait_for_workers:
                left = self._timeout - (time.monotonic() - started)
                count = self._server.wait_for_clients(world_size, max(left, 0.0))
                if count < world_size:
                    raise StoreTimeout(
                        f"TCPStore master at {self._address}: {count} of {world_size} clients "
                        f"connected within {self._timeout:g} s (the master's own client counts)"
                    )
        except BaseException:
            self.close()
            raise

    @property
    def host(self) -> str:
        """The server's host, as given."""
        return self._host

    @property
    def port(self) -> int:
        """The server's port (the kernel's pick when the master was given 0)."""
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` of the server."""
        return self._address

    @property
    def authenticated(self) -> bool:
        """Whether this client authenticates to the store with the job's secret."""
        return self._secret is not None

    @property
    def server(self) -> StoreServer | None:
        """The server this (master) store runs, or None on a client."""
        return self._server

    # --- the Store interface ---------------------------------------------------------------

    def set(self, key: str, value: Value) -> None:
        body = wire.body_key_value(encode_key(key), encode_value(value))
        self._expect_ok(self._call(wire.OP_SET, body, None, (key,)), wire.OP_SET)

    def get(self, key: str) -> bytes:
        seconds = self._timeout
        resp = self._call(wire.OP_GET, wire.body_get(seconds, encode_key(key)), seconds, (key,))
        if resp.status == wire.STATUS_OK:
            return resp.body
        raise self._failure(resp, wire.OP_GET, seconds)

    def add(self, key: str, amount: int) -> int:
        body = wire.body_add(check_amount(amount), encode_key(key))
        resp = self._call(wire.OP_ADD, body, None, (key,))
        return self._parse(wire.parse_int, self._expect_ok(resp, wire.OP_ADD))

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        body = wire.body_compare_set(encode_key(key), encode_value(expected), encode_value(desired))
        resp = self._call(wire.OP_COMPARE_SET, body, None, (key,))
        return self._expect_ok(resp, wire.OP_COMPARE_SET)

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        ks = encode_keys(keys)
        if not ks:
            return
        seconds = to_seconds(timeout, self._timeout)
        resp = self._call(wire.OP_WAIT, wire.body_wait(seconds, ks), seconds, keys)
        if resp.status != wire.STATUS_OK:
            raise self._failure(resp, wire.OP_WAIT, seconds)

    def check(self, keys: Sequence[str]) -> bool:
        ks = encode_keys(keys)
        if not ks:
            return True
        resp = self._call(wire.OP_CHECK, wire.body_keys(ks), None, keys)
        return self._parse(wire.parse_bool, self._expect_ok(resp, wire.OP_CHECK))

    def delete_key(self, key: str) -> bool:
        resp = self._call(wire.OP_DELETE, encode_key(key), None, (key,))
        return self._parse(wire.parse_bool, self._expect_ok(resp, wire.OP_DELETE))

    def num_keys(self) -> int:
        resp = self._call(wire.OP_NUM_KEYS, b"", None, ())
        return self._parse(wire.parse_int, self._expect_ok(resp, wire.OP_NUM_KEYS))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        ks = encode_keys(keys)
        if not ks:
            return []
        seconds = self._timeout
        resp = self._call(wire.OP_MULTI_GET, wire.body_wait(seconds, ks), seconds, keys)
        if resp.status != wire.STATUS_OK:
            raise self._failure(resp, wire.OP_MULTI_GET, seconds)
        values = self._parse(wire.parse_values, resp.body)
        if len(values) != len(ks):
            raise StoreError(
                f"store at {self._address} answered multi_get of {len(ks)} keys with "
                f"{len(values)} values"
            )
        return values

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        ks = encode_keys(keys)
        vs = [encode_value(v) for v in values]
        if len(ks) != len(vs):
            raise InvalidArgument(f"multi_set got {len(ks)} keys but {len(vs)} values")
        if not ks:
            return
        resp = self._call(wire.OP_MULTI_SET, wire.body_multi_set(ks, vs), None, keys)
        self._expect_ok(resp, wire.OP_MULTI_SET)

    def append(self, key: str, value: Value) -> None:
        body = wire.body_key_value(encode_key(key), encode_value(value))
        self._expect_ok(self._call(wire.OP_APPEND, body, None, (key,)), wire.OP_APPEND)

    def ping(self) -> None:
        """Round-trip an empty request (a liveness check).

        Raises:
            StoreError: the server is unreachable or closed the connection.
        """
        self._expect_ok(self._call(wire.OP_PING, b"", None, ()), wire.OP_PING)

    def stop_reconnecting(self) -> None:
        """Make a lost connection final: a call that finds it lost makes one connection
        attempt of at most :data:`_FINAL_CONNECT` seconds, without retries, then fails.

        Example:
            >>> store = TCPStore("127.0.0.1", 0, is_master=True, timeout=5)
            >>> store.stop_reconnecting(); store.add("left", 1)  # connected: as before
            1
            >>> store.close()
        """
        self._final = True

    def close(self) -> None:
        """Close the connection; on the master, also stop the server. Idempotent."""
        self._closed = True
        sock = self._sock
        if sock is not None:
            # Wakes a thread blocked in recv so that the lock below comes free at once.
            with contextlib.suppress(OSError):  # not connected any more
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:
            self._disconnect()
        if self._server is not None:
            self._server.close()

    def __repr__(self) -> str:
        role = "master" if self._server is not None else "client"
        return f"TCPStore({self._address!r}, {role}, timeout={self._timeout:g})"

    # --- connection ------------------------------------------------------------------------

    def _connect(self, register: bool) -> socket.socket:
        """Connect and handshake, retrying with backoff until the timeout (lock held); once
        :meth:`stop_reconnecting` was called, one short attempt."""
        final = self._final
        deadline = time.monotonic() + (
            min(self._timeout, _FINAL_CONNECT) if final else self._timeout
        )
        delay = _BACKOFF_FIRST
        last: str = "no attempt finished"
        failed = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._closed or (final and failed):
                if self._closed:
                    raise StoreError(f"TCPStore to {self._address} is closed")
                if final:
                    raise StoreError(
                        f"the connection to the store at {self._address} was lost and this "
                        f"client is leaving: not reconnecting (last error: {last})"
                    )
                raise StoreTimeout(
                    f"could not connect to the store at {self._address} within "
                    f"{self._timeout:g} s (last error: {last})"
                )
            try:
                sock = socket.create_connection(
                    (self._host, self._port), timeout=min(left, _MAX_SOCKET_TIMEOUT)
                )
            except socket.gaierror as exc:
                raise StoreError(
                    f"cannot resolve the store host of {self._address}: {exc}"
                ) from exc
            except OSError as exc:
                last, failed = str(exc), failed + 1
                time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
                delay = min(delay * 2, _BACKOFF_MAX)
                continue
            try:
                self._handshake(sock, register, deadline)
            except _Retry as exc:
                sock.close()
                last, failed = str(exc), failed + 1
                time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
                delay = min(delay * 2, _BACKOFF_MAX)
                continue
            except BaseException:
                sock.close()
                raise
            self._sock = sock
            self._sock_timeout = None
            return sock

    def _handshake(self, sock: socket.socket, register: bool, deadline: float) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = wire.ClientConnection()
        secret = self._secret
        mine = None if secret is None else new_nonce()
        try:
            sock.settimeout(min(max(deadline - time.monotonic(), 0.001), _MAX_SOCKET_TIMEOUT))
            sock.sendall(conn.hello(wire.FLAG_REGISTER if register else 0, mine))
            reply = self._handshake_event(sock, conn)
            if not isinstance(reply, wire.HelloReply):
                raise StoreError(f"the server at {self._address} sent no handshake answer")
            if reply.status == wire.HELLO_MAC_REQUIRED:
                raise StoreError(
                    f"the store at {self._address} requires frame MACs, which this client did "
                    "not offer: run the same meshcomm version on both sides"
                )
            if reply.version != wire.PROTOCOL_VERSION or reply.status == wire.HELLO_BAD_VERSION:
                raise StoreError(
                    f"the store server at {self._address} speaks protocol version "
                    f"{reply.version}; this client speaks version {wire.PROTOCOL_VERSION}"
                )
            if secret is None or mine is None:
                if reply.status == wire.HELLO_AUTH_REQUIRED:
                    raise StoreAuthError(
                        f"the store at {self._address} requires authentication, but this "
                        f"client has no secret: set {SECRET_ENV} (the job's secret) or pass "
                        "secret="
                    )
                if reply.status != wire.HELLO_OK:
                    raise StoreError(
                        f"the store at {self._address} answered the handshake with status "
                        f"{reply.status}"
                    )
            else:
                if reply.status == wire.HELLO_OK:
                    raise StoreAuthError(
                        f"the store at {self._address} has no secret (it is unauthenticated), "
                        f"but this client has one ({SECRET_ENV} or secret=): refusing to use it"
                    )
                if reply.status == wire.HELLO_CHALLENGE:
                    # A store from before frame MACs (or a hello reply rewritten on the way):
                    # its frames could be changed undetected, so it is not used.
                    raise StoreError(
                        f"the store at {self._address} authenticates without frame MACs (a "
                        "meshcomm store older than this client); this client requires them: "
                        "run the same meshcomm version on both sides"
                    )
                if reply.status != wire.HELLO_CHALLENGE_MAC:
                    raise StoreError(
                        f"the store at {self._address} answered the handshake with status "
                        f"{reply.status}"
                    )
                expected = proof(secret, b"server", b"store", mine, reply.nonce)
                if not matches(expected, reply.proof):
                    raise StoreAuthError(
                        f"the store at {self._address} could not prove it knows this job's "
                        f"secret: the secrets differ (another job's store, a wrong "
                        f"{SECRET_ENV}, or an impostor)"
                    )
                key = session_key(secret, b"store", mine, reply.nonce)
                sock.sendall(
                    conn.answer(proof(secret, b"client", b"store", mine, reply.nonce), key)
                )
                verdict = self._handshake_event(sock, conn)
                if not isinstance(verdict, wire.AuthResult) or verdict.status != wire.HELLO_OK:
                    raise StoreAuthError(
                        f"the store at {self._address} rejected this client's proof of the "
                        "job's secret"
                    )
        except ProtocolError as exc:
            raise StoreError(
                f"the server at {self._address} is not a meshcomm store server: {exc}"
            ) from exc
        except TimeoutError as exc:
            raise StoreTimeout(
                f"the server at {self._address} did not answer the store handshake within "
                f"{self._timeout:g} s"
            ) from exc
        except OSError as exc:
            raise _Retry(f"handshake failed: {exc}") from exc
        self._conn = conn

    def _handshake_event(
        self, sock: socket.socket, conn: wire.ClientConnection
    ) -> wire.HelloReply | wire.AuthResult | wire.Response:
        while True:
            event = conn.next_event()
            if event is not None:
                return event
            data = sock.recv(256)
            if not data:
                raise _Retry("the server closed the connection during the handshake")
            conn.receive_data(data)

    def _disconnect(self) -> None:
        """Close the socket (lock held); the next request reconnects."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _call(self, op: int, body: bytes, wait: float | None, keys: Sequence[str]) -> wire.Response:
        """Send one request and return its response (lock held inside).

        Args:
            op: the opcode.
            body: the request body.
            wait: seconds the server may park the request, or None for a plain request.
            keys: the keys concerned, for error messages.
        """
        if len(body) > wire.MAX_BODY_BYTES:
            raise InvalidArgument(
                f"{wire.OP_NAMES[op]} request of {len(body)} bytes exceeds the store's "
                f"{wire.MAX_BODY_BYTES}-byte frame limit (keys {show_keys(keys)})"
            )
        # One budget for plain and blocking requests alike keeps settimeout calls rare.
        budget = min((self._timeout if wait is None else wait) + _SLACK, _MAX_SOCKET_TIMEOUT)
        with self._lock:
            if self._closed:
                raise StoreError(f"TCPStore to {self._address} is closed")
            sock = self._sock
            if sock is None:
                sock = self._connect(register=False)
            self._rid = rid = (self._rid + 1) & 0xFFFFFFFF
            conn = self._conn
            frame = conn.request(op, rid, body)
            deadline = time.monotonic() + budget
            try:
                if self._sock_timeout != budget:
                    sock.settimeout(budget)
                    self._sock_timeout = budget
                sock.sendall(frame)
            except OSError as exc:
                # A partly sent frame would desynchronise the stream: start afresh next time.
                self._disconnect()
                raise StoreError(
                    f"sending {wire.OP_NAMES[op]} to the store at {self._address} failed: {exc}"
                ) from exc
            first = True
            while True:
                try:
                    event = conn.next_event()
                except wire.MacError as exc:
                    self._disconnect()
                    raise StoreAuthError(
                        f"the store at {self._address}: a store frame failed its MAC: the "
                        f"connection was tampered with (during {wire.OP_NAMES[op]}, keys "
                        f"{show_keys(keys)})"
                    ) from exc
                except ProtocolError as exc:
                    self._disconnect()
                    raise StoreError(
                        f"the store at {self._address} broke the protocol: {exc}"
                    ) from exc
                if event is None:
                    left = deadline - time.monotonic()
                    try:
                        if left <= 0:
                            raise TimeoutError
                        if not first:  # the first recv runs under the budget set above
                            sock.settimeout(left)
                            self._sock_timeout = left
                        first = False
                        size = sock.recv_into(self._rbuf)
                    except TimeoutError as exc:
                        # The connection stays: the late answer will be skipped by its id.
                        raise StoreTimeout(
                            f"the store at {self._address} did not answer {wire.OP_NAMES[op]} "
                            f"(keys {show_keys(keys)}) within {budget:g} s"
                        ) from exc
                    except OSError as exc:
                        self._disconnect()
                        raise StoreError(
                            f"lost the connection to the store at {self._address} during "
                            f"{wire.OP_NAMES[op]}: {exc}"
                        ) from exc
                    if not size:
                        self._disconnect()
                        if self._closed:
                            raise StoreError(f"TCPStore to {self._address} is closed")
                        raise StoreError(
                            f"the store at {self._address} closed the connection during "
                            f"{wire.OP_NAMES[op]} (keys {show_keys(keys)})"
                        )
                    conn.receive_data(self._rview[:size])
                elif isinstance(event, wire.Response) and event.rid == rid:
                    return event
                # else: the answer to a request this client gave up on; skip it.

    def _expect_ok(self, resp: wire.Response, op: int) -> bytes:
        if resp.status == wire.STATUS_OK:
            return resp.body
        raise self._failure(resp, op, self._timeout)

    def _failure(self, resp: wire.Response, op: int, seconds: float) -> StoreError:
        if resp.status == wire.STATUS_TIMEOUT:
            missing = self._parse(wire.parse_keys, resp.body)
            return StoreTimeout(
                f"TCPStore {self._address}: {wire.OP_NAMES[op]} timed out after {seconds:g} s; "
                f"keys still missing: {show_keys(missing)}"
            )
        message = resp.body.decode(errors="replace")
        return StoreError(f"store at {self._address}: {wire.OP_NAMES[op]} failed: {message}")

    def _parse(self, parse: Callable[[bytes], _T], body: bytes) -> _T:
        try:
            return parse(body)
        except ProtocolError as exc:
            raise StoreError(f"the store at {self._address} sent a bad answer: {exc}") from exc


class _Retry(Exception):
    """A connection attempt failed in a way worth retrying (reset, closed early)."""
