"""The tcp backend's transport: channels to every peer and the progress engine.

One :class:`Transport` per process owns a listening socket, one connection per peer rank
(opened on first use, shared by every communicator and told apart by communicator id), a
shared-memory pair per same-host peer, and a single-threaded progress engine:
:meth:`Transport.exchange` posts sends and receives, then drives every channel until its own
operations are complete. Frames nobody waits for yet are kept and matched later, first in
first out per (communicator, source, tag) (:mod:`~meshcomm.backends.tcp.matching`).

Channels, chosen per peer (:func:`channel_kind`): peers on the same host exchange frames
through shared-memory rings (:mod:`~meshcomm.backends.tcp.shm`), large payloads as an
address the receiver copies from with ``process_vm_readv`` (RTS, answered by FIN); other
peers through their socket. ``MESHCOMM_TRANSPORT=tcp`` forces sockets everywhere. The socket
stays open beside a shared-memory pair for set-up, GOODBYE and death detection (EOF).

Waiting: when every pending operation of the call is on shared memory, the engine sleeps on
its futex doorbell (after a short spin when the host's ranks fit its cores), waking at least
every 10 ms to look at the sockets (EOF of a dead peer, new connections). When some pending
operation needs a socket, it sleeps in ``select`` on the sockets instead, in slices of 0.1 to
2 ms between which it polls the rings (no helper thread: nothing else competes for the
GIL or for a core).

Connection set-up lives in :mod:`~meshcomm.backends.tcp.connections`; addresses in
:mod:`~meshcomm.backends.tcp.addresses`. The listening socket is served by a thread of its
own (:mod:`~meshcomm.backends.tcp.listener`) that accepts at all times, screens handshakes
(and with a job secret authenticates them, :mod:`~meshcomm.backends.tcp.link_auth`), and
parks the good connections until the engine takes them.

Faults: EOF or a reset on a peer's connection raises :class:`~meshcomm.errors.PeerError`
naming that peer (after draining its ring, if any), and the detecting rank writes an abort
record (``meshcomm/tcp/abort``) to the store; every rank blocked in the engine checks that
key about once a second, so ranks with no connection to the dead one fail too. No progress
for the timeout raises :class:`~meshcomm.errors.CommTimeout`. After either, the transport is
broken and every call fails fast with the original reason. A failing rank writes its record
and a note of why it gives up before it raises, so a peer that sees it leave names the first
failure instead of calling it dead (``Transport._blame``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from meshcomm._secret import job_secret
from meshcomm.backends.tcp import cma, wire
from meshcomm.backends.tcp.abort import AbortRecord
from meshcomm.backends.tcp.addresses import (
    addr_key,
    choose_host,
    format_address,
    tune,
)
from meshcomm.backends.tcp.board import BoardEngine
from meshcomm.backends.tcp.connections import (
    _ACCEPTING,
    _CLOSED,
    _CONNECTING,
    _OPEN,
    Channel,
    ShmMessage,
)
from meshcomm.backends.tcp.link import TcpLink
from meshcomm.backends.tcp.listener import LinkListener
from meshcomm.backends.tcp.matching import (
    ANY_SOURCE,
    LINK_TAG,
    PLAIN,
    RTS,
    Recv,
    Send,
    as_bytes,
)
from meshcomm.backends.tcp.shm import host_key, shm_enabled, sweep
from meshcomm.backends.tcp.shm_budget import budget_bytes
from meshcomm.backends.tcp.shm_engine import (
    CMA_MIN,
    ShmPeer,
    Spinner,
    shares_cores,
    spin_policy,
)
from meshcomm.errors import (
    CommError,
    CommTimeout,
    InvalidArgument,
    MeshCommError,
    MismatchError,
    PeerError,
    ProtocolError,
    RendezvousError,
    StoreError,
)
from meshcomm.store.base import Store

__all__ = [
    "ABORT_KEY",
    "ANY_SOURCE",
    "LEFT_KEY",
    "LINK_TAG",
    "TOKEN_KEY",
    "ShmPeer",
    "TcpLink",
    "Transport",
    "addr_key",
    "as_bytes",
    "channel_kind",
]

TOKEN_KEY = "meshcomm/tcp/token"
ABORT_KEY = "meshcomm/tcp/abort"
#: + the rank: why a rank gave up (its first error), written before it can leave.
LEFT_KEY = "meshcomm/tcp/left/"

_ABORT_CHECK_INTERVAL = 1.0
# The listener thread empties the backlog between GIL slices of a busy rank: room for a
# burst of connections meanwhile.
_BACKLOG = 1024
# Payloads up to this size are copied behind their header and sent as one buffer.
_COALESCE_MAX = 16 * 1024
# Sleeping on the doorbell, look at the sockets at least this often.
_SOCKET_POLL = 0.01
# Sleeping in select with shared-memory operations pending: poll the rings this often.
_MIXED_MIN, _MIXED_MAX = 0.0001, 0.002
# ... and with only socket operations pending (the rings are drained for others' sake).
_MIXED_IDLE = 0.01
_GOODBYE = "closed its communicator"
_NO_GOODBYE = "its connection closed (EOF) without a goodbye"
_NOTE_MAX = 1000
_T = TypeVar("_T")


def channel_kind(same_host: bool) -> str:
    """Return the channel a peer gets: ``"shm"`` for a same-host peer, else ``"tcp"``.

    ``MESHCOMM_TRANSPORT`` may be ``auto`` (default: shared memory where the platform
    supports it) or ``tcp`` (sockets everywhere).

    Raises:
        InvalidArgument: ``MESHCOMM_TRANSPORT`` has another value.

    Example:
        >>> channel_kind(same_host=False)
        'tcp'
    """
    return "shm" if shm_enabled() and same_host else "tcp"


def _local_size(size: int) -> int:
    for name in ("MESHCOMM_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        raw = os.environ.get(name, "").strip()
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
    return size


class Transport(BoardEngine):
    """Channels to every peer of one world and the engine that moves their frames.

    Create it with :meth:`start`. All methods are thread-safe: calls are serialized by a
    lock, and progress happens only inside calls (the one background thread accepts and
    screens connections; it never touches a channel the engine owns).

    Attributes:
        rank: this process's global rank.
        size: the world size.
        timeout: seconds without progress before ``CommTimeout``.
        address: the advertised ``host:port`` of this rank's listener.
        rejected: reasons of handshakes this rank refused (foreign or stale peers).
        shm_fallbacks: why a same-host peer uses its socket instead of shared memory.
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
        secret: bytes | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.address = address
        self._store = store
        self._token = token
        self._secret = secret
        self.rejected = []
        self.labels = {}
        self._links = LinkListener(
            listener,
            rank=rank,
            size=size,
            token=token,
            secret=secret,
            address=address,
            rejected=self.rejected,
            handshake_timeout=min(timeout, 10.0),
            max_parked=max(64, 2 * size),
        )
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._links.wake, selectors.EVENT_READ, None)  # data None: parked
        self._lock = threading.Lock()
        self._conns = {}
        self._tcp = {}
        self._connecting = {}
        self._accepting = set()
        self._awaiting = set()  # our connect was refused as a duplicate: theirs comes
        self._setup = {}
        self._gone = {}  # peers whose connection ended between frames
        self._shm = {}
        self._shm_list = []
        self._sendq = {}
        self._posted = {}
        self._posted_any = {}
        self._unexpected = {}
        self._npending = 0
        self._progressed = False
        self._last_abort_check = 0.0
        self._last_socket_poll = 0.0
        self._failure: CommError | None = None
        self._closed = False
        self._shm_wanted = shm_enabled()
        self._host_key = host_key() if self._shm_wanted else ""
        self._local_size = _local_size(size)
        self._spinner = Spinner(spin_policy(self._local_size), shares_cores(self._local_size))
        self._bell = None
        self._board = None
        self.shm_fallbacks = {}
        self._links.start()

    @classmethod
    def start(
        cls,
        rank: int,
        size: int,
        store: Store,
        timeout: float,
        *,
        secret: str | bytes | None = None,
    ) -> Transport:
        """Listen, agree on the job token, and publish this rank's address in the store.

        Nothing waits for other ranks: connections open on first use.

        Args:
            rank: this process's global rank.
            size: the world size.
            store: the job's store.
            timeout: seconds without progress before ``CommTimeout``.
            secret: the job's secret (every link is then mutually authenticated); None reads
                ``MESHCOMM_SECRET``; ``""`` means none. Every rank must agree.

        Raises:
            InvalidArgument: bad rank, size, timeout or secret, or a bad
                ``MESHCOMM_TRANSPORT``.
            RendezvousError: the store holds a malformed token.
        """
        if not isinstance(size, int) or size < 1:
            raise InvalidArgument(f"world size must be a positive int, got {size!r}")
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise InvalidArgument(f"rank must be in [0, {size}), got {rank!r}")
        if not timeout > 0:
            raise InvalidArgument(f"timeout must be positive, got {timeout!r}")
        if secret is not None and not isinstance(secret, (str, bytes)):
            raise InvalidArgument(
                f"rank {rank}: secret must be a str, bytes or None, got {type(secret).__name__}"
            )
        key = job_secret(secret)
        shm_enabled()  # validates MESHCOMM_TRANSPORT and MESHCOMM_SHM_SPIN_US before any I/O
        budget_bytes()  # and MESHCOMM_SHM_BUDGET
        spin_policy(_local_size(size))
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
            tune(listener)  # accepted sockets inherit the buffer sizes
            listener.bind((bind_host, 0))
            listener.listen(max(_BACKLOG, size))
            listener.setblocking(False)
            address = format_address(adv_host, listener.getsockname()[1])
            store.set(addr_key(rank), address)
        except BaseException:
            listener.close()
            raise
        return cls(rank, size, store, timeout, bytes(token), listener, address, key)

    # -- public operations -------------------------------------------------------------------
    @property
    def failure(self) -> CommError | None:
        """The error that broke this transport, or None while it works."""
        return self._failure

    def sibling(self, store: Store) -> Transport:
        """Start another transport of this process for a sub-group: the same rank, world
        size, timeout and secret, its keys in ``store``."""
        return Transport.start(
            self.rank, self.size, store, self.timeout, secret=self._secret or b""
        )

    def raise_failure(self) -> None:
        """Raise (a replay of) the error that broke this transport, if one did."""
        if self._failure is not None:
            raise _replay(self._failure)

    @property
    def connected_peers(self) -> list[int]:
        """Global ranks this process has an open connection to (for diagnostics)."""
        return sorted(self._conns)

    @property
    def channels(self) -> dict[int, str]:
        """The channel each connected peer's data takes: ``"shm"``, ``"tcp"`` or ``"setup"``."""
        kinds = {peer: "setup" for peer in self._setup}
        kinds.update({peer: "tcp" for peer in self._tcp})
        kinds.update({peer: "shm" for peer in self._shm})
        return dict(sorted(kinds.items()))

    @property
    def authenticated(self) -> bool:
        """Whether every link of this transport is authenticated with the job's secret."""
        return self._secret is not None

    @property
    def job(self) -> str:
        """The job token as shared-memory names carry it (for :func:`shm.sweep`)."""
        return self._token.hex()

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
        if not self._lock.acquire(timeout=self.timeout):
            raise CommTimeout(
                f"rank {self.rank}: exchange waited {self.timeout:g} s for another thread's "
                "operation on this transport"
            )
        try:
            if self._failure is not None or self._closed:
                self._run([], [], "exchange", comm_id)  # raises the reason
            self._npending = 0
            try:
                if tag < LINK_TAG:  # a stamped call: frames nobody waits for are checked
                    stamped = (comm_id, tag)
                    if stamped != self._stamped:  # a call's first exchange: scan those here
                        self._stamped = stamped
                        if self._unexpected:
                            self._scan_strays(comm_id)
                else:
                    self._stamped = None
                rops = [Recv(comm_id, src, tag, buf) for src, buf in recvs]
                for r in rops:
                    self._post_recv(r)
                sops = [s for peer, buf in sends if (s := self._post_data(comm_id, tag, peer, buf))]
                if self._npending:
                    self._wait("exchange", comm_id, sops, rops)
            except BaseException as exc:
                self._fail(exc, "exchange")
                raise
        finally:
            self._lock.release()

    def _post_data(self, comm_id: int, tag: int, peer: int, buf: memoryview) -> Send | None:
        """Post one Link send; None when it went out at once (the common small case)."""
        n = len(buf)
        sp = self._shm.get(peer)
        if n <= _COALESCE_MAX:
            # Small payloads ride in one bytes object with their header: one buffer per
            # write is much cheaper than two.
            frame = wire.pack_data_header(comm_id, tag, n) + buf
            if sp is not None and not self._sendq.get(peer):
                done = sp.tx.push(frame)  # type: ignore[arg-type]
                if done:
                    self._progressed = True
                    if done == len(frame):
                        return None
                s = Send(peer, [memoryview(frame)[done:]], len(frame) - done)
                self._sendq[peer] = deque([s])
                self._npending += 1
                return s
            s = Send(peer, [frame], len(frame))
        elif sp is not None and sp.cma and n >= CMA_MIN:
            rts = wire.pack_rts_header(comm_id, tag, n, cma.address_of(buf))
            s = Send(peer, [rts], len(rts), RTS)
            s.data = buf  # alive until the peer has read it
        else:
            s = Send(peer, [wire.pack_data_header(comm_id, tag, n), buf], wire.HEADER_SIZE + n)
        self._post_send(s)
        return s

    def send_array(self, comm_id: int, tag: int, dst: int, array: np.ndarray) -> None:
        """Send a C-contiguous array with its dtype and shape to global rank ``dst``."""
        meta = wire.encode_array_meta(array.dtype, array.shape)
        payload = as_bytes(array)
        head = wire.encode_header(
            wire.ARRAY, comm_id=comm_id, tag=tag, length=len(payload), meta=meta
        )
        op = Send(dst, [head, payload], len(head) + len(payload))
        self._locked_run([op], [], f"send to rank {dst} (tag {tag})", comm_id)

    def recv_array(self, comm_id: int, tag: int, src: int) -> tuple[np.ndarray, int]:
        """Receive an array from global rank ``src`` (``ANY_SOURCE``: any) and its sender."""
        op = Recv(comm_id, src, tag, None)
        source = "any rank" if src == ANY_SOURCE else f"rank {src}"
        self._locked_run([], [op], f"recv from {source} (tag {tag})", comm_id)
        if op.array is None:  # pragma: no cover - a completed array receive always has one
            raise ProtocolError("array receive completed without an array")
        return op.array, op.source

    def forget(self, comm_id: int) -> None:
        """Drop frames buffered for a closed communicator (skipped if the lock stays busy)."""
        if not self._lock.acquire(timeout=self.timeout):
            return
        try:
            self._forget_unexpected(comm_id)
        finally:
            self._lock.release()

    def close(self) -> None:
        """Say GOODBYE to connected peers and close every channel. Idempotent."""
        if self._closed:
            return
        locked = self._lock.acquire(timeout=self.timeout)
        try:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(CommError):
                self._flush_control()
            for sp in list(self._shm_list):
                self._detach_shm(sp.peer)
            goodbye = wire.encode_header(wire.GOODBYE, comm_id=0, tag=0, length=0)
            for ch in list(self._conns.values()):
                if self._failure is None and not self._sendq.get(ch.peer):
                    with contextlib.suppress(OSError):
                        ch.sock.send(goodbye)
            channels = [key.data for key in self._sel.get_map().values() if key.data is not None]
            for ch in channels:
                self._drop(ch)
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(self._links.wake)
            self._links.close()
            self._sel.close()
            self._unexpected.clear()
            self._board = None
            if self._bell is not None:
                self._bell.close()
            # Names left by peers killed during their shared-memory set-up (ours are gone).
            if self._shm_wanted:
                sweep(self.job)
        finally:
            if locked:
                self._lock.release()

    # -- the engine ----------------------------------------------------------------------------
    def _locked_run(self, sends: list[Send], recvs: list[Recv], what: str, comm_id: int) -> None:
        if not self._lock.acquire(timeout=self.timeout):
            raise CommTimeout(
                f"rank {self.rank}: {what} waited {self.timeout:g} s for another thread's "
                "operation on this transport"
            )
        try:
            self._run(sends, recvs, what, comm_id)
        finally:
            self._lock.release()

    def _run(self, sends: list[Send], recvs: list[Recv], what: str, comm_id: int) -> None:
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
                self._wait(what, comm_id, sends, recvs)
        except BaseException as exc:
            self._fail(exc, what)
            raise

    def _fail(self, exc: BaseException, what: str) -> None:
        if isinstance(exc, CommError):
            self._break(exc)
        else:
            # Interrupted half way (KeyboardInterrupt, MemoryError): frames are cut, so the
            # streams can no longer be trusted.
            self._break(CommError(f"rank {self.rank}: {what} was interrupted: {exc!r}"))

    def _wait(self, what: str, comm_id: int, sends: list[Send], recvs: list[Recv]) -> None:
        clock = time.monotonic
        timeout = self.timeout
        start = last_progress = clock()
        mixed = _MIXED_MIN
        spun = False
        while self._npending:
            if self._shm_list:
                self._poll_shm()
                if not self._npending:
                    return
            now = clock()
            if self._progressed:
                self._progressed = False
                last_progress = now
                mixed = _MIXED_MIN
                spun = False  # poll again before the next sleep
            idle = now - last_progress
            if idle >= timeout:
                if what == "exchange":
                    what = f"exchange {self._label(comm_id)}"
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
            bell = self._bell
            if bell is None or not self._shm_list:
                self._select(wait)  # sockets only
            elif self._needs_socket(sends, recvs):
                # Some operation waits on a socket: sleep in select, poll the rings between.
                slice_ = mixed if self._shm_pending(sends, recvs) else _MIXED_IDLE
                self._select(min(wait, slice_))
                mixed = min(2 * mixed, _MIXED_MAX)
            elif now - self._last_socket_poll >= _SOCKET_POLL:
                self._last_socket_poll = now
                self._select(0)
            elif not spun and self._spinner.bound:
                spun = True
                self._spin_shm(now)
            else:
                # Everything pending is on shared memory: arm, look once more, sleep.
                bell.arm()
                self._poll_shm()
                if self._progressed or not self._npending:
                    bell.disarm()
                    continue
                bell.wait(min(wait, _SOCKET_POLL))

    def _select(self, timeout: float) -> None:
        for key, mask in self._sel.select(timeout):
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

    def _needs_socket(self, sends: list[Send], recvs: list[Recv]) -> bool:
        if self._connecting or self._awaiting or self._setup or self._accepting:
            return True
        shm = self._shm
        me = self.rank
        for s in sends:
            if s.left and s.peer != me and s.peer not in shm:
                return True
        for r in recvs:
            if not r.done and r.src not in shm:
                return True
        return any(ch.writing or ch.decoder.in_frame for ch in self._tcp.values())

    def _describe_pending(self, sends: list[Send], recvs: list[Recv]) -> str:
        parts = [
            f"receive from {'any rank' if r.src == ANY_SOURCE else f'rank {r.src}'}"
            for r in recvs
            if not r.done
        ]
        waiting_fin = {id(s) for sp in self._shm_list for s in sp.rts}
        parts += [f"send to rank {s.peer} ({s.left} bytes left)" for s in sends if s.left]
        parts += [f"send to rank {s.peer} (not yet read)" for s in sends if id(s) in waiting_fin]
        silent = sorted({r.src for r in recvs if not r.done} | {s.peer for s in sends if s.left})
        unconnected = [p for p in silent if p >= 0 and p != self.rank and p not in self._conns]
        note = f"; not connected to ranks {unconnected}" if unconnected else ""
        return "still waiting: " + ", ".join(parts[:8]) + note

    def _break(self, exc: CommError) -> None:
        first = self._failure is None
        self._failure = exc
        self._posted.clear()
        self._posted_any.clear()
        self._sendq.clear()
        for sp in self._shm_list:
            sp.rts.clear()
        self._npending = 0
        if first:
            self._note_leaving(exc)

    # -- sending -------------------------------------------------------------------------------
    def _post_send(self, s: Send) -> None:
        peer = s.peer
        if peer == self.rank:
            self._send_to_self(s)
            return
        queue = self._sendq.get(peer)
        sp = self._shm.get(peer)
        if sp is not None:
            if not queue and self._shm_write(sp, s):
                if s.kind == RTS:
                    sp.rts.append(s)
                    self._npending += 1
                return
        else:
            ch = self._tcp.get(peer)
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
            if ch is not None:
                self._want_write(ch, True)
            else:
                self._ensure_connection(peer)
        if queue is None:
            queue = self._sendq[peer] = deque()
        queue.append(s)
        self._npending += 1

    def _send_to_self(self, s: Send) -> None:
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

    def _flush(self, ch: Channel) -> None:
        sock = ch.sock
        for queue, control in ((ch.ctrl, True), (self._sendq.get(ch.peer), False)):
            if control is False and ch.peer not in self._tcp:
                break  # data waits for the shared-memory set-up to end
            while queue:
                s = queue[0]
                bufs = s.bufs
                try:
                    sent = sock.send(bufs[0]) if len(bufs) == 1 else sock.sendmsg(bufs)
                except BlockingIOError:
                    self._want_write(ch, True)
                    return
                except OSError as exc:
                    raise self._lost(ch, exc) from None
                self._progressed = True
                if sent < s.left:
                    s.advance(sent)
                    self._want_write(ch, True)
                    return
                queue.popleft()
                s.left = 0
                if s.kind == PLAIN:
                    self._npending -= 1
        self._want_write(ch, False)

    def _want_write(self, ch: Channel, on: bool) -> None:
        if ch.writing != on:
            ch.writing = on
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
            self._sel.modify(ch.sock, events, ch)

    def _flush_control(self) -> None:
        """Write what the engine owes its peers (FINs, set-up frames), as far as possible."""
        for sp in self._shm_list:
            if self._sendq.get(sp.peer):
                self._shm_flush(sp)
        for ch in self._conns.values():
            if ch.ctrl:
                self._flush(ch)

    # -- receiving -----------------------------------------------------------------------------
    def _read(self, ch: Channel) -> None:
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

    def _drain(self, ch: Channel | ShmPeer) -> None:
        dec = ch.decoder
        while True:
            try:
                ev = dec.next_event()
            except ProtocolError as exc:
                if not ch.is_shm and ch.state is _ACCEPTING:  # type: ignore[union-attr]
                    self._reject(ch, str(exc))  # type: ignore[arg-type]  # a stranger
                    return
                where = "shared memory" if ch.is_shm else ch.address  # type: ignore[union-attr]
                raise ProtocolError(
                    f"rank {self.rank}: bad bytes from rank {ch.peer} at {where}: {exc}"
                ) from None
            if ev is wire.NEED_DATA:
                return
            if ev is wire.PAYLOAD_DONE:
                current = ch.current
                ch.current = None
                if type(current) is ShmMessage:
                    self._on_shm_message(ch, current)  # type: ignore[arg-type]
                else:
                    self._payload_done(current)  # type: ignore[arg-type]
                continue
            if type(ev) is not wire.FrameHeader:
                self._on_hello(ch, ev)  # type: ignore[arg-type]
                if ch.state is _CLOSED:  # type: ignore[union-attr]
                    return
                continue
            kind = ev.kind
            if kind == wire.DATA or kind == wire.ARRAY:  # noqa: PLR1714 - the hot path
                if not ch.is_shm and ch.state is not _OPEN:  # type: ignore[union-attr]
                    raise ProtocolError(f"frame {ev!r} before the handshake completed")
                ch.current, target = self._target_for(ev, ch.peer)
                dec.set_target(target)
            elif ch.is_shm and kind == wire.RTS:
                self._on_rts(ch, ev)  # type: ignore[arg-type]
            elif ch.is_shm and kind == wire.FIN:
                self._on_fin(ch)  # type: ignore[arg-type]
            elif not ch.is_shm and kind == wire.SHM and ch.state is _OPEN:  # type: ignore[union-attr]
                msg = ShmMessage(ev.tag, ev.length)
                ch.current = msg
                dec.set_target(memoryview(msg.buf))
            elif not ch.is_shm and kind == wire.GOODBYE:
                ch.goodbye = True  # type: ignore[union-attr]
                ch.current = None
                dec.set_target(memoryview(bytearray(0)))
            else:
                where = "shared memory" if ch.is_shm else "its socket"
                raise ProtocolError(
                    f"rank {self.rank}: frame {ev!r} from rank {ch.peer} is not allowed on {where}"
                )

    # -- faults --------------------------------------------------------------------------------
    #: A store operation of the failure path failed (see _store_op).
    _store_lost = False

    def _eof(self, ch: Channel) -> None:
        peer = ch.peer
        if ch.state is _ACCEPTING:
            self._drop(ch)
            return
        sp = self._shm.get(peer)
        if sp is not None:
            self._shm_read(sp)  # what the peer wrote before it went is still ours
        if ch.state is _CONNECTING or ch.decoder.in_frame:
            raise self._lost(ch, ConnectionError("connection closed (EOF)"))
        if sp is not None and sp.decoder.in_frame:
            raise self._lost(ch, ConnectionError("it stopped writing its ring mid-frame"))
        # Between frames: a peer that closed (GOODBYE) or simply exited after its last
        # operation is only an error if this rank still needs it, now or later.
        waits = self._waits_on(peer)
        self._drop(ch)
        self._gone[peer] = _GOODBYE if ch.goodbye else _NO_GOODBYE
        if waits:
            raise self._gone_error(peer, "wait for")

    def _gone_error(self, peer: int, action: str) -> PeerError:
        how = self._gone[peer]
        if how is _GOODBYE:
            # A goodbye comes only from a healthy rank that closed on purpose: its own doing.
            reason = f"rank {peer} {how} (seen by rank {self.rank})"
            current = self._swap_abort(AbortRecord(peer, reason))
            if current is not None and current.mismatch:
                raise MismatchError(current.reason)  # it left after the ranks disagreed
            blamed = peer
        else:
            reason, blamed = self._blame(peer, how)
        return PeerError(f"rank {self.rank}: cannot {action} rank {peer}: {reason}", blamed)

    def _waits_on(self, peer: int) -> bool:
        sp = self._shm.get(peer)
        return (
            bool(self._sendq.get(peer))
            or (sp is not None and bool(sp.rts))
            or any(key[1] == peer and q for key, q in self._posted.items())
        )

    def _lost(self, ch: Channel, exc: BaseException) -> PeerError:
        """Drop the broken channel of a known peer; publish and return the error to raise."""
        peer = ch.peer
        self._drop(ch)
        reason, blamed = self._blame(peer, str(exc), f"connection to {ch.address}, ")
        return PeerError(f"rank {self.rank}: peer {reason}", blamed)

    def _peer_died(self, peer: int, how: str) -> PeerError:
        """The error for a same-host peer whose process is gone (``how`` says how we saw it)."""
        reason, blamed = self._blame(peer, how)
        return PeerError(f"rank {self.rank}: peer {reason}", blamed)

    def _blame(self, peer: int, how: str, where: str = "") -> tuple[str, int]:
        """Say who failed when ``peer`` went away without a goodbye, and publish it if first.

        A rank that fails publishes its abort record (or finds one) and notes why it gives
        up (:data:`LEFT_KEY`) before it raises, so before it can close its channels. So a
        record already in the store that names another rank is the failure ``peer`` left
        after: ``peer`` is a survivor, and the report names the rank that really failed. A
        note without such a record says ``peer`` left after its own error (a timeout): it
        is blamed, but not called dead, and no record is written (timeouts write none).
        Only with neither is ``peer`` taken for dead.

        Returns:
            The reason to report and the global rank to blame.
        """
        seen = f"{where}seen by rank {self.rank}"
        record = self._read_abort()
        if record is not None and record.mismatch:
            # It left after the ranks disagreed on a call: that is the error, in words.
            raise MismatchError(record.reason)
        why = self._store_op(lambda: self._read_key(LEFT_KEY + str(peer)))
        if why is not None:
            # It failed and left: not a death, and (as for timeouts) no abort record; a
            # failure the abort record names came first and is the one to blame.
            reason = f"rank {peer} left after its own error ({why}; {seen})"
            return self._after(self._read_abort(), peer, how, seen) or (reason, peer)
        reason = f"rank {peer} died: {how} ({seen})"
        record = self._swap_abort(AbortRecord(peer, reason))
        if record is None:
            # No store (it may have died with its host): a death this rank saw itself earlier
            # stands in for the abort record.
            earlier = [g for g, went in self._gone.items() if went is _NO_GOODBYE and g != peer]
            if earlier:
                why = f"rank {earlier[0]} died: {_NO_GOODBYE} (seen by rank {self.rank} earlier)"
                record = AbortRecord(earlier[0], why)
        return self._after(record, peer, how, seen) or (reason, peer)

    def _note_leaving(self, exc: CommError) -> None:
        """Say in the store why this rank is giving up, before it can close its channels, so
        that a peer that sees it go does not take it for dead."""
        note = f"{type(exc).__name__}: {exc}"[:_NOTE_MAX]
        self._store_op(lambda: self._store.set(LEFT_KEY + str(self.rank), note))

    def _left_after_failure(self, peer: int, how: str) -> PeerError | None:
        """The error for a same-host peer whose buffer went away under a copy, if it failed or
        left after a failure the abort record names (it stopped waiting for us and freed
        the buffer); None without a record (the ranks disagree: a protocol error)."""
        record = self._read_abort()
        if record is None:
            return None
        seen = f"seen by rank {self.rank}"
        if record.rank == peer:
            return PeerError(f"rank {self.rank}: peer {record} (then: {how}, {seen})", peer)
        found = self._after(record, peer, how, seen)
        return PeerError(f"rank {self.rank}: {found[0]}", found[1]) if found else None

    def _after(
        self, record: AbortRecord | None, peer: int, how: str, seen: str
    ) -> tuple[str, int] | None:
        """When ``record`` names a failure of another rank than ``peer`` and this one: the
        report that ``peer`` left after it, and that rank."""
        first = record.rank if record is not None else None
        if first is None or first in (peer, self.rank):
            return None
        return f"{record}; rank {peer} left after that failure ({how}, {seen})", first

    def _publish_abort(self, record: AbortRecord) -> None:
        self._swap_abort(record)

    def _swap_abort(self, record: AbortRecord) -> AbortRecord | None:
        """Publish ``record`` unless a record exists; return the one in the store (None: the
        store did not answer)."""
        current = self._store_op(lambda: self._store.compare_set(ABORT_KEY, b"", record.encode()))
        return None if current is None else AbortRecord.decode(bytes(current), self.size)

    def _read_abort(self) -> AbortRecord | None:
        raw = self._store_op(lambda: self._read_raw(ABORT_KEY))
        return None if raw is None else AbortRecord.decode(raw, self.size)

    def _store_op(self, op: Callable[[], _T]) -> _T | None:
        """Run a store operation of the failure path; None if the store did not answer.

        The store may be gone with its host, which must not mask the error; after one failed
        operation the others are skipped: each could spend the store's whole timeout trying
        to reconnect.
        """
        if self._store_lost:
            return None
        try:
            return op()
        except (MeshCommError, OSError):
            self._store_lost = True
            return None

    def _read_key(self, key: str) -> str | None:
        raw = self._read_raw(key)
        return None if raw is None else raw.decode(errors="replace")

    def _read_raw(self, key: str) -> bytes | None:
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key))

    def _check_abort(self) -> None:
        try:
            raw = self._read_raw(ABORT_KEY)
        except (StoreError, OSError):
            return  # an unreachable store is not a verdict; the timeout still bounds us
        if raw is None:
            return
        record = AbortRecord.decode(raw, self.size)
        if record.mismatch:
            raise MismatchError(record.reason)  # every rank raises the same words
        raise PeerError(f"rank {self.rank}: aborting, another rank reported: {record}", record.rank)

    def publish_mismatch(self, reason: str) -> str:
        """Publish a mismatch (both calls in words) as the abort record, so that every rank
        of this transport raises it; return the mismatch to raise here: the first one
        published (another rank may have seen the same mismatch first)."""
        current = self._swap_abort(AbortRecord(None, reason, mismatch=True))
        return current.reason if current is not None and current.mismatch else reason


def _replay(exc: CommError) -> CommError:
    message = f"tcp transport already failed: {exc}"
    if isinstance(exc, PeerError):
        return PeerError(message, exc.rank)
    return type(exc)(message)
