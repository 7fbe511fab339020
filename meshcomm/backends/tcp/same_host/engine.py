"""The shared-memory half of the tcp transport's progress engine.

Same-host peers whose handshake succeeded get a :class:`ShmPeer`: the two rings of their
:class:`~meshcomm.backends.tcp.same_host.rings.ShmPair` and a decoder for the incoming one. Frames
are the
socket's frames (:mod:`~meshcomm.backends.tcp.wire`), so matching is shared; what differs:

* **Writing** copies into the ring as far as it has room; the rest waits in the peer's send
  queue until the reader frees space (it rings our doorbell when we came up short).
* **Reading** takes whole DATA frames for posted receives straight out of the ring (one copy,
  into the destination, header decoded in place); anything else goes through the decoder.
* **Large payloads** (``CMA_MIN`` and up) go as an RTS frame naming the payload's address;
  the receiver copies it with ``process_vm_readv`` straight into the destination (or into a
  new buffer when no receive is posted yet, so sends never wait for a receive to be posted)
  and answers FIN, which completes the send. Without CMA they stream through the ring.
* **Waiting** polls the rings for a while before sleeping on the doorbell
  (:class:`~meshcomm.backends.tcp.waiting.Waiter`, which drives :meth:`ShmEngine.poll`).

:class:`ShmEngine` is the ring carrier a transport holds beside its socket carrier
(:class:`~meshcomm.backends.tcp.connections.Connections`); both offer :meth:`post`,
:meth:`pending`, :meth:`flush_control` and :meth:`waits_on` (:class:`Carrier`).
"""

from __future__ import annotations

import errno
import os
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Protocol

from meshcomm.backends.tcp import wire
from meshcomm.backends.tcp.faults import Faults
from meshcomm.backends.tcp.matching import CONTROL, PLAIN, RTS, Matching, Recv, Send
from meshcomm.backends.tcp.same_host import cma
from meshcomm.backends.tcp.same_host.doorbell import Doorbell
from meshcomm.backends.tcp.same_host.rings import ShmPair
from meshcomm.backends.tcp.waiting import Progress
from meshcomm.errors import ProtocolError

__all__ = ["CMA_MIN", "Carrier", "ShmEngine", "ShmPeer"]

#: Payloads from this size go to a same-host peer as an address (RTS) when it can read us
#: (``MESHCOMM_SHM_CMA_MIN`` overrides it, in bytes).
CMA_MIN = int(os.environ.get("MESHCOMM_SHM_CMA_MIN", "").strip() or 256 * 1024)


class Carrier(Protocol):
    """What a transport asks of each kind of channel (sockets, shared-memory rings)."""

    def post(self, s: Send) -> None:
        """Write ``s`` to its peer as far as it goes now; queue the rest (one pending op)."""

    def pending(self, sends: Sequence[Send], recvs: Sequence[Recv]) -> bool:
        """Whether an operation of the current call still waits on this kind of channel."""

    def flush_control(self) -> None:
        """Write what the engine owes its peers (FINs, set-up frames), as far as possible."""

    def waits_on(self, peer: int) -> bool:
        """Whether something of this carrier still needs ``peer`` (besides posted receives)."""


class ShmPeer:
    """A same-host peer's shared-memory pair, with the decoder of its incoming ring.

    Attributes:
        rts: RTS sends to this peer that wait for their FIN, oldest first.
        cma: whether payloads may go to this peer as an address.
        reads: whether this process can read the peer's memory.
    """

    __slots__ = ("cma", "current", "decoder", "pair", "peer", "pid", "reads", "rts", "rx", "tx")

    def __init__(self, peer: int, pair: ShmPair) -> None:
        self.peer = peer
        self.pair = pair
        self.tx = pair.tx
        self.rx = pair.rx
        self.pid = pair.peer_pid
        self.cma = pair.peer_reads_us
        self.reads = pair.we_read_peer
        self.decoder = wire.Decoder(handshake=False)
        self.current: object = None
        self.rts: deque[Send] = deque()


