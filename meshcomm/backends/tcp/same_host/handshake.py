"""The handshake that pairs two same-host ranks over shared memory.

Two small strict-JSON messages each way (an offer, then an ack or a nack) travel over the
ranks' socket; see :mod:`~meshcomm.backends.tcp.same_host.rings` for the lifecycle of the names and
:class:`ShmHandshake` for the steps.
"""

from __future__ import annotations

import ctypes
import functools
import json
import secrets
from typing import Any

from meshcomm.backends.tcp.same_host import cma
from meshcomm.backends.tcp.same_host import ring_budget as shm_budget
from meshcomm.backends.tcp.same_host.doorbell import (
    B_MAGIC,
    B_NONCE,
    B_RANK,
    MAGIC_BELL,
    Bell,
    Doorbell,
)
from meshcomm.backends.tcp.same_host.platform import (
    BELL_SIZE,
    MAX_CAPACITY,
    RING_HEADER,
    SEGMENT_NAME_RE,
    W_CAPACITY,
    W_MAGIC,
    W_NONCE,
    W_RECEIVER,
    W_SENDER,
    W_VERSION,
    SharedMapping,
    check_rank,
    create_segment,
    default_capacity,
    host_key,
    open_segment,
    segment_name,
    unlink_segment,
)
from meshcomm.backends.tcp.same_host.ring_channel import ShmChannel, ShmPair
from meshcomm.errors import CommError, InvalidArgument, ProtocolError

__all__ = ["ShmHandshake"]

_VERSION = 2
_MAGIC_RING = int.from_bytes(b"MCSHMRNG", "little")
_MAX_MESSAGE = 4096


_OFFER_FIELDS = {
    "v": int,
    "kind": str,
    "job": str,
    "rank": int,
    "peer": int,
    "pid": int,
    "start": int,
    "host": str,
    "ring": str,
    "ring_nonce": int,
    "cap": int,
    "bell": str,
    "bell_fd": int,
    "bell_nonce": int,
    "probe": int,
}
_ACK_FIELDS = {
    "v": int,
    "kind": str,
    "rank": int,
    "peer": int,
    "ok": bool,
    "proc": bool,
    "cma": bool,
    "reason": str,
}


