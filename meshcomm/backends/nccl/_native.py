"""A ctypes binding to libnccl for what cupy's binding lacks: configured init and split.

cupy's ``cupy.cuda.nccl`` makes communicators with ``ncclCommInitRank`` only. Two NCCL
features need more:

* **Non-blocking init** (``ncclCommInitRankConfig`` with ``blocking = 0``, NCCL >= 2.14):
  the call returns at once and the communicator's state (``ncclCommGetAsyncError``) says
  ``ncclInProgress`` until it is ready. A member that never arrives is then a deadline this
  process polls, and ``ncclCommAbort`` frees what was made; with the blocking init a thread
  stays stuck inside NCCL for good.
* **Split** (``ncclCommSplit``, NCCL >= 2.18): a sub-communicator made from a live parent by
  a collective call over the parent, with no unique id through the store, sharing the
  parent's resources where NCCL can.

cupy cannot adopt an ``ncclComm_t`` made elsewhere, so the calls the backend makes on such a
communicator go through here too: :class:`NativeComm` has the methods of cupy's
``NcclCommunicator`` that the backend uses, with the same names and arguments, plus
``groupStart``/``groupEnd`` (a non-blocking communicator must be polled after them).

The library is the one cupy loaded where it did (``libnccl.so.2`` by name, which the dynamic
loader resolves to the copy already in the process), else the ``nvidia-nccl-cu12/13``
wheel's, or the file ``MESHCOMM_NCCL_LIBRARY`` names.

Example:
    >>> config = make_config(blocking=False)
    >>> config.magic == MAGIC, config.blocking, config.splitShare == UNDEF_INT
    (True, 0, True)
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

__all__ = [
    "IN_PROGRESS",
    "MAGIC",
    "NOCOLOR",
    "UNDEF_INT",
    "Config",
    "Library",
    "NativeComm",
    "NcclFailure",
    "UniqueId",
    "load_library",
    "make_config",
]

#: ncclResult_t's ncclInProgress: a non-blocking call not finished yet.
IN_PROGRESS = 7
#: NCCL_CONFIG_UNDEF_INT: a config field NCCL fills with its default.
UNDEF_INT = -(2**31)
#: NCCL_API_MAGIC, which marks a config as initialized.
MAGIC = 0xCAFEBEEF
#: NCCL_SPLIT_NOCOLOR: this rank joins no communicator of the split.
NOCOLOR = -1
#: NCCL_VERSION(2, 18, 0): the config fields below are those of 2.18; NCCL defaults the rest.
_CONFIG_VERSION = 21800
#: The oldest NCCL with every call this binding makes (ncclCommSplit came in 2.18).
OLDEST = 21800
#: How often a pending call's state is polled.
_POLL_SECONDS = 0.0002
#: ncclResult_t names, as NCCL's docs give them.
_RESULTS = (
    "ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
    "ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress",
    "ncclTimeout",
)  # fmt: skip


class Config(ctypes.Structure):
    """``ncclConfig_t`` up to ``splitShare`` (the 2.18 layout; later versions append).

    NCCL reads ``size`` bytes of the caller's struct and fills the fields past them with
    their defaults, so this prefix is valid for every NCCL from 2.18 on.
    """

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
    ]


def make_config(blocking: bool) -> Config:
    """A config as ``NCCL_CONFIG_INITIALIZER`` makes it, with ``blocking`` set.

    Example:
        >>> make_config(blocking=True).blocking
        1
    """
    return Config(
        ctypes.sizeof(Config),
        MAGIC,
        _CONFIG_VERSION,
        1 if blocking else 0,
        UNDEF_INT,
        UNDEF_INT,
        UNDEF_INT,
        None,
        UNDEF_INT,
    )


class NcclFailure(RuntimeError):
    """An NCCL call returned an error (``code`` is its ncclResult_t).

    Example:
        >>> str(NcclFailure(4, "ncclCommSplit", "invalid argument"))
        'ncclCommSplit: ncclInvalidArgument (4): invalid argument'
    """

    def __init__(self, code: int, call: str, text: str) -> None:
        name = _RESULTS[code] if 0 <= code < len(_RESULTS) else "ncclResult"
        super().__init__(f"{call}: {name} ({code}): {text}")
        self.code = code


class UniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 bytes, passed by value."""

    _fields_ = [("internal", ctypes.c_char * 128)]


