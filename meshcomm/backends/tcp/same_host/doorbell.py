"""Futex doorbells: how a process sleeps until a same-host peer has work for it.

Each process owns one :class:`Doorbell`, a 32-bit futex word in a shared page; every
same-host peer maps it and rings it when it makes data (or ring space) available and the
owner may be asleep. See :mod:`~meshcomm.backends.tcp.same_host.rings` for the protocol (who rings,
and
why no wake-up is lost).

Example:
    >>> bell = Doorbell("doc", 0, expected_peers=0)
    >>> _ = bell.arm(); bell.wait(0.01)          # nobody rings
    False
    >>> _ = bell.arm(); bell.wake(); bell.wait(0.01)
    True
    >>> bell.close()
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import secrets
import time
from collections.abc import Callable
from datetime import timedelta

from meshcomm.backends.tcp.same_host.platform import (
    BELL_SIZE,
    SEQ_CST,
    Platform,
    Seconds,
    SharedMapping,
    Timespec,
    check_rank,
    create_segment,
    job_token,
    process_start_time,
    require_platform,
    segment_name,
    unlink_segment,
)
from meshcomm.errors import CommError, InvalidArgument

__all__ = [
    "BOARD_BYTES",
    "BOARD_OFFSET",
    "BOARD_SEQ_WORD",
    "BOARD_STAMP_WORD",
    "DEFAULT_SPIN_US",
    "Bell",
    "Doorbell",
    "spin_us_from_env",
]

#: Microseconds a waiter spins before sleeping, when it has a core to itself.
DEFAULT_SPIN_US = 50.0

MAGIC_BELL = int.from_bytes(b"MCSHMBEL", "little")
# The u32 futex word is at offset 0; u64 words 1.. describe the owner; word 8 is the owner's
# "may be asleep" flag (set by arm, cleared when a wait returns).
B_MAGIC, B_RANK, _B_PID, B_NONCE, _B_SLEEPY = 1, 2, 3, 4, 8
#: The owner's board (:mod:`~meshcomm.backends.tcp.same_host.board`): its sequence word (u64 index,
# on a
#: cache line of its own), and two slots of ``BOARD_BYTES`` from byte ``BOARD_OFFSET``.
BOARD_SEQ_WORD = 16
#: The stamps of the owner's board calls, one per slot (u64 indices, on the sequence word's
#: cache line): 0, or 1 + the call's stamp (:mod:`meshcomm.diagnostics.fingerprint`).
BOARD_STAMP_WORD = 17
BOARD_OFFSET = 4096
BOARD_BYTES = (BELL_SIZE - BOARD_OFFSET) // 2
_FUTEX_WAIT = 0
_FUTEX_WAKE_OP = 5
# FUTEX_OP(FUTEX_OP_ADD, 1, FUTEX_OP_CMP_EQ, 0): *word += 1 atomically, then wake.
_WAKE_OP_ADD_ONE = (1 << 28) | (0 << 24) | (1 << 12) | 0
_WAKE_ALL = 0x7FFFFFFF


def _no_fence() -> None:
    """The fence of a platform without one (its peers do not share plain memory)."""


class Bell:
    """A mapped doorbell word (our own or a peer's)."""

    def __init__(self, mapping: SharedMapping, plat: Platform, rank: int) -> None:
        self.mapping = mapping
        self.rank = rank
        self._syscall = plat.syscall
        #: A full memory fence (a no-op where the platform has none): a C-level callable,
        #: no Python frame, for the board's every call.
        self.fence: Callable[[], object] = (
            _no_fence if plat.fence is None else functools.partial(plat.fence, SEQ_CST)
        )
        #: The owner's may-be-asleep flag, read in place (:meth:`armed` without its frame;
        #: check ``mapping.closed`` first).
        self.sleepy: Callable[[], int] = functools.partial(mapping.load, _B_SLEEPY)
        self._nr = ctypes.c_long(plat.sys_futex)
        self._addr = ctypes.c_void_p(mapping.addr)
        self._wake_args = (
            self._nr,
            self._addr,
            ctypes.c_long(_FUTEX_WAKE_OP),
            ctypes.c_long(_WAKE_ALL),
            ctypes.c_long(0),  # nr_wake2 travels in the timeout slot
            self._addr,
            ctypes.c_long(_WAKE_OP_ADD_ONE),
        )

    def value(self) -> int:
        return self.mapping.load_word()

    def armed(self) -> bool:
        """The owner's may-be-asleep flag (meaningful after a fence)."""
        return not self.mapping.closed and self.sleepy() != 0

    def ring(self) -> None:
        if self.mapping.closed:
            return
        rc = self._syscall(*self._wake_args)
        if rc < 0:
            err = ctypes.get_errno()
            raise CommError(f"futex wake of rank {self.rank}'s doorbell failed: {os.strerror(err)}")

    def futex_wait(self, expected: int, seconds: float) -> int:
        """Sleep while the word equals ``expected``; return 0 or the errno."""
        whole = int(seconds)
        ts = Timespec(whole, int((seconds - whole) * 1e9))
        rc = self._syscall(
            self._nr,
            self._addr,
            ctypes.c_long(_FUTEX_WAIT),
            ctypes.c_long(expected),
            ctypes.byref(ts),
            ctypes.c_void_p(None),
            ctypes.c_long(0),
        )
        return 0 if rc == 0 else ctypes.get_errno()


def _wait_seconds(timeout: Seconds) -> float:
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise InvalidArgument(f"timeout must be seconds or a timedelta, got {timeout!r}")
    if not seconds >= 0 or seconds == float("inf"):
        raise InvalidArgument(f"timeout must be finite and >= 0 seconds, got {seconds!r}")
    return seconds


def spin_us_from_env() -> float | None:
    """``MESHCOMM_SHM_SPIN_US``: microseconds a waiter polls before sleeping; None: unset.

    Raises:
        InvalidArgument: it is not a number in [0, 1e6].

    Example:
        >>> spin_us_from_env() is None or spin_us_from_env() >= 0
        True
    """
    raw = os.environ.get("MESHCOMM_SHM_SPIN_US", "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1e6:
        raise InvalidArgument(f"MESHCOMM_SHM_SPIN_US must be in [0, 1e6], got {raw!r}")
    return value


def _default_spin(local_size: int | None) -> float:
    value = spin_us_from_env()
    if value is not None:
        return value
    if local_size is None or local_size > len(os.sched_getaffinity(0)):
        return 0.0  # more ranks than cores: a spinning waiter steals the core its peer needs
    return DEFAULT_SPIN_US


class Doorbell:
    """This process's futex doorbell, plus the doorbells of the same-host peers it rings.

    Args:
        job: the job token (bytes, e.g. the 16-byte token of the wire handshake, or a short
            string of ``[A-Za-z0-9_-]``); segment names carry it.
        rank: this process's global rank.
        local_size: ranks on this host; the waiter spins only when they fit the cores.
        expected_peers: how many same-host peers will pair with this process. The name is
            unlinked as soon as one peer reached the doorbell through ``/proc`` (then all
            can), else once this many handshakes ended; None: only then, or at :meth:`seal`
            or close.
        spin_us: microseconds :meth:`wait` polls before sleeping (default: 50 when
            ``local_size`` ranks fit this process's cores, else 0; ``MESHCOMM_SHM_SPIN_US``).

    Raises:
        CommError: shared memory is unsupported here or ``/dev/shm`` is full.
        InvalidArgument: a bad job token, rank or count.

    Example:
        >>> bell = Doorbell("doc", 0, expected_peers=0)
        >>> _ = bell.arm(); bell.wait(0.01)          # nobody rings
        False
        >>> _ = bell.arm(); bell.wake(); bell.wait(0.01)
        True
        >>> bell.close()
    """

    def __init__(
        self,
        job: str | bytes,
        rank: int,
        *,
        local_size: int | None = None,
        expected_peers: int | None = None,
        spin_us: float | None = None,
    ) -> None:
        self.job = job_token(job)
        self.rank = check_rank(rank, "rank")
        if local_size is not None and (not isinstance(local_size, int) or local_size < 1):
            raise InvalidArgument(f"local_size must be a positive int, got {local_size!r}")
        if expected_peers is not None and (
            not isinstance(expected_peers, int)
            or isinstance(expected_peers, bool)
            or expected_peers < 0
        ):
            raise InvalidArgument(f"expected_peers must be an int >= 0, got {expected_peers!r}")
        if spin_us is not None and not 0 <= spin_us <= 1e6:
            raise InvalidArgument(f"spin_us must be in [0, 1e6], got {spin_us!r}")
        self._spin = (_default_spin(local_size) if spin_us is None else spin_us) * 1e-6
        self._plat = require_platform()
        self.pid = os.getpid()
        self.start_time = process_start_time(self.pid)
        self.nonce = secrets.randbits(64)
        self.name = segment_name(self.job, "bell", self.rank, None, self.pid, self.nonce)
        mapping = create_segment(self.name, BELL_SIZE, self._plat, keep_fd=True)
        for index, value in (
            (B_MAGIC, MAGIC_BELL),
            (B_RANK, self.rank),
            (_B_PID, self.pid),
            (B_NONCE, self.nonce),
        ):
            mapping.store(index, value)
        self._own = Bell(mapping, self._plat, self.rank)
        self._linked = True
        self._expected = expected_peers
        self._acks = 0
        self._peers: dict[int, Bell] = {}
        self._armed = self._own.value()
        self._is_armed = False
        self.closed = False
        if expected_peers == 0:
            self.seal()

    def arm(self) -> int:
        """Declare "about to sleep": call it *before* the last check of the channels.

        Sets this process's may-be-asleep flag (so channels ring it) and snapshots the
        doorbell value that :meth:`wait` compares against. Arm only when a pass over the
        channels made no progress: while armed, every publication to us costs the peer a
        syscall. :meth:`wait` (or :meth:`disarm`) clears it.

        Returns:
            The snapshot.
        """
        mapping = self._own.mapping
        mapping.store(_B_SLEEPY, 1)
        self._own.fence()  # the flag store before the channel loads that follow (Dekker)
        self._armed = self._own.value()
        self._is_armed = True
        return self._armed

    def disarm(self) -> None:
        """Clear the may-be-asleep flag without waiting (the last check found work)."""
        self._is_armed = False
        self._own.mapping.store(_B_SLEEPY, 0)

    def wait(self, timeout: Seconds) -> bool:
        """Sleep until the doorbell rang since :meth:`arm`, or ``timeout`` passed; disarm.

        Spins for ``spin_us`` first, then sleeps in ``FUTEX_WAIT`` (no CPU). A ring that
        happened between :meth:`arm` and this call returns at once; so does a wait that was
        not armed (its caller must go round its loop and arm).

        Args:
            timeout: seconds (or a timedelta) >= 0; 0 only polls.

        Returns:
            True if the doorbell rang, False if the timeout expired first.

        Raises:
            InvalidArgument: a negative or non-finite timeout.
            CommError: the doorbell is closed or the futex call failed.
        """
        seconds = _wait_seconds(timeout)
        if self.closed:
            raise CommError(f"rank {self.rank}: wait on a closed doorbell")
        if not self._is_armed:
            return True
        try:
            return self._wait(seconds)
        finally:
            self.disarm()

    def _wait(self, seconds: float) -> bool:
        bell, seen = self._own, self._armed
        if bell.value() != seen:
            return True
        if self._spin > 0:
            end = time.perf_counter() + min(self._spin, seconds)
            while time.perf_counter() < end:
                if bell.value() != seen:
                    return True
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bell.value() != seen
            err = bell.futex_wait(seen, remaining)
            if bell.value() != seen:
                return True
            if err == errno.ETIMEDOUT:
                return False
            if err not in (0, errno.EINTR, errno.EAGAIN):
                raise CommError(f"rank {self.rank}: futex wait failed: {os.strerror(err)}")

    def ring(self, rank: int) -> None:
        """Ring the doorbell of same-host peer ``rank`` (channels do this themselves).

        Raises:
            InvalidArgument: no shared-memory pair with ``rank`` exists.
        """
        bell = self._peers.get(rank)
        if bell is None:
            raise InvalidArgument(
                f"rank {self.rank}: no shared-memory peer {rank}; peers: {sorted(self._peers)}"
            )
        bell.ring()

    def wake(self) -> None:
        """Ring this process's own doorbell (from another thread, or to cut a wait short)."""
        self._own.ring()

    def peer_bell(self, rank: int) -> Bell | None:
        """The mapped doorbell of same-host peer ``rank`` (None: no pair with it)."""
        return self._peers.get(rank)

    def own_bell(self) -> Bell:
        """This process's own doorbell word and page."""
        return self._own

    @property
    def plain_memory(self) -> bool:
        """Whether plain loads and stores of shared words are ordered (x86-64 TSO, so no
        libatomic is in use) and a full fence is at hand: what the board needs."""
        return self._plat.atomics is None and self._plat.fence is not None

    def seal(self) -> None:
        """Unlink the doorbell's name: no further peer can pair with this process."""
        if self._linked:
            self._linked = False
            unlink_segment(self.name)

    def close(self) -> None:
        """Unlink the name and unmap this doorbell and every peer's. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.seal()
        for bell in self._peers.values():
            bell.mapping.close()
        self._peers.clear()
        self._own.mapping.close()

    def __enter__(self) -> Doorbell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _handshake_done(self) -> None:
        self._acks += 1
        if self._expected is not None and self._acks >= self._expected:
            self.seal()

    def _attach(self, rank: int, bell: Bell) -> None:
        old = self._peers.pop(rank, None)
        if old is not None and old is not bell:
            old.mapping.close()
        self._peers[rank] = bell

    def _detach(self, rank: int, bell: Bell) -> None:
        if self._peers.get(rank) is bell:
            del self._peers[rank]
        bell.mapping.close()

    def __repr__(self) -> str:
        return f"Doorbell(job={self.job!r}, rank={self.rank}, peers={sorted(self._peers)})"
