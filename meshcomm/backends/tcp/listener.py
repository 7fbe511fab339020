"""A rank's always-open door: the thread that accepts peer connections and screens them.

The progress engine runs only inside calls, so a listener served by the engine accepts only
while its rank is in a call; strangers then pile up in the kernel's backlog until real peers
cannot connect. :class:`LinkListener` accepts at all times, on its own thread, and runs the
acceptor's side of each connection's handshake up to the point where only the engine can
decide (is this a duplicate of a connection the engine is opening?):

- the connector's HELLO must arrive whole within ``handshake_timeout`` and match the job
  (magic, version, token, world size, a rank other than ours);
- with a secret, the AUTH exchange (:mod:`~meshcomm.backends.tcp.link_auth`) must succeed;
- nothing may follow a handshake message before it is answered (a real peer waits).

Connections that pass are *parked* with their HELLO and the engine is woken (a byte on a
socket pair it selects on); it takes them with :meth:`LinkListener.take` and answers ACCEPT
or REJECT. Everything else is refused (a REJECT with the reason, when the stranger spoke the
protocol) and closed. Work and memory are bounded: at most ``max_pending`` handshakes in
progress (a new connection beyond that evicts the oldest, so a real peer, whose handshake
takes a round trip, gets through a flood of idle ones), each reading at most one handshake
message (about 1 KiB), and at most ``max_parked`` parked connections (a HELLO each).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque

from meshcomm.backends.tcp import wire
from meshcomm.backends.tcp.addresses import format_address
from meshcomm.backends.tcp.link_auth import (
    AUTH_REASON,
    acceptor_proof,
    connector_proof,
    link_context,
    matches,
    new_nonce,
)
from meshcomm.errors import ProtocolError

__all__ = ["LinkListener", "Parked"]

_READ = 4096  # more than any handshake message; a peer never sends more before the answer
_STOP = object()
_JOIN_TIMEOUT = 5.0
_DRAIN_READS = 16
_ACCEPT_BATCH = 256


class Parked:
    """A screened connection waiting for the engine.

    Attributes:
        sock: the connection (non-blocking).
        address: the connector's ``host:port`` as this side sees it.
        hello: its HELLO.
    """

    __slots__ = ("address", "hello", "sock")

    def __init__(self, sock: socket.socket, address: str, hello: wire.Hello) -> None:
        self.sock = sock
        self.address = address
        self.hello = hello


class _Screening:
    """One connection whose handshake is in progress."""

    __slots__ = ("address", "context", "deadline", "decoder", "hello", "nonce", "sock")

    def __init__(self, sock: socket.socket, address: str, deadline: float) -> None:
        self.sock = sock
        self.address = address
        self.deadline = deadline
        self.decoder = wire.Decoder(0)
        self.hello: wire.Hello | None = None  # set once the HELLO passed
        self.nonce = b""
        self.context = b""


class LinkListener:
    """Accepts and screens peer connections on a thread; parks the good ones for the engine.

    Args:
        listener: the bound, listening socket (owned from now on: :meth:`close` closes it).
        rank: this process's global rank.
        size: the world size.
        token: the job token.
        secret: the job's secret, or None (no authentication).
        address: this rank's published ``host:port`` (bound into the proofs).
        rejected: a list the reasons of refused handshakes are appended to (the last 16 kept).
        handshake_timeout: seconds a connection may take to complete its handshake.
        max_pending: handshakes in progress at most.
        max_parked: parked connections at most (beyond: refused, "too many").

    Attributes:
        wake: the socket that becomes readable when a connection was parked (the engine
            selects on it; :meth:`take` empties it).
    """

    def __init__(
        self,
        listener: socket.socket,
        *,
        rank: int,
        size: int,
        token: bytes,
        secret: bytes | None,
        address: str,
        rejected: list[str],
        handshake_timeout: float = 10.0,
        max_pending: int = 128,
        max_parked: int = 64,
    ) -> None:
        self._listener = listener
        self._rank = rank
        self._size = size
        self._token = token
        self._secret = secret
        self._address = address
        self._rejected = rejected
        self._handshake_timeout = handshake_timeout
        self._max_pending = max_pending
        self._max_parked = max_parked
        self._parked: deque[Parked] = deque()
        self._lock = threading.Lock()
        self.wake, self._wake_w = socket.socketpair()
        self._stop_r, self._stop_w = socket.socketpair()
        for s in (self.wake, self._wake_w, self._stop_r, self._stop_w):
            s.setblocking(False)
        self._screening: OrderedDict[socket.socket, _Screening] = OrderedDict()
        self._closed = False
        self._thread = threading.Thread(
            target=self._serve, name=f"meshcomm-tcp-listener-{rank}", daemon=True
        )

    def start(self) -> None:
        """Start accepting."""
        self._thread.start()

    @property
    def parked(self) -> int:
        """Connections waiting for the engine."""
        return len(self._parked)

    @property
    def screening(self) -> int:
        """Handshakes in progress."""
        return len(self._screening)

    def take(self) -> list[Parked]:
        """Return (and forget) the parked connections, oldest first."""
        with contextlib.suppress(OSError):
            while self.wake.recv(4096):
                pass
        with self._lock:
            taken = list(self._parked)
            self._parked.clear()
        return taken

    def close(self) -> None:
        """Stop the thread, close every connection it holds and the listening socket."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            with contextlib.suppress(OSError):
                self._stop_w.send(b"x")
            self._thread.join(_JOIN_TIMEOUT)
        # The thread closed what it screened; parked connections nobody took are ours.
        for parked in self.take():
            parked.sock.close()
        for s in (self._listener, self.wake, self._wake_w, self._stop_r, self._stop_w):
            s.close()

    # -- the thread ----------------------------------------------------------------------------
    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        try:
            sel.register(self._listener, selectors.EVENT_READ, None)
            sel.register(self._stop_r, selectors.EVENT_READ, _STOP)
            while True:
                # Idle, sleep until a connection or close() (the stop socket) says so: no
                # periodic wake-up competes with the engine for the GIL.
                timeout = None
                if self._screening:
                    first = next(iter(self._screening.values()))
                    timeout = max(0.0, first.deadline - time.monotonic())
                for key, _ in sel.select(timeout):
                    if key.data is _STOP:
                        return
                    if key.data is None:
                        self._accept_some(sel)
                    elif key.fileobj in self._screening:
                        self._screen(sel, key.data)
                self._expire(sel)
        finally:
            for conn in list(self._screening.values()):
                self._close(sel, conn)
            sel.close()

    def _accept_some(self, sel: selectors.BaseSelector) -> None:
        try:
            self._accept(sel)
        except Exception as exc:  # the door must stay open: note it, pause, go on
            self._note(f"accepting failed: {exc!r}")
            time.sleep(0.01)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        # A bounded batch per wake-up (the deadlines of those in progress still count), large
        # enough to empty the backlog within one GIL slice of a busy rank.
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # Out of file descriptors, say: the connection stays in the backlog; pause
                # rather than spin on a listener that stays readable.
                time.sleep(0.01)
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if len(self._screening) >= self._max_pending:
                # Evict the oldest: a flood of silent connections must not lock real peers
                # out, and a real peer finishes its handshake in a round trip.
                oldest = next(iter(self._screening.values()))
                self._note(f"{oldest.address}: evicted, {self._max_pending} handshakes pending")
                self._close(sel, oldest)
            address = format_address(str(addr[0]), int(addr[1]))
            conn = _Screening(sock, address, time.monotonic() + self._handshake_timeout)
            self._screening[sock] = conn
            sel.register(sock, selectors.EVENT_READ, conn)

    def _expire(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        while self._screening:
            first = next(iter(self._screening.values()))
            if first.deadline > now:
                return
            self._note(
                f"{first.address}: no complete handshake within {self._handshake_timeout:g} s"
            )
            self._close(sel, first)

    def _screen(self, sel: selectors.BaseSelector, conn: _Screening) -> None:
        try:
            self._read(sel, conn)
        except Exception as exc:  # no input may stop the listener: drop this one alone
            self._note(f"{conn.address}: dropped after an internal error: {exc!r}")
            self._close(sel, conn)

    def _read(self, sel: selectors.BaseSelector, conn: _Screening) -> None:
        try:
            data = conn.sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(sel, conn)
            return
        if not data:
            self._close(sel, conn)
            return
        dec = conn.decoder
        dec.receive_data(data)
        try:
            event = dec.next_event()
        except ProtocolError as exc:
            self._refuse(sel, conn, str(exc))
            return
        if event is wire.NEED_DATA:
            return
        if not isinstance(event, wire.Hello) or dec.buffered:
            self._refuse(sel, conn, "bytes after a handshake message before it was answered")
            return
        try:
            if conn.hello is None:
                self._on_hello(sel, conn, event)
            else:
                self._on_auth(sel, conn, event)
        except ProtocolError as exc:
            self._refuse(sel, conn, str(exc))

    def _on_hello(self, sel: selectors.BaseSelector, conn: _Screening, hello: wire.Hello) -> None:
        wire.check_hello(
            hello, kinds=[wire.HELLO], token=self._token, world_size=self._size, peer=conn.address
        )
        if hello.rank == self._rank:
            raise ProtocolError(f"rank {hello.rank} is this process ({self._address})")
        offered = bool(hello.flags & wire.F_AUTH)
        if self._secret is None:
            if offered:
                raise ProtocolError(
                    f"{AUTH_REASON}rank {self._rank} at {self._address} has no job secret, "
                    f"rank {hello.rank} has one (set MESHCOMM_SECRET alike on every rank)"
                )
            self._park(sel, conn, hello)
            return
        if not offered:
            raise ProtocolError(
                f"{AUTH_REASON}rank {self._rank} at {self._address} requires the job's secret, "
                f"rank {hello.rank} sent none (set MESHCOMM_SECRET alike on every rank)"
            )
        conn.hello = hello
        conn.nonce = new_nonce()
        conn.context = link_context(
            self._token,
            self._size,
            connector=hello.rank,
            acceptor=self._rank,
            address=self._address,
            flags=hello.flags,
            host_key=hello.reason if hello.flags & wire.F_SHM else "",
        )
        answer = wire.encode_auth(
            rank=self._rank,
            world_size=self._size,
            token=self._token,
            nonce=conn.nonce,
            proof=acceptor_proof(self._secret, conn.context, hello.nonce, conn.nonce),
        )
        self._send(sel, conn, answer)
        conn.decoder.expect_handshake()

    def _on_auth(self, sel: selectors.BaseSelector, conn: _Screening, auth: wire.Hello) -> None:
        hello = conn.hello
        if hello is None or self._secret is None:  # pragma: no cover - _read's branch
            raise ProtocolError("AUTH before an authenticated HELLO")
        wire.check_hello(
            auth,
            kinds=[wire.AUTH],
            token=self._token,
            world_size=self._size,
            peer=conn.address,
            expect_rank=hello.rank,
        )
        expected = connector_proof(self._secret, conn.context, hello.nonce, conn.nonce)
        if auth.nonce != hello.nonce or not matches(expected, auth.proof):
            raise ProtocolError(
                f"{AUTH_REASON}the connection from {conn.address} claiming rank {hello.rank} "
                f"did not prove it holds this job's secret (another secret, or a replayed "
                "handshake)"
            )
        self._park(sel, conn, hello)

    def _park(self, sel: selectors.BaseSelector, conn: _Screening, hello: wire.Hello) -> None:
        with self._lock:
            full = len(self._parked) >= self._max_parked
            if not full:
                self._forget(sel, conn)
                self._parked.append(Parked(conn.sock, conn.address, hello))
        if full:
            raise ProtocolError(
                f"rank {self._rank}: {self._max_parked} connections already wait for this rank"
            )
        with contextlib.suppress(OSError):  # a full pipe already says "look"
            self._wake_w.send(b"x")

    def _send(self, sel: selectors.BaseSelector, conn: _Screening, data: bytes) -> None:
        try:
            sent = conn.sock.send(data)
        except OSError:
            sent = 0
        if sent != len(data):  # a fresh socket's buffer takes a handshake message whole
            raise ProtocolError(f"{conn.address}: could not send the handshake answer")

    def _refuse(self, sel: selectors.BaseSelector, conn: _Screening, reason: str) -> None:
        self._note(reason)
        answer = wire.encode_hello(
            wire.REJECT, rank=self._rank, world_size=self._size, token=wire.NO_TOKEN, reason=reason
        )
        with contextlib.suppress(OSError):
            conn.sock.send(answer)
        self._close(sel, conn)

    def _note(self, reason: str) -> None:
        self._rejected.append(reason)
        del self._rejected[:-16]

    def _forget(self, sel: selectors.BaseSelector, conn: _Screening) -> None:
        self._screening.pop(conn.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn.sock)

    def _close(self, sel: selectors.BaseSelector, conn: _Screening) -> None:
        self._forget(sel, conn)
        # Read what is left so close() sends FIN, not RST (the REJECT must arrive); a few
        # reads at most, since a stranger may keep sending.
        with contextlib.suppress(OSError):
            for _ in range(_DRAIN_READS):
                if not conn.sock.recv(65536):
                    break
        conn.sock.close()
