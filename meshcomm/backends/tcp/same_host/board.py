"""Small all_reduces among same-host ranks through a board of slots.

All_reduces of the world communicator below the CMA collectives' threshold
(:mod:`~meshcomm.backends.tcp.same_host.cma_collectives`, 256 KiB) and up to :func:`board_max` bytes
(256 KiB), when every member is a shared-memory peer, skip the rings. Each process's
doorbell page (:mod:`~meshcomm.backends.tcp.same_host.doorbell`), which every same-host peer already
maps, carries a **board**: a sequence word and two slots of ``BOARD_BYTES``. Call ``k`` on
rank ``r``:

1. copy the contribution into slot ``k % 2`` of its own board, then store ``k`` in its
   sequence word (the store that publishes the bytes: TSO keeps the order);
2. ring every peer that is asleep (its doorbell's may-be-asleep flag, read after a fence:
   the doorbell protocol, so no wake-up is lost);
3. wait until every member's sequence word is ``>= k``;
4. combine slot ``k % 2`` of every member, in rank order, into the result: every rank computes
   the same bytes from the same operands in the same order.

One round and no message: a ring message costs a header, two ring updates and a match on
each side, and the step-by-step algorithms chain two or more of them per call, which with
more ranks than cores means as many waits for a descheduled peer. Measured at 4 ranks on the
2-core VM, an 8-byte all_reduce spent ~190 us of CPU per rank (wall ~400 us), most of it in
the rings' Python on both sides of two recursive-doubling steps, against ~75 us on the board
(wall 105-170 us); a bare loop of the same protocol takes 19 us. Two slots suffice: a rank
that writes slot ``k % 2`` for call ``k`` has seen every member's ``k - 1``, so every member
has finished reading call ``k - 2``; a member that is already at ``k + 1`` writes the other
slot.

Waiting is the transport's one wait loop (:class:`~meshcomm.backends.tcp.waiting.Waiter`)
with "every member's sequence word is ``>= k``" as its predicate: it polls the words, giving
the core away between polls for the spin budget, then sleeps on the doorbell, and keeps the
rings and sockets moving meanwhile: a peer's EOF raises :class:`~meshcomm.errors.PeerError` naming
it, no new arrival for the timeout raises :class:`~meshcomm.errors.CommTimeout`, and an abort
record of another rank is seen within about a second.

Every member must take this path for the same calls, so the choice depends only on the size
(the same on every rank) and on a verdict agreed once, on the first call that could use it
(the communicator asks :meth:`BoardAllReduce.local_ok` of every member). Only the world
communicator uses the board (one per process); sub-communicators run the algorithms.

Knob: ``MESHCOMM_SHM_BOARD_MAX`` (bytes, at most ``BOARD_BYTES``; ``0``: never), read once at
import; set it alike on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np

from meshcomm.backends.algorithms._common import ufunc_of
from meshcomm.backends.tcp.faults import Faults
from meshcomm.backends.tcp.matching import Matching
from meshcomm.backends.tcp.same_host.doorbell import (
    BOARD_BYTES,
    BOARD_OFFSET,
    BOARD_SEQ_WORD,
    BOARD_STAMP_WORD,
    Bell,
)
from meshcomm.backends.tcp.same_host.engine import ShmEngine
from meshcomm.backends.tcp.same_host.platform import SharedMapping
from meshcomm.backends.tcp.waiting import Progress, Waiter
from meshcomm.errors import CommError, InvalidArgument
from meshcomm.reduction import ReduceOp

__all__ = ["BOARD_BYTES", "Board", "BoardAllReduce", "board_max"]


def _env_max() -> int:
    raw = os.environ.get("MESHCOMM_SHM_BOARD_MAX", "").strip()
    if not raw:
        return BOARD_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= BOARD_BYTES:
        raise InvalidArgument(
            f"MESHCOMM_SHM_BOARD_MAX must be an integer in [0, {BOARD_BYTES}], got {raw!r}"
        )
    return value


_ENV_MAX = _env_max()
#: How many call signatures' slot views a board keeps.
_VIEWS_KEPT = 64
#: Polls of a late member's word before the wait loop (a few microseconds).
_QUICK_POLLS = range(48)
#: Every member's slot views of one signature: ``[parity][member]``.
_Views = tuple[tuple[np.ndarray, ...], ...]


def board_max() -> int:
    """The largest all_reduce buffer (bytes) that takes the board; 0: never.

    Example:
        >>> 0 <= board_max() <= BOARD_BYTES
        True
    """
    return _ENV_MAX


class Board:
    """The boards of one communicator's members, mapped in this process.

    Attributes:
        members: the members' global ranks, by communicator rank.
        rank: this process's communicator rank.
        seq: the number of board calls so far (the same on every member).
        peer_bells: the other members' doorbells (rung when their owner may be asleep).
        fence: a full memory fence (our sequence word before the loads of their flags).
        last: the last call signature's dtype, shape and :meth:`views`.
        last_op: the last op and its ufunc (:meth:`ufunc`).
    """

    def __init__(
        self,
        members: Sequence[int],
        rank: int,
        mappings: Sequence[SharedMapping],
        peer_bells: Sequence[Bell] = (),
        fence: Callable[[], object] = lambda: None,
    ) -> None:
        self.members = tuple(members)
        self.rank = rank
        self.seq = 0
        self.peer_bells = tuple(peer_bells)
        self.fence = fence
        # Views of our own (holding them keeps a mapping alive if a peer's goes away under us:
        # its bytes are then read, never a closed map).
        self.slots: list[tuple[np.ndarray, np.ndarray]] = []
        self.seqs: list[memoryview] = []
        self.stamps: list[memoryview] = []
        # The others' communicator ranks (their stamps are compared with ours).
        self.others = [j for j in range(len(self.members)) if j != rank]
        # Typed views of every member's slots by (dtype, shape): a call signature's views are
        # made once, not three per call (at 8 bytes each costs as much as the copy it serves).
        self._views: dict[tuple[np.dtype, tuple[int, ...]], _Views] = {}
        # The last signature's, compared by identity and tuple equality (hashing a dtype
        # costs more than the comparison).
        self.last: tuple[np.dtype | None, tuple[int, ...], _Views] = (None, (), ((), ()))
        # The last op's ufunc (a ReduceOp hashes in Python, so a dict lookup is a call).
        self.last_op: tuple[ReduceOp | None, np.ufunc] = (None, np.add)
        for m in mappings:
            raw = m.data(BOARD_OFFSET, 2 * BOARD_BYTES)
            arr = np.frombuffer(raw, np.uint8)
            self.slots.append((arr[:BOARD_BYTES], arr[BOARD_BYTES:]))
            word = m.data(8 * BOARD_SEQ_WORD, 8).cast("Q")
            self.seqs.append(word)
            self.stamps.append(m.data(8 * BOARD_STAMP_WORD, 16).cast("Q"))
        self.seq = int(self.seqs[rank][0])  # 0 for a new doorbell; the same on all members

    def views(self, dtype: np.dtype, shape: tuple[int, ...]) -> _Views:
        """Every member's slot ``0`` and ``1`` as arrays of ``dtype`` and ``shape`` (at most
        ``BOARD_BYTES``): ``views(...)[parity][member]``."""
        last = self.last
        if last[0] is dtype and last[1] == shape:
            return last[2]
        key = (dtype, shape)
        got = self._views.get(key)
        if got is None:
            if len(self._views) >= _VIEWS_KEPT:
                self._views.clear()  # many signatures: start over rather than grow
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            got = self._views[key] = tuple(
                tuple(s[p][:nbytes].view(dtype).reshape(shape) for s in self.slots) for p in (0, 1)
            )
        self.last = (dtype, shape, got)
        return got

    def ufunc(self, op: ReduceOp) -> np.ufunc:
        """The ufunc that combines two operands of ``op`` (a primitive op)."""
        last = self.last_op
        if last[0] is op:
            return last[1]
        ufunc = ufunc_of(op)
        self.last_op = (op, ufunc)
        return ufunc


class BoardAllReduce:
    """The board all_reduce of one transport (see the module docstring).

    Args:
        rank: this process's global rank.
        rings: the ring engine (the doorbell, which peers share memory).
        matching: the stamps of the mismatch checks.
        faults: the failure path (members gone).
        progress: the transport's counters.
        waiter: the transport's wait loop.
    """

    def __init__(
        self,
        rank: int,
        rings: ShmEngine,
        matching: Matching,
        faults: Faults,
        progress: Progress,
        waiter: Waiter,
    ) -> None:
        self.rank = rank
        self.board: Board | None = None
        self._rings = rings
        self._matching = matching
        self._faults = faults
        self._progress = progress
        self._waiter = waiter

    # -- agreement --------------------------------------------------------------------------
    def local_ok(self, members: Sequence[int]) -> bool:
        """Whether this process could run board calls among ``members`` (global ranks):
        every other member is a shared-memory peer whose doorbell we map, no other
        communicator owns this process's board, and the platform orders plain loads and
        stores (x86-64) and has a fence."""
        bell = self._rings.doorbell
        if bell is None or self.board is not None:
            return False
        if not bell.plain_memory:
            return False
        shm = self._rings.peers
        return all(g == self.rank or (g in shm and bell.peer_bell(g) is not None) for g in members)

    def open(self, members: Sequence[int], rank: int) -> Board:
        """Map the board of every member (after every member said :meth:`local_ok`)."""
        bell = self._rings.doorbell
        if bell is None:  # pragma: no cover - local_ok said there is one
            raise CommError(f"rank {self.rank}: no doorbell to hold a board")
        bells = [bell.own_bell() if g == self.rank else bell.peer_bell(g) for g in members]
        mappings = [b.mapping for b in bells if b is not None]
        if len(mappings) != len(bells):  # pragma: no cover - local_ok said they exist
            raise CommError(f"rank {self.rank}: a member's doorbell is not mapped")
        peers = [b for g, b in zip(members, bells, strict=True) if g != self.rank and b]
        self.board = Board(members, rank, mappings, peers, bell.own_bell().fence)
        return self.board

    # -- the call ---------------------------------------------------------------------------
    def run(
        self, board: Board, send: np.ndarray, recv: np.ndarray, op: ReduceOp, stamp: int | None
    ) -> None:
        """Reduce ``send`` of every member into ``recv`` (C-contiguous, of one dtype and
        shape, at most ``BOARD_BYTES``; ``send`` may be ``recv``); the transport holds its
        lock.

        ``stamp``: the call's stamp (:mod:`meshcomm.diagnostics.fingerprint`), or None. It goes next
        to the contribution; every member compares every member's after the wait, and a
        link frame of the world that arrives meanwhile (a rank that took the rings for this
        call: a different size) is checked against it.

        Raises:
            MismatchError: a member's stamp differs from ours.
            CommTimeout: no member arrived for the timeout.
            PeerError: a member died or closed (names its global rank).
        """
        matching = self._matching
        if stamp is None:
            matching.stamped = None
            mark = 0
        else:
            matching.stamped = (0, -2 - stamp)  # the world's communicator id
            if matching.unexpected:
                matching.scan_strays(0)
            mark = stamp + 1
        gone = self._faults.gone
        if gone:
            for g in board.members:
                if g in gone:
                    raise self._faults.gone_error(g, "all_reduce with")
        k = board.seq + 1
        parity = k & 1
        dtype, shape, last = recv.dtype, recv.shape, board.last
        both = last[2] if last[0] is dtype and last[1] == shape else board.views(dtype, shape)
        views = both[parity]
        me = board.rank
        views[me][...] = send
        board.stamps[me][parity] = mark
        board.seqs[me][0] = k  # publishes the bytes above (TSO: stores stay in order)
        board.seq = k
        board.fence()  # our word before the loads of the peers' flags (Dekker)
        for pb in board.peer_bells:
            if not pb.mapping.closed and pb.sleepy():  # pb.armed(), without its frame
                pb.ring()
        seqs = board.seqs
        for j in board.others:
            word = seqs[j]
            if word[0] < k:
                # A member a little behind (the usual case where every rank has a core) is
                # met by a few plain polls, without the wait loop's setup.
                for _ in _QUICK_POLLS:
                    if word[0] >= k:
                        break
                else:
                    self._wait(board, k)
                    break
        if mark:
            stamps = board.stamps
            for j in board.others:
                theirs = stamps[j][parity]
                if theirs != mark and theirs:
                    raise matching.mismatch(0, board.members[j], -2 - (theirs - 1))
        last_op = board.last_op
        ufunc = last_op[1] if last_op[0] is op else board.ufunc(op)
        ufunc(views[0], views[1], recv)  # out positionally: no keyword to parse
        for j in range(2, len(views)):
            ufunc(recv, views[j], recv)

    def _wait(self, board: Board, k: int) -> None:
        seqs = board.seqs
        missing = [j for j in range(len(board.members)) if seqs[j][0] < k]
        if not missing:
            return
        members = board.members
        gone = self._faults.gone
        progress = self._progress

        def arrived() -> bool:
            nonlocal missing
            still = [j for j in missing if seqs[j][0] < k]
            if not still:
                return True
            if len(still) < len(missing):
                progress.moved = True  # a member arrived: progress
                missing = still
            for j in still:
                if members[j] in gone:
                    raise self._faults.gone_error(members[j], "wait for")
            return False

        def stalled() -> str:
            late = [members[j] for j in missing]
            return f"all_reduce on the shared-memory board; still waiting for ranks {late}"

        self._waiter.until(arrived, stalled, poll_always=False, respin=False)
