"""The TCPStore server: one thread, one ``selectors`` loop, non-blocking sockets.

One thread serves every client, so 512 idle clients cost 512 sockets and nothing else. A
``get``/``wait``/``multi_get`` on a missing key is parked server-side and answered when the
key appears, or with a TIMEOUT frame when the deadline the client sent passes. A client that
breaks the protocol (wrong magic, unknown opcode, oversized length prefix, garbage) is
dropped alone; the others are never disturbed. Memory per connection stays bounded: the
decoder refuses oversized frames from their header, a connection whose replies pile up
(``_HIGH_WATER``) is not read until they drain, and parked requests per connection are capped.

This module is the server's socket side: the selector loop, accepting, the handshake, sending
and dropping. The rest lives apart: where it listens in :mod:`meshcomm.store._address`, the
memory budget in :mod:`meshcomm.store._budget`, a connection's state in
:mod:`meshcomm.store._conn`, the answers to requests in :mod:`meshcomm.store._handlers`, and
parked requests in :mod:`meshcomm.store._waiters`.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import logging
import selectors
import socket
import threading
import time

from meshcomm.common.secret import job_secret, matches, new_nonce, proof, session_key
from meshcomm.errors import InvalidArgument, ProtocolError, StoreError
from meshcomm.store import wire
from meshcomm.store._address import (
    DEFAULT_BACKLOG,
    bind_listener,
    check_host_port,
    format_address,
)
from meshcomm.store._budget import (
    DEFAULT_MEMORY_LIMIT,
    MEMORY_ENV,
    MemoryBudget,
    parse_memory_limit,
)
from meshcomm.store._conn import Conn
from meshcomm.store._handlers import RequestHandler
from meshcomm.store._waiters import Waiters
from meshcomm.store.memory import KVState

__all__ = [
    "DEFAULT_BACKLOG",
    "DEFAULT_MEMORY_LIMIT",
    "HANDSHAKE_TIMEOUT",
    "MEMORY_ENV",
    "StoreServer",
    "check_host_port",
    "format_address",
    "parse_memory_limit",
]

#: Seconds a new connection has to finish the handshake (authentication included) before it
#: is dropped: a half-open or slowloris connection costs a socket and < 100 bytes, for so long.
HANDSHAKE_TIMEOUT = 10.0

_log = logging.getLogger("meshcomm.store")

_RECV_BYTES = 256 * 1024
# Stop reading a connection whose unsent replies exceed this; resume once they drain.
_HIGH_WATER = 4 * 1024 * 1024
# Longest single sleep in select(): epoll refuses timeouts past ~24.8 days (2**31 ms), and a
# waiter with no deadline must not become one; a periodic wake-up costs nothing.
_MAX_POLL = 3600.0
# Pause accepting for this long when the process runs out of file descriptors.
_ACCEPT_PAUSE = 0.1
_ACCEPT_BATCH = 512
_LISTENER = object()
_WAKE = object()


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
        self._budget = MemoryBudget(parse_memory_limit(memory_limit))
        self._host = host
        self._listener = bind_listener(host, port, backlog)
        self._port: int = self._listener.getsockname()[1]
        self._state = KVState()
        self._waiters = Waiters(self._budget)
        self._requests = RequestHandler(
            self._state, self._budget, self._waiters, self.address, self._flush
        )
        self._rbuf = bytearray(_RECV_BYTES)
        self._rview = memoryview(self._rbuf)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._conns: set[Conn] = set()
        self._ready: set[Conn] = set()
        self._accept_resume: float | None = None
        self._handshakes: collections.deque[Conn] = collections.deque()
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
        return self._budget.limit

    @property
    def memory_used(self) -> int:
        """Bytes counted against the budget now: stored keys and values (with a per-entry
        overhead), parked requests, unsent replies and frames being received."""
        return self._budget.used

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
                if isinstance(data, Conn):
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
            waiting = self._waiters.next_deadline is not None
            if waiting or self._handshakes or self._accept_resume is not None:
                self._on_timers(time.monotonic())
            while self._ready:
                conn = self._ready.pop()
                if conn.stalled and conn.sock.fileno() >= 0:
                    self._process(conn)
                    self._flush(conn)

    def _poll_timeout(self) -> float | None:
        when = self._waiters.next_deadline
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
            conn = Conn(sock, peer)
            conn.proto = wire.ServerConnection(functools.partial(self._requests.admit, conn))
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
        self._requests.expire(now)

    def _on_readable(self, conn: Conn) -> None:
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
        conn.recount(self._budget)
        self._process(conn)
        if conn.sock.fileno() >= 0:
            self._flush(conn)

    def _process(self, conn: Conn) -> None:
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
                        conn.recount(self._budget)
                    self._requests.handle(conn, event.rid, event.op, event.args)
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

    def _on_hello(self, conn: Conn, hello: wire.Hello) -> None:
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

    def _on_proof(self, conn: Conn, answer: bytes) -> None:
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

    def _admitted(self, conn: Conn) -> None:
        """The handshake is done: count a registering client."""
        conn.ready = True
        if conn.flags & wire.FLAG_REGISTER:
            with self._clients_cond:
                self._registered += 1
                self._clients_cond.notify_all()

    def _refuse(self, conn: Conn, answer: bytes) -> None:
        """Send a last handshake answer (best effort) and drop the connection."""
        with contextlib.suppress(OSError):  # it is being dropped either way
            conn.sock.send(answer)
        self._drop(conn, None)

    # --- output and teardown -----------------------------------------------------------------

    def _flush(self, conn: Conn) -> None:
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
        conn.recount(self._budget)

    def _drop(self, conn: Conn, reason: str | None, level: int = logging.INFO) -> None:
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
            self._waiters.unpark(waiter, stale=True)
        with contextlib.suppress(KeyError, ValueError):  # never registered, or already closed
            self._sel.unregister(conn.sock)
        conn.sock.close()
        conn.out = bytearray()  # clear() would keep the capacity while the conn lives on
        conn.proto = wire.ServerConnection()
        conn.reserved = 0
        self._budget.io -= conn.held
        conn.held = 0
        self._waiters.compact()

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
