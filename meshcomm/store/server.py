"""The TCPStore server: one thread, one ``selectors`` loop, non-blocking sockets.

One thread serves every client, so 512 idle clients cost 512 sockets and nothing else. A
``get``/``wait``/``multi_get`` on a missing key is parked server-side and answered when the
key appears, or with a TIMEOUT frame when the deadline the client sent passes. A client that
breaks the protocol (wrong magic, unknown opcode, oversized length prefix, garbage) is
dropped alone; the others are never disturbed. Memory per connection stays bounded: the
decoder refuses oversized frames from their header, a connection whose replies pile up
(``_HIGH_WATER``) is not read until they drain, and parked requests per connection are capped.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import heapq
import itertools
import logging
import math
import os
import re
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from meshcomm._secret import job_secret, matches, new_nonce, proof, session_key
from meshcomm.errors import InvalidArgument, ProtocolError, StoreError
from meshcomm.store import wire
from meshcomm.store.memory import KVState

__all__ = [
    "DEFAULT_BACKLOG",
    "DEFAULT_MEMORY_LIMIT",
    "HANDSHAKE_TIMEOUT",
    "MEMORY_ENV",
    "StoreServer",
    "format_address",
    "parse_memory_limit",
]

#: ``listen()`` backlog: large so that hundreds of ranks can connect at once without resets.
DEFAULT_BACKLOG = 2048
#: The store's total memory budget in bytes unless ``memory_limit=`` or ``MESHCOMM_STORE_MEMORY``
#: says otherwise: keys and values, parked requests, unsent replies and frames being received.
DEFAULT_MEMORY_LIMIT = 256 * 1024 * 1024
#: The environment variable that sets the budget (bytes, or a number with K, M or G: MiB...).
MEMORY_ENV = "MESHCOMM_STORE_MEMORY"
#: Seconds a new connection has to finish the handshake (authentication included) before it
#: is dropped: a half-open or slowloris connection costs a socket and < 100 bytes, for so long.
HANDSHAKE_TIMEOUT = 10.0
# Smallest budget accepted: below it even bootstrap traffic would be refused.
_MIN_MEMORY_LIMIT = 1024 * 1024
# What a key/value pair costs beyond its bytes (two bytes objects and a dict slot), and a
# parked request beyond its keys; rough, so that a flood of tiny keys is counted too.
_ENTRY_OVERHEAD = 128
_WAITER_OVERHEAD = 256
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}

_log = logging.getLogger("meshcomm.store")

_RECV_BYTES = 256 * 1024
# Stop reading a connection whose unsent replies exceed this; resume once they drain.
_HIGH_WATER = 4 * 1024 * 1024
# Parked (blocking) requests one connection may hold; a well-behaved client has one.
_MAX_PARKED = 256
_WRITES = frozenset(
    (wire.OP_SET, wire.OP_ADD, wire.OP_COMPARE_SET, wire.OP_MULTI_SET, wire.OP_APPEND)
)
# Longest single sleep in select(): epoll refuses timeouts past ~24.8 days (2**31 ms), and a
# waiter with no deadline must not become one; a periodic wake-up costs nothing.
_MAX_POLL = 3600.0
# Pause accepting for this long when the process runs out of file descriptors.
_ACCEPT_PAUSE = 0.1
_ACCEPT_BATCH = 512
_LISTENER = object()
_WAKE = object()


def format_address(host: str, port: int) -> str:
    """Return ``host:port``, with brackets around an IPv6 literal.

    Example:
        >>> format_address("127.0.0.1", 29500), format_address("::1", 80)
        ('127.0.0.1:29500', '[::1]:80')
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_memory_limit(value: int | str | None = None) -> int:
    """The store's memory budget in bytes: ``value``, else ``MESHCOMM_STORE_MEMORY``, else 256 MiB.

    A str may carry a binary unit: ``"512M"``, ``"2G"`` (``"MiB"``, ``"GB"`` spellings too).

    Raises:
        InvalidArgument: not a whole number of bytes, or under 1 MiB; names the value.

    Example:
        >>> parse_memory_limit("512M"), parse_memory_limit(2**30)
        (536870912, 1073741824)
    """
    source = "memory_limit"
    if value is None:
        value = os.environ.get(MEMORY_ENV) or DEFAULT_MEMORY_LIMIT
        source = MEMORY_ENV
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+)\s*([KMGT]?)(?:I?B)?\s*", value.upper())
        if match is None:
            raise InvalidArgument(
                f"{source} must be a number of bytes, optionally with K, M, G or T, got {value!r}"
            )
        limit = int(match.group(1)) * _UNITS[match.group(2)]
    elif isinstance(value, int) and not isinstance(value, bool):
        limit = value
    else:
        raise InvalidArgument(f"{source} must be an int or a str, got {type(value).__name__}")
    if limit < _MIN_MEMORY_LIMIT:
        raise InvalidArgument(
            f"{source} must be at least {_MIN_MEMORY_LIMIT} bytes (1 MiB), got {value!r}"
        )
    return limit


