"""Small all_reduces among same-host ranks through a board of slots (a transport mixin).

All_reduces of the world communicator below the direct path's threshold
(:mod:`~meshcomm.backends.tcp.direct`, 256 KiB) and up to :func:`board_max` bytes (256 KiB),
when every member is a shared-memory peer, skip the rings. Each process's
doorbell page (:mod:`~meshcomm.backends.tcp.doorbell`), which every same-host peer already
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

Waiting polls the sequence words, giving the core away between polls (``sched_yield``) for the
engine's spin budget, then sleeps on the doorbell, as the ring engine does, and keeps the rings
and sockets moving meanwhile: a peer's EOF raises :class:`~meshcomm.errors.PeerError` naming
it, no new arrival for the timeout raises :class:`~meshcomm.errors.CommTimeout`, and an abort
record of another rank is seen within about a second.

Every member must take this path for the same calls, so the choice depends only on the size
(the same on every rank) and on a verdict agreed once, on the first call that could use it
(:meth:`BoardEngine.board_agree`). Only the world communicator uses the board (one per
process); sub-communicators run the algorithms.

Knob: ``MESHCOMM_SHM_BOARD_MAX`` (bytes, at most ``BOARD_BYTES``; ``0``: never), read once at
import; set it alike on every rank.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from meshcomm.backends.algorithms._common import combine_into
from meshcomm.backends.tcp.doorbell import (
    BOARD_BYTES,
    BOARD_OFFSET,
    BOARD_SEQ_WORD,
    BOARD_STAMP_WORD,
    _Bell,
)
from meshcomm.backends.tcp.matching import Recv, Send
from meshcomm.backends.tcp.shm_engine import ShmEngine
from meshcomm.backends.tcp.shm_platform import _Mapping
from meshcomm.errors import CommError, CommTimeout, InvalidArgument
from meshcomm.reduction import ReduceOp

__all__ = ["BOARD_BYTES", "Board", "BoardEngine", "board_max"]


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
    """

    def __init__(self, members: Sequence[int], rank: int, mappings: Sequence[_Mapping]) -> None:
        self.members = tuple(members)
        self.rank = rank
        self.seq = 0
        # Views of our own (holding them keeps a mapping alive if a peer's goes away under us:
        # its bytes are then read, never a closed map).
        self.slots: list[tuple[np.ndarray, np.ndarray]] = []
        self.seqs: list[memoryview] = []
        self.stamps: list[memoryview] = []
        # The others' communicator ranks (their stamps are compared with ours).
        self.others = [j for j in range(len(self.members)) if j != rank]
        for m in mappings:
            raw = m.data(BOARD_OFFSET, 2 * BOARD_BYTES)
            arr = np.frombuffer(raw, np.uint8)
            self.slots.append((arr[:BOARD_BYTES], arr[BOARD_BYTES:]))
            word = m.data(8 * BOARD_SEQ_WORD, 8).cast("Q")
            self.seqs.append(word)
            self.stamps.append(m.data(8 * BOARD_STAMP_WORD, 16).cast("Q"))
        self.seq = int(self.seqs[rank][0])  # 0 for a new doorbell; the same on all members


