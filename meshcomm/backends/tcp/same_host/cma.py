"""Cross-memory attach: read a same-host peer's memory in one copy (``process_vm_readv``).

Large messages between ranks that share a host skip the ring: the sender announces the
address of its buffer (an RTS frame through the ring), the receiver copies straight from the
sender's address space into its destination with ``process_vm_readv(2)``, then answers FIN.
One copy instead of two (into the ring, out of it), and no ring space held.

The kernel allows it between processes of the same user unless a policy forbids it (Yama
``ptrace_scope`` 2 or more, seccomp filters in some containers), so every pair probes it
during the shared-memory handshake and falls back to the ring when the probe fails.
``MESHCOMM_SHM_CMA=0`` turns it off.

Example:
    >>> import ctypes, os
    >>> word = ctypes.c_uint64(0x1234)
    >>> read_word(os.getpid(), ctypes.addressof(word)) == 0x1234 or not cma_available()
    True
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import sys
from typing import Any

import numpy as np

from meshcomm.errors import InvalidArgument

__all__ = [
    "address_of",
    "cma_available",
    "cma_enabled",
    "read_at",
    "read_into",
    "read_word",
    "write_at",
]

# One call moves at most this much: the kernel stops at about 2 GiB per call anyway, and
# pieces of this size keep the copy cache-friendly.
_PIECE = 64 << 20
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23
# Destinations from this size are faulted in before the copy (see _populate).
_POPULATE_MIN = 1 << 20


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


@functools.lru_cache(maxsize=1)
def _madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def _populate(address: int, nbytes: int) -> None:
    """Fault in the pages of a destination before the kernel copies into it.

    ``process_vm_readv`` faults untouched destination pages in one at a time, several
    times slower than the copy itself (a fresh ``np.empty`` of many MiB is untouched);
    ``MADV_POPULATE_WRITE`` (Linux 5.14) does it in one sweep. Best effort: older kernels
    say EINVAL and the copy faults the pages in as before.
    """
    fn = _madvise()
    start = (address + _PAGE - 1) & ~(_PAGE - 1)
    end = (address + nbytes) & ~(_PAGE - 1)
    if fn is not None and end - start >= _POPULATE_MIN:
        fn(start, end - start, _MADV_POPULATE_WRITE)


def _vm_call(name: str) -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return fn


@functools.lru_cache(maxsize=1)
def _readv() -> Any:
    """libc's ``process_vm_readv``, or None where it does not exist."""
    return _vm_call("process_vm_readv")


@functools.lru_cache(maxsize=1)
def _writev() -> Any:
    """libc's ``process_vm_writev``, or None where it does not exist."""
    return _vm_call("process_vm_writev")


def cma_available() -> bool:
    """Return True if this libc has ``process_vm_readv`` (the kernel may still refuse).

    Example:
        >>> isinstance(cma_available(), bool)
        True
    """
    return _readv() is not None


def cma_enabled() -> bool:
    """Return True unless ``MESHCOMM_SHM_CMA`` turns single-copy reads off.

    Raises:
        InvalidArgument: ``MESHCOMM_SHM_CMA`` is not one of ``1 0 on off auto true false``.

    Example:
        >>> import os
        >>> os.environ["MESHCOMM_SHM_CMA"] = "0"; cma_enabled()
        False
        >>> del os.environ["MESHCOMM_SHM_CMA"]
    """
    raw = os.environ.get("MESHCOMM_SHM_CMA", "").strip().lower()
    if raw in ("0", "off", "false"):
        return False
    if raw not in ("", "1", "on", "auto", "true"):
        raise InvalidArgument(f"MESHCOMM_SHM_CMA must be 0 or 1, got {raw!r}")
    return cma_available()


def address_of(view: memoryview) -> int:
    """Return the address of a contiguous buffer's first byte (read-only buffers too)."""
    return int(np.frombuffer(view, np.uint8).ctypes.data) if len(view) else 0


def read_into(pid: int, dest: memoryview, remote: int) -> None:
    """Copy ``len(dest)`` bytes at address ``remote`` of process ``pid`` into ``dest``.

    Raises:
        OSError: the kernel refused or the peer is gone (``errno`` says which: ``ESRCH``
            for a process that no longer exists, ``EFAULT`` for a bad address, ``EPERM``).
    """
    total = len(dest)
    if total:
        read_at(pid, address_of(dest), total, remote)


def read_at(pid: int, local: int, nbytes: int, remote: int) -> None:
    """Copy ``nbytes`` at address ``remote`` of process ``pid`` to our address ``local``.

    The caller vouches that ``[local, local + nbytes)`` is writable memory it owns (the
    address of a live numpy array, say); :func:`read_into` is the checked form.

    Raises:
        OSError: as :func:`read_into`.
    """
    if nbytes:
        _populate(local, nbytes)
        _move(_readv(), "process_vm_readv", pid, local, nbytes, remote)


def write_at(pid: int, remote: int, nbytes: int, local: int) -> None:
    """Copy ``nbytes`` at our address ``local`` to address ``remote`` of process ``pid``.

    The kernel allows it exactly where it allows :func:`read_at` (the same ptrace check),
    unless a seccomp filter tells them apart.

    Raises:
        OSError: as :func:`read_into`.
    """
    if nbytes:
        _move(_writev(), "process_vm_writev", pid, local, nbytes, remote)


def _move(fn: Any, name: str, pid: int, local: int, nbytes: int, remote: int) -> None:
    if fn is None:
        raise OSError(errno.ENOSYS, f"{name} is not available")
    done = 0
    liov, riov = _IoVec(), _IoVec()
    while done < nbytes:
        want = min(nbytes - done, _PIECE)
        liov.iov_base, liov.iov_len = local + done, want
        riov.iov_base, riov.iov_len = remote + done, want
        got = fn(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
        if got <= 0:
            err = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(err, f"{name} with pid {pid}: {os.strerror(err)}")
        done += got


def read_word(pid: int, remote: int) -> int | None:
    """Read the u64 at ``remote`` in process ``pid``; None if the kernel refuses (the probe)."""
    if _readv() is None:
        return None
    word = bytearray(8)
    try:
        read_into(pid, memoryview(word), remote)
    except OSError:
        return None
    return int.from_bytes(word, sys.byteorder)
