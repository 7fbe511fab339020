"""The shared-memory half of the tcp transport's progress engine (a mixin).

Same-host peers whose handshake succeeded get a :class:`ShmPeer`: the two rings of their
:class:`~meshcomm.backends.tcp.shm.ShmPair` and a decoder for the incoming one. Frames are the
socket's frames (:mod:`~meshcomm.backends.tcp.wire`), so matching is shared; what differs:

* **Writing** copies into the ring as far as it has room; the rest waits in the peer's send
  queue until the reader frees space (it rings our doorbell when we came up short).
* **Reading** takes whole DATA frames for posted receives straight out of the ring (one copy,
  into the destination, header decoded in place); anything else goes through the decoder.
* **Large payloads** (``CMA_MIN`` and up) go as an RTS frame naming the payload's address;
  the receiver copies it with ``process_vm_readv`` straight into the destination (or into a
  new buffer when no receive is posted yet, so sends never wait for a receive to be posted)
  and answers FIN, which completes the send. Without CMA they stream through the ring.
* **Waiting** polls the rings for a while (:func:`spin_policy`) before the engine sleeps on the
  doorbell.
"""

from __future__ import annotations

import errno
import os
import time
from collections import deque
from collections.abc import Iterable

from meshcomm.backends.tcp import cma, wire
from meshcomm.backends.tcp.connections import Channel, Connections
from meshcomm.backends.tcp.matching import CONTROL, PLAIN, RTS, Recv, Send
from meshcomm.backends.tcp.shm import ShmPair
from meshcomm.errors import CommError, InvalidArgument, PeerError, ProtocolError

__all__ = [
    "CMA_MIN",
    "SPIN_FIT_US",
    "SPIN_MIN_US",
    "SPIN_SHARED_US",
    "ShmEngine",
    "ShmPeer",
    "Spinner",
    "shares_cores",
    "spin_policy",
]

#: Payloads from this size go to a same-host peer as an address (RTS) when it can read us
#: (``MESHCOMM_SHM_CMA_MIN`` overrides it, in bytes).
CMA_MIN = int(os.environ.get("MESHCOMM_SHM_CMA_MIN", "").strip() or 256 * 1024)
#: Microseconds a waiter polls its rings before sleeping, with a core to itself ...
SPIN_FIT_US = 1000.0
#: ... and with more local ranks than cores, or a machine loaded by others.
SPIN_SHARED_US = 200.0
#: The poll shrinks to this after polls that found nothing (the peer is not running).
SPIN_MIN_US = 20.0
# How often the host's load is looked at (os.getloadavg).
_LOAD_CHECK = 1.0