_Comm = ctypes.c_void_p
_Ptr = ctypes.c_void_p
_Stream = ctypes.c_void_p
_I, _Size = ctypes.c_int, ctypes.c_size_t
#: Every call bound: name -> argument types (each returns an ncclResult_t int).
_SIGNATURES: dict[str, list[Any]] = {
    "ncclGetVersion": [ctypes.POINTER(_I)],
    "ncclGetUniqueId": [ctypes.c_char_p],
    "ncclCommInitRankConfig": [ctypes.POINTER(_Comm), _I, UniqueId, _I, ctypes.c_void_p],
    "ncclCommSplit": [_Comm, _I, _I, ctypes.POINTER(_Comm), ctypes.c_void_p],
    "ncclCommGetAsyncError": [_Comm, ctypes.POINTER(_I)],
    "ncclCommFinalize": [_Comm],
    "ncclCommDestroy": [_Comm],
    "ncclCommAbort": [_Comm],
    "ncclAllReduce": [_Ptr, _Ptr, _Size, _I, _I, _Comm, _Stream],
    "ncclReduce": [_Ptr, _Ptr, _Size, _I, _I, _I, _Comm, _Stream],
    "ncclBroadcast": [_Ptr, _Ptr, _Size, _I, _I, _Comm, _Stream],
    "ncclReduceScatter": [_Ptr, _Ptr, _Size, _I, _I, _Comm, _Stream],
    "ncclAllGather": [_Ptr, _Ptr, _Size, _I, _Comm, _Stream],
    "ncclSend": [_Ptr, _Size, _I, _I, _Comm, _Stream],
    "ncclRecv": [_Ptr, _Size, _I, _I, _Comm, _Stream],
    "ncclGroupStart": [],
    "ncclGroupEnd": [],
}


class Library:
    """libnccl's calls, typed.

    Args:
        cdll: the loaded library.

    Raises:
        ImportError: the library is older than 2.18 or lacks a call.
    """

    def __init__(self, cdll: ctypes.CDLL) -> None:
        self.path = str(cdll._name)
        self.fn: dict[str, Any] = {}
        for name, argtypes in _SIGNATURES.items():
            try:
                fn = getattr(cdll, name)
            except AttributeError as exc:
                raise ImportError(
                    f"{self.path} has no {name}: not NCCL, or NCCL older than 2.18"
                ) from exc
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            self.fn[name] = fn
        self._error_string = cdll.ncclGetErrorString
        self._error_string.argtypes, self._error_string.restype = [_I], ctypes.c_char_p
        found = ctypes.c_int()
        self.check(self.fn["ncclGetVersion"](ctypes.byref(found)), "ncclGetVersion")
        #: NCCL_VERSION_CODE of the loaded library (2.30.7 is 23007).
        self.version = int(found.value)
        if self.version < OLDEST:
            raise ImportError(
                f"{self.path} is NCCL {self.version}; the native binding needs {OLDEST} or later"
            )

    def check(self, code: int, call: str) -> None:
        """Raise :class:`NcclFailure` unless ``code`` is success."""
        if code != 0:
            text = self._error_string(code)
            raise NcclFailure(code, call, text.decode() if text else "")

    def unique_id(self) -> bytes:
        """A new ``ncclUniqueId``, as its 128 bytes."""
        raw = ctypes.create_string_buffer(128)
        self.check(self.fn["ncclGetUniqueId"](raw), "ncclGetUniqueId")
        return raw.raw


def _candidates() -> list[str]:
    named = os.environ.get("MESHCOMM_NCCL_LIBRARY")
    if named:
        return [named]
    found = ["libnccl.so.2"]
    spec = importlib.util.find_spec("nvidia")  # the namespace of NVIDIA's wheels
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        found.append(str(Path(root) / "nccl" / "lib" / "libnccl.so.2"))
    return found


