"""Same-host fast path of the tcp backend: byte rings in shared memory, woken by futexes.

Two ranks on one host exchange bytes through two :class:`ShmChannel` rings (one each way)
instead of a loopback socket. A channel is a non-blocking byte stream shaped like a socket
(``send_some`` / ``recv_into_some`` copy what fits or what is there, 0 when they can't), so the
transport's progress engine treats channels and sockets alike. Waiting never spins for long: each
process owns one :class:`Doorbell`, a 32-bit futex word in shared memory that every same-host
peer rings when it makes data (or ring space) available.

Ring layout (one file per direction, created by the receiver)::

    header, 4096 bytes of u64 words, each written by exactly one side:
        0 magic "MCSHMRNG", 1 version, 2 capacity, 3 receiver rank, 4 sender rank, 5 nonce
        8 head (bytes ever written), 9 closed, 10 blocked      (sender's cache line)
        16 tail (bytes ever read), 17 closed, 18 blocked       (receiver's cache line)
    data, ``capacity`` bytes; byte ``i`` of the stream lives at ``i % capacity``

Head and tail are monotonically increasing 64-bit counts, each written by a single process, so
no read-modify-write atomics are needed, only ordering:

* **Memory ordering.** The sender copies bytes, *then* stores head; the receiver loads head,
  *then* copies bytes, *then* stores tail; the sender loads tail before overwriting. On x86-64
  (TSO) plain aligned 8-byte loads and stores give exactly this: stores are not reordered with
  stores, loads not with loads, and a load not with a later store; the copy and the counter store
  happen in separate C calls through pointers, so no compiler may reorder them either. Other
  architectures (aarch64) need release stores and acquire loads: there the counters go through
  libatomic's ``__atomic_store_8(RELEASE)`` / ``__atomic_load_8(ACQUIRE)``; without libatomic,
  :func:`shm_supported` is False and the transport uses sockets.

* **Who rings.** A futex wake is a syscall (and wakes a process that may not care), so a
  publication rings the peer only if the peer both *came up short on this ring at the current
  position* (its "blocked" word, set by a ``send_some`` / ``recv_into_some`` that moved fewer
  bytes than offered) and *may be asleep* (the may-be-asleep flag ``S`` in its doorbell, set by
  :meth:`Doorbell.arm`, cleared when :meth:`Doorbell.wait` returns). Both are Dekker pairs with
  sequentially consistent fences (libatomic's ``atomic_thread_fence``): the short side stores
  its mark (or ``S``), fences, and looks at the ring (the channels) again; the publishing side
  stores its counter, fences, and loads the mark and ``S``. So either the waiter sees the
  publication or the publisher sees both flags and rings. Without that fence (no libatomic)
  every publication rings: correct, one syscall more each. Contract for the engine: before it
  waits for a channel, its last operation on that channel must have come up short (attempt
  the operation; do not pre-filter with :meth:`ShmChannel.readable_bytes`).

* **No lost wake-up.** A waiter (1) arms: sets ``S``, fences, snapshots its doorbell ``v``;
  (2) checks its channels; (3) futex-waits while the word still equals ``v``. A ringer (a)
  publishes, (b) decides to ring as above, (c) rings with ``FUTEX_WAKE_OP``, which increments the
  word atomically and wakes its waiters under the kernel's futex bucket lock; the kernel's
  compare-and-enqueue in (3) takes the same lock. If (c) is ordered before the load of ``v``, (a)
  is visible to (2) (the atomic op orders a before c; TSO or acquire orders the load before 2).
  If (c) comes later, either its locked section runs first and (3) sees a value other than ``v``
  and returns at once, or (3) runs first and is queued when (c) wakes it. A plain
  ``word = word + 1`` from user space would not do: two ringers could both write ``v+1``, the
  later one's publication still in a store buffer while the waiter checks, and the waiter would
  sleep on a word that no longer changes. A lost wake-up needs exactly 2**32 rings between (1)
  and (3), and every wait has a timeout besides.

* **Lifecycle.** Names in ``/dev/shm`` live only while set-up is in flight. The receiver
  creates its ring (``posix_fallocate`` first, so a full ``/dev/shm`` is an error now, not a
  SIGBUS later) and offers its name with its doorbell's; the peer opens the ring, *unlinks the
  name itself* before it moves any byte, and acknowledges; the creator unlinks again after the
  ack (a no-op unless the peer failed halfway). A doorbell is shared with every same-host peer,
  so its owner keeps its descriptor open and peers open ``/proc/<pid>/fd/<n>`` (same user,
  no name needed); the first ack that says so unlinks the doorbell's name. Where ``/proc``
  refuses, peers open it by name, unlinked once ``expected_peers`` handshakes ended (or at
  :meth:`Doorbell.seal` / close). Mappings outlive names, so nothing is left on exit or on
  SIGKILL of either side once set-up is done; a process killed *during* set-up can leave a
  name, which :func:`sweep` removes (names carry the creator's pid). No
  ``multiprocessing.shared_memory``, so no resource tracker is involved.

* **Peer death.** A ring cannot see EOF; :meth:`ShmChannel.peer_alive` checks the peer's pid and
  start time in ``/proc`` (a reused pid or a zombie counts as dead), for the engine to call when a
  wait slice expires. A graceful :meth:`ShmChannel.close` sets the closed word and rings the peer.

A progress engine waits like this (check, arm, check again, then sleep)::

    while pending:
        if step_all_channels():                # send_some / recv_into_some, non-blocking
            continue
        bell.arm()
        if step_all_channels():
            bell.disarm()
            continue
        if not bell.wait(0.1) and not all(pair.peer_alive() for pair in pairs):
            raise PeerError(...)

Channels are not thread-safe; one thread drives all channels of a process (another thread may
call :meth:`Doorbell.wake` to interrupt its wait, e.g. when a socket became readable).

Example:
    >>> a, b = Doorbell("doc", 0, expected_peers=1), Doorbell("doc", 1, expected_peers=1)
    >>> ha, hb = ShmHandshake(a, peer=1, capacity=64), ShmHandshake(b, peer=0, capacity=64)
    >>> ha.accept(hb.offer()); hb.accept(ha.offer())
    >>> pa, pb = ha.complete(hb.ack()), hb.complete(ha.ack())
    >>> pa.tx.send_some(memoryview(b"hello")), pb.rx.readable_bytes()
    (5, 5)
    >>> buf = bytearray(8); pb.rx.recv_into_some(memoryview(buf)), bytes(buf[:5])
    (5, b'hello')
    >>> for thing in (pa, pb, a, b): thing.close()
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import mmap
import os
import platform
import re
import secrets
import stat
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np

from meshcomm.errors import CommError, InvalidArgument, PeerError, ProtocolError

__all__ = [
    "DEFAULT_CAPACITY",
    "Doorbell",
    "ShmChannel",
    "ShmHandshake",
    "ShmPair",
    "default_capacity",
    "host_key",
    "shm_enabled",
    "shm_supported",
    "sweep",
]

#: Bytes of one ring when neither the caller nor ``MESHCOMM_SHM_BYTES`` says otherwise.
DEFAULT_CAPACITY = 4 << 20
#: Upper bound on a ring's capacity (a typo in ``MESHCOMM_SHM_BYTES`` must not eat the host).
MAX_CAPACITY = 1 << 36
#: Microseconds a waiter spins before sleeping, when it has a core to itself.
DEFAULT_SPIN_US = 50.0

SHM_DIR = "/dev/shm"
_PREFIX = "mcshm"
_HEADER = 4096
_BELL_SIZE = 4096
_VERSION = 1
_MAGIC_RING = int.from_bytes(b"MCSHMRNG", "little")
_MAGIC_BELL = int.from_bytes(b"MCSHMBEL", "little")
_MAX_MESSAGE = 4096

# Header word indices (u64). Counters sit on their own 64-byte cache lines.
_W_MAGIC, _W_VERSION, _W_CAPACITY, _W_RECEIVER, _W_SENDER, _W_NONCE = 0, 1, 2, 3, 4, 5
# Sender-owned words share one cache line, receiver-owned words the next. A "blocked" word
# holds 1 + the position at which its owner last came up short (0: never).
_W_HEAD, _W_SENDER_CLOSED, _W_TX_BLOCKED = 8, 9, 10
_W_TAIL, _W_RECEIVER_CLOSED, _W_RX_BLOCKED = 16, 17, 18
# Doorbell: the u32 futex word is at offset 0; u64 words 1.. describe the owner; word 8 is
# the owner's "may be asleep" flag (set by arm, cleared when a wait returns).
_B_MAGIC, _B_RANK, _B_PID, _B_NONCE, _B_SLEEPY = 1, 2, 3, 4, 8

# linux/futex.h; stable kernel ABI. Shared (not _PRIVATE) ops: the word is in a shared mapping.
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_TSO_MACHINES = ("x86_64", "amd64")
_FUTEX_WAIT = 0
_FUTEX_WAKE_OP = 5
# FUTEX_OP(FUTEX_OP_ADD, 1, FUTEX_OP_CMP_EQ, 0): *word += 1 atomically, then wake.
_WAKE_OP_ADD_ONE = (1 << 28) | (0 << 24) | (1 << 12) | 0
_WAKE_ALL = 0x7FFFFFFF
_ACQUIRE, _RELEASE, _SEQ_CST = 2, 3, 5  # __ATOMIC_ACQUIRE, __ATOMIC_RELEASE, __ATOMIC_SEQ_CST

_JOB_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NAME_RE = re.compile(
    r"mcshm\.(?P<job>[A-Za-z0-9_-]{1,64})\.(?P<kind>ring|bell)\.(?P<rank>\d{1,9})\."
    r"(?P<peer>\d{1,9}|x)\.(?P<pid>\d{1,10})\.(?P<nonce>[0-9a-f]{16})"
)

BytesLike = bytes | bytearray | memoryview | np.ndarray
Seconds = float | int | timedelta


# -- platform ------------------------------------------------------------------------------


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libatomic_fence() -> Any:
    """libatomic's ``atomic_thread_fence`` (called with SEQ_CST), or None where missing."""
    try:
        fence = ctypes.CDLL("libatomic.so.1").atomic_thread_fence
    except (OSError, AttributeError):
        return None
    fence.argtypes, fence.restype = [ctypes.c_int], None
    return fence


