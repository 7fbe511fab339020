"""Operations and message matching of the tcp backend's progress engine (no I/O).

A receive is *posted* until a frame of its (communicator, source, tag) arrives; a frame that
nobody waits for yet is kept as an *unexpected* message, first in first out per
(communicator, source, tag), and bound to the next receive that asks for it. Frames are
matched the same way whichever channel (socket or shared memory) brought them.

:class:`Matching` is one of the parts a :class:`~meshcomm.backends.tcp.transport.Transport`
holds: it owns the queues, and counts posted receives in the transport's
:class:`~meshcomm.backends.tcp.waiting.Progress`.

Example:
    >>> as_bytes(np.arange(2, dtype=np.int32)).nbytes
    8
"""

from __future__ import annotations

from collections import deque

import numpy as np

from meshcomm.backends.tcp import wire
from meshcomm.backends.tcp.waiting import Progress
from meshcomm.errors import InvalidArgument, MismatchError, ProtocolError

__all__ = [
    "ANY_SOURCE",
    "CONTROL",
    "LINK_TAG",
    "PLAIN",
    "RTS",
    "Matching",
    "Message",
    "Recv",
    "Send",
    "as_bytes",
]

#: Tag of Link traffic (negative tags are internal; users get 0 and up). A link frame of a
#: stamped call (mismatch checks, :mod:`meshcomm.diagnostics.fingerprint`) carries ``-2 - stamp``
#: instead; frames are matched as LINK_TAG and the tag compared once matched.
LINK_TAG = -1
# Stamps carry the call's sequence number in their low bits (_fingerprint.SEQ_BITS).
_SEQ_MASK = 0xFFFF
_SEQ_HALF = 0x8000
#: ``src`` of a receive that accepts any rank.
ANY_SOURCE = -1

# Send kinds: a frame this call waits for; an RTS (done when its FIN comes back); a
# control frame of the engine itself (no caller waits for it).
PLAIN, RTS, CONTROL = 0, 1, 2


