"""What the shared-memory fast path needs from the machine, and the files it lives in.

Platform probing (Linux, futex syscall number, x86-64 TSO or libatomic, a writable
``/dev/shm``), the environment knobs (``MESHCOMM_TRANSPORT``, ``MESHCOMM_SHM_BYTES``), the
host key that tells whether two ranks can share memory, process liveness by pid and start
time, segment names and :func:`sweep`, and :class:`SharedMapping`, a mapped segment with ordered
access to its 64-bit header words. :mod:`~meshcomm.backends.tcp.same_host.doorbell` and
:mod:`~meshcomm.backends.tcp.same_host.rings` build on it; see the latter for the design.

Example:
    >>> isinstance(shm_supported(), bool), host_key() == host_key()
    (True, True)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import platform
import re
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from meshcomm.errors import CommError, InvalidArgument, ProtocolError

# __all__ is what the rest of meshcomm uses. The ring layout (W_*, RING_HEADER, BELL_SIZE),
# Platform / require_platform and the segment helpers are the shared parts of the same-host
# channel's own modules (doorbell, shm_channel, shm_handshake), public to them, not beyond.
__all__ = [
    "DEFAULT_CAPACITY",
    "MAX_CAPACITY",
    "SHM_DIR",
    "SharedMapping",
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

SHM_DIR = "/dev/shm"
_PREFIX = "mcshm"
RING_HEADER = 4096
# A doorbell page, then its board (meshcomm.backends.tcp.same_host.board): two slots of 256 KiB.
BELL_SIZE = 4096 + 2 * 262144

# Ring header word indices (u64). Counters sit on their own 64-byte cache lines.
W_MAGIC, W_VERSION, W_CAPACITY, W_RECEIVER, W_SENDER, W_NONCE = 0, 1, 2, 3, 4, 5
# Sender-owned words share one cache line, receiver-owned words the next. A "blocked" word
# holds 1 + the position at which its owner last came up short (0: never).
W_HEAD, W_SENDER_CLOSED, W_TX_BLOCKED = 8, 9, 10
W_TAIL, W_RECEIVER_CLOSED, W_RX_BLOCKED = 16, 17, 18

# linux/futex.h; stable kernel ABI. Shared (not _PRIVATE) ops: the word is in a shared mapping.
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_TSO_MACHINES = ("x86_64", "amd64")
_ACQUIRE, _RELEASE, SEQ_CST = 2, 3, 5  # __ATOMIC_ACQUIRE, __ATOMIC_RELEASE, __ATOMIC_SEQ_CST

_JOB_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
SEGMENT_NAME_RE = re.compile(
    r"mcshm\.(?P<job>[A-Za-z0-9_-]{1,64})\.(?P<kind>ring|bell)\.(?P<rank>\d{1,9})\."
    r"(?P<peer>\d{1,9}|x)\.(?P<pid>\d{1,10})\.(?P<nonce>[0-9a-f]{16})"
)

BytesLike = bytes | bytearray | memoryview | np.ndarray
Seconds = float | int | timedelta


# -- platform ------------------------------------------------------------------------------


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libatomic_fence() -> Any:
    """libatomic's ``atomic_thread_fence`` (called with SEQ_CST), or None where missing."""
    try:
        fence = ctypes.CDLL("libatomic.so.1").atomic_thread_fence
    except (OSError, AttributeError):
        return None
    # No argtypes: ctypes passes a Python int as a C int by default, which is the argument's
    # type, and the argtypes converter cost as much as the rest of the call (the board and
    # the rings fence on every publication).
    fence.restype = None
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
class Platform:
    syscall: Any  # libc's syscall(2)
    sys_futex: int
    atomics: _LibAtomic | None  # None: plain loads and stores suffice (x86-64 TSO)
    fence: Any  # atomic_thread_fence, or None: channels then ring on every publication


@functools.lru_cache(maxsize=1)
def _platform() -> Platform | str:
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
    return Platform(syscall, _SYS_FUTEX[machine], atomics, fence)


def shm_supported() -> bool:
    """Return True if this machine can run the shared-memory fast path.

    It needs Linux on x86-64 (whose TSO memory model the rings rely on) or on aarch64 with
    libatomic (for release stores and acquire loads), a writable ``/dev/shm`` and futexes.

    Example:
        >>> isinstance(shm_supported(), bool)
        True
    """
    return not isinstance(_platform(), str)


def require_platform() -> Platform:
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