class _LibAtomic:
    """libatomic's acquire loads and release stores (for machines weaker than x86 TSO)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libatomic.so.1")
        # getattr: a dunder name written inside a class body would be name-mangled.
        self.load8 = getattr(lib, "__atomic_load_8")
        self.load8.argtypes, self.load8.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint64
        self.store8 = getattr(lib, "__atomic_store_8")
        self.store8.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
        self.store8.restype = None
        self.load4 = getattr(lib, "__atomic_load_4")
        self.load4.argtypes, self.load4.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint32


@dataclass(frozen=True)
class _Platform:
    syscall: Any  # libc's syscall(2)
    sys_futex: int
    atomics: _LibAtomic | None  # None: plain loads and stores suffice (x86-64 TSO)
    fence: Any  # atomic_thread_fence, or None: channels then ring on every publication


@functools.lru_cache(maxsize=1)
def _platform() -> _Platform | str:
    """Resolve what the fast path needs once; a string says why it is unsupported."""
    if not sys.platform.startswith("linux"):
        return f"shared-memory transport needs Linux, this is {sys.platform}"
    machine = platform.machine().lower()
    if machine not in _SYS_FUTEX:
        return f"shared-memory transport does not know the futex syscall on {machine}"
    if not (os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)):
        return f"{SHM_DIR} is missing or not writable"
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError) as exc:
        return f"libc syscall() is not available: {exc}"
    syscall.restype = ctypes.c_long
    # Test knob: "libatomic" runs the weak-memory path on x86, "nofence" the always-ring one.
    mode = os.environ.get("MESHCOMM_SHM_ATOMICS", "").strip().lower()
    atomics: _LibAtomic | None = None
    if mode == "libatomic" or machine not in _TSO_MACHINES:
        try:
            atomics = _LibAtomic()
        except (OSError, AttributeError) as exc:
            return f"{machine} needs libatomic.so.1 for ordered loads and stores: {exc}"
    fence = None if mode == "nofence" else _libatomic_fence()
    return _Platform(syscall, _SYS_FUTEX[machine], atomics, fence)


def shm_supported() -> bool:
    """Return True if this machine can run the shared-memory fast path.

    It needs Linux on x86-64 (whose TSO memory model the rings rely on) or on aarch64 with
    libatomic (for release stores and acquire loads), a writable ``/dev/shm`` and futexes.

    Example:
        >>> isinstance(shm_supported(), bool)
        True
    """
    return not isinstance(_platform(), str)


def _require_platform() -> _Platform:
    plat = _platform()
    if isinstance(plat, str):
        raise CommError(plat)
    return plat


def shm_enabled() -> bool:
    """Return True if the tcp backend should use shared memory between same-host ranks.

    ``MESHCOMM_TRANSPORT=tcp`` forces sockets everywhere; unset, empty or ``auto`` use shared
    memory where :func:`shm_supported` (the values the transport accepts too).

    Raises:
        InvalidArgument: ``MESHCOMM_TRANSPORT`` has another value.

    Example:
        >>> import os
        >>> os.environ["MESHCOMM_TRANSPORT"] = "tcp"; shm_enabled()
        False
        >>> del os.environ["MESHCOMM_TRANSPORT"]
    """
    raw = os.environ.get("MESHCOMM_TRANSPORT", "")
    value = raw.strip().lower()
    if value == "tcp":
        return False
    if value not in ("", "auto"):
        raise InvalidArgument(f"MESHCOMM_TRANSPORT must be 'auto' or 'tcp', got {raw!r}")
    return shm_supported()


def default_capacity() -> int:
    """Return the ring capacity in bytes: ``MESHCOMM_SHM_BYTES`` if set, else 4 MiB.

    Raises:
        InvalidArgument: ``MESHCOMM_SHM_BYTES`` is not an integer in [1, 2**36].

    Example:
        >>> default_capacity() > 0
        True
    """
    raw = os.environ.get("MESHCOMM_SHM_BYTES", "")
    if raw.strip() == "":
        return DEFAULT_CAPACITY
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_CAPACITY:
        raise InvalidArgument(
            f"MESHCOMM_SHM_BYTES must be an integer number of bytes in [1, {MAX_CAPACITY}], "
            f"got {raw!r}"
        )
    return value


@functools.lru_cache(maxsize=1)
def host_key() -> str:
    """Return a string equal for two processes exactly when they can share a ring.

    It combines the kernel boot id, the device of the ``/dev/shm`` file system and the pid
    namespace (peer liveness is checked by pid). The transport compares the keys that ranks
    publish to decide which peers get shared memory.

    Example:
        >>> host_key() == host_key()
        True
    """
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path) as fh:
                parts.append(fh.read().strip())
        except OSError:
            parts.append(platform.node())
    try:
        parts.append(str(os.stat(SHM_DIR).st_dev))
    except OSError:
        parts.append("noshm")
    try:
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("nopidns")
    return "/".join(parts)


# -- processes and names -------------------------------------------------------------------


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _process_alive(pid: int, start: int | None) -> bool:
    """True while ``pid`` runs and is the process that started at ``start`` (if known)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        fields = data[data.rindex(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X", b"x"):
            return False
        return start is None or int(fields[19]) == start
    except (ValueError, IndexError):
        return True


def _job_token(job: str | bytes) -> str:
    if isinstance(job, (bytes, bytearray)):
        if not job:
            raise InvalidArgument("job token must not be empty")
        return bytes(job[:32]).hex()
    if not isinstance(job, str) or not _JOB_RE.fullmatch(job):
        raise InvalidArgument(
            f"job token must be bytes or 1-64 characters of [A-Za-z0-9_-], got {job!r}"
        )
    return job


def _check_rank(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 10**9:
        raise InvalidArgument(f"{what} must be an int in [0, 10**9), got {value!r}")
    return value


def _seg_name(job: str, kind: str, rank: int, peer: int | None, pid: int, nonce: int) -> str:
    return f"{_PREFIX}.{job}.{kind}.{rank}.{'x' if peer is None else peer}.{pid}.{nonce:016x}"


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


def sweep(job: str | bytes | None = None) -> list[str]:
    """Remove names left in ``/dev/shm`` by meshcomm processes that died during set-up.

    Only names whose creating process is gone (or a zombie) and that belong to this user are
    removed, so it is safe to call at any time, e.g. by a launcher after its ranks exited.

    Args:
        job: only this job's names (the token given to :class:`Doorbell`); None: every job.

    Returns:
        The names removed.

    Example:
        >>> sweep("no-such-job")
        []
    """
    token = None if job is None else _job_token(job)
    removed: list[str] = []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in entries:
        match = _NAME_RE.fullmatch(name)
        if match is None or (token is not None and match["job"] != token):
            continue
        if _process_alive(int(match["pid"]), None):
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, name)).st_uid != os.geteuid():
                continue
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            continue
        removed.append(name)
    return removed


# -- mappings ------------------------------------------------------------------------------


class _Mapping:
    """One shared file mapped read-write, with ordered access to its header words."""

    def __init__(self, fd: int, size: int, plat: _Platform) -> None:
        self.mm = mmap.mmap(fd, size)
        self.size = size
        # A ctypes object over the buffer pins it and yields the address for futex/libatomic.
        self._anchor: ctypes.c_uint64 | None = ctypes.c_uint64.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)
        self._view = memoryview(self.mm)
        self._q = self._view[:_HEADER].cast("Q")
        self._u32 = self._view[:8].cast("I")
        self._atomics = plat.atomics
        self.fence = plat.fence
        self.fd: int | None = None  # kept open only for a doorbell (peers reopen it via /proc)
        self.closed = False

    def load(self, index: int) -> int:
        if self._atomics is None:
            return int(self._q[index])
        return int(self._atomics.load8(self.addr + 8 * index, _ACQUIRE))

    def store(self, index: int, value: int) -> None:
        if self._atomics is None:
            self._q[index] = value
        else:
            self._atomics.store8(self.addr + 8 * index, value, _RELEASE)

    def load_word(self) -> int:
        """The u32 at offset 0 (a doorbell's futex word)."""
        if self._atomics is None:
            return int(self._u32[0])
        return int(self._atomics.load4(self.addr, _ACQUIRE))

    def data(self, offset: int, size: int) -> memoryview:
        return self._view[offset : offset + size]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._q.release()
        self._u32.release()
        self._view.release()
        self._anchor = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        # A caller still holding a view keeps the mapping until that view goes.
        with contextlib.suppress(BufferError):
            self.mm.close()