def _decode(message: bytes, fields: dict[str, type], what: str, rank: int) -> dict[str, Any]:
    """Parse a handshake message strictly: JSON object, exact keys, exact types."""
    if not isinstance(message, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be bytes, got {type(message).__name__}")
    raw = bytes(message)
    if len(raw) > _MAX_MESSAGE:
        raise ProtocolError(f"rank {rank}: shared-memory {what} of {len(raw)} bytes is too long")
    try:
        obj = json.loads(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"rank {rank}: shared-memory {what} is not ASCII JSON") from exc
    if not isinstance(obj, dict) or set(obj) != set(fields):
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise ProtocolError(
            f"rank {rank}: shared-memory {what} must have fields {sorted(fields)}, got {got}"
        )
    for key, kind in fields.items():
        value = obj[key]
        if type(value) is not kind or (isinstance(value, int) and value < 0):
            raise ProtocolError(f"rank {rank}: shared-memory {what} field {key!r} is {value!r}")
    if obj["v"] != _VERSION:
        raise ProtocolError(
            f"rank {rank}: shared-memory {what} version {obj['v']}, this side speaks {_VERSION}"
        )
    return obj


class ShmHandshake:
    """Set up the shared-memory pair between this process and one same-host peer.

    Both ranks run the same steps, exchanging two small ASCII messages over the existing
    socket (or the store)::

        hs = ShmHandshake(bell, peer)          # creates our inbound ring (named)
        send(hs.offer()); peer_offer = recv()
        try:
            hs.accept(peer_offer)              # maps the peer's ring and doorbell, unlinks its name
            send(hs.ack())
        except CommError as exc:
            send(hs.nack(str(exc)))
        pair = hs.complete(recv())             # unlinks our names; CommError if either side failed
        # on any error: hs.close(), and use the socket for this peer

    No byte moves before both names are gone: the peer unlinks our ring's name before its
    ``accept`` returns. Messages are strict JSON, validated field by field; nothing is unpickled.

    Args:
        doorbell: this process's doorbell (its job and rank are used).
        peer: the peer's global rank.
        capacity: bytes of the inbound ring (default :func:`default_capacity`).

    Raises:
        CommError: the ring cannot be created (e.g. ``/dev/shm`` is full).
        InvalidArgument: a bad peer rank or capacity.
    """

    def __init__(self, doorbell: Doorbell, peer: int, *, capacity: int | None = None) -> None:
        self.rank = doorbell.rank
        self.peer = check_rank(peer, "peer")
        if peer == self.rank:
            raise InvalidArgument(f"rank {self.rank}: cannot pair with itself")
        if doorbell.closed:
            raise CommError(f"rank {self.rank}: handshake with rank {peer} on a closed doorbell")
        cap = default_capacity() if capacity is None else capacity
        if not isinstance(cap, int) or isinstance(cap, bool) or not 1 <= cap <= MAX_CAPACITY:
            raise InvalidArgument(f"capacity must be an int in [1, {MAX_CAPACITY}], got {cap!r}")
        self._bell = doorbell
        self._plat = doorbell._plat
        self.capacity = cap
        self._nonce = secrets.randbits(64)
        # The peer proves it can read our memory by reading this word (see cma).
        self._probe = ctypes.c_uint64(self._nonce)
        self._cma = False
        self._name = segment_name(doorbell.job, "ring", self.rank, peer, doorbell.pid, self._nonce)
        size = RING_HEADER + cap
        if not shm_budget.rings.reserve(size):
            budget = shm_budget.rings
            raise CommError(
                f"rank {self.rank}: a {size}-byte ring for rank {peer} would pass this "
                f"process's shared-memory budget ({budget.in_use} of {budget.limit} bytes in "
                f"use by rings): this pair uses its socket; raise {shm_budget.BUDGET_ENV} or "
                "close groups no longer needed"
            )
        try:
            self._rx: SharedMapping | None = create_segment(self._name, size, self._plat)
        except BaseException:
            shm_budget.rings.release(size)
            raise
        # The ring's bytes go back to the budget when its mapping closes, whoever holds it.
        self._rx.on_close = functools.partial(shm_budget.rings.release, size)
        for index, value in (
            (W_MAGIC, _MAGIC_RING),
            (W_VERSION, _VERSION),
            (W_CAPACITY, cap),
            (W_RECEIVER, self.rank),
            (W_SENDER, peer),
            (W_NONCE, self._nonce),
        ):
            self._rx.store(index, value)
        self._tx: SharedMapping | None = None
        self._peer_bell: Bell | None = None
        self._peer_offer: dict[str, Any] | None = None
        self._via_proc = False
        self._done = False

    def offer(self) -> bytes:
        """The message that tells the peer where our inbound ring and our doorbell are."""
        bell = self._bell
        return json.dumps(
            {
                "v": _VERSION,
                "kind": "offer",
                "job": bell.job,
                "rank": self.rank,
                "peer": self.peer,
                "pid": bell.pid,
                "start": bell.start_time or 0,
                "host": host_key(),
                "ring": self._name,
                "ring_nonce": self._nonce,
                "cap": self.capacity,
                "bell": bell.name,
                "bell_fd": bell._own.mapping.fd or 0,
                "bell_nonce": bell.nonce,
                "probe": ctypes.addressof(self._probe),
            },
            separators=(",", ":"),
        ).encode("ascii")

    def accept(self, peer_offer: bytes) -> None:
        """Map the peer's ring (our sending end) and its doorbell, and unlink the ring's name.

        Raises:
            ProtocolError: the offer is malformed or meant for another job or rank pair.
            CommError: the segments cannot be opened (another host, another ``/dev/shm``).
        """
        if self._rx is None or self._tx is not None:
            raise CommError(f"rank {self.rank}: accept called twice or after close")
        me, job = self.rank, self._bell.job
        obj = _decode(peer_offer, _OFFER_FIELDS, "offer", me)
        expect = {"kind": "offer", "job": job, "rank": self.peer, "peer": me}
        for key, want in expect.items():
            if obj[key] != want:
                raise ProtocolError(
                    f"rank {me}: shared-memory offer from rank {self.peer} has {key} "
                    f"{obj[key]!r}, expected {want!r}"
                )
        if obj["host"] != host_key():
            raise CommError(
                f"rank {me}: rank {self.peer} is on another host or container "
                f"(host key {obj['host']!r}, ours {host_key()!r})"
            )
        ring, bell = SEGMENT_NAME_RE.fullmatch(obj["ring"]), SEGMENT_NAME_RE.fullmatch(obj["bell"])
        ring_ok = ring is not None and ring.group("kind", "job", "rank", "peer") == (
            "ring",
            job,
            str(self.peer),
            str(me),
        )
        bell_ok = bell is not None and bell.group("kind", "job", "rank") == (
            "bell",
            job,
            str(self.peer),
        )
        if not (ring_ok and bell_ok and 1 <= obj["cap"] <= MAX_CAPACITY):
            raise ProtocolError(
                f"rank {me}: shared-memory offer from rank {self.peer} names "
                f"{obj['ring']!r} and {obj['bell']!r} with capacity {obj['cap']}"
            )
        tx = open_segment(obj["ring"], RING_HEADER + obj["cap"], self._plat, unlink=True)
        try:
            header = [tx.load(i) for i in range(6)]
            want = [_MAGIC_RING, _VERSION, obj["cap"], self.peer, me, obj["ring_nonce"]]
            if header != want:
                raise ProtocolError(
                    f"rank {me}: ring {obj['ring']} from rank {self.peer} has header "
                    f"{header}, expected {want}"
                )
            mapping = self._open_bell(obj)
        except BaseException:
            tx.close()
            raise
        self._tx = tx
        self._peer_bell = Bell(mapping, self._plat, self.peer)
        self._peer_offer = obj
        if cma.cma_enabled():
            self._cma = cma.read_word(obj["pid"], obj["probe"]) == obj["ring_nonce"]

    def _open_bell(self, obj: dict[str, Any]) -> SharedMapping:
        """Map the peer's doorbell: through ``/proc/<pid>/fd/<n>`` if we may, else by name."""
        want = [MAGIC_BELL, self.peer, obj["bell_nonce"]]
        try:
            path = f"/proc/{obj['pid']}/fd/{obj['bell_fd']}"
            mapping = open_segment(path, BELL_SIZE, self._plat, unlink=False)
            if [mapping.load(i) for i in (B_MAGIC, B_RANK, B_NONCE)] == want:
                self._via_proc = True
                return mapping
            mapping.close()
        except CommError:
            pass  # another process's descriptors are off limits here: use the name
        mapping = open_segment(obj["bell"], BELL_SIZE, self._plat, unlink=False)
        got = [mapping.load(i) for i in (B_MAGIC, B_RANK, B_NONCE)]
        if got != want:
            mapping.close()
            raise ProtocolError(
                f"rank {self.rank}: doorbell {obj['bell']} of rank {self.peer} has header "
                f"{got}, expected {want}"
            )
        return mapping

    def _reply(self, ok: bool, reason: str) -> bytes:
        return json.dumps(
            {
                "v": _VERSION,
                "kind": "ack",
                "rank": self.rank,
                "peer": self.peer,
                "ok": ok,
                "proc": ok and self._via_proc,
                "cma": ok and self._cma,
                "reason": reason.encode("ascii", "replace").decode()[:1000],
            },
            separators=(",", ":"),
        ).encode("ascii")

    def ack(self) -> bytes:
        """The message that says :meth:`accept` succeeded."""
        if self._peer_offer is None:
            raise CommError(f"rank {self.rank}: ack before a successful accept")
        return self._reply(True, "")

    def nack(self, reason: str) -> bytes:
        """The message that says :meth:`accept` failed, and why (both sides fall back)."""
        return self._reply(False, str(reason))

    def complete(self, peer_ack: bytes) -> ShmPair:
        """Finish after the peer's ack: unlink our names and hand out both channels.

        Raises:
            CommError: the peer (or our own :meth:`accept`) failed; every segment of this
                handshake is released, and the transport uses the socket for this peer.
            ProtocolError: the ack is malformed.
        """
        try:
            obj = _decode(peer_ack, _ACK_FIELDS, "ack", self.rank)
            if (obj["kind"], obj["rank"], obj["peer"]) != ("ack", self.peer, self.rank):
                raise ProtocolError(
                    f"rank {self.rank}: shared-memory ack has kind {obj['kind']!r} from rank "
                    f"{obj['rank']} to rank {obj['peer']}, expected ack from rank {self.peer}"
                )
            if not obj["ok"]:
                raise CommError(
                    f"rank {self.rank}: rank {self.peer} could not map shared memory: "
                    f"{obj['reason']}"
                )
            offer, peer_bell = self._peer_offer, self._peer_bell
            if self._rx is None or self._tx is None or peer_bell is None or offer is None:
                raise CommError(f"rank {self.rank}: complete before a successful accept")
            common: dict[str, Any] = {
                "rank": self.rank,
                "peer": self.peer,
                "peer_pid": offer["pid"],
                "peer_start": offer["start"] or None,
                "peer_bell": peer_bell,
            }
            tx = ShmChannel(self._tx, is_sender=True, capacity=offer["cap"], **common)
            rx = ShmChannel(self._rx, is_sender=False, capacity=self.capacity, **common)
        except BaseException:
            self.close()
            raise
        self._rx = self._tx = None
        self._peer_bell = None
        if obj["proc"]:
            self._bell.seal()  # peers can reach our doorbell without its name
        self._end()
        self._bell._attach(self.peer, peer_bell)
        return ShmPair(
            tx,
            rx,
            self.peer,
            offer["pid"],
            self._bell,
            peer_bell,
            peer_reads_us=obj["cma"],
            we_read_peer=self._cma,
        )

    def _end(self) -> None:
        """Unlink our ring's name; count this handshake toward the doorbell's expected peers."""
        unlink_segment(self._name)
        if not self._done:
            self._done = True
            self._bell._handshake_done()

    def close(self) -> None:
        """Abandon the handshake (no-op after :meth:`complete`): unlink, unmap what is ours.

        Either way the handshake counts toward the doorbell's ``expected_peers``.
        """
        self._end()
        for mapping in (self._rx, self._tx):
            if mapping is not None:
                mapping.close()
        if self._peer_bell is not None:
            self._peer_bell.mapping.close()
        self._rx = self._tx = None
        self._peer_bell = None

    def __enter__(self) -> ShmHandshake:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