def host_key() -> str:
    """Return a string equal for two processes exactly when they can share a ring.

    It combines the kernel boot id, the device of the ``/dev/shm`` file system and the pid
    namespace (peer liveness is checked by pid). Ranks send it in their handshake to decide
    which peers get shared memory. ``MESHCOMM_HOST_KEY``, when set, is appended: ranks with
    different values act as if on different hosts (tests use it to mix channels).

    Example:
        >>> host_key() == host_key()
        True
    """
    extra = os.environ.get("MESHCOMM_HOST_KEY", "").strip()
    return _machine_key() + (f"/{extra}" if extra else "")


@functools.lru_cache(maxsize=1)
def _machine_key() -> str:
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


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid: int, start: int | None) -> bool:
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


def job_token(job: str | bytes) -> str:
    if isinstance(job, (bytes, bytearray)):
        if not job:
            raise InvalidArgument("job token must not be empty")
        return bytes(job[:32]).hex()
    if not isinstance(job, str) or not _JOB_RE.fullmatch(job):
        raise InvalidArgument(
            f"job token must be bytes or 1-64 characters of [A-Za-z0-9_-], got {job!r}"
        )
    return job


def check_rank(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 10**9:
        raise InvalidArgument(f"{what} must be an int in [0, 10**9), got {value!r}")
    return value


def segment_name(job: str, kind: str, rank: int, peer: int | None, pid: int, nonce: int) -> str:
    return f"{_PREFIX}.{job}.{kind}.{rank}.{'x' if peer is None else peer}.{pid}.{nonce:016x}"


def unlink_segment(name: str) -> None:
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
    token = None if job is None else job_token(job)
    removed: list[str] = []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in entries:
        match = SEGMENT_NAME_RE.fullmatch(name)
        if match is None or (token is not None and match["job"] != token):
            continue
        if process_alive(int(match["pid"]), None):
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


class SharedMapping:
    """One shared file mapped read-write, with ordered access to its header words."""

    def __init__(self, fd: int, size: int, plat: Platform) -> None:
        self.mm = mmap.mmap(fd, size)
        self.size = size
        #: Called once when the mapping closes (a ring gives its bytes back to the budget).
        self.on_close: Callable[[], None] | None = None
        # A ctypes object over the buffer pins it and yields the address for futex/libatomic.
        self._anchor: ctypes.c_uint64 | None = ctypes.c_uint64.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)
        self._view = memoryview(self.mm)
        self._q = self._view[:RING_HEADER].cast("Q")
        self._u32 = self._view[:8].cast("I")
        self._atomics = plat.atomics
        self.fence = plat.fence
        self.fd: int | None = None  # kept open only for a doorbell (peers reopen it via /proc)
        self.closed = False
        # ``load(i)`` / ``store(i, v)`` access u64 header word ``i``. Under TSO they are the
        # memoryview's own item methods (one aligned 8-byte move, no Python frame): the
        # channels' hot path calls them several times per message.
        self.load: Callable[[int], int]
        self.store: Callable[[int, int], None]
        if self._atomics is None:
            self.load = self._q.__getitem__
            self.store = self._q.__setitem__
        else:
            self.load = self._atomic_load
            self.store = self._atomic_store

    def _atomic_load(self, index: int) -> int:
        assert self._atomics is not None  # only bound when atomics exist
        return int(self._atomics.load8(self.addr + 8 * index, _ACQUIRE))

    def _atomic_store(self, index: int, value: int) -> None:
        assert self._atomics is not None
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
        if self.on_close is not None:
            self.on_close()
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


def create_segment(name: str, size: int, plat: Platform, *, keep_fd: bool = False) -> SharedMapping:
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
        mapping = SharedMapping(fd, size, plat)
    except OSError as exc:
        os.close(fd)
        unlink_segment(name)
        raise CommError(
            f"cannot reserve {size} bytes of shared memory in {SHM_DIR} for {name}: {exc}; "
            f"set MESHCOMM_SHM_BYTES lower or MESHCOMM_TRANSPORT=tcp"
        ) from exc
    except BaseException:
        os.close(fd)
        unlink_segment(name)
        raise
    if keep_fd:
        mapping.fd = fd
    else:
        os.close(fd)
    return mapping


def open_segment(name: str, size: int, plat: Platform, *, unlink: bool) -> SharedMapping:
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
            unlink_segment(name)  # before any byte moves: from now on only the mappings keep it
        return SharedMapping(fd, size, plat)
    finally:
        os.close(fd)