def spin_policy(local_size: int) -> float:
    """Seconds a waiter polls its rings before it sleeps on its doorbell.

    A futex wake-up costs tens of microseconds on a virtual machine, more than a whole
    small exchange, so a waiter polls first, giving its core away between polls
    (``sched_yield``) so that a rank with work runs first: at most ``SPIN_FIT_US`` when every
    local rank has a core, ``SPIN_SHARED_US`` when they share. ``MESHCOMM_SHM_SPIN_US`` sets
    the time (0: sleep at once). The engine adapts below this bound (:class:`Spinner`).

    Raises:
        InvalidArgument: ``MESHCOMM_SHM_SPIN_US`` is not a number in [0, 1e6].

    Example:
        >>> spin_policy(1) >= 0
        True
    """
    shared = local_size > len(os.sched_getaffinity(0))
    raw = os.environ.get("MESHCOMM_SHM_SPIN_US", "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 <= value <= 1e6:
            raise InvalidArgument(f"MESHCOMM_SHM_SPIN_US must be in [0, 1e6], got {raw!r}")
        return value * 1e-6
    return (SPIN_SHARED_US if shared else SPIN_FIT_US) * 1e-6


def shares_cores(local_size: int) -> bool:
    """Whether this host's ranks outnumber this process's cores."""
    return local_size > len(os.sched_getaffinity(0))


class Spinner:
    """How long to poll before sleeping: a budget under a fixed bound.

    With a core per local rank the budget adapts: a poll that ends with data doubles it (up
    to the bound), one that finds nothing halves it (down to ``SPIN_MIN_US``), because a
    peer that is not running (its core taken by another process) is only delayed by a
    poller that holds a core; and while the host's load average exceeds its cores, the bound
    drops to ``SPIN_SHARED_US``. When local ranks share cores the budget stays at its bound:
    a poller yields its core between polls, so a rank with work on the same core runs first.
    """

    def __init__(self, bound: float, shared: bool) -> None:
        self.bound = bound
        self.budget = bound
        self._adapt = not shared and bound > SPIN_SHARED_US * 1e-6
        self._cores = len(os.sched_getaffinity(0))
        self._busy = False
        self._checked = 0.0

    def limit(self, now: float) -> float:
        """The bound in force now (lower while the host is loaded by others)."""
        if not self._adapt:
            return self.bound
        if now - self._checked >= _LOAD_CHECK:
            self._checked = now
            try:
                self._busy = os.getloadavg()[0] > self._cores + 0.5
            except OSError:
                self._busy = False
        return SPIN_SHARED_US * 1e-6 if self._busy else self.bound

    def update(self, hit: bool, now: float) -> None:
        """Grow the budget after a poll that found work, shrink it after one that did not."""
        if not self._adapt:
            return
        if hit:
            self.budget = min(self.limit(now), 2 * self.budget)
        else:
            self.budget = max(SPIN_MIN_US * 1e-6, self.budget / 2)


class ShmPeer:
    """A same-host peer's shared-memory pair, with the decoder of its incoming ring.

    Attributes:
        is_shm: True (a socket :class:`~meshcomm.backends.tcp.connections.Channel` says
            False).
        rts: RTS sends to this peer that wait for their FIN, oldest first.
        cma: whether payloads may go to this peer as an address.
        reads: whether this process can read the peer's memory.
    """

    __slots__ = ("cma", "current", "decoder", "pair", "peer", "pid", "reads", "rts", "rx", "tx")
    is_shm = True

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


class ShmEngine(Connections):
    """Writing, reading and waiting on shared-memory pairs (a mixin of the transport)."""

    _npending: int
    _shm: dict[int, ShmPeer]
    _shm_list: list[ShmPeer]
    _spinner: Spinner

    def _drain(self, ch: Channel | ShmPeer) -> None:
        raise NotImplementedError  # the transport's

    def _peer_died(self, peer: int, how: str) -> PeerError:
        raise NotImplementedError

    def _left_after_failure(self, peer: int, how: str) -> PeerError | None:
        raise NotImplementedError

    def _break(self, exc: CommError) -> None:
        raise NotImplementedError

    # -- direct access to peers' memory (meshcomm.backends.tcp.direct) ------------------------
    def reads_all(self, peers: Iterable[int]) -> bool:
        """Whether every peer (global ranks) is a shared-memory peer whose memory this process
        can read and that can read this process's memory (``process_vm_readv`` both ways)."""
        shm = self._shm
        return all((sp := shm.get(p)) is not None and sp.cma and sp.reads for p in peers)

    def read_peer(self, peer: int, local: int, nbytes: int, remote: int) -> None:
        """Copy ``nbytes`` at address ``remote`` of same-host ``peer`` to our address ``local``.

        The caller keeps ``[local, local + nbytes)`` alive and writable, and knows from the
        peer that the remote range is a live buffer (an address it published and has not yet
        released). A failure breaks the transport, as any failed operation does.

        Raises:
            PeerError: the peer's process is gone (names it).
            ProtocolError: the kernel refused (a bad address: the ranks disagree).
        """
        self._peer_copy(False, peer, local, nbytes, remote)

    def write_peer(self, peer: int, remote: int, nbytes: int, local: int) -> None:
        """Copy ``nbytes`` at our address ``local`` to address ``remote`` of same-host ``peer``
        (the peer published the range for this); errors as :meth:`read_peer`."""
        self._peer_copy(True, peer, local, nbytes, remote)

    def writes_to(self, peer: int, remote: int, nbytes: int, local: int) -> bool:
        """Probe :meth:`write_peer` (a range the peer gave for it): False where refused."""
        sp = self._shm.get(peer)
        if sp is None:
            return False
        try:
            cma.write_at(sp.pid, remote, nbytes, local)
        except OSError:
            return False
        return True

    def _peer_copy(self, write: bool, peer: int, local: int, nbytes: int, remote: int) -> None:
        what = "write" if write else "read"
        sp = self._shm.get(peer)
        error: CommError
        if sp is None and peer in self._gone:  # it left between frames; its pair is gone
            error = self._gone_error(peer, what)
        elif sp is None:
            error = ProtocolError(f"rank {self.rank}: rank {peer} is not a shared-memory peer")
        else:
            try:
                if write:
                    cma.write_at(sp.pid, remote, nbytes, local)
                else:
                    cma.read_at(sp.pid, local, nbytes, remote)
                return
            except OSError as exc:
                if exc.errno == errno.ESRCH:
                    error = self._peer_died(peer, "its process is gone")
                else:
                    how = f"cannot {what} {nbytes} bytes of it at {remote:#x}: {exc}"
                    error = self._left_after_failure(peer, how) or ProtocolError(
                        f"rank {self.rank}: cannot {what} {nbytes} bytes of rank {peer} at "
                        f"{remote:#x}: {exc}"
                    )
        self._break(error)
        raise error

    def _spin_shm(self, now: float) -> None:
        """Poll the rings until something moved or the spin budget is spent.

        Each round looks at one counter per ring (:meth:`ShmChannel.moved`) and reads only
        when one moved, then yields the core, so that a round costs a few microseconds and a
        rank with work on this core runs in between.
        """
        spinner = self._spinner
        until = now + min(spinner.budget, spinner.limit(now))
        clock = time.monotonic
        pause = os.sched_yield
        hit = False
        while clock() < until:
            for sp in self._shm_list:
                if sp.rx.moved() or sp.tx.moved():
                    self._poll_shm()
                    break
            if self._progressed or not self._npending:
                hit = True
                break
            pause()
        spinner.update(hit, now)

    def _shm_pending(self, sends: list[Send], recvs: list[Recv]) -> bool:
        shm = self._shm
        return any(not r.done and r.src in shm for r in recvs) or any(
            s.peer in shm and (s.left or s in shm[s.peer].rts) for s in sends
        )

    def _attach_shm(self, peer: int, pair: ShmPair) -> None:
        sp = ShmPeer(peer, pair)
        self._shm[peer] = sp
        self._shm_list.append(sp)
        if self._sendq.get(peer):
            self._shm_flush(sp)
        self._shm_read(sp)  # the peer may have written already

    def _detach_shm(self, peer: int) -> None:
        sp = self._shm.pop(peer, None)
        if sp is not None:
            self._shm_list.remove(sp)
            sp.pair.close()

    def _shm_write(self, sp: ShmPeer, s: Send) -> bool:
        """Write as much of ``s`` as the ring takes; True when all of it is in."""
        push = sp.tx.push
        bufs = s.bufs
        while bufs:
            buf = bufs[0]
            n = push(buf)  # type: ignore[arg-type]
            if n:
                self._progressed = True
                s.left -= n
            if n == len(buf):
                bufs.pop(0)
                continue
            if n:
                bufs[0] = memoryview(buf)[n:]
            return False
        return True

    def _shm_flush(self, sp: ShmPeer) -> None:
        queue = self._sendq.get(sp.peer)
        while queue:
            s = queue[0]
            if not self._shm_write(sp, s):
                return
            queue.popleft()
            if s.kind == RTS:
                sp.rts.append(s)  # still pending: its FIN completes it
            elif s.kind == PLAIN:
                self._npending -= 1

    def _poll_shm(self) -> None:
        sendq = self._sendq
        for sp in self._shm_list:
            self._shm_read(sp)
            if sendq.get(sp.peer):
                self._shm_flush(sp)

    def _shm_read(self, sp: ShmPeer) -> None:
        dec = sp.decoder
        if self._posted and dec.idle:
            self._shm_express(sp)
            if not self._npending:
                return  # the rest (if any) waits for the next call's look
        pull = sp.rx.pull
        while True:
            view = dec.recv_view()
            n = pull(view)
            if not n:
                return
            self._progressed = True
            dec.commit(n)
            self._drain(sp)
            if n < len(view):
                return

    def _shm_express(self, sp: ShmPeer) -> None:
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
        posted = self._posted
        peer = sp.peer
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
            self._npending -= 1
            self._progressed = True

    def _on_rts(self, sp: ShmPeer, h: wire.FrameHeader) -> None:
        current, target = self._target_for(h, sp.peer)
        try:
            cma.read_into(sp.pid, target, h.address)
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                raise self._peer_died(sp.peer, "its process is gone") from None
            how = f"cannot read {h.length} bytes of it at {h.address:#x}: {exc}"
            raise self._left_after_failure(sp.peer, how) or ProtocolError(
                f"rank {self.rank}: cannot read {h.length} bytes of rank {sp.peer} at "
                f"{h.address:#x}: {exc}"
            ) from None
        self._payload_done(current)
        queue = self._sendq.get(sp.peer)
        if not queue:
            n = sp.tx.push(wire.FIN_FRAME)  # type: ignore[arg-type]
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
        self._npending -= 1