class ShmEngine:
    """Writing, reading and polling the shared-memory pairs of one transport.

    Args:
        rank: this process's global rank.
        token: the job token (names the doorbell).
        progress: the transport's counters.
        matching: where frames find their receives.
        faults: the transport's failure path (a copy that fails).
        sendq: the transport's send queues, by peer (shared with the socket carrier).

    Attributes:
        peers: shared-memory peers, by global rank.
        peer_list: the same, in attach order (the order they are polled in).
    """

    def __init__(
        self,
        rank: int,
        token: bytes,
        progress: Progress,
        matching: Matching,
        faults: Faults,
        sendq: dict[int, deque[Send]],
    ) -> None:
        self.rank = rank
        self.peers: dict[int, ShmPeer] = {}
        self.peer_list: list[ShmPeer] = []
        self.doorbell: Doorbell | None = None
        self._token = token
        self._progress = progress
        self._matching = matching
        self._faults = faults
        self._sendq = sendq

    @property
    def bell(self) -> Doorbell | None:
        """This process's doorbell while some pair is attached; else None."""
        return self.doorbell if self.peer_list else None

    def own_doorbell(self) -> Doorbell:
        """This process's doorbell, made on first use (the first pair's handshake)."""
        if self.doorbell is None:
            # spin_us=0: the engine polls the rings themselves before it sleeps.
            self.doorbell = Doorbell(self._token, self.rank, spin_us=0)
        return self.doorbell

    def reads_all(self, peers: Iterable[int]) -> bool:
        """Whether every peer (global ranks) is a shared-memory peer whose memory this process
        can read and that can read this process's memory (``process_vm_readv`` both ways)."""
        shm = self.peers
        return all((sp := shm.get(p)) is not None and sp.cma and sp.reads for p in peers)

    # -- the carrier -------------------------------------------------------------------------
    def post(self, s: Send) -> None:
        """Write ``s`` into its peer's ring as far as it has room; queue the rest."""
        peer = s.peer
        queue = self._sendq.get(peer)
        if not queue and self.write(self.peers[peer], s):
            if s.kind == RTS:
                self.peers[peer].rts.append(s)
                self._progress.pending += 1
            return
        if queue is None:
            queue = self._sendq[peer] = deque()
        queue.append(s)
        self._progress.pending += 1

    def post_frame(self, sp: ShmPeer, frame: bytes) -> Send | None:
        """Write a small frame (header and payload in one buffer) into ``sp``'s ring, which
        has nothing queued before it; None when all of it went in, else its pending rest."""
        done = sp.tx.push(frame)
        if done:
            self._progress.moved = True
            if done == len(frame):
                return None
        s = Send(sp.peer, [memoryview(frame)[done:]], len(frame) - done)
        self._sendq[sp.peer] = deque([s])
        self._progress.pending += 1
        return s

    def pending(self, sends: Sequence[Send], recvs: Sequence[Recv]) -> bool:
        """Whether an operation of the call waits on a ring (data or a FIN)."""
        shm = self.peers
        return any(not r.done and r.src in shm for r in recvs) or any(
            s.peer in shm and (s.left or s in shm[s.peer].rts) for s in sends
        )

    def flush_control(self) -> None:
        """Write what waits for room in the rings (FINs among it)."""
        sendq = self._sendq
        for sp in self.peer_list:
            if sendq.get(sp.peer):
                self.flush(sp)

    def waits_on(self, peer: int) -> bool:
        """Whether an RTS to ``peer`` still waits for its FIN."""
        sp = self.peers.get(peer)
        return sp is not None and bool(sp.rts)

    def clear(self) -> None:
        """Forget every RTS waiting for its FIN (the transport broke)."""
        for sp in self.peer_list:
            sp.rts.clear()

    # -- pairs -------------------------------------------------------------------------------
    def attach(self, peer: int, pair: ShmPair) -> None:
        """Take ``peer``'s pair into use: write what waits for it, read what it wrote."""
        sp = ShmPeer(peer, pair)
        self.peers[peer] = sp
        self.peer_list.append(sp)
        if self._sendq.get(peer):
            self.flush(sp)
        self.read(sp)  # the peer may have written already

    def detach(self, peer: int) -> None:
        """Close ``peer``'s pair, if it has one."""
        sp = self.peers.pop(peer, None)
        if sp is not None:
            self.peer_list.remove(sp)
            sp.pair.close()

    def close(self) -> None:
        """Close every pair (the doorbell stays: :meth:`close_doorbell`)."""
        for sp in list(self.peer_list):
            self.detach(sp.peer)

    def close_doorbell(self) -> None:
        """Close this process's doorbell (after every pair and handshake is closed)."""
        if self.doorbell is not None:
            self.doorbell.close()

    # -- writing -----------------------------------------------------------------------------
    def write(self, sp: ShmPeer, s: Send) -> bool:
        """Write as much of ``s`` as the ring takes; True when all of it is in."""
        push = sp.tx.push
        bufs = s.bufs
        while bufs:
            buf = bufs[0]
            n = push(buf)
            if n:
                self._progress.moved = True
                s.left -= n
            if n == len(buf):
                bufs.pop(0)
                continue
            if n:
                bufs[0] = memoryview(buf)[n:]
            return False
        return True

    def flush(self, sp: ShmPeer) -> None:
        """Write ``sp``'s queued sends, oldest first, until the ring is full."""
        queue = self._sendq.get(sp.peer)
        while queue:
            s = queue[0]
            if not self.write(sp, s):
                return
            queue.popleft()
            if s.kind == RTS:
                sp.rts.append(s)  # still pending: its FIN completes it
            elif s.kind == PLAIN:
                self._progress.pending -= 1

    # -- reading -----------------------------------------------------------------------------
    def poll(self) -> None:
        """Read every ring and write what waits for room."""
        sendq = self._sendq
        for sp in self.peer_list:
            self.read(sp)
            if sendq.get(sp.peer):
                self.flush(sp)

    def poll_moved(self) -> None:
        """:meth:`poll`, only when a ring's counters moved since the last look (one word
        per ring: the cheap look of a spinning waiter): a peer wrote to us, or read from
        us while sends to it wait for room (a sender's view of the reader's counter is
        refreshed only by writing, so it stays "moved" once the peer read our last bytes)."""
        sendq = self._sendq
        for sp in self.peer_list:
            if sp.rx.moved() or (sp.tx.moved() and sendq.get(sp.peer)):
                self.poll()
                return

    def read(self, sp: ShmPeer) -> None:
        """Take what ``sp`` wrote into its ring."""
        dec = sp.decoder
        if self._matching.posted and dec.idle:
            self._express(sp)
            if not self._progress.pending:
                return  # the rest (if any) waits for the next call's look
        pull = sp.rx.pull
        while True:
            view = dec.recv_view()
            n = pull(view)
            if not n:
                return
            self._progress.moved = True
            dec.commit(n)
            self._drain(sp)
            if n < len(view):
                return

    def in_frame(self, peer: int) -> bool:
        """Whether ``peer`` stopped writing its ring in the middle of a frame."""
        sp = self.peers.get(peer)
        return sp is not None and sp.decoder.in_frame

    def _express(self, sp: ShmPeer) -> None:
        """Take whole DATA frames for posted receives straight out of the ring.

        The decoder's path copies the bytes into its buffer and builds a header object per
        frame; this one decodes the header in place and copies the payload once, into its
        destination. Anything else (a frame split by the ring's end or not yet complete, no
        matching receive, a size that does not match) is left to the decoder, which also
        reports what is wrong.
        """
        rx = sp.rx
        ring = rx.data
        cap = rx.capacity
        unpack = wire.HEADER.unpack_from
        posted = self._matching.posted
        peer = sp.peer
        progress = self._progress
        hsize = wire.HEADER_SIZE
        while True:
            pos, avail = rx.peek()
            if avail < hsize or pos > cap - hsize:
                return
            marker, kind, flags, meta, reserved, comm_id, tag, length = unpack(ring, pos)
            total = hsize + length
            if kind != wire.DATA or total > avail or pos + total > cap:
                return
            key = (comm_id, peer, -1 if tag < -1 else tag)  # stamped link frames: LINK_TAG
            queue = posted.get(key)
            if not queue:
                return
            r = queue[0]
            dest = r.dest
            if dest is None or len(dest) != length or flags or meta or reserved or tag != r.want:
                return  # the decoder's path reports it (a stamp that differs: a mismatch)
            if marker != b"mc":
                return
            queue.popleft()
            if not queue:
                del posted[key]
            dest[:] = ring[pos + hsize : pos + total]
            rx.consume(total)
            r.source = peer
            r.done = True
            progress.pending -= 1
            progress.moved = True

    def _drain(self, sp: ShmPeer) -> None:
        dec = sp.decoder
        matching = self._matching
        while True:
            try:
                ev = dec.next_event()
            except ProtocolError as exc:
                raise ProtocolError(
                    f"rank {self.rank}: bad bytes from rank {sp.peer} at shared memory: {exc}"
                ) from None
            if ev is wire.NEED_DATA:
                return
            if ev is wire.PAYLOAD_DONE:
                current = sp.current
                sp.current = None
                matching.payload_done(current)
                continue
            if type(ev) is not wire.FrameHeader:
                raise ProtocolError(f"rank {self.rank}: a handshake on shared memory: {ev!r}")
            kind = ev.kind
            if kind == wire.DATA or kind == wire.ARRAY:  # noqa: PLR1714 - the hot path
                sp.current, target = matching.target_for(ev, sp.peer)
                dec.set_target(target)
            elif kind == wire.RTS:
                self._on_rts(sp, ev)
            elif kind == wire.FIN:
                self._on_fin(sp)
            else:
                raise ProtocolError(
                    f"rank {self.rank}: frame {ev!r} from rank {sp.peer} is not allowed on "
                    "shared memory"
                )

    def _on_rts(self, sp: ShmPeer, h: wire.FrameHeader) -> None:
        current, target = self._matching.target_for(h, sp.peer)
        try:
            cma.read_into(sp.pid, target, h.address)
        except OSError as exc:
            raise self._faults.copy_failed(
                sp.peer, "read", h.length, h.address, exc, exc.errno == errno.ESRCH
            ) from None
        self._matching.payload_done(current)
        queue = self._sendq.get(sp.peer)
        if not queue:
            n = sp.tx.push(wire.FIN_FRAME)
            if n == len(wire.FIN_FRAME):
                return
            rest = wire.FIN_FRAME[n:]
            queue = self._sendq[sp.peer] = deque()
        else:
            rest = wire.FIN_FRAME
        queue.append(Send(sp.peer, [rest], len(rest), CONTROL))

    def _on_fin(self, sp: ShmPeer) -> None:
        if not sp.rts:
            raise ProtocolError(f"rank {self.rank}: FIN from rank {sp.peer} without an RTS")
        s = sp.rts.popleft()
        s.data = None
        self._progress.pending -= 1