def check_host_port(host: str, port: int) -> None:
    """Validate a store address before any I/O.

    Raises:
        InvalidArgument: ``host`` is not a non-empty str or ``port`` not an int in [0, 65535].
    """
    if not isinstance(host, str) or not host:
        # An empty host would bind every interface; the store binds only what it is given.
        raise InvalidArgument(f"store host must be a non-empty str, got {host!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise InvalidArgument(f"store port must be an int in [0, 65535], got {port!r}")


class _Conn:
    """One client connection: socket, decoder, unsent replies, parked requests."""

    __slots__ = (
        "events",
        "flags",
        "held",
        "nonces",
        "out",
        "parked",
        "peer",
        "proto",
        "ready",
        "reserved",
        "since",
        "sock",
        "stalled",
    )

    def __init__(self, sock: socket.socket, peer: object) -> None:
        self.sock = sock
        self.peer = peer
        self.proto = wire.ServerConnection()
        # Bytes this connection counts against the budget (``out`` and input), and the size
        # of the large frame admitted and still arriving (counted whole from its header on).
        self.held = 0
        self.reserved = 0
        # The handshake: done (``ready``), when it began, the hello's flags, and the
        # (client, server) nonces while a proof is awaited.
        self.ready = False
        self.since = time.monotonic()
        self.flags = 0
        self.nonces = (b"", b"")
        self.out = bytearray()
        self.parked: set[_Waiter] = set()
        self.events = selectors.EVENT_READ
        # Complete requests wait in ``proto`` because ``out`` is over the high-water mark;
        # the socket is not read until they are handled, so ``proto`` cannot grow.
        self.stalled = False


class _Waiter:
    """A parked GET / WAIT / MULTI_GET, filed under one of its missing keys."""

    __slots__ = ("conn", "cost", "deadline", "done", "key", "keys", "op", "rid")

    def __init__(
        self, conn: _Conn, rid: int, op: int, keys: list[bytes], key: bytes, deadline: float
    ) -> None:
        self.conn = conn
        self.rid = rid
        self.op = op
        self.keys = keys
        self.key = key
        self.deadline = deadline
        self.done = False
        self.cost = _WAITER_OVERHEAD + sum(len(k) + _ENTRY_OVERHEAD for k in keys)


class StoreServer:
    """A TCPStore server that runs without a client of its own (``meshrun`` hosts one).

    The socket is bound in the constructor, so :attr:`port` is known at once (pass port 0
    for a free port) and a port in use fails there. :meth:`start` serves from a daemon
    thread; :meth:`serve_forever` serves from the calling thread until :meth:`stop`.

    Args:
        host: the address to bind, exactly as given (e.g. ``"127.0.0.1"`` for one host).
        port: the port to bind; 0 picks a free one.
        backlog: the ``listen()`` backlog.
        memory_limit: the total bytes the store may hold (keys and values, parked requests,
            unsent replies, frames being received); a request that would go over is answered
            with an ERROR naming the budget and the sizes, and nothing else is disturbed.
            Default: ``MESHCOMM_STORE_MEMORY``, else 256 MiB. See :func:`parse_memory_limit`.
        secret: the job's secret (str or bytes): every client must prove it knows it
            (HMAC-SHA256 challenge-response both ways, see :mod:`meshcomm.store.wire`) before
            any request is read. None (the default) reads ``MESHCOMM_SECRET``; ``""`` (or no
            secret anywhere) serves without authentication, as torch's TCPStore does.
        handshake_timeout: seconds a new connection has to finish its handshake before it is
            dropped (:data:`HANDSHAKE_TIMEOUT`).

    Raises:
        InvalidArgument: empty host, a port outside [0, 65535], or a bad memory limit.
        StoreError: the address cannot be bound (port in use, unknown host); names host:port.

    Example:
        >>> from meshcomm.store import TCPStore
        >>> with StoreServer("127.0.0.1", 0) as server:
        ...     client = TCPStore("127.0.0.1", server.port, timeout=5)
        ...     client.set("k", "v")
        ...     print(client.get("k"))
        ...     client.close()
        b'v'
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        backlog: int = DEFAULT_BACKLOG,
        *,
        memory_limit: int | str | None = None,
        secret: str | bytes | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
    ):
        check_host_port(host, port)
        if not (isinstance(handshake_timeout, (int, float)) and 0 < handshake_timeout <= 3600):
            raise InvalidArgument(
                f"handshake_timeout must be seconds in (0, 3600], got {handshake_timeout!r}"
            )
        self._handshake_timeout = float(handshake_timeout)
        self._secret = job_secret(secret)
        self._memory_limit = parse_memory_limit(memory_limit)
        self._stored = 0  # keys and values, with _ENTRY_OVERHEAD each
        self._io = 0  # the sum of every connection's ``held``
        self._parked_bytes = 0
        self._host = host
        self._listener = _bind(host, port, backlog)
        self._port: int = self._listener.getsockname()[1]
        self._state = KVState()
        self._rbuf = bytearray(_RECV_BYTES)
        self._rview = memoryview(self._rbuf)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._conns: set[_Conn] = set()
        self._ready: set[_Conn] = set()
        self._waiters: dict[bytes, list[_Waiter]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._stale_deadlines = 0
        self._seq = itertools.count()
        self._accept_resume: float | None = None
        self._handshakes: collections.deque[_Conn] = collections.deque()
        self._registered = 0
        self._clients_cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._lifecycle = threading.Lock()
        self._stopping = False
        self._serving = False
        self._closed = False

    # --- public ------------------------------------------------------------------------------

    @property
    def host(self) -> str:
        """The host the server is bound to, as given."""
        return self._host

    @property
    def port(self) -> int:
        """The bound port (the kernel's pick when constructed with port 0)."""
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` of the server."""
        return format_address(self._host, self._port)

    @property
    def num_connections(self) -> int:
        """Client connections open right now."""
        return len(self._conns)

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for all connections: unparsed input plus unsent replies (approximate)."""
        return sum(len(c.out) + c.proto.buffered for c in list(self._conns))

    @property
    def authenticated(self) -> bool:
        """Whether clients must prove they know the job's secret."""
        return self._secret is not None

    @property
    def memory_limit(self) -> int:
        """The memory budget in bytes."""
        return self._memory_limit

    @property
    def memory_used(self) -> int:
        """Bytes counted against the budget now: stored keys and values (with a per-entry
        overhead), parked requests, unsent replies and frames being received."""
        return self._stored + self._io + self._parked_bytes

    @property
    def registered_clients(self) -> int:
        """Clients that have registered so far (TCPStore constructors; see ``wait_for_clients``)."""
        return self._registered

    def start(self) -> StoreServer:
        """Serve from a daemon thread; returns self.

        Raises:
            StoreError: the server was already started or closed.
        """
        with self._lifecycle:
            if self._closed or self._thread is not None or self._serving:
                raise StoreError(f"store server at {self.address} was already started or closed")
            self._thread = threading.Thread(
                target=self.serve_forever, name=f"meshcomm-store-{self._port}", daemon=True
            )
            self._serving = True
            self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread until :meth:`stop` or :meth:`close`; then clean up."""
        with self._lifecycle:
            if self._closed:
                raise StoreError(f"store server at {self.address} is closed")
            self._serving = True
        try:
            self._loop()
        finally:
            self._cleanup()

    def stop(self) -> None:
        """Ask the serving loop to end soon; safe from a signal handler. Does not wait."""
        self._stopping = True
        # A full buffer means it is already woken; a closed socket, already stopped.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def close(self) -> None:
        """Stop serving, drop every client and release the port. Idempotent."""
        self.stop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)
        with self._lifecycle:
            serving = self._serving
        if not serving:
            self._cleanup()

    def wait_for_clients(self, count: int, timeout: float) -> int:
        """Block until ``count`` clients have registered (or ``timeout`` seconds pass).

        TCPStore clients register once, on their first connection, so this counts ranks.

        Returns:
            The number registered so far (``>= count`` unless the wait timed out).
        """
        with self._clients_cond:
            self._clients_cond.wait_for(
                lambda: self._registered >= count or self._closed,
                min(timeout, threading.TIMEOUT_MAX),
            )
            return self._registered

    def __enter__(self) -> StoreServer:
        if self._thread is None and not self._serving:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StoreServer({self.address!r}, connections={len(self._conns)})"

    # --- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        select = self._sel.select
        while not self._stopping:
            for key, mask in select(self._poll_timeout()):
                data = key.data
                if isinstance(data, _Conn):
                    try:
                        if mask & selectors.EVENT_WRITE:
                            self._flush(data)
                        if mask & selectors.EVENT_READ and data.sock.fileno() >= 0:
                            self._on_readable(data)
                    except Exception as exc:  # a bug or MemoryError: lose one client, not all
                        _log.exception("store %s: error serving %s", self.address, data.peer)
                        self._drop(data, f"internal error: {exc!r}")
                elif data is _LISTENER:
                    self._accept()
                else:
                    self._drain_wake()
            if self._deadlines or self._handshakes or self._accept_resume is not None:
                self._on_timers(time.monotonic())
            while self._ready:
                conn = self._ready.pop()
                if conn.stalled and conn.sock.fileno() >= 0:
                    self._process(conn)
                    self._flush(conn)

    def _poll_timeout(self) -> float | None:
        when = self._deadlines[0][0] if self._deadlines else None
        if self._accept_resume is not None and (when is None or self._accept_resume < when):
            when = self._accept_resume
        if self._handshakes:
            due = self._handshakes[0].since + self._handshake_timeout
            when = due if when is None else min(when, due)
        return None if when is None else min(max(0.0, when - time.monotonic()), _MAX_POLL)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass  # drained (BlockingIOError) or closed

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: the listener would stay readable and spin the loop.
                    _log.warning("store %s: cannot accept (%s); pausing", self.address, exc)
                    self._sel.unregister(self._listener)
                    self._accept_resume = time.monotonic() + _ACCEPT_PAUSE
                return  # ECONNABORTED and friends: that client is gone already
            sock.setblocking(False)
            with contextlib.suppress(OSError):  # the peer already reset; the first recv will say so
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, peer)
            conn.proto = wire.ServerConnection(functools.partial(self._admit, conn))
            self._conns.add(conn)
            self._handshakes.append(conn)
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _on_timers(self, now: float) -> None:
        if self._accept_resume is not None and now >= self._accept_resume:
            self._accept_resume = None
            self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
        handshakes = self._handshakes
        # Accepted in order, all with the same timeout: the oldest is always first.
        while handshakes and (handshakes[0].ready or handshakes[0] not in self._conns):
            handshakes.popleft()
        while handshakes and handshakes[0].since + self._handshake_timeout <= now:
            conn = handshakes.popleft()
            if not conn.ready:
                self._drop(conn, f"no handshake within {self._handshake_timeout:g} s")
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            waiter = heapq.heappop(deadlines)[2]
            if waiter.done:
                self._stale_deadlines -= 1
                continue
            self._unpark(waiter, stale=False)
            conn = waiter.conn
            conn.proto.frame(conn.out, wire.timed_out(waiter.rid, self._state.missing(waiter.keys)))
            self._flush(conn)

    def _on_readable(self, conn: _Conn) -> None:
        try:
            # Into one reused buffer: a fresh 256 KiB bytes per recv costs an mmap/munmap pair.
            size = conn.sock.recv_into(self._rbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(conn, f"recv failed: {exc}")
            return
        if not size:
            self._drop(conn, None)
            return
        conn.proto.receive_data(self._rview[:size])
        self._account(conn)
        self._process(conn)
        if conn.sock.fileno() >= 0:
            self._flush(conn)

    def _process(self, conn: _Conn) -> None:
        """Handle the complete requests buffered on ``conn`` while its replies fit."""
        proto = conn.proto
        conn.stalled = True
        try:
            while len(conn.out) < _HIGH_WATER:
                event = proto.next_event()
                if event is None:
                    conn.stalled = False
                    return
                if isinstance(event, wire.Request):
                    if conn.reserved:
                        conn.reserved = 0
                        self._account(conn)
                    self._handle(conn, event.rid, event.op, event.args)
                elif isinstance(event, wire.Refused):
                    conn.proto.frame(conn.out, wire.error(event.rid, event.reason))
                elif isinstance(event, wire.ClientProof):
                    self._on_proof(conn, event.proof)
                    if conn.sock.fileno() < 0:
                        return
                else:
                    self._on_hello(conn, event)
                    if conn.sock.fileno() < 0:
                        return
        except wire.MacError as exc:
            self._drop(conn, str(exc), logging.WARNING)
        except ProtocolError as exc:
            # A member of the job does not break the protocol: on an authenticated connection
            # this is most likely a changed header (checked before its MAC can be), so it is
            # as loud as a failed MAC.
            level = logging.WARNING if proto.authenticated else logging.INFO
            self._drop(conn, f"protocol violation: {exc}", level)

    def _on_hello(self, conn: _Conn, hello: wire.Hello) -> None:
        if hello.version != wire.PROTOCOL_VERSION:
            _log.info(
                "store %s: dropping %s: protocol version %d, this server speaks %d",
                self.address,
                conn.peer,
                hello.version,
                wire.PROTOCOL_VERSION,
            )
            self._refuse(conn, wire.hello_reply(False))
            return
        conn.flags = hello.flags
        secret = self._secret
        if secret is None:
            # A client with a secret refuses this answer itself (it names the reason).
            conn.out += wire.hello_reply(True)
            self._admitted(conn)
            return
        if not hello.flags & wire.FLAG_AUTH:
            _log.warning(
                "store %s: refusing %s: it has no secret and this store requires one",
                self.address,
                conn.peer,
            )
            self._refuse(conn, wire.hello_reply(False, wire.HELLO_AUTH_REQUIRED))
            return
        if not hello.flags & wire.FLAG_MAC:
            # Authenticated frames without MACs could be changed on the way: refused, so that
            # an attacker who clears the flag gets nothing either.
            _log.warning(
                "store %s: refusing %s: it authenticates without frame MACs (a meshcomm "
                "older than this store, or a tampered hello)",
                self.address,
                conn.peer,
            )
            self._refuse(conn, wire.hello_reply(False, wire.HELLO_MAC_REQUIRED))
            return
        mine = new_nonce()
        conn.nonces = (hello.nonce, mine)
        conn.out += wire.challenge(mine, proof(secret, b"server", b"store", hello.nonce, mine))
        conn.proto.expect_proof(session_key(secret, b"store", hello.nonce, mine))

    def _on_proof(self, conn: _Conn, answer: bytes) -> None:
        assert self._secret is not None  # only a server with a secret asks for a proof
        theirs, mine = conn.nonces
        conn.nonces = (b"", b"")  # one proof per challenge
        if not matches(proof(self._secret, b"client", b"store", theirs, mine), answer):
            _log.warning(
                "store %s: refusing %s: wrong proof (its secret is not this job's)",
                self.address,
                conn.peer,
            )
            self._refuse(conn, wire.auth_result(False))
            return
        conn.out += wire.auth_result(True)
        self._admitted(conn)

    def _admitted(self, conn: _Conn) -> None:
        """The handshake is done: count a registering client."""
        conn.ready = True
        if conn.flags & wire.FLAG_REGISTER:
            with self._clients_cond:
                self._registered += 1
                self._clients_cond.notify_all()

    def _refuse(self, conn: _Conn, answer: bytes) -> None:
        """Send a last handshake answer (best effort) and drop the connection."""
        with contextlib.suppress(OSError):  # it is being dropped either way
            conn.sock.send(answer)
        self._drop(conn, None)

    # --- requests ----------------------------------------------------------------------------

    def _handle(self, conn: _Conn, rid: int, op: int, args: tuple[Any, ...]) -> None:
        state = self._state
        out = conn.out
        if op == wire.OP_GET:
            timeout, key = args
            value = state.data.get(key)
            if value is None:
                self._park(conn, rid, op, [key], timeout)
            else:
                self._answer(conn, rid, op, [key])
        elif op in _WRITES:
            self._write(conn, rid, op, args)
        elif op in (wire.OP_WAIT, wire.OP_MULTI_GET):
            timeout, keys = args
            if state.missing(keys):
                self._park(conn, rid, op, keys, timeout)
            else:
                self._answer(conn, rid, op, keys)
        elif op == wire.OP_CHECK:
            conn.proto.frame(out, wire.ok_bool(rid, not state.missing(args[0])))
        elif op == wire.OP_DELETE:
            before = self._entry(args[0])
            conn.proto.frame(out, wire.ok_bool(rid, state.delete(args[0])))
            self._stored -= before
        elif op == wire.OP_NUM_KEYS:
            conn.proto.frame(out, wire.ok_int(rid, len(state.data)))
        else:  # OP_PING; the decoder admits no other opcode
            conn.proto.frame(out, wire.ok(rid))

    def _write(self, conn: _Conn, rid: int, op: int, args: tuple[Any, ...]) -> None:
        """SET, ADD, COMPARE_SET, MULTI_SET, APPEND: refused if the result would not fit."""
        state = self._state
        if op == wire.OP_MULTI_SET:
            final = dict(zip(args[0], args[1], strict=True))  # a repeated key: the last wins
            keys = list(final)
            after = sum(len(k) + len(v) + _ENTRY_OVERHEAD for k, v in final.items())
        else:
            keys = [args[0]]
            size = len(args[0]) + _ENTRY_OVERHEAD
            if op == wire.OP_SET:
                after = size + len(args[1])
            elif op == wire.OP_APPEND:
                after = max(self._entry(args[0]), size) + len(args[1])
            elif op == wire.OP_ADD:
                after = size + 20  # the decimal digits of an int64
            else:  # COMPARE_SET: at most the desired value
                after = size + len(args[2])
        before = sum(self._entry(k) for k in keys)
        used = self.memory_used
        if after > before and used + after - before > self._memory_limit:
            conn.proto.frame(
                conn.out,
                wire.error(
                    rid,
                    f"{wire.OP_NAMES[op]} of key {keys[0][:64]!r} refused: {after - before} more "
                    f"bytes would take the store to {used + after - before} bytes, over its "
                    f"memory budget of {self._memory_limit} bytes ({self._usage()}); "
                    f"raise it with memory_limit= or {MEMORY_ENV}",
                ),
            )
            return
        out = conn.out
        if op == wire.OP_SET:
            state.data[args[0]] = args[1]
            conn.proto.frame(out, wire.ok(rid))
        elif op == wire.OP_ADD:
            try:
                total = state.add(args[0], args[1])
            except StoreError as exc:
                conn.proto.frame(out, wire.error(rid, str(exc)))
                return
            conn.proto.frame(out, wire.ok_int(rid, total))
        elif op == wire.OP_COMPARE_SET:
            conn.proto.frame(out, wire.ok_value(rid, state.compare_set(*args)))
        elif op == wire.OP_MULTI_SET:
            state.multi_set(*args)
            conn.proto.frame(out, wire.ok(rid))
        else:
            state.append(args[0], args[1])
            conn.proto.frame(out, wire.ok(rid))
        self._stored += sum(self._entry(k) for k in keys) - before
        if self._waiters:
            for key in keys:
                self._notify(key)

    def _entry(self, key: bytes) -> int:
        """What ``key`` and its value cost against the budget (0 if missing)."""
        value = self._state.data.get(key)
        return 0 if value is None else len(key) + len(value) + _ENTRY_OVERHEAD

    def _usage(self) -> str:
        return (
            f"{self._stored} in keys and values, {self._io} in connection buffers, "
            f"{self._parked_bytes} in parked requests"
        )

    def _admit(self, conn: _Conn, rid: int, op: int, length: int) -> str | None:
        """Reserve room for a large frame from its header, or say why it is refused."""
        need = wire.HEADER_SIZE + length
        extra = max(0, need - conn.proto.buffered)
        used = self.memory_used
        if used + extra > self._memory_limit:
            _log.info(
                "store %s: refusing a %d-byte %s from %s: memory budget %d, in use %d",
                self.address,
                length,
                wire.OP_NAMES[op],
                conn.peer,
                self._memory_limit,
                used,
            )
            return (
                f"{wire.OP_NAMES[op]} request of {length} bytes refused: it would take the store "
                f"to {used + extra} bytes, over its memory budget of {self._memory_limit} bytes "
                f"({self._usage()}); raise it with memory_limit= or {MEMORY_ENV}"
            )
        conn.reserved = need
        self._account(conn)
        return None

    def _account(self, conn: _Conn) -> None:
        """Recount what ``conn`` holds: unsent replies, and its input or admitted frame."""
        held = len(conn.out) + max(conn.proto.buffered, conn.reserved)
        self._io += held - conn.held
        conn.held = held

    def _answer(self, conn: _Conn, rid: int, op: int, keys: Sequence[bytes]) -> None:
        """Reply OK to a GET / WAIT / MULTI_GET whose keys all exist (or ERROR if too big)."""
        data = self._state.data
        out = conn.out
        if op == wire.OP_WAIT:
            conn.proto.frame(out, wire.ok(rid))
            return
        if op == wire.OP_GET:
            value = data[keys[0]]
            size = len(value)
        else:
            values = [data[key] for key in keys]
            size = sum(len(v) + 4 for v in values) + 4
            if size > wire.MAX_BODY_BYTES:
                conn.proto.frame(
                    out,
                    wire.error(
                        rid,
                        f"multi_get of {len(keys)} keys totals {size} bytes, over the "
                        f"{wire.MAX_BODY_BYTES}-byte frame limit; get the keys one at a time",
                    ),
                )
                return
        used = self.memory_used
        if size > wire.ADMIT_THRESHOLD and used + size > self._memory_limit:
            conn.proto.frame(
                out,
                wire.error(
                    rid,
                    f"{wire.OP_NAMES[op]} reply of {size} bytes refused: it would take the store "
                    f"to {used + size} bytes, over its memory budget of {self._memory_limit} bytes "
                    f"({self._usage()}); read earlier replies first, or raise the budget with "
                    f"memory_limit= or {MEMORY_ENV}",
                ),
            )
            return
        if op == wire.OP_GET:
            # Header and value appended apart: one copy of a large value, not two.
            conn.proto.frame(out, wire.ok_header(rid, size), value)
        else:
            conn.proto.frame(out, wire.ok_values(rid, values))
        self._account(conn)

    def _park(self, conn: _Conn, rid: int, op: int, keys: list[bytes], timeout: float) -> None:
        if len(conn.parked) >= _MAX_PARKED:
            conn.proto.frame(
                conn.out,
                wire.error(
                    rid,
                    f"{wire.OP_NAMES[op]} refused: {_MAX_PARKED} blocking requests are already "
                    f"parked on this connection, the most one connection may park",
                ),
            )
            return
        missing = self._state.missing(keys)
        # The decoder clamped timeout into [0, FOREVER]; FOREVER means no deadline at all,
        # so no huge float ever reaches the heap or select().
        forever = timeout >= wire.FOREVER
        deadline = math.inf if forever else time.monotonic() + timeout
        waiter = _Waiter(conn, rid, op, keys, missing[0], deadline)
        used = self.memory_used
        if used + waiter.cost > self._memory_limit:
            conn.proto.frame(
                conn.out,
                wire.error(
                    rid,
                    f"{wire.OP_NAMES[op]} of {len(keys)} keys refused: parking it costs "
                    f"{waiter.cost} bytes, which would take the store to {used + waiter.cost} "
                    f"bytes, over its memory budget of {self._memory_limit} bytes "
                    f"({self._usage()})",
                ),
            )
            return
        self._parked_bytes += waiter.cost
        self._waiters.setdefault(waiter.key, []).append(waiter)
        conn.parked.add(waiter)
        if not forever:
            heapq.heappush(self._deadlines, (waiter.deadline, next(self._seq), waiter))

    def _notify(self, key: bytes) -> None:
        """``key`` now exists: answer or re-file the requests parked under it."""
        waiters = self._waiters.pop(key, None)
        if not waiters:
            return
        state = self._state
        for waiter in waiters:
            if waiter.done:
                continue
            missing = state.missing(waiter.keys)
            if missing:
                waiter.key = missing[0]
                self._waiters.setdefault(waiter.key, []).append(waiter)
                continue
            waiter.done = True
            if waiter.deadline != math.inf:  # only waiters with a deadline sit in the heap
                self._stale_deadlines += 1
            self._parked_bytes -= waiter.cost
            conn = waiter.conn
            conn.parked.discard(waiter)
            self._answer(conn, waiter.rid, waiter.op, waiter.keys)
            self._flush(conn)
        self._compact_deadlines()

    def _unpark(self, waiter: _Waiter, stale: bool) -> None:
        """Withdraw a waiter (timed out, or its connection dropped)."""
        waiter.done = True
        self._parked_bytes -= waiter.cost
        if stale and waiter.deadline != math.inf:
            self._stale_deadlines += 1
        waiter.conn.parked.discard(waiter)
        filed = self._waiters.get(waiter.key)
        if filed is not None:
            with contextlib.suppress(ValueError):  # filed under a list being notified right now
                filed.remove(waiter)
            if not filed:
                del self._waiters[waiter.key]

    def _compact_deadlines(self) -> None:
        # Answered waiters stay in the heap until their deadline; rebuild when they dominate.
        if self._stale_deadlines > 1024 and self._stale_deadlines * 2 > len(self._deadlines):
            self._deadlines = [entry for entry in self._deadlines if not entry[2].done]
            heapq.heapify(self._deadlines)
            self._stale_deadlines = 0

    # --- output and teardown -----------------------------------------------------------------

    def _flush(self, conn: _Conn) -> None:
        out = conn.out
        if out:
            try:
                sent = conn.sock.send(out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._drop(conn, f"send failed: {exc}")
                return
            if sent:
                del out[:sent]
        below = len(out) < _HIGH_WATER
        if conn.stalled and below:
            self._ready.add(conn)  # its buffered requests are handled at the end of the round
        events = selectors.EVENT_READ if below and not conn.stalled else 0
        if out:
            events |= selectors.EVENT_WRITE
        if events and events != conn.events and conn.sock.fileno() >= 0:
            conn.events = events
            self._sel.modify(conn.sock, events, conn)
        self._account(conn)

    def _drop(self, conn: _Conn, reason: str | None, level: int = logging.INFO) -> None:
        if conn not in self._conns:
            return
        if reason is not None:
            _log.log(level, "store %s: dropping client %s: %s", self.address, conn.peer, reason)
        elif conn.nonces[1]:
            # Challenged, and gone before its proof: a client with another secret finds this
            # server's proof wrong and leaves without giving one (it must not prove itself to
            # a server it cannot trust).
            _log.warning(
                "store %s: %s left during authentication: its secret differs from this "
                "store's, or it gave up",
                self.address,
                conn.peer,
            )
        self._conns.discard(conn)
        self._ready.discard(conn)
        for waiter in list(conn.parked):
            self._unpark(waiter, stale=True)
        with contextlib.suppress(KeyError, ValueError):  # never registered, or already closed
            self._sel.unregister(conn.sock)
        conn.sock.close()
        conn.out = bytearray()  # clear() would keep the capacity while the conn lives on
        conn.proto = wire.ServerConnection()
        conn.reserved = 0
        self._io -= conn.held
        conn.held = 0
        self._compact_deadlines()

    def _cleanup(self) -> None:
        with self._lifecycle:
            if self._closed:
                return
            self._closed = True
            self._serving = False
        for conn in list(self._conns):
            self._drop(conn, None)
        self._sel.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()
        with self._clients_cond:
            self._clients_cond.notify_all()


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    address = format_address(host, port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise StoreError(f"cannot start the store server on {address}: {exc}") from exc
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # Lets a restarted server rebind over TIME_WAIT leftovers; never a live listener's port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StoreError(
                f"cannot start the store server on {address}: the port is already in use"
            ) from exc
        raise StoreError(f"cannot start the store server on {address}: {exc}") from exc
    return sock