class BoardEngine(ShmEngine):
    """The board all_reduce of the transport (a mixin; see the module docstring)."""

    _board: Board | None
    _lock: threading.Lock
    _failure: CommError | None
    _closed: bool
    _gone: dict[int, str]
    _last_socket_poll: float
    _last_abort_check: float
    timeout: float

    def _select(self, timeout: float) -> None:
        raise NotImplementedError  # the transport's

    def _check_abort(self) -> None:
        raise NotImplementedError

    def _run(self, sends: list[Send], recvs: list[Recv], what: str, comm_id: int) -> None:
        raise NotImplementedError

    def _fail(self, exc: BaseException, what: str) -> None:
        raise NotImplementedError

    # -- agreement --------------------------------------------------------------------------
    def board_local_ok(self, members: Sequence[int]) -> bool:
        """Whether this process could run board calls among ``members`` (global ranks):
        every other member is a shared-memory peer whose doorbell we map, no other
        communicator owns this process's board, and the platform orders plain loads and
        stores (x86-64) and has a fence."""
        bell = self._bell
        if bell is None or self._board is not None:
            return False
        if not bell.plain_memory:
            return False
        shm = self._shm
        return all(g == self.rank or (g in shm and bell.peer_bell(g) is not None) for g in members)

    def board_open(self, members: Sequence[int], rank: int) -> Board:
        """Map the board of every member (after every member said :meth:`board_local_ok`)."""
        bell = self._bell
        if bell is None:  # pragma: no cover - board_local_ok said there is one
            raise CommError(f"rank {self.rank}: no doorbell to hold a board")
        bells = [bell.own_bell() if g == self.rank else bell.peer_bell(g) for g in members]
        mappings = [b.mapping for b in bells if b is not None]
        if len(mappings) != len(bells):  # pragma: no cover - board_local_ok said they exist
            raise CommError(f"rank {self.rank}: a member's doorbell is not mapped")
        self._board = Board(members, rank, mappings)
        return self._board

    # -- the call ---------------------------------------------------------------------------
    def board_all_reduce(
        self, send: np.ndarray, recv: np.ndarray, op: ReduceOp, stamp: int | None = None
    ) -> None:
        """Reduce ``send`` of every member into ``recv`` (flat, same dtype and size, at most
        ``BOARD_BYTES``; ``send`` may be ``recv``).

        ``stamp``: the call's stamp (:mod:`meshcomm._fingerprint`), or None. It goes next
        to the contribution; every member compares every member's after the wait, and a
        link frame of the world that arrives meanwhile (a rank that took the rings for this
        call: a different size) is checked against it.

        Raises:
            MismatchError: a member's stamp differs from ours.
            CommTimeout: no member arrived for the timeout.
            PeerError: a member died or closed (names its global rank).
        """
        if not self._lock.acquire(timeout=self.timeout):
            raise CommTimeout(
                f"rank {self.rank}: all_reduce waited {self.timeout:g} s for another thread's "
                "operation on this transport"
            )
        try:
            board = self._board
            if self._failure is not None or self._closed or board is None:
                self._run([], [], "all_reduce", 0)  # raises the reason
                raise CommError(f"rank {self.rank}: all_reduce: no board")  # pragma: no cover
            self._npending = 0
            try:
                if stamp is None:
                    self._stamped = None
                    self._board_run(board, send, recv, op, 0)
                else:
                    self._stamped = (0, -2 - stamp)  # the world's communicator id
                    if self._unexpected:
                        self._scan_strays(0)
                    self._board_run(board, send, recv, op, stamp + 1)
            except BaseException as exc:
                self._fail(exc, "all_reduce")
                raise
        finally:
            self._lock.release()

    def _board_run(
        self, board: Board, send: np.ndarray, recv: np.ndarray, op: ReduceOp, mark: int
    ) -> None:
        for g in board.members:
            if g in self._gone:
                raise self._gone_error(g, "all_reduce with")
        k = board.seq + 1
        parity = k & 1
        me = board.rank
        nbytes = recv.nbytes
        board.slots[me][parity][:nbytes] = send.view(np.uint8)
        board.stamps[me][parity] = mark
        board.seqs[me][0] = k  # publishes the bytes above (TSO: stores stay in order)
        board.seq = k
        bell = self._bell
        assert bell is not None  # a board exists only with a doorbell
        bell.own_bell().fence()  # our word before the loads of the peers' flags (Dekker)
        for g in board.members:
            if g != self.rank:
                pb: _Bell | None = bell.peer_bell(g)
                if pb is not None and pb.armed():
                    pb.ring()
        self._board_wait(board, k)
        if mark:
            stamps = board.stamps
            for j in board.others:
                theirs = stamps[j][parity]
                if theirs != mark and theirs:
                    raise self._mismatch(0, board.members[j], -2 - (theirs - 1))
        dtype = recv.dtype
        slots = board.slots
        combine_into(
            op, slots[0][parity][:nbytes].view(dtype), slots[1][parity][:nbytes].view(dtype), recv
        )
        for j in range(2, len(board.members)):
            combine_into(op, recv, slots[j][parity][:nbytes].view(dtype), recv)

    def _board_missing(self, board: Board, k: int, missing: list[int]) -> list[int]:
        seqs = board.seqs
        return [j for j in missing if seqs[j][0] < k]

    def _board_wait(self, board: Board, k: int) -> None:
        missing = self._board_missing(board, k, list(range(len(board.members))))
        if not missing:
            return
        clock = time.monotonic
        pause = os.sched_yield
        timeout = self.timeout
        start = last_progress = clock()
        spinner = self._spinner
        spin_until = start + min(spinner.budget, spinner.limit(start))
        bell = self._bell
        assert bell is not None
        shm_list = self._shm_list
        members = board.members
        while True:
            now = clock()
            if self._progressed:
                self._progressed = False
                last_progress = now
            idle = now - last_progress
            if idle >= timeout:
                late = [members[j] for j in missing]
                raise CommTimeout(
                    f"rank {self.rank}: no progress for {timeout:g} s in all_reduce on the "
                    f"shared-memory board; still waiting for ranks {late}"
                )
            if now - self._last_socket_poll >= _SOCKET_POLL:
                self._last_socket_poll = now
                self._select(0)
                for j in missing:
                    if members[j] in self._gone:
                        raise self._gone_error(members[j], "wait for")
            since_check = now - max(self._last_abort_check, start)
            if since_check >= _ABORT_CHECK_INTERVAL:
                self._last_abort_check = now
                self._check_abort()
                since_check = 0.0
            for sp in shm_list:
                if sp.rx.moved() or sp.tx.moved():
                    self._poll_shm()  # others' frames keep moving while we wait
                    break
            if now < spin_until:
                pause()
            else:
                bell.arm()
                self._poll_shm()  # marks the rings we wait on, so their writers ring us
                still = self._board_missing(board, k, missing)
                if len(still) == len(missing) and not self._progressed:
                    wait = min(timeout - idle, _ABORT_CHECK_INTERVAL - since_check)
                    bell.wait(max(0.0, min(wait, _SOCKET_POLL)))
                else:
                    bell.disarm()
            still = self._board_missing(board, k, missing)
            if not still:
                return
            if len(still) < len(missing):
                self._progressed = True
                missing = still


# The transport's intervals (kept equal to its own).
_SOCKET_POLL = 0.01
_ABORT_CHECK_INTERVAL = 1.0
