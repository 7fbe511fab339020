"""One shared-memory byte ring per direction between two same-host ranks.

:class:`ShmChannel` is one end of a ring (made by
:class:`~meshcomm.backends.tcp.same_host.handshake.ShmHandshake`); :class:`ShmPair` holds both ends
of one peer. See :mod:`~meshcomm.backends.tcp.same_host.rings` for the layout and the protocol.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshcomm.backends.tcp.same_host.doorbell import Bell, Doorbell
from meshcomm.backends.tcp.same_host.platform import (
    RING_HEADER,
    SEQ_CST,
    W_HEAD,
    W_RECEIVER_CLOSED,
    W_RX_BLOCKED,
    W_SENDER_CLOSED,
    W_TAIL,
    W_TX_BLOCKED,
    BytesLike,
    SharedMapping,
    process_alive,
)
from meshcomm.errors import CommError, InvalidArgument, PeerError, ProtocolError

__all__ = ["ShmChannel", "ShmPair"]


def _byte_view(data: object, *, writable: bool, what: str) -> memoryview:
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise InvalidArgument(f"{what} must be C-contiguous")
        data = data.reshape(-1).view(np.uint8)  # also covers dtypes without a buffer format
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError as exc:
        msg = f"{what} must support the buffer protocol, got {type(data).__name__}"
        raise TypeError(msg) from exc
    if writable and view.readonly:
        raise InvalidArgument(f"{what} must be writable")
    if view.ndim != 1 or view.format != "B":
        if not view.c_contiguous:
            raise InvalidArgument(f"{what} must be C-contiguous")
        view = view.cast("B")
    elif not view.c_contiguous:
        raise InvalidArgument(f"{what} must be contiguous")
    return view


class ShmChannel:
    """One end of a one-directional shared-memory byte ring (made by :class:`ShmHandshake`).

    The sending end calls :meth:`send_some`, the receiving end :meth:`recv_into_some`; both
    copy with two ``memmove`` at most (wrap-around) and never block. An operation that moves
    fewer bytes than offered marks this end as waiting on the ring, which is what makes the
    peer ring this process's doorbell when it publishes (see the module docstring).

    Attributes:
        rank: this process's rank.
        peer: the other end's rank.
        peer_pid: the other end's process id.
        capacity: bytes the ring holds.
        is_sender: True for the sending end.
    """

    def __init__(
        self,
        mapping: SharedMapping,
        *,
        is_sender: bool,
        rank: int,
        peer: int,
        peer_pid: int,
        peer_start: int | None,
        peer_bell: Bell,
        capacity: int,
    ) -> None:
        self._map = mapping
        self._ring = mapping.data(RING_HEADER, capacity)
        self.is_sender = is_sender
        self.rank = rank
        self.peer = peer
        self.peer_pid = peer_pid
        self._peer_start = peer_start
        self._peer_bell = peer_bell
        self.capacity = capacity
        self._fence = mapping.fence
        # Each side writes its own counter and "blocked" word, and caches them.
        if is_sender:
            self._mine_word, self._theirs_word = W_HEAD, W_TAIL
            self._blocked_word, self._peer_blocked_word = W_TX_BLOCKED, W_RX_BLOCKED
        else:
            self._mine_word, self._theirs_word = W_TAIL, W_HEAD
            self._blocked_word, self._peer_blocked_word = W_RX_BLOCKED, W_TX_BLOCKED
        self._load = mapping.load
        self._store = mapping.store
        self._mine = mapping.load(self._mine_word)
        self._seen = -1  # the other end's counter when this end last looked
        self._blocked = mapping.load(self._blocked_word)
        self.closed = False

    def _check(self, sender: bool, what: str) -> None:
        if self.closed:
            raise CommError(f"rank {self.rank}: {what} on a closed channel with rank {self.peer}")
        if sender != self.is_sender:
            role = "sending" if self.is_sender else "receiving"
            raise InvalidArgument(
                f"rank {self.rank}: {what} on the {role} end of the channel with rank {self.peer}"
            )

    def _used(self, head: int, tail: int) -> int:
        used = head - tail
        if not 0 <= used <= self.capacity:
            raise ProtocolError(
                f"rank {self.rank}: shared-memory ring with rank {self.peer} is corrupt: "
                f"head {head}, tail {tail}, capacity {self.capacity}"
            )
        return used

    def send_some(self, data: BytesLike, *, notify: bool = True) -> int:
        """Copy as many leading bytes of ``data`` as fit into the ring.

        Args:
            data: a contiguous bytes-like object or array.
            notify: ring the receiver if it is asleep waiting on this ring (pass False to
                batch, then call ``Doorbell.ring(peer)``, which rings unconditionally).

        Returns:
            The number of bytes copied; 0 when the ring is full (or ``data`` is empty).

        Raises:
            PeerError: the receiver closed its end.
        """
        self._check(True, "send_some")
        view = _byte_view(data, writable=False, what="send_some data")
        if self._map.load(W_RECEIVER_CLOSED):
            raise PeerError(
                f"rank {self.rank}: rank {self.peer} closed its shared-memory channel",
                rank=self.peer,
            )
        return self._transfer(view, notify)

    def recv_into_some(self, buf: BytesLike, *, notify: bool = True) -> int:
        """Copy as many available bytes as fit into ``buf`` (from its start).

        Args:
            buf: a writable contiguous buffer.
            notify: ring the sender if it is asleep waiting for space in this ring.

        Returns:
            The number of bytes copied; 0 when the ring is empty (see :meth:`peer_closed`).
        """
        self._check(False, "recv_into_some")
        return self._transfer(_byte_view(buf, writable=True, what="recv_into_some buffer"), notify)

    def push(self, view: memoryview | bytes) -> int:
        """:meth:`send_some` without argument checks, for the transport's hot path.

        ``view`` must be bytes or a 1-D byte memoryview (no view is made of a frame already
        in bytes) and this the sending end; the peer is rung if
        it waits on this ring. A closed receiver is not checked (the socket reports it).
        """
        return self._transfer(view, True)

    def pull(self, view: memoryview) -> int:
        """:meth:`recv_into_some` without argument checks (``view``: writable 1-D bytes)."""
        return self._transfer(view, True)

    def _transfer(self, view: Any, notify: bool) -> int:
        """Move bytes between ``view`` and the ring; declare "blocked" if short; notify.

        ``view``: what :meth:`push` takes (bytes or a byte memoryview) on the sending end, a
        writable byte memoryview on the receiving end (one signature for both directions).
        """
        load = self._load
        cap = self.capacity
        mine = self._mine  # head (sender) or tail (receiver): only we write it
        want = len(view)
        done = 0
        while True:
            theirs = self._seen = load(self._theirs_word)
            used = mine - theirs if self.is_sender else theirs - mine
            if not 0 <= used <= cap:
                raise ProtocolError(
                    f"rank {self.rank}: shared-memory ring with rank {self.peer} is corrupt: "
                    f"counters {mine} and {theirs}, capacity {cap}"
                )
            count = want - done
            room = cap - used if self.is_sender else used
            count = min(count, room)
            if count > 0:
                pos = mine % cap
                first = cap - pos
                ring = self._ring
                end = done + count
                if self.is_sender:
                    if first >= count:
                        ring[pos : pos + count] = view[done:end]
                    else:
                        ring[pos:] = view[done : done + first]
                        ring[: count - first] = view[done + first : end]
                elif first >= count:
                    view[done:end] = ring[pos : pos + count]
                else:
                    view[done : done + first] = ring[pos:]
                    view[done + first : end] = ring[: count - first]
                mine += count
                done = end
                self._mine = mine
                self._store(self._mine_word, mine)
            fence = self._fence
            if done == want or fence is None:
                break
            # Short: publish "blocked at this position", then look once more (Dekker with
            # the peer's publish-fence-check in the notification below). Already marked at
            # this position: the mark stands, and the look once more was done then.
            mark = mine + 1
            if self._blocked == mark:
                break
            self._blocked = mark
            self._store(self._blocked_word, mark)
            fence(SEQ_CST)
        if done and notify:
            self._notify()
        return done

    def _notify(self) -> None:
        """Ring the peer if it came up short on this ring here and may be asleep."""
        fence = self._fence
        if fence is None:
            self._peer_bell.ring()
            return
        fence(SEQ_CST)  # our counter store before the loads that decide to ring
        load = self._load
        if load(self._peer_blocked_word) == load(self._theirs_word) + 1:
            bell = self._peer_bell
            if bell.armed():
                bell.ring()

    def peek(self) -> tuple[int, int]:
        """Receiving end: (position in :attr:`data` of the next unread byte, bytes readable).

        With :meth:`consume`, this lets the transport decode a frame in place. Looking
        does not count as coming up short: before waiting, call :meth:`pull`.
        """
        mine = self._mine
        head = self._seen = self._load(W_HEAD)
        avail = head - mine
        if not 0 <= avail <= self.capacity:
            raise ProtocolError(
                f"rank {self.rank}: shared-memory ring with rank {self.peer} is corrupt: "
                f"{avail} bytes readable, capacity {self.capacity}"
            )
        return mine % self.capacity, avail

    def moved(self) -> bool:
        """Whether the other end moved its counter since this end last looked (one load).

        For polling many rings cheaply; a ring that moved is then read (or written) for real.
        """
        return bool(self._load(self._theirs_word) != self._seen)

    def consume(self, nbytes: int) -> None:
        """Receiving end: mark ``nbytes`` (at most what :meth:`peek` said) as read."""
        self._mine += nbytes
        self._store(W_TAIL, self._mine)
        self._notify()

    @property
    def data(self) -> memoryview:
        """The ring's bytes (byte ``i`` of the stream is at ``i % capacity``)."""
        return self._ring

    def readable_bytes(self) -> int:
        """Bytes written and not yet read."""
        if self.closed:
            return 0
        return self._used(self._map.load(W_HEAD), self._map.load(W_TAIL))

    def writable_bytes(self) -> int:
        """Free bytes in the ring."""
        return 0 if self.closed else self.capacity - self.readable_bytes()

    def peer_closed(self) -> bool:
        """True once the other end called :meth:`close` (a receiver still drains what is left)."""
        if self.closed:
            return True
        return bool(self._map.load(W_RECEIVER_CLOSED if self.is_sender else W_SENDER_CLOSED))

    def peer_alive(self) -> bool:
        """True while the peer's process exists (a zombie or a reused pid counts as dead)."""
        return process_alive(self.peer_pid, self._peer_start)

    def close(self) -> None:
        """Mark this end closed, ring the peer so it notices, and unmap. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._map.store(W_SENDER_CLOSED if self.is_sender else W_RECEIVER_CLOSED, 1)
        with contextlib.suppress(CommError):
            self._peer_bell.ring()
        self._ring.release()
        self._map.close()

    def __repr__(self) -> str:
        role = "tx" if self.is_sender else "rx"
        return f"ShmChannel({role}, rank={self.rank}, peer={self.peer}, capacity={self.capacity})"


@dataclass
class ShmPair:
    """Both channels between this process and one same-host peer.

    Attributes:
        tx: the sending end (this rank to ``peer``).
        rx: the receiving end (``peer`` to this rank).
        peer: the peer's rank.
        peer_pid: the peer's process id.
        peer_reads_us: the peer can read this process's memory (``process_vm_readv``), so
            large payloads may go to it as an address instead of through the ring.
        we_read_peer: this process can read the peer's memory.
    """

    tx: ShmChannel
    rx: ShmChannel
    peer: int
    peer_pid: int
    _doorbell: Doorbell = field(repr=False)
    _peer_bell: Bell = field(repr=False)
    peer_reads_us: bool = False
    we_read_peer: bool = False

    def peer_alive(self) -> bool:
        """True while the peer's process exists."""
        return self.rx.peer_alive()

    def close(self) -> None:
        """Close both channels and unmap the peer's doorbell. Idempotent."""
        self.tx.close()
        self.rx.close()
        self._doorbell._detach(self.peer, self._peer_bell)

    def __enter__(self) -> ShmPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