_LOADED: Library | None = None


def load_library() -> Library:
    """The libnccl this process uses, bound (loaded once).

    Raises:
        ImportError: no libnccl 2.18 or later was found; says where it looked.
    """
    global _LOADED
    if _LOADED is None:
        tried = []
        for candidate in _candidates():
            try:
                cdll = ctypes.CDLL(candidate)
            except OSError as exc:
                tried.append(f"{candidate}: {exc}")
                continue
            _LOADED = Library(cdll)
            break
        else:
            raise ImportError(
                "the native NCCL binding found no libnccl.so.2 (install the nvidia-nccl-cu12 "
                "or -cu13 wheel, or name the file in MESHCOMM_NCCL_LIBRARY); tried: "
                + "; ".join(tried)
            )
    return _LOADED


class NativeComm:
    """An ``ncclComm_t`` made here, non-blocking, with the calls the backend makes.

    Every method has the name and arguments of cupy's ``NcclCommunicator`` method of the
    same name. A call that NCCL leaves in progress is polled until it settles, at most
    ``timeout`` seconds; past that the communicator is aborted and ``TimeoutError`` raised.

    Args:
        lib: the bound library.
        handle: the communicator.
        timeout: seconds a call may stay in progress.
    """

    def __init__(self, lib: Library, handle: ctypes.c_void_p, timeout: float) -> None:
        self._lib = lib
        self._fn = lib.fn
        self._handle: ctypes.c_void_p | None = handle
        self.timeout = timeout

    @classmethod
    def init_rank(
        cls, lib: Library, size: int, unique_id: bytes, rank: int, timeout: float
    ) -> NativeComm:
        """``ncclCommInitRankConfig``, non-blocking, waited for at most ``timeout`` s.

        Raises:
            NcclFailure: NCCL refused or failed (no GPU, a bad id, ...).
            TimeoutError: not ready in time (the communicator is aborted).
        """
        handle = _Comm()
        config = make_config(blocking=False)
        uid = UniqueId.from_buffer_copy(unique_id)
        code = lib.fn["ncclCommInitRankConfig"](
            ctypes.byref(handle), size, uid, rank, ctypes.byref(config)
        )
        return cls._settled(lib, handle, code, "ncclCommInitRankConfig", timeout)

    @classmethod
    def _settled(
        cls, lib: Library, handle: ctypes.c_void_p, code: int, call: str, timeout: float
    ) -> NativeComm:
        if code not in (0, IN_PROGRESS):
            if handle.value:
                lib.fn["ncclCommAbort"](handle)
            lib.check(code, call)
        comm = cls(lib, handle, timeout)
        comm._settle(call)
        return comm

    @property
    def comm(self) -> int:
        """The ``ncclComm_t`` as an int (0 once destroyed or aborted)."""
        return int(self._handle.value or 0) if self._handle is not None else 0

    def state(self) -> int:
        """``ncclCommGetAsyncError``: 0, ``IN_PROGRESS``, or the error's code."""
        found = ctypes.c_int()
        code = self._fn["ncclCommGetAsyncError"](self._live("ncclCommGetAsyncError"), found)
        self._lib.check(code, "ncclCommGetAsyncError")
        return int(found.value)

    def _live(self, call: str) -> ctypes.c_void_p:
        if self._handle is None:
            raise NcclFailure(5, call, "the communicator was destroyed or aborted")
        return self._handle

    def _settle(self, call: str) -> None:
        """Poll until the communicator leaves ``IN_PROGRESS``; raise its error if any."""
        deadline = time.monotonic() + self.timeout
        while True:
            state = self.state()
            if state != IN_PROGRESS:
                if state:
                    self.abort()
                    self._lib.check(state, call)
                return
            if time.monotonic() > deadline:
                self.abort()
                raise TimeoutError(f"{call} was still in progress after {self.timeout:g} s")
            time.sleep(_POLL_SECONDS)

    def _run(self, call: str, *args: Any) -> None:
        code = self._fn[call](*args)
        if code == IN_PROGRESS:
            self._settle(call)
        elif code:
            self._lib.check(code, call)

    def split(self, color: int, key: int) -> NativeComm | None:
        """``ncclCommSplit``; collective over this communicator. ``color`` :data:`NOCOLOR`
        joins none (returns None); the others get the members of their colour, by ``key``.

        Raises:
            NcclFailure: NCCL refused or failed.
            TimeoutError: not ready in time (the new communicator is aborted).
        """
        handle = _Comm()
        config = make_config(blocking=False)
        code = self._fn["ncclCommSplit"](
            self._live("ncclCommSplit"), color, key, ctypes.byref(handle), ctypes.byref(config)
        )
        if code in (0, IN_PROGRESS):
            # On a non-blocking parent the split runs as the parent's job: NCCL returns
            # ncclSuccess at once, the parent reads in progress, and the new handle is
            # written only when the job ends (NCCL 2.28 on an H100: about 20 ms). So the
            # parent settles first, then the handle is read; none: NOCOLOR, nothing made.
            self._settle("ncclCommSplit")
            if not handle.value:
                return None
        return self._settled(self._lib, handle, code, "ncclCommSplit", self.timeout)

    # -- cupy's NcclCommunicator methods -------------------------------------------------
    def allReduce(
        self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int
    ) -> None:
        """``ncclAllReduce``."""
        self._run("ncclAllReduce", sendbuf, recvbuf, count, datatype, op, self._handle, stream)

    def reduce(
        self,
        sendbuf: int,
        recvbuf: int,
        count: int,
        datatype: int,
        op: int,
        root: int,
        stream: int,
    ) -> None:
        """``ncclReduce``."""
        self._run("ncclReduce", sendbuf, recvbuf, count, datatype, op, root, self._handle, stream)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        """``ncclBroadcast`` in place."""
        self._run("ncclBroadcast", buff, buff, count, datatype, root, self._handle, stream)

    def reduceScatter(
        self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int
    ) -> None:
        """``ncclReduceScatter``."""
        self._run(
            "ncclReduceScatter", sendbuf, recvbuf, recvcount, datatype, op, self._handle, stream
        )

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        """``ncclAllGather``."""
        self._run("ncclAllGather", sendbuf, recvbuf, count, datatype, self._handle, stream)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        """``ncclSend``."""
        self._run("ncclSend", sendbuf, count, datatype, peer, self._handle, stream)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        """``ncclRecv``."""
        self._run("ncclRecv", recvbuf, count, datatype, peer, self._handle, stream)

    def groupStart(self) -> None:
        """``ncclGroupStart``."""
        self._lib.check(self._fn["ncclGroupStart"](), "ncclGroupStart")

    def groupEnd(self) -> None:
        """``ncclGroupEnd``, then wait while this communicator is in progress."""
        self._run("ncclGroupEnd")

    def check_async_error(self) -> None:
        """Raise :class:`NcclFailure` if NCCL reported an asynchronous error."""
        state = self.state()
        if state not in (0, IN_PROGRESS):
            self._lib.check(state, "ncclCommGetAsyncError")

    def abort(self) -> None:
        """``ncclCommAbort``; later calls fail. Idempotent."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self._fn["ncclCommAbort"](handle)

    def destroy(self) -> None:
        """``ncclCommFinalize`` (waited for), then ``ncclCommDestroy``; where finalizing
        fails or does not settle within the timeout, ``ncclCommAbort`` instead. Never
        raises, as cupy's ``destroy``. Idempotent."""
        if self._handle is None:
            return
        try:
            self._run("ncclCommFinalize", self._handle)
        except (NcclFailure, TimeoutError):
            self.abort()  # _settle aborted it already where it timed out: then a no-op
            return
        handle, self._handle = self._handle, None
        self._fn["ncclCommDestroy"](handle)
