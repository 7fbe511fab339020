"""The tcp backend's sockets: connections between ranks and the progress engine.

This is the only module of the backend that touches sockets. One :class:`Transport` per
process owns a listening socket, one connection per peer rank (opened on first use, shared
by every communicator and told apart by communicator id), and a single-threaded progress
engine: :meth:`Transport.exchange` posts sends and receives, then drives every socket with
``selectors`` until its own operations are complete. Frames nobody waits for yet are kept
and matched later, first in first out per (communicator, source, tag).

Connection setup: each rank listens on port 0 and publishes ``host:port`` under
``meshcomm/tcp/addr/<rank>`` in the store. The sender of the first message to a peer
connects and says HELLO (magic, version, job token, rank); the peer answers ACCEPT or
REJECT. When two ranks connect to each other at once, the connection opened by the lower
rank is kept and the other is refused as a duplicate, so both sides agree without a round.

Faults: EOF or a reset on a peer's connection raises :class:`~meshcomm.errors.PeerError`
naming that peer, and the detecting rank writes an abort record (``meshcomm/tcp/abort``)
to the store; every rank blocked in the engine checks that key about once a second, so
ranks with no connection to the dead one fail too. No progress for the timeout raises
:class:`~meshcomm.errors.CommTimeout`. After either, the transport is broken and every call
fails fast with the original reason.

A channel is picked per peer (:func:`channel_kind`); only sockets exist today, and
``MESHCOMM_TRANSPORT=tcp`` will keep forcing them once a shared-memory channel lands.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence

import numpy as np

from meshcomm.backends.tcp import wire
from meshcomm.errors import (
    CommError,
    CommTimeout,
    InvalidArgument,
    MeshCommError,
    PeerError,
    ProtocolError,
    RendezvousError,
    StoreError,
)
from meshcomm.store.base import Store

__all__ = [
    "ABORT_KEY",
    "ANY_SOURCE",
    "LINK_TAG",
    "TOKEN_KEY",
    "TcpLink",
    "Transport",
    "addr_key",
    "as_bytes",
    "channel_kind",
]

TOKEN_KEY = "meshcomm/tcp/token"
ABORT_KEY = "meshcomm/tcp/abort"
#: Tag of Link traffic (negative tags are internal; users get 0 and up).
LINK_TAG = -1
#: ``src`` of a receive that accepts any rank.
ANY_SOURCE = -1

_ABORT_CHECK_INTERVAL = 1.0
# 4 MiB socket buffers: room for a whole ring step of mid-sized messages in the kernel.
_SOCKET_BUFFER = 4 * 1024 * 1024
_CONNECT_ATTEMPT_TIMEOUT = 2.0
# Payloads up to this size are copied behind their header and sent as one buffer.
_COALESCE_MAX = 16 * 1024
_ABORT_RANK = re.compile(r"rank (\d+)")


def addr_key(rank: int) -> str:
    """Return the store key under which ``rank`` publishes its ``host:port``.

    Example:
        >>> addr_key(3)
        'meshcomm/tcp/addr/3'
    """
    return f"meshcomm/tcp/addr/{rank}"


def channel_kind(same_host: bool) -> str:
    """Return the channel kind for a peer: only ``"tcp"`` exists today.

    ``MESHCOMM_TRANSPORT`` may be ``auto`` (default) or ``tcp`` (force sockets even where a
    faster same-host channel exists). A shared-memory channel will be picked here for
    same-host peers under ``auto``.

    Raises:
        InvalidArgument: ``MESHCOMM_TRANSPORT`` has another value.

    Example:
        >>> channel_kind(same_host=True)
        'tcp'
    """
    raw = os.environ.get("MESHCOMM_TRANSPORT", "auto").strip().lower() or "auto"
    if raw not in ("auto", "tcp"):
        raise InvalidArgument(f"MESHCOMM_TRANSPORT must be 'auto' or 'tcp', got {raw!r}")
    return "tcp"


def as_bytes(buffer: object, *, writable: bool = False) -> memoryview:
    """Return a flat byte view of a C-contiguous array (no copy; ml_dtypes work too).

    Raises:
        InvalidArgument: the buffer is not C-contiguous, or is read-only where written.

    Example:
        >>> as_bytes(np.arange(2, dtype=np.int32)).nbytes
        8
    """
    try:
        view = memoryview(buffer).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError):
        # ml_dtypes arrays have no buffer format; their uint8 view does.
        arr = np.asarray(buffer)
        if not arr.flags.c_contiguous:
            raise InvalidArgument(
                f"buffers must be C-contiguous, got a {arr.dtype} array of strides {arr.strides}"
            ) from None
        view = arr.reshape(-1).view(np.uint8).data
    if writable and view.readonly:
        raise InvalidArgument("receive buffers must be writable, got a read-only buffer")
    return view


# -- operations and messages -----------------------------------------------------------------


class _Send:
    """One outgoing frame: the unsent rest of its byte views."""

    __slots__ = ("bufs", "left", "peer")

    def __init__(self, peer: int, bufs: list[bytes | memoryview], left: int) -> None:
        self.peer = peer
        self.bufs = bufs
        self.left = left

    def advance(self, sent: int) -> None:
        self.left -= sent
        bufs = self.bufs
        while sent:
            first = bufs[0]
            if sent >= len(first):
                sent -= len(first)
                bufs.pop(0)
            else:
                bufs[0] = first[sent:]
                sent = 0


class _Recv:
    """One posted receive: into ``dest`` (Link bytes), or a new array (``dest`` None)."""

    __slots__ = ("array", "comm_id", "dest", "done", "source", "src", "tag")

    def __init__(self, comm_id: int, src: int, tag: int, dest: memoryview | None) -> None:
        self.comm_id = comm_id
        self.src = src
        self.tag = tag
        self.dest = dest
        self.done = False
        self.array: np.ndarray | None = None
        self.source = -1


class _Message:
    """A frame that arrived before its receive was posted (its payload may still be coming)."""

    __slots__ = ("array", "buf", "done", "header", "src", "waiter")

    def __init__(self, header: wire.FrameHeader, src: int) -> None:
        self.header = header
        self.src = src
        self.done = False
        self.waiter: _Recv | None = None
        self.array: np.ndarray | None = None
        self.buf: memoryview


_CONNECTING = "connecting"  # we connected and sent HELLO; waiting for ACCEPT/REJECT
_ACCEPTING = "accepting"  # accepted; waiting for the peer's HELLO
_OPEN = "open"
_CLOSED = "closed"


class _Channel:
    """One socket to a peer, with its decoder and the frame being received."""

    __slots__ = ("address", "current", "decoder", "goodbye", "peer", "sock", "state", "writing")

    def __init__(self, sock: socket.socket, state: str, peer: int, address: str) -> None:
        self.sock = sock
        self.state = state
        self.peer = peer  # -1 until an accepted peer says who it is
        self.address = address
        self.decoder = wire.Decoder()
        self.current: _Recv | _Message | None = None
        self.goodbye = False
        self.writing = False


# -- addresses -------------------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _route_address(target: str) -> str:
    # The local address the kernel would use to reach ``target`` (a UDP connect sends nothing).
    try:
        family = socket.AF_INET6 if ":" in target else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _store_host(store: object) -> str:
    # A PrefixStore wraps the TCPStore that knows the server's host.
    for _ in range(8):
        host = getattr(store, "host", None)
        if isinstance(host, str):
            return host
        store = getattr(store, "underlying_store", None)
        if store is None:
            break
    return ""


def choose_host(store: Store) -> tuple[str, str]:
    """Return (bind host, advertised host) for this rank's listener.

    ``MESHCOMM_HOST`` wins; else a non-loopback ``MESHCOMM_MASTER_ADDR`` / ``MASTER_ADDR``
    (or the TCPStore's host) means several hosts, so we bind and advertise the local address
    that routes to it; else 127.0.0.1.
    """
    host = os.environ.get("MESHCOMM_HOST", "").strip()
    master = (
        os.environ.get("MESHCOMM_MASTER_ADDR", "").strip()
        or os.environ.get("MASTER_ADDR", "").strip()
        or _store_host(store)
    )
    if host:
        if host in ("0.0.0.0", "::"):
            return host, _route_address(master) if master and not _is_loopback(master) else host
        return host, host
    if master and not _is_loopback(master):
        local = _route_address(master)
        return local, local
    return "127.0.0.1", "127.0.0.1"


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise RendezvousError(f"malformed address {address!r} in the store, expected host:port")
    return host.strip("[]"), int(port)


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            if sock.getsockopt(socket.SOL_SOCKET, opt) < _SOCKET_BUFFER:
                sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)


# -- the transport ---------------------------------------------------------------------------


class Transport:
    """Connections to every peer of one world and the engine that moves their frames.

    Create it with :meth:`start`. All methods are thread-safe: calls are serialized by a
    lock, and progress happens only inside calls (there is no background thread).

    Attributes:
        rank: this process's global rank.
        size: the world size.
        timeout: seconds without progress before ``CommTimeout``.
        address: the advertised ``host:port`` of this rank's listener.
    """

    def __init__(
        self,
        rank: int,
        size: int,
        store: Store,
        timeout: float,
        token: bytes,
        listener: socket.socket,
        address: str,
    ) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.address = address
        self._store = store
        self._token = token
        self._listener = listener
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._open: dict[int, _Channel] = {}
        self._connecting: dict[int, _Channel] = {}
        self._awaiting: set[int] = set()  # our connect was refused as a duplicate: theirs comes
        self._gone: dict[int, str] = {}  # peers whose connection ended between frames
        self._sendq: dict[int, deque[_Send]] = {}
        self._posted: dict[tuple[int, int, int], deque[_Recv]] = {}
        self._posted_any: dict[tuple[int, int], deque[_Recv]] = {}
        self._unexpected: dict[tuple[int, int, int], deque[_Message]] = {}
        self._npending = 0
        self._progressed = False
        self._last_abort_check = 0.0
        self._failure: CommError | None = None
        self._closed = False
        #: Reasons of handshakes this rank refused (foreign or stale peers), newest last.
        self.rejected: list[str] = []

    @classmethod
    def start(cls, rank: int, size: int, store: Store, timeout: float) -> Transport:
        """Listen, agree on the job token, and publish this rank's address in the store.

        Nothing waits for other ranks: connections open on first use.

        Raises:
            InvalidArgument: bad rank, size or timeout.
            RendezvousError: the store holds a malformed token.
        """
        if not isinstance(size, int) or size < 1:
            raise InvalidArgument(f"world size must be a positive int, got {size!r}")
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise InvalidArgument(f"rank must be in [0, {size}), got {rank!r}")
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be positive, got {timeout!r}")
        channel_kind(same_host=True)  # validates MESHCOMM_TRANSPORT before any I/O
        # Every rank proposes a token; the first proposal in the store wins for all.
        token = store.compare_set(TOKEN_KEY, b"", secrets.token_bytes(wire.TOKEN_SIZE))
        if len(token) != wire.TOKEN_SIZE:
            raise RendezvousError(
                f"rank {rank}: store key {TOKEN_KEY!r} holds {len(token)} bytes, expected a "
                f"{wire.TOKEN_SIZE}-byte job token"
            )
        bind_host, adv_host = choose_host(store)
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _tune(listener)  # accepted sockets inherit the buffer sizes
            listener.bind((bind_host, 0))
            listener.listen(max(128, size))
            listener.setblocking(False)
            address = _format_address(adv_host, listener.getsockname()[1])
            store.set(addr_key(rank), address)
        except BaseException:
            listener.close()
            raise
        return cls(rank, size, store, timeout, bytes(token), listener, address)

    # -- public operations -------------------------------------------------------------------
    @property
    def failure(self) -> CommError | None:
        """The error that broke this transport, or None while it works."""
        return self._failure

    @property
    def connected_peers(self) -> list[int]:
        """Global ranks this process has an open connection to (for diagnostics)."""
        return sorted(self._open)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def exchange(
        self,
        comm_id: int,
        tag: int,
        sends: Sequence[tuple[int, memoryview]],
        recvs: Sequence[tuple[int, memoryview]],
    ) -> None:
        """Send and receive raw bytes (global peer ranks); return when all have completed.

        Each receive buffer must have exactly the size of the matching send.

        Raises:
            CommTimeout: no progress for the timeout.
            PeerError: a peer died or closed (names its global rank).
            ProtocolError: a frame did not match its receive (kind or size).
        """
        header = wire.pack_data_header
        hsize = wire.HEADER_SIZE
        # Small payloads ride in one bytes object with their header: one buffer per send
        # call is much cheaper in the kernel than a two-buffer sendmsg.
        sops = [
            _Send(peer, [header(comm_id, tag, len(buf)) + buf], hsize + len(buf))
            if len(buf) <= _COALESCE_MAX
            else _Send(peer, [header(comm_id, tag, len(buf)), buf], hsize + len(buf))
            for peer, buf in sends
        ]
        rops = [_Recv(comm_id, src, tag, buf) for src, buf in recvs]
        self._locked_run(sops, rops, f"exchange on communicator {comm_id:#x}")

    def send_array(self, comm_id: int, tag: int, dst: int, array: np.ndarray) -> None:
        """Send a C-contiguous array with its dtype and shape to global rank ``dst``."""
        meta = wire.encode_array_meta(array.dtype, array.shape)
        payload = as_bytes(array)
        head = wire.encode_header(
            wire.ARRAY, comm_id=comm_id, tag=tag, length=len(payload), meta=meta
        )
        op = _Send(dst, [head, payload], len(head) + len(payload))
        self._locked_run([op], [], f"send to rank {dst} (tag {tag})")

    def recv_array(self, comm_id: int, tag: int, src: int) -> tuple[np.ndarray, int]:
        """Receive an array from global rank ``src`` (``ANY_SOURCE``: any) and its sender."""
        op = _Recv(comm_id, src, tag, None)
        source = "any rank" if src == ANY_SOURCE else f"rank {src}"
        self._locked_run([], [op], f"recv from {source} (tag {tag})")
        if op.array is None:  # pragma: no cover - a completed array receive always has one
            raise ProtocolError("array receive completed without an array")
        return op.array, op.source

    def forget(self, comm_id: int) -> None:
        """Drop frames buffered for a closed communicator (skipped if the lock stays busy)."""
        if not self._lock.acquire(timeout=self.timeout):
            return
        try:
            for key in [k for k in self._unexpected if k[0] == comm_id]:
                del self._unexpected[key]
        finally:
            self._lock.release()

    def close(self) -> None:
        """Say GOODBYE to connected peers and close every socket. Idempotent."""
        if self._closed:
            return
        locked = self._lock.acquire(timeout=self.timeout)
        try:
            if self._closed:
                return
            self._closed = True
            goodbye = wire.encode_header(wire.GOODBYE, comm_id=0, tag=0, length=0)
            for ch in list(self._open.values()):
                if self._failure is None and not self._sendq.get(ch.peer):
                    with contextlib.suppress(OSError):
                        ch.sock.send(goodbye)
            channels = [key.data for key in self._sel.get_map().values() if key.data is not None]
            for ch in channels:
                self._drop(ch)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(self._listener)
            self._listener.close()
            self._sel.close()
            self._unexpected.clear()
        finally:
            if locked:
                self._lock.release()

    # -- the engine ----------------------------------------------------------------------------
    def _locked_run(self, sends: list[_Send], recvs: list[_Recv], what: str) -> None:
        if not self._lock.acquire(timeout=self.timeout):
            raise CommTimeout(
                f"rank {self.rank}: {what} waited {self.timeout:g} s for another thread's "
                "operation on this transport"
            )
        try:
            self._run(sends, recvs, what)
        finally:
            self._lock.release()

    def _run(self, sends: list[_Send], recvs: list[_Recv], what: str) -> None:
        if self._failure is not None:
            raise _replay(self._failure)
        if self._closed:
            raise CommError(f"rank {self.rank}: {what} on a closed tcp transport")
        self._npending = 0
        try:
            for r in recvs:
                self._post_recv(r)
            for s in sends:
                self._post_send(s)
            if self._npending:
                self._wait(what, sends, recvs)
        except CommError as exc:
            self._break(exc)
            raise
        except BaseException as exc:
            # Interrupted half way (KeyboardInterrupt, MemoryError): frames are cut, so the
            # streams can no longer be trusted.
            self._break(CommError(f"rank {self.rank}: {what} was interrupted: {exc!r}"))
            raise

    def _wait(self, what: str, sends: list[_Send], recvs: list[_Recv]) -> None:
        clock = time.monotonic
        timeout = self.timeout
        start = last_progress = clock()
        select = self._sel.select
        while self._npending:
            now = clock()
            if self._progressed:
                self._progressed = False
                last_progress = now
            idle = now - last_progress
            if idle >= timeout:
                raise CommTimeout(
                    f"rank {self.rank}: no progress for {timeout:g} s in {what}; "
                    f"{self._describe_pending(sends, recvs)}"
                )
            since_check = now - max(self._last_abort_check, start)
            if since_check >= _ABORT_CHECK_INTERVAL:
                self._last_abort_check = now
                self._check_abort()
                since_check = 0.0
            wait = min(timeout - idle, _ABORT_CHECK_INTERVAL - since_check)
            for key, mask in select(wait):
                ch = key.data
                if ch is None:
                    self._accept()
                    continue
                if ch.state is _CLOSED:  # dropped earlier in this batch (duplicate, EOF)
                    continue
                if mask & selectors.EVENT_READ:
                    self._read(ch)
                if mask & selectors.EVENT_WRITE and ch.state is _OPEN:
                    self._flush(ch)

    def _describe_pending(self, sends: list[_Send], recvs: list[_Recv]) -> str:
        parts = [
            f"receive from {'any rank' if r.src == ANY_SOURCE else f'rank {r.src}'}"
            for r in recvs
            if not r.done
        ]
        parts += [f"send to rank {s.peer} ({s.left} bytes left)" for s in sends if s.left]
        silent = sorted({r.src for r in recvs if not r.done} | {s.peer for s in sends if s.left})
        unconnected = [p for p in silent if p >= 0 and p != self.rank and p not in self._open]
        note = f"; not connected to ranks {unconnected}" if unconnected else ""
        return "still waiting: " + ", ".join(parts[:8]) + note

    def _break(self, exc: CommError) -> None:
        self._failure = exc
        self._posted.clear()
        self._posted_any.clear()
        self._sendq.clear()
        self._npending = 0

    # -- posting -----------------------------------------------------------------------------
    def _post_recv(self, r: _Recv) -> None:
        src = r.src
        if src == ANY_SOURCE:
            msg = self._pop_unexpected_any(r.comm_id, r.tag)
        else:
            key = (r.comm_id, src, r.tag)
            queue = self._unexpected.get(key)
            msg = None
            if queue:
                msg = queue.popleft()
                if not queue:
                    del self._unexpected[key]
        if msg is not None:
            self._bind(r, msg)
            return
        if src != ANY_SOURCE and src in self._gone:
            raise self._gone_error(src, "receive from")
        self._npending += 1
        if src == ANY_SOURCE:
            self._posted_any.setdefault((r.comm_id, r.tag), deque()).append(r)
        else:
            self._posted.setdefault((r.comm_id, src, r.tag), deque()).append(r)

    def _pop_unexpected_any(self, comm_id: int, tag: int) -> _Message | None:
        # The earliest complete-or-not message from any source (insertion order of the dict
        # is arrival order of each source's first pending frame; good enough and fair).
        for key, queue in self._unexpected.items():
            if key[0] == comm_id and key[2] == tag and queue:
                msg = queue.popleft()
                if not queue:
                    del self._unexpected[key]
                return msg
        return None

    def _bind(self, r: _Recv, msg: _Message) -> None:
        self._check_match(r, msg.header, msg.src)
        r.source = msg.src
        if msg.done:
            self._deliver(r, msg)
        else:
            msg.waiter = r
            self._npending += 1

    def _check_match(self, r: _Recv, h: wire.FrameHeader, src: int) -> None:
        if r.dest is None:
            if h.kind != wire.ARRAY:
                raise ProtocolError(
                    f"rank {self.rank}: recv (tag {r.tag}) got a Link frame from rank {src}; "
                    "send/recv and collectives must not share a tag"
                )
        elif h.kind != wire.DATA or h.length != len(r.dest):
            got = "an array (send)" if h.kind == wire.ARRAY else f"{h.length} bytes"
            raise ProtocolError(
                f"rank {self.rank}: expected {len(r.dest)} bytes from rank {src} on "
                f"communicator {r.comm_id:#x}, got {got}: ranks disagree on the operation"
            )

    @staticmethod
    def _deliver(r: _Recv, msg: _Message) -> None:
        if r.dest is None:
            r.array = msg.array
        else:
            r.dest[:] = msg.buf
        r.done = True

    def _post_send(self, s: _Send) -> None:
        peer = s.peer
        if peer == self.rank:
            self._send_to_self(s)
            return
        ch = self._open.get(peer)
        queue = self._sendq.get(peer)
        if ch is not None and not queue:
            bufs = s.bufs
            try:
                sent = ch.sock.send(bufs[0]) if len(bufs) == 1 else ch.sock.sendmsg(bufs)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                raise self._lost(ch, exc) from None
            if sent == s.left:
                s.left = 0
                return
            if sent:
                s.advance(sent)
                self._progressed = True
        if queue is None:
            queue = self._sendq[peer] = deque()
        queue.append(s)
        self._npending += 1
        if ch is not None:
            self._want_write(ch, True)
        else:
            self._ensure_connection(peer)

    def _send_to_self(self, s: _Send) -> None:
        data = b"".join(s.bufs)
        dec = wire.Decoder(handshake=False)
        dec.receive_data(data)
        header = dec.next_event()
        if not isinstance(header, wire.FrameHeader):  # pragma: no cover - we encoded it
            raise ProtocolError("self-send produced no frame")
        target = self._target_for(header, self.rank)
        dec.set_target(target[1])
        dec.next_event()
        self._payload_done(target[0])

    def _flush(self, ch: _Channel) -> None:
        queue = self._sendq.get(ch.peer)
        sock = ch.sock
        while queue:
            s = queue[0]
            bufs = s.bufs
            try:
                sent = sock.send(bufs[0]) if len(bufs) == 1 else sock.sendmsg(bufs)
            except BlockingIOError:
                break
            except OSError as exc:
                raise self._lost(ch, exc) from None
            self._progressed = True
            if sent == s.left:
                queue.popleft()
                s.left = 0
                self._npending -= 1
            else:
                s.advance(sent)
                break
        self._want_write(ch, bool(queue))

    def _want_write(self, ch: _Channel, on: bool) -> None:
        if ch.writing != on:
            ch.writing = on
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
            self._sel.modify(ch.sock, events, ch)

    # -- receiving -----------------------------------------------------------------------------
    def _read(self, ch: _Channel) -> None:
        dec = ch.decoder
        recv_into = ch.sock.recv_into
        while True:
            view = dec.recv_view()
            try:
                n = recv_into(view)
            except BlockingIOError:
                return
            except OSError as exc:
                if ch.state is _ACCEPTING:
                    self._drop(ch)
                    return
                raise self._lost(ch, exc) from None
            if n == 0:
                self._eof(ch)
                return
            self._progressed = True
            dec.commit(n)
            self._drain(ch)
            if ch.state is _CLOSED or n < len(view):
                return

    def _drain(self, ch: _Channel) -> None:
        dec = ch.decoder
        while True:
            try:
                ev = dec.next_event()
            except ProtocolError as exc:
                if ch.state is _ACCEPTING:
                    self._reject(ch, str(exc))  # a stranger: refuse it, stay healthy
                    return
                raise ProtocolError(
                    f"rank {self.rank}: bad bytes from rank {ch.peer} at {ch.address}: {exc}"
                ) from None
            if ev is wire.NEED_DATA:
                return
            if ev is wire.PAYLOAD_DONE:
                current = ch.current
                ch.current = None
                self._payload_done(current)
            elif isinstance(ev, wire.FrameHeader):
                if ev.kind == wire.GOODBYE:
                    ch.goodbye = True
                    ch.current = None
                    dec.set_target(memoryview(bytearray(0)))
                    continue
                if ch.state is not _OPEN:
                    raise ProtocolError(f"frame {ev!r} before the handshake completed")
                ch.current, target = self._target_for(ev, ch.peer)
                dec.set_target(target)
            else:
                self._on_hello(ch, ev)  # type: ignore[arg-type]
                if ch.state is _CLOSED:
                    return

    def _target_for(self, h: wire.FrameHeader, src: int) -> tuple[_Recv | _Message, memoryview]:
        key = (h.comm_id, src, h.tag)
        queue = self._posted.get(key)
        r = None
        if queue:
            r = queue.popleft()
            if not queue:
                del self._posted[key]
        else:
            any_queue = self._posted_any.get((h.comm_id, h.tag))
            if any_queue:
                r = any_queue.popleft()
                if not any_queue:
                    del self._posted_any[(h.comm_id, h.tag)]
        if r is not None:
            self._check_match(r, h, src)
            r.source = src
            if r.dest is not None:
                return r, r.dest
            r.array = np.empty(h.shape, h.dtype)  # type: ignore[arg-type]
            return r, as_bytes(r.array, writable=True)
        msg = _Message(h, src)
        if h.kind == wire.ARRAY:
            msg.array = np.empty(h.shape, h.dtype)  # type: ignore[arg-type]
            msg.buf = as_bytes(msg.array, writable=True)
        else:
            msg.buf = memoryview(bytearray(h.length))
        self._unexpected.setdefault(key, deque()).append(msg)
        return msg, msg.buf

    def _payload_done(self, current: _Recv | _Message | None) -> None:
        if type(current) is _Recv:
            current.done = True
            self._npending -= 1
        elif type(current) is _Message:
            current.done = True
            waiter = current.waiter
            if waiter is not None:
                self._deliver(waiter, current)
                self._npending -= 1

    def _eof(self, ch: _Channel) -> None:
        peer = ch.peer
        if ch.state is _ACCEPTING:
            self._drop(ch)
            return
        if ch.state is _CONNECTING or ch.decoder.in_frame:
            raise self._lost(ch, ConnectionError("connection closed (EOF)"))
        # Between frames: a peer that closed (GOODBYE) or simply exited after its last
        # operation is only an error if this rank still needs it, now or later.
        self._drop(ch)
        self._gone[peer] = (
            "closed its communicator"
            if ch.goodbye
            else "died: its connection closed (EOF) without a goodbye"
        )
        if self._waits_on(peer):
            raise self._gone_error(peer, "wait for")

    def _gone_error(self, peer: int, action: str) -> PeerError:
        reason = f"rank {peer} {self._gone[peer]} (seen by rank {self.rank})"
        self._publish_abort(reason)
        return PeerError(f"rank {self.rank}: cannot {action} rank {peer}: {reason}", peer)

    def _waits_on(self, peer: int) -> bool:
        return bool(self._sendq.get(peer)) or any(
            key[1] == peer and q for key, q in self._posted.items()
        )

    def _lost(self, ch: _Channel, exc: BaseException) -> PeerError:
        """Drop the broken channel of a known peer; publish and return the error to raise."""
        peer = ch.peer
        self._drop(ch)
        reason = f"rank {peer} died: {exc} (connection to {ch.address}, seen by rank {self.rank})"
        self._publish_abort(reason)
        return PeerError(f"rank {self.rank}: peer {reason}", peer)

    def _publish_abort(self, record: str) -> None:
        # First record wins; the store may be gone with its host, which must not mask the error.
        with contextlib.suppress(MeshCommError, OSError):
            self._store.compare_set(ABORT_KEY, b"", record.encode())

    def _check_abort(self) -> None:
        try:
            if not self._store.check([ABORT_KEY]):
                return
            record = self._store.get(ABORT_KEY).decode(errors="replace")
        except (StoreError, OSError):
            return  # an unreachable store is not a verdict; the timeout still bounds us
        match = _ABORT_RANK.search(record)
        dead = int(match.group(1)) if match else None
        raise PeerError(f"rank {self.rank}: aborting, another rank reported: {record}", dead)

    # -- connections ---------------------------------------------------------------------------
    def _ensure_connection(self, peer: int) -> None:
        if peer in self._connecting or peer in self._awaiting:
            return
        if peer in self._gone:
            raise self._gone_error(peer, "send to")
        self._connect(peer)

    def _connect(self, peer: int) -> None:
        deadline = time.monotonic() + self.timeout
        delay = 0.01
        address = "?"
        while True:
            remaining = deadline - time.monotonic()
            address = self._lookup(peer, max(remaining, 0.001))
            host, port = _split_address(address)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                _tune(sock)
                sock.settimeout(max(0.001, min(remaining, _CONNECT_ATTEMPT_TIMEOUT)))
                sock.connect((host, port))
                break
            except OSError as exc:
                sock.close()
                remaining = deadline - time.monotonic()
                if remaining <= delay:
                    message = (
                        f"rank {self.rank}: could not connect to rank {peer} at {address} "
                        f"within {self.timeout:g} s: {exc}"
                    )
                    if isinstance(exc, TimeoutError):
                        raise CommTimeout(message) from None
                    raise PeerError(message, peer) from None
            if time.monotonic() - self._last_abort_check >= _ABORT_CHECK_INTERVAL:
                self._last_abort_check = time.monotonic()
                self._check_abort()
            time.sleep(delay)
            delay = min(2 * delay, 0.5)
        sock.setblocking(False)
        ch = _Channel(sock, _CONNECTING, peer, address)
        hello = wire.encode_hello(
            wire.HELLO, rank=self.rank, world_size=self.size, token=self._token
        )
        try:
            sock.send(hello)  # a fresh socket's buffer always takes 36 bytes
        except OSError as exc:
            sock.close()
            raise PeerError(
                f"rank {self.rank}: rank {peer} at {address} dropped the connection: {exc}", peer
            ) from None
        self._sel.register(sock, selectors.EVENT_READ, ch)
        self._connecting[peer] = ch
        self._progressed = True

    def _lookup(self, peer: int, timeout: float) -> str:
        key = addr_key(peer)
        try:
            self._store.wait([key], timeout=timeout)
            return self._store.get(key).decode()
        except StoreError as exc:
            raise CommTimeout(
                f"rank {self.rank}: rank {peer} did not publish its address ({key!r}) within "
                f"{self.timeout:g} s: {exc}"
            ) from None

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                # e.g. out of file descriptors: the listener stays readable, so pause a
                # little rather than spin; the peer's connect waits in the backlog.
                time.sleep(0.01)
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ch = _Channel(sock, _ACCEPTING, -1, _format_address(str(addr[0]), int(addr[1])))
            self._sel.register(sock, selectors.EVENT_READ, ch)
            self._progressed = True

    def _on_hello(self, ch: _Channel, hello: wire.Hello) -> None:
        if ch.state is _CONNECTING:
            self._on_answer(ch, hello)
            return
        if ch.state is not _ACCEPTING:
            raise ProtocolError(f"a second handshake from rank {ch.peer}")
        try:
            wire.check_hello(
                hello,
                kinds=[wire.HELLO],
                token=self._token,
                world_size=self.size,
                peer=f"{ch.address}",
            )
        except ProtocolError as exc:
            self._reject(ch, str(exc))
            return
        peer = hello.rank
        if peer == self.rank:
            self._reject(ch, f"rank {peer} is this process ({self.address})")
            return
        if peer in self._gone:
            self._reject(ch, f"rank {peer} already closed its connection to rank {self.rank}")
            return
        mine = self._connecting.get(peer)
        if peer in self._open or (mine is not None and self.rank < peer):
            # Both connected at once: the connection the lower rank opened is the one kept.
            self._reject(ch, f"duplicate connection from rank {peer} to rank {self.rank}")
            return
        if mine is not None:
            self._drop(mine)  # theirs wins: the lower rank opened it
        self._awaiting.discard(peer)
        answer = wire.encode_hello(
            wire.ACCEPT, rank=self.rank, world_size=self.size, token=self._token
        )
        try:
            ch.sock.send(answer)
        except OSError:
            self._drop(ch)
            return
        self._opened(ch, peer)

    def _on_answer(self, ch: _Channel, hello: wire.Hello) -> None:
        peer = ch.peer
        if hello.kind == wire.REJECT:
            self._drop(ch)
            if hello.reason.startswith("duplicate connection"):
                self._awaiting.add(peer)  # the peer's own connection to us is on its way
                return
            raise ProtocolError(
                f"rank {self.rank}: rank {peer} at {ch.address} refused the connection: "
                f"{hello.reason}"
            )
        wire.check_hello(
            hello,
            kinds=[wire.ACCEPT],
            token=self._token,
            world_size=self.size,
            peer=f"rank {peer} at {ch.address}",
            expect_rank=peer,
        )
        del self._connecting[peer]
        self._opened(ch, peer)

    def _opened(self, ch: _Channel, peer: int) -> None:
        ch.peer = peer
        ch.state = _OPEN
        self._open[peer] = ch
        if self._sendq.get(peer):
            self._flush(ch)

    def _reject(self, ch: _Channel, reason: str) -> None:
        self.rejected.append(reason)
        del self.rejected[:-16]
        answer = wire.encode_hello(
            wire.REJECT, rank=self.rank, world_size=self.size, token=self._token, reason=reason
        )
        with contextlib.suppress(OSError):
            ch.sock.send(answer)
        self._drop(ch)

    def _drop(self, ch: _Channel) -> None:
        if ch.state is _CLOSED:
            return
        if self._open.get(ch.peer) is ch:
            del self._open[ch.peer]
        if self._connecting.get(ch.peer) is ch:
            del self._connecting[ch.peer]
        ch.state = _CLOSED
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(ch.sock)
        # Read what is left so close() sends FIN, not RST (RST can destroy data in flight).
        with contextlib.suppress(OSError):
            ch.sock.setblocking(False)
            while ch.sock.recv(65536):
                pass
        ch.sock.close()


def _replay(exc: CommError) -> CommError:
    message = f"tcp transport already failed: {exc}"
    if isinstance(exc, PeerError):
        return PeerError(message, exc.rank)
    return type(exc)(message)


class TcpLink:
    """The :class:`~meshcomm.backends.link.Link` of one communicator over a transport.

    Args:
        transport: the world's transport.
        comm_id: the communicator's id (frames of other communicators never match).
        global_ranks: world rank of each communicator rank.
        rank: this process's communicator rank.
    """

    def __init__(
        self, transport: Transport, comm_id: int, global_ranks: Sequence[int], rank: int
    ) -> None:
        self.transport = transport
        self.comm_id = comm_id
        self.global_ranks = tuple(global_ranks)
        self.rank = rank
        self.size = len(self.global_ranks)

    def exchange(
        self,
        sends: Sequence[tuple[int, np.ndarray]],
        recvs: Sequence[tuple[int, np.ndarray]],
    ) -> None:
        """Post every send and receive at once; return when all have completed.

        Raises:
            InvalidArgument: a peer rank outside the communicator, or a bad buffer.
            CommTimeout: no progress for the timeout.
            PeerError: a peer is gone (names its global rank).
        """
        g = self.global_ranks
        size = self.size
        try:
            gsends = [(g[p], as_bytes(b)) for p, b in sends if 0 <= p < size]
            grecvs = [(g[p], as_bytes(b, writable=True)) for p, b in recvs if 0 <= p < size]
        except TypeError:
            gsends = grecvs = []
        if len(gsends) != len(sends) or len(grecvs) != len(recvs):
            bad = [p for p, _ in (*sends, *recvs) if not (isinstance(p, int) and 0 <= p < size)]
            raise InvalidArgument(
                f"rank {self.rank}: exchange peers must be ranks in [0, {size}), got {bad}"
            )
        self.transport.exchange(self.comm_id, LINK_TAG, gsends, grecvs)