def _create_segment(name: str, size: int, plat: _Platform, *, keep_fd: bool = False) -> _Mapping:
    """Create, reserve and map ``name``; with ``keep_fd`` its descriptor stays open as ``fd``."""
    path = os.path.join(SHM_DIR, name)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise CommError(f"cannot create shared-memory segment {path}: {exc}") from exc
    try:
        # Reserve the pages now: on a full tmpfs, touching an unreserved page is a SIGBUS.
        os.posix_fallocate(fd, 0, size)
        mapping = _Mapping(fd, size, plat)
    except OSError as exc:
        os.close(fd)
        _unlink(name)
        raise CommError(
            f"cannot reserve {size} bytes of shared memory in {SHM_DIR} for {name}: {exc}; "
            f"set MESHCOMM_SHM_BYTES lower or MESHCOMM_TRANSPORT=tcp"
        ) from exc
    except BaseException:
        os.close(fd)
        _unlink(name)
        raise
    if keep_fd:
        mapping.fd = fd
    else:
        os.close(fd)
    return mapping


def _open_segment(name: str, size: int, plat: _Platform, *, unlink: bool) -> _Mapping:
    """Open and map ``name`` in ``/dev/shm``, or a ``/proc/<pid>/fd/<n>`` path (no name)."""
    via_proc = name.startswith("/proc/")
    path = name if via_proc else os.path.join(SHM_DIR, name)
    # /proc/<pid>/fd/<n> is a magic link, so it must be followed; names must not be links.
    flags = os.O_RDWR | os.O_CLOEXEC | (0 if via_proc else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise CommError(
            f"cannot open shared-memory segment {path} (is the peer on another host or "
            f"container?): {exc}"
        ) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise CommError(f"{path} is not a regular file owned by uid {os.geteuid()}")
        if info.st_size != size:
            raise ProtocolError(f"{path} has {info.st_size} bytes, the offer said {size}")
        if unlink and not via_proc:
            _unlink(name)  # before any byte moves: from now on only the mappings keep it
        return _Mapping(fd, size, plat)
    finally:
        os.close(fd)


# -- doorbells -----------------------------------------------------------------------------


class _Bell:
    """A mapped doorbell word (our own or a peer's)."""

    def __init__(self, mapping: _Mapping, plat: _Platform, rank: int) -> None:
        self.mapping = mapping
        self.rank = rank
        self._syscall = plat.syscall
        self._fence = plat.fence
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

    def fence(self) -> None:
        if self._fence is not None:
            self._fence(_SEQ_CST)

    def armed(self) -> bool:
        """The owner's may-be-asleep flag (meaningful after a fence)."""
        return not self.mapping.closed and self.mapping.load(_B_SLEEPY) != 0

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
        ts = _Timespec(whole, int((seconds - whole) * 1e9))
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


def _default_spin(local_size: int | None) -> float:
    raw = os.environ.get("MESHCOMM_SHM_SPIN_US", "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 <= value <= 1e6:
            raise InvalidArgument(f"MESHCOMM_SHM_SPIN_US must be in [0, 1e6], got {raw!r}")
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
        self.job = _job_token(job)
        self.rank = _check_rank(rank, "rank")
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
        self._plat = _require_platform()
        self.pid = os.getpid()
        self.start_time = _start_time(self.pid)
        self.nonce = secrets.randbits(64)
        self.name = _seg_name(self.job, "bell", self.rank, None, self.pid, self.nonce)
        mapping = _create_segment(self.name, _BELL_SIZE, self._plat, keep_fd=True)
        for index, value in (
            (_B_MAGIC, _MAGIC_BELL),
            (_B_RANK, self.rank),
            (_B_PID, self.pid),
            (_B_NONCE, self.nonce),
        ):
            mapping.store(index, value)
        self._own = _Bell(mapping, self._plat, self.rank)
        self._linked = True
        self._expected = expected_peers
        self._acks = 0
        self._peers: dict[int, _Bell] = {}
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

    def seal(self) -> None:
        """Unlink the doorbell's name: no further peer can pair with this process."""
        if self._linked:
            self._linked = False
            _unlink(self.name)

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

    def _attach(self, rank: int, bell: _Bell) -> None:
        old = self._peers.pop(rank, None)
        if old is not None and old is not bell:
            old.mapping.close()
        self._peers[rank] = bell

    def _detach(self, rank: int, bell: _Bell) -> None:
        if self._peers.get(rank) is bell:
            del self._peers[rank]
        bell.mapping.close()

    def __repr__(self) -> str:
        return f"Doorbell(job={self.job!r}, rank={self.rank}, peers={sorted(self._peers)})"


# -- channels ------------------------------------------------------------------------------


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
        mapping: _Mapping,
        *,
        is_sender: bool,
        rank: int,
        peer: int,
        peer_pid: int,
        peer_start: int | None,
        peer_bell: _Bell,
        capacity: int,
    ) -> None:
        self._map = mapping
        self._ring = mapping.data(_HEADER, capacity)
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
            self._mine_word, self._theirs_word = _W_HEAD, _W_TAIL
            self._blocked_word, self._peer_blocked_word = _W_TX_BLOCKED, _W_RX_BLOCKED
        else:
            self._mine_word, self._theirs_word = _W_TAIL, _W_HEAD
            self._blocked_word, self._peer_blocked_word = _W_RX_BLOCKED, _W_TX_BLOCKED
        self._mine = mapping.load(self._mine_word)
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
        if self._map.load(_W_RECEIVER_CLOSED):
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

    def _transfer(self, view: memoryview, notify: bool) -> int:
        """Move bytes between ``view`` and the ring; declare "blocked" if short; notify."""
        mapping, cap, ring, sending = self._map, self.capacity, self._ring, self.is_sender
        fence = self._fence
        mine = self._mine  # head (sender) or tail (receiver): only we write it
        want, done = len(view), 0
        while True:
            theirs = mapping.load(self._theirs_word)
            room = cap - self._used(mine, theirs) if sending else self._used(theirs, mine)
            count = min(want - done, room)
            if count > 0:
                pos = mine % cap
                first = min(count, cap - pos)
                if sending:
                    ring[pos : pos + first] = view[done : done + first]
                    if count > first:
                        ring[: count - first] = view[done + first : done + count]
                else:
                    view[done : done + first] = ring[pos : pos + first]
                    if count > first:
                        view[done + first : done + count] = ring[: count - first]
                mine += count
                done += count
                self._mine = mine
                mapping.store(self._mine_word, mine)
            if done == want or fence is None:
                break
            # Short: publish "blocked at this position", then look once more (Dekker with
            # the peer's publish-fence-check in the notification below).
            mark = mine + 1
            if self._blocked == mark:
                break
            self._blocked = mark
            mapping.store(self._blocked_word, mark)
            fence(_SEQ_CST)
        if done > 0 and notify:
            bell = self._peer_bell
            if fence is None:
                bell.ring()
            else:
                fence(_SEQ_CST)  # our counter store before the loads that decide to ring
                blocked = mapping.load(self._peer_blocked_word)
                if blocked == mapping.load(self._theirs_word) + 1 and bell.armed():
                    bell.ring()
        return done

    def readable_bytes(self) -> int:
        """Bytes written and not yet read."""
        if self.closed:
            return 0
        return self._used(self._map.load(_W_HEAD), self._map.load(_W_TAIL))

    def writable_bytes(self) -> int:
        """Free bytes in the ring."""
        return 0 if self.closed else self.capacity - self.readable_bytes()

    def peer_closed(self) -> bool:
        """True once the other end called :meth:`close` (a receiver still drains what is left)."""
        if self.closed:
            return True
        return bool(self._map.load(_W_RECEIVER_CLOSED if self.is_sender else _W_SENDER_CLOSED))

    def peer_alive(self) -> bool:
        """True while the peer's process exists (a zombie or a reused pid counts as dead)."""
        return _process_alive(self.peer_pid, self._peer_start)

    def close(self) -> None:
        """Mark this end closed, ring the peer so it notices, and unmap. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self._map.store(_W_SENDER_CLOSED if self.is_sender else _W_RECEIVER_CLOSED, 1)
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
    """

    tx: ShmChannel
    rx: ShmChannel
    peer: int
    peer_pid: int
    _doorbell: Doorbell = field(repr=False)
    _peer_bell: _Bell = field(repr=False)

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


# -- handshake -----------------------------------------------------------------------------

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
}
_ACK_FIELDS = {
    "v": int,
    "kind": str,
    "rank": int,
    "peer": int,
    "ok": bool,
    "proc": bool,
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
        self.peer = _check_rank(peer, "peer")
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
        self._name = _seg_name(doorbell.job, "ring", self.rank, peer, doorbell.pid, self._nonce)
        self._rx: _Mapping | None = _create_segment(self._name, _HEADER + cap, self._plat)
        for index, value in (
            (_W_MAGIC, _MAGIC_RING),
            (_W_VERSION, _VERSION),
            (_W_CAPACITY, cap),
            (_W_RECEIVER, self.rank),
            (_W_SENDER, peer),
            (_W_NONCE, self._nonce),
        ):
            self._rx.store(index, value)
        self._tx: _Mapping | None = None
        self._peer_bell: _Bell | None = None
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
        ring, bell = _NAME_RE.fullmatch(obj["ring"]), _NAME_RE.fullmatch(obj["bell"])
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
        tx = _open_segment(obj["ring"], _HEADER + obj["cap"], self._plat, unlink=True)
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
        self._peer_bell = _Bell(mapping, self._plat, self.peer)
        self._peer_offer = obj

    def _open_bell(self, obj: dict[str, Any]) -> _Mapping:
        """Map the peer's doorbell: through ``/proc/<pid>/fd/<n>`` if we may, else by name."""
        want = [_MAGIC_BELL, self.peer, obj["bell_nonce"]]
        try:
            path = f"/proc/{obj['pid']}/fd/{obj['bell_fd']}"
            mapping = _open_segment(path, _BELL_SIZE, self._plat, unlink=False)
            if [mapping.load(i) for i in (_B_MAGIC, _B_RANK, _B_NONCE)] == want:
                self._via_proc = True
                return mapping
            mapping.close()
        except CommError:
            pass  # another process's descriptors are off limits here: use the name
        mapping = _open_segment(obj["bell"], _BELL_SIZE, self._plat, unlink=False)
        got = [mapping.load(i) for i in (_B_MAGIC, _B_RANK, _B_NONCE)]
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
        return ShmPair(tx, rx, self.peer, offer["pid"], self._bell, peer_bell)

    def _end(self) -> None:
        """Unlink our ring's name; count this handshake toward the doorbell's expected peers."""
        _unlink(self._name)
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