def as_bytes(buffer: object, *, writable: bool = False) -> memoryview:
    """Return a flat byte view of a C-contiguous array (no copy; ml_dtypes work too).

    Raises:
        InvalidArgument: the buffer is not C-contiguous, or is read-only where written.

    Example:
        >>> as_bytes(b"abc").tolist()
        [97, 98, 99]
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


class Send:
    """One outgoing frame: the unsent rest of its byte views.

    Attributes:
        peer: destination global rank.
        bufs: what is left to write (header, payload).
        left: bytes left to write.
        kind: PLAIN, RTS or CONTROL.
        data: an RTS's payload (kept alive until its FIN).
    """

    __slots__ = ("bufs", "data", "kind", "left", "peer")

    def __init__(
        self, peer: int, bufs: list[bytes | memoryview], left: int, kind: int = PLAIN
    ) -> None:
        self.peer = peer
        self.bufs = bufs
        self.left = left
        self.kind = kind
        self.data: memoryview | None = None

    def advance(self, sent: int) -> None:
        """Drop the first ``sent`` bytes."""
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


class Recv:
    """One posted receive: into ``dest`` (Link bytes), or a new array (``dest`` None)."""

    __slots__ = ("array", "comm_id", "dest", "done", "source", "src", "tag", "want")

    def __init__(self, comm_id: int, src: int, tag: int, dest: memoryview | None) -> None:
        self.comm_id = comm_id
        self.src = src
        # Stamped link receives match as LINK_TAG; the stamp is compared after matching.
        self.tag = LINK_TAG if tag < LINK_TAG else tag
        self.want = tag
        self.dest = dest
        self.done = False
        self.array: np.ndarray | None = None
        self.source = -1


class Message:
    """A frame that arrived before its receive was posted (its payload may still be coming)."""

    __slots__ = ("array", "buf", "done", "header", "src", "waiter")

    def __init__(self, header: wire.FrameHeader, src: int) -> None:
        self.header = header
        self.src = src
        self.done = False
        self.waiter: Recv | None = None
        self.array: np.ndarray | None = None
        self.buf: memoryview


class Matching:
    """Posted receives, unexpected messages, and how frames find their receive.

    One per transport; the socket and ring engines hand it every DATA, RTS and ARRAY frame
    (:meth:`target_for`) and every finished payload (:meth:`payload_done`), whichever
    channel brought it.

    Args:
        rank: this process's global rank (for messages).
        progress: the transport's counters (a posted receive is one pending operation).

    Attributes:
        posted: receives waiting for a frame, by (communicator, source, tag).
        posted_any: receives from any source, by (communicator, tag).
        unexpected: frames nobody waited for yet, by (communicator, source, tag).
        labels: comm id -> how errors name that communicator's group (set by its
            communicator).
        stamped: (comm id, link tag) of the stamped call in progress, or None: a frame of
            that communicator that nobody waits for is checked against it when it arrives.
    """

    def __init__(self, rank: int, progress: Progress) -> None:
        self.rank = rank
        self.progress = progress
        self.posted: dict[tuple[int, int, int], deque[Recv]] = {}
        self.posted_any: dict[tuple[int, int], deque[Recv]] = {}
        self.unexpected: dict[tuple[int, int, int], deque[Message]] = {}
        self.labels: dict[int, str] = {}
        self.stamped: tuple[int, int] | None = None

    def label(self, comm_id: int) -> str:
        """How errors name communicator ``comm_id``'s group."""
        return self.labels.get(comm_id, "on the world" if comm_id == 0 else "on a sub-group")

    def expect(self, comm_id: int, tag: int) -> None:
        """Begin a call of ``comm_id`` whose link frames carry ``tag``: a stamped call's
        first exchange checks the frames already waiting unreceived."""
        if tag < LINK_TAG:
            stamped = (comm_id, tag)
            if stamped != self.stamped:
                self.stamped = stamped
                if self.unexpected:
                    self.scan_strays(comm_id)
        else:
            self.stamped = None

    def post_recv(self, r: Recv) -> bool:
        """Post ``r``, or bind it to a frame that came first; True when it waits."""
        src = r.src
        if src == ANY_SOURCE:
            msg = self._pop_unexpected_any(r.comm_id, r.tag)
        else:
            key = (r.comm_id, src, r.tag)
            queue = self.unexpected.get(key)
            msg = None
            if queue:
                msg = queue.popleft()
                if not queue:
                    del self.unexpected[key]
        if msg is not None:
            self._bind(r, msg)
            return False
        self.progress.pending += 1
        if src == ANY_SOURCE:
            self.posted_any.setdefault((r.comm_id, r.tag), deque()).append(r)
        else:
            self.posted.setdefault((r.comm_id, src, r.tag), deque()).append(r)
        return True

    def _pop_unexpected_any(self, comm_id: int, tag: int) -> Message | None:
        # The earliest complete-or-not message from any source (insertion order of the dict
        # is arrival order of each source's first pending frame; good enough and fair).
        for key, queue in self.unexpected.items():
            if key[0] == comm_id and key[2] == tag and queue:
                msg = queue.popleft()
                if not queue:
                    del self.unexpected[key]
                return msg
        return None

    def _bind(self, r: Recv, msg: Message) -> None:
        self._check_match(r, msg.header, msg.src)
        r.source = msg.src
        if msg.done:
            self._deliver(r, msg)
        else:
            msg.waiter = r
            self.progress.pending += 1

    def _check_match(self, r: Recv, h: wire.FrameHeader, src: int) -> None:
        if r.dest is None:
            if h.kind != wire.ARRAY:
                raise ProtocolError(
                    f"rank {self.rank}: recv (tag {r.tag}) got a Link frame from rank {src}; "
                    "send/recv and collectives must not share a tag"
                )
        else:
            tag = h.tag
            if tag != r.want and tag < LINK_TAG and r.want < LINK_TAG:  # both stamped
                raise self.mismatch(r.comm_id, src, tag)
            if h.kind == wire.ARRAY or h.length != len(r.dest):
                got = "an array (send)" if h.kind == wire.ARRAY else f"{h.length} bytes"
                raise ProtocolError(
                    f"rank {self.rank}: expected {len(r.dest)} bytes from rank {src} "
                    f"{self.label(r.comm_id)}, got {got}: the ranks disagree on the "
                    "operation (MESHCOMM_DEBUG=DETAIL names both calls)"
                )

    def mismatch(self, comm_id: int, src: int, tag: int) -> MismatchError:
        """The error for a frame of ``src`` stamped ``tag`` that differs from this call's."""
        return MismatchError(
            f"rank {self.rank}: rank {src} called a different collective "
            f"{self.label(comm_id)} than this rank",
            peer=src,
            theirs=-2 - tag,
        )

    def stray(self, comm_id: int, src: int, tag: int) -> None:
        """Raise if a stamped frame nobody waits for yet cannot belong to a later call of
        the stamped call in progress: the same call number with another signature, or an
        earlier one (its receiver finished that call without it). Frames of later calls
        (a peer that is ahead) wait for their receive."""
        current = self.stamped
        if current is None or current[0] != comm_id or tag >= LINK_TAG or tag == current[1]:
            return
        ahead = ((-2 - tag) - (-2 - current[1])) & _SEQ_MASK
        if ahead == 0 or ahead >= _SEQ_HALF:
            raise self.mismatch(comm_id, src, tag)

    def scan_strays(self, comm_id: int) -> None:
        """:meth:`stray` for the frames of ``comm_id`` already waiting unreceived: the oldest
        of each source is enough (a source's frames arrive in call order, so a frame of an
        earlier call is at the head of its queue). Senders that only send (the leaves of a
        reduce, a broadcast's root) may run many calls ahead; checking every waiting frame
        at every call cost their receiver 150 us a call at world 4."""
        for key, queue in self.unexpected.items():
            if key[0] == comm_id and key[2] == LINK_TAG and queue:
                self.stray(comm_id, key[1], queue[0].header.tag)

    @staticmethod
    def _deliver(r: Recv, msg: Message) -> None:
        if r.dest is None:
            r.array = msg.array
        else:
            r.dest[:] = msg.buf
        r.done = True

    def target_for(self, h: wire.FrameHeader, src: int) -> tuple[Recv | Message, memoryview]:
        """The receive (or a new unexpected message) a DATA, RTS or ARRAY frame goes to."""
        tag = h.tag
        key = (h.comm_id, src, LINK_TAG if tag < LINK_TAG else tag)
        queue = self.posted.get(key)
        r = None
        if queue:
            r = queue.popleft()
            if not queue:
                del self.posted[key]
        elif tag >= 0:
            any_queue = self.posted_any.get((h.comm_id, tag))
            if any_queue:
                r = any_queue.popleft()
                if not any_queue:
                    del self.posted_any[(h.comm_id, tag)]
        if r is not None:
            self._check_match(r, h, src)
            r.source = src
            if r.dest is not None:
                return r, r.dest
            r.array = np.empty(h.shape, h.dtype)  # type: ignore[arg-type]
            return r, as_bytes(r.array, writable=True)
        if tag < LINK_TAG:
            self.stray(h.comm_id, src, tag)
        msg = Message(h, src)
        if h.kind == wire.ARRAY:
            msg.array = np.empty(h.shape, h.dtype)  # type: ignore[arg-type]
            msg.buf = as_bytes(msg.array, writable=True)
        else:
            msg.buf = memoryview(bytearray(h.length))
        self.unexpected.setdefault(key, deque()).append(msg)
        return msg, msg.buf

    def payload_done(self, current: object) -> None:
        """A frame's payload is in: complete its receive (or its unexpected message)."""
        if type(current) is Recv:
            current.done = True
            self.progress.pending -= 1
        elif type(current) is Message:
            current.done = True
            waiter = current.waiter
            if waiter is not None:
                self._deliver(waiter, current)
                self.progress.pending -= 1

    def waits_for(self, peer: int) -> bool:
        """Whether a posted receive waits for a frame of ``peer``."""
        return any(key[1] == peer and q for key, q in self.posted.items())

    def forget(self, comm_id: int) -> None:
        """Drop the frames kept for communicator ``comm_id`` (it closed)."""
        for key in [k for k in self.unexpected if k[0] == comm_id]:
            del self.unexpected[key]

    def clear(self) -> None:
        """Drop every posted receive (the transport broke)."""
        self.posted.clear()
        self.posted_any.clear()
