"""The tcp backend's transport: channels to every peer and the progress engine.

One :class:`Transport` per process owns a listening socket, one connection per peer rank
(opened on first use, shared by every communicator and told apart by communicator id), a
shared-memory pair per same-host peer, and a single-threaded progress engine:
:meth:`Transport.exchange` posts sends and receives, then drives every channel until its own
operations are complete. Frames nobody waits for yet are kept and matched later, first in
first out per (communicator, source, tag) (:mod:`~meshcomm.backends.tcp.matching`).

Channels, chosen per peer (:func:`channel_kind`): peers on the same host exchange frames
through shared-memory rings (:mod:`~meshcomm.backends.tcp.same_host.rings`), large payloads as an
address the receiver copies from with ``process_vm_readv`` (RTS, answered by FIN); other
peers through their socket. ``MESHCOMM_TRANSPORT=tcp`` forces sockets everywhere. The socket
stays open beside a shared-memory pair for set-up, GOODBYE and death detection (EOF).

Waiting: when every pending operation of the call is on shared memory, the engine sleeps on
its futex doorbell (after a short spin when the host's ranks fit its cores), waking at least
every 10 ms to look at the sockets (EOF of a dead peer, new connections). When some pending
operation needs a socket, it sleeps in ``select`` on the sockets instead, in slices of 0.1 to
2 ms between which it polls the rings (no helper thread: nothing else competes for the
GIL or for a core).

The transport is made of parts it holds, each in a module of its own: the matching of
frames to receives (:mod:`~meshcomm.backends.tcp.matching`), the two carriers, sockets
(:mod:`~meshcomm.backends.tcp.connections`, which also sets connections up) and
shared-memory rings (:mod:`~meshcomm.backends.tcp.same_host.engine`), the board
(:mod:`~meshcomm.backends.tcp.same_host.board`), copies of peers' memory
(:mod:`~meshcomm.backends.tcp.same_host.peer_memory`), the failure path
(:mod:`~meshcomm.backends.tcp.faults`) and the one wait loop
(:mod:`~meshcomm.backends.tcp.waiting`). Addresses are in
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
failure instead of calling it dead (:meth:`~meshcomm.backends.tcp.faults.Faults.blame`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
from collections import deque
from collections.abc import Sequence

import numpy as np

from meshcomm.backends.tcp import wire
from meshcomm.backends.tcp.addresses import (
    addr_key,
    choose_host,
    format_address,
    tune,
)
from meshcomm.backends.tcp.alarm import WorldAlarm
from meshcomm.backends.tcp.connections import Connections
from meshcomm.backends.tcp.faults import ABORT_KEY, LEFT_KEY, Faults
from meshcomm.backends.tcp.link import TcpLink
from meshcomm.backends.tcp.listener import LinkListener
from meshcomm.backends.tcp.matching import (
    ANY_SOURCE,
    LINK_TAG,
    RTS,
    Matching,
    Recv,
    Send,
    as_bytes,
)
from meshcomm.backends.tcp.same_host import cma
from meshcomm.backends.tcp.same_host.board import BoardAllReduce
from meshcomm.backends.tcp.same_host.engine import CMA_MIN, Carrier, ShmEngine, ShmPeer
from meshcomm.backends.tcp.same_host.peer_memory import PeerMemory
from meshcomm.backends.tcp.same_host.ring_budget import budget_bytes
from meshcomm.backends.tcp.same_host.rings import host_key, shm_enabled, sweep
from meshcomm.backends.tcp.waiting import Progress, Spinner, Waiter, shares_cores, spin_policy
from meshcomm.common.secret import job_secret
from meshcomm.errors import (
    CommError,
    CommTimeout,
    InvalidArgument,
    MismatchError,
    PeerError,
    ProtocolError,
    RendezvousError,
)
from meshcomm.reduction import ReduceOp
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

# The listener thread empties the backlog between GIL slices of a busy rank: room for a
# burst of connections meanwhile.
_BACKLOG = 1024
# Payloads up to this size are copied behind their header and sent as one buffer.
_COALESCE_MAX = 16 * 1024


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


class Transport:
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
        labels: comm id -> how errors name that communicator's group.
        memory: copies of same-host peers' memory (the CMA collectives').
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
        alarm: WorldAlarm | None = None,
    ) -> None:
        self.rank = rank
        # A mismatch seen on any group of the world (shared with the sub-groups' transports).
        self.alarm = WorldAlarm(store, rank, size) if alarm is None else alarm
        # How the alarm names this transport's group: its keys' prefix, the same on every rank.
        self._alarm_group = getattr(store, "prefix", "") or "world"
        self.size = size
        self.timeout = timeout
        self.address = address
        self._token = token
        self._secret = secret
        self.rejected: list[str] = []
        links = LinkListener(
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
        self._lock = threading.Lock()
        self._failure: CommError | None = None
        self._closed = False
        self._shm_wanted = shm_enabled()
        local_size = _local_size(size)
        # The parts, each with one job; they share the counters and the send queues.
        self._progress = progress = Progress()
        self._sendq: dict[int, deque[Send]] = {}
        self._faults = faults = Faults(rank, size, store)
        self._matching = matching = Matching(rank, progress)
        self.labels = matching.labels
        self._rings = rings = ShmEngine(rank, token, progress, matching, faults, self._sendq)
        self._sockets = sockets = Connections(
            rank,
            size,
            timeout,
            store,
            token,
            secret,
            links,
            self.rejected,
            progress,
            matching,
            rings,
            faults,
            self._sendq,
            host_key() if self._shm_wanted else None,
        )
        self.shm_fallbacks = sockets.shm_fallbacks
        # Both kinds of channel behind one interface (each checked against it here).
        self._carriers: tuple[Carrier, Carrier] = (rings, sockets)
        self._waiter = Waiter(
            rank,
            timeout,
            progress,
            Spinner(spin_policy(local_size), shares_cores(local_size)),
            rings,
            sockets.select,
            self._check_abort,
        )
        self._board = BoardAllReduce(rank, rings, matching, faults, progress, self._waiter)
        self.memory = PeerMemory(rank, rings, faults, self._break)
        # The hot path's own references (the same dicts the parts hold).
        self._shm = rings.peers
        self._gone = faults.gone
        links.start()

    @classmethod
    def start(
        cls,
        rank: int,
        size: int,
        store: Store,
        timeout: float,
        *,
        secret: str | bytes | None = None,
        alarm: WorldAlarm | None = None,
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
            alarm: the world's alarm, for a sub-group's transport (None: the world's own,
                announced through ``store``).

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
        return cls(rank, size, store, timeout, bytes(token), listener, address, key, alarm)

    # -- public operations -------------------------------------------------------------------
    @property
    def failure(self) -> CommError | None:
        """The error that broke this transport, or None while it works."""
        return self._failure

    def sibling(self, store: Store) -> Transport:
        """Start another transport of this process for a sub-group: the same rank, world
        size, timeout and secret, its keys in ``store``."""
        return Transport.start(
            self.rank, self.size, store, self.timeout, secret=self._secret or b"", alarm=self.alarm
        )

    def raise_failure(self) -> None:
        """Raise (a replay of) the error that broke this transport, if one did."""
        if self._failure is not None:
            raise _replay(self._failure)

    @property
    def connected_peers(self) -> list[int]:
        """Global ranks this process has an open connection to (for diagnostics)."""
        return sorted(self._sockets.conns)

    @property
    def channels(self) -> dict[int, str]:
        """The channel each connected peer's data takes: ``"shm"``, ``"tcp"`` or ``"setup"``."""
        kinds = {peer: "setup" for peer in self._sockets.setup}
        kinds.update({peer: "tcp" for peer in self._sockets.tcp})
        kinds.update({peer: "shm" for peer in self._shm})
        return dict(sorted(kinds.items()))

    @property
    def shm_peers(self) -> dict[int, ShmPeer]:
        """The shared-memory peers, by global rank (for diagnostics)."""
        return dict(self._shm)

    @property
    def screening(self) -> int:
        """Connections the listener thread is screening now (for diagnostics)."""
        return self._sockets.screening

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

    def publish_mismatch(self, reason: str) -> str:
        """Publish a mismatch (both calls in words) as the abort record, so that every rank
        of this transport raises it; return the mismatch to raise here: the first one
        published (another rank may have seen the same mismatch first). It is also announced
        to the whole world (:mod:`~meshcomm.backends.tcp.alarm`): ranks that
        returned from the call raise at their next call on any group."""
        words = self._faults.publish_mismatch(reason)
        self.alarm.announce(self._alarm_group, words)
        return words

    def _check_abort(self) -> None:
        """A waiting call's abort check (about once a second): this transport's abort record
        (the group's own mismatch comes first), then the world's alarm."""
        try:
            self._faults.check_abort()
        except MismatchError:
            self.alarm.raised(self._alarm_group)
            raise
        self.alarm.check()

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
            progress = self._progress
            progress.pending = 0
            try:
                matching = self._matching
                matching.expect(comm_id, tag)
                rops = [Recv(comm_id, src, tag, buf) for src, buf in recvs]
                gone = self._gone
                for r in rops:
                    if matching.post_recv(r) and r.src in gone:
                        raise self._faults.gone_error(r.src, "receive from")
                sops = [s for peer, buf in sends if (s := self._post_data(comm_id, tag, peer, buf))]
                if progress.pending:
                    self._wait("exchange", comm_id, sops, rops)
            except BaseException as exc:
                cause = self._fail(exc, "exchange")
                if cause is not exc:
                    raise cause from None
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
                return self._rings.post_frame(sp, frame)
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

    # -- the board ---------------------------------------------------------------------------
    def board_local_ok(self, members: Sequence[int]) -> bool:
        """Whether this process could run board calls among ``members`` (global ranks);
        see :meth:`~meshcomm.backends.tcp.same_host.board.BoardAllReduce.local_ok`."""
        return self._board.local_ok(members)

    def board_open(self, members: Sequence[int], rank: int) -> None:
        """Map the board of every member (after every member said :meth:`board_local_ok`)."""
        self._board.open(members, rank)

    def board_all_reduce(
        self, send: np.ndarray, recv: np.ndarray, op: ReduceOp, stamp: int | None = None
    ) -> None:
        """Reduce ``send`` of every member into ``recv`` on the board (C-contiguous, of one
        dtype and shape, at most ``BOARD_BYTES``; ``send`` may be ``recv``); ``stamp``: the call's
        stamp, or None (:meth:`~meshcomm.backends.tcp.same_host.board.BoardAllReduce.run`).

        Raises:
            MismatchError: a member's stamp differs from ours.
            CommTimeout: no member arrived for the timeout.
            PeerError: a member died or closed (names its global rank).
        """
        lock = self._lock
        # A free lock is taken without the timed wait's clock setup (every call at 8 bytes).
        if not lock.acquire(False) and not lock.acquire(timeout=self.timeout):
            raise CommTimeout(
                f"rank {self.rank}: all_reduce waited {self.timeout:g} s for another thread's "
                "operation on this transport"
            )
        try:
            board = self._board.board
            if self._failure is not None or self._closed or board is None:
                self._run([], [], "all_reduce", 0)  # raises the reason
                raise CommError(f"rank {self.rank}: all_reduce: no board")  # pragma: no cover
            self._progress.pending = 0
            try:
                self._board.run(board, send, recv, op, stamp)
            except BaseException as exc:
                cause = self._fail(exc, "all_reduce")
                if cause is not exc:
                    raise cause from None
                raise
        finally:
            lock.release()

    # -- closing -----------------------------------------------------------------------------
    def forget(self, comm_id: int) -> None:
        """Drop frames buffered for a closed communicator (skipped if the lock stays busy)."""
        if not self._lock.acquire(timeout=self.timeout):
            return
        try:
            self._matching.forget(comm_id)
        finally:
            self._lock.release()

    def announce_abort(self, reason: str) -> None:
        """Abort this world on purpose, saying why, before the GOODBYE (see
        :meth:`~meshcomm.backends.tcp.faults.Faults.abort_world`)."""
        self._faults.abort_world(reason)

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
                for carrier in self._carriers:
                    carrier.flush_control()
            self._rings.close()
            self._sockets.close(goodbye=self._failure is None)
            self._matching.unexpected.clear()
            self._board.board = None
            self._rings.close_doorbell()
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
        self._progress.pending = 0
        try:
            gone = self._gone
            for r in recvs:
                if self._matching.post_recv(r) and r.src != ANY_SOURCE and r.src in gone:
                    raise self._faults.gone_error(r.src, "receive from")
            for s in sends:
                self._post_send(s)
            if self._progress.pending:
                self._wait(what, comm_id, sends, recvs)
        except BaseException as exc:
            cause = self._fail(exc, what)
            if cause is not exc:
                raise cause from None
            raise

    def _fail(self, exc: BaseException, what: str) -> BaseException:
        """Break the transport for ``exc``, raised by a call; return the error to raise:
        ``exc``, or the world's mismatch when ``exc`` is a peer that left after it (it raised
        the mismatch and closed, or exited): the mismatch is what went wrong."""
        # (No store look-up when the failure path found the store gone: each try could wait
        # for the store's timeout.)
        if isinstance(exc, PeerError) and not self._faults.store_lost and self.alarm.recall():
            try:
                self.alarm.check()  # the mismatch this rank owes: the peer left after it
            except MismatchError as mismatch:
                exc = mismatch
        if isinstance(exc, MismatchError):
            self.alarm.raised(self._alarm_group)
        if isinstance(exc, CommError):
            self._break(exc)
        else:
            # Interrupted half way (KeyboardInterrupt, MemoryError): frames are cut, so the
            # streams can no longer be trusted.
            self._break(CommError(f"rank {self.rank}: {what} was interrupted: {exc!r}"))
        return exc

    def _wait(self, what: str, comm_id: int, sends: list[Send], recvs: list[Recv]) -> None:
        progress = self._progress
        sockets = self._sockets
        rings = self._rings

        def done() -> bool:
            return not progress.pending

        def stalled() -> str:
            doing = f"exchange {self._matching.label(comm_id)}" if what == "exchange" else what
            return f"{doing}; {self._describe_pending(sends, recvs)}"

        self._waiter.until(
            done,
            stalled,
            needs_socket=lambda: sockets.pending(sends, recvs),
            rings_pending=lambda: rings.pending(sends, recvs),
        )

    def _describe_pending(self, sends: list[Send], recvs: list[Recv]) -> str:
        parts = [
            f"receive from {'any rank' if r.src == ANY_SOURCE else f'rank {r.src}'}"
            for r in recvs
            if not r.done
        ]
        waiting_fin = {id(s) for sp in self._rings.peer_list for s in sp.rts}
        parts += [f"send to rank {s.peer} ({s.left} bytes left)" for s in sends if s.left]
        parts += [f"send to rank {s.peer} (not yet read)" for s in sends if id(s) in waiting_fin]
        silent = sorted({r.src for r in recvs if not r.done} | {s.peer for s in sends if s.left})
        unconnected = self._sockets.unconnected(silent)
        note = f"; not connected to ranks {unconnected}" if unconnected else ""
        return "still waiting: " + ", ".join(parts[:8]) + note

    def _break(self, exc: CommError) -> None:
        first = self._failure is None
        self._failure = exc
        self._matching.clear()
        self._sendq.clear()
        self._rings.clear()
        self._progress.pending = 0
        if first:
            self._faults.note_leaving(exc)

    # -- sending -------------------------------------------------------------------------------
    def _post_send(self, s: Send) -> None:
        peer = s.peer
        if peer == self.rank:
            self._send_to_self(s)
        else:
            self._carriers[peer not in self._shm].post(s)  # rings, else sockets

    def _send_to_self(self, s: Send) -> None:
        data = b"".join(s.bufs)
        dec = wire.Decoder(handshake=False)
        dec.receive_data(data)
        header = dec.next_event()
        if not isinstance(header, wire.FrameHeader):  # pragma: no cover - we encoded it
            raise ProtocolError("self-send produced no frame")
        target = self._matching.target_for(header, self.rank)
        dec.set_target(target[1])
        dec.next_event()
        self._matching.payload_done(target[0])


def _replay(exc: CommError) -> CommError:
    message = f"tcp transport already failed: {exc}"
    if isinstance(exc, PeerError):
        return PeerError(message, exc.rank)
    return type(exc)(message)
