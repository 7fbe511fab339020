"""How ranks of one host share a buffer: the memory mechanism under the CUDA IPC protocol.

The protocol (:mod:`.communicator`) is written once over :class:`PeerMemory`: each rank
allocates a *window* of its own (:meth:`PeerMemory.allocate`), exports it as bytes (a
handle) that travel through the job's store, and every peer opens it once
(:meth:`PeerMemory.open`) and reads it with the array module :attr:`PeerMemory.xp`. Two
mechanisms implement it:

- :class:`CudaIpcMemory`: device memory from ``cudaMalloc``, exported with
  ``cudaIpcGetMemHandle`` and opened with ``cudaIpcOpenMemHandle`` (cupy's runtime
  bindings); the work runs on a stream of the communicator's, ordered after the caller's
  current stream and before its later work. Writes into a window are made visible to peers
  before the per-call host handshake either by an interprocess event
  (``cudaIpcGetEventHandle``) that peers' streams wait on (the default: no host
  synchronize) or, with ``MESHCOMM_CUDA_IPC_EVENTS=0``, by synchronizing that stream.
- :class:`SharedMemoryStandIn`: host memory in a ``memfd`` (numpy over ``mmap``), opened by
  peers through ``/proc/<pid>/fd/<n>``, so the same protocol runs on a CPU: the tests run
  every collective over it at worlds 1-8 (``tests/test_cuda_ipc.py``).

cupy is imported only when a :class:`CudaIpcMemory` is made.

Example:
    >>> import numpy as np
    >>> mem = SharedMemoryStandIn()
    >>> window = mem.allocate(64)
    >>> window.view[:4] = 7
    >>> peer = mem.open(window.handle, 64)  # as a peer would, from the handle's bytes
    >>> peer.view[:4].tolist(), mem.opens
    ([7, 7, 7, 7], 1)
    >>> mem.close_opened(peer); mem.free(window)
"""

from __future__ import annotations

import contextlib
import mmap
import os
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from types import ModuleType
from typing import Any

import numpy as np

from meshcomm.errors import CommError, ProtocolError

__all__ = [
    "EVENTS_ENV",
    "CudaIpcMemory",
    "Opened",
    "PeerMemory",
    "SharedMemoryStandIn",
    "Window",
    "events_requested",
]

#: ``1``: order windows across processes with CUDA IPC events instead of a host synchronize.
EVENTS_ENV = "MESHCOMM_CUDA_IPC_EVENTS"


def events_requested() -> bool:
    """Whether windows are ordered with interprocess events: yes unless :data:`EVENTS_ENV`
    says ``0``/``off``/``false``/``no`` (then a stream synchronize before each handshake).

    Events are the default: with two ranks on an H100, an all_reduce took 0.65x the
    synchronize's time at 8 B, 0.52x at 1 MiB and 0.25x at 64 MiB (docs/benchmarks.md).

    Example:
        >>> os.environ[EVENTS_ENV] = "0"; events_requested()
        False
        >>> del os.environ[EVENTS_ENV]; events_requested()
        True
    """
    return os.environ.get(EVENTS_ENV, "").strip().lower() not in ("0", "off", "false", "no")


class Window:
    """This rank's window: ``view`` (a 1-D uint8 array of ``nbytes`` of :attr:`PeerMemory.xp`)
    and ``handle`` (the bytes a peer opens it with).

    Attributes:
        view: the window's bytes.
        handle: what :meth:`PeerMemory.open` takes, in another process.
        nbytes: its size.
        token: what the mechanism needs to free it.

    Example:
        >>> w = Window(np.zeros(4, np.uint8), b"handle", 4, None)
        >>> w.nbytes, w.handle
        (4, b'handle')
    """

    __slots__ = ("handle", "nbytes", "token", "view")

    def __init__(self, view: Any, handle: bytes, nbytes: int, token: Any) -> None:
        self.view, self.handle, self.nbytes, self.token = view, handle, nbytes, token


class Opened:
    """A peer's window opened here: ``view`` (its bytes) and what closing it needs.

    Attributes:
        view: the peer's window, a 1-D uint8 array of :attr:`PeerMemory.xp`.
        event: the peer's interprocess event, opened here (CUDA with events), else None.
        token: what the mechanism needs to close it.

    Example:
        >>> Opened(np.zeros(2, np.uint8), None).event is None
        True
    """

    __slots__ = ("event", "token", "view")

    def __init__(self, view: Any, token: Any, event: Any = None) -> None:
        self.view, self.token, self.event = view, token, event


class PeerMemory(ABC):
    """The memory mechanism under the protocol: windows, their handles, and the ordering
    of the work that writes and reads them.

    The protocol calls, per collective: :meth:`running` around everything it does (work is
    ordered after the caller's and before its later work); :meth:`before_write` (wait until
    the peers no longer read this rank's slot), its writes, :meth:`written` (make them
    visible to peers, before the host handshake), the handshake, :meth:`before_read` (the
    peers' writes are visible here), its reads.

    Attributes:
        name: what the mechanism is called in messages (``"cuda_ipc"``, ``"shm"``).
        xp: the array module of windows and of the buffers the collectives take.
        opens: how many peer windows were opened so far (the tests check the cache with it).

    Example:
        >>> mem: PeerMemory = SharedMemoryStandIn()
        >>> mem.name, mem.xp.__name__, mem.fresh().opens
        ('shm', 'numpy', 0)
    """

    name = "abstract"
    xp: ModuleType = np

    def __init__(self) -> None:
        self.opens = 0

    @abstractmethod
    def allocate(self, nbytes: int) -> Window:
        """A new window of ``nbytes`` for this rank, exported."""

    @abstractmethod
    def open(self, handle: bytes, nbytes: int, event: bytes = b"") -> Opened:
        """A peer's window of ``nbytes`` from its ``handle`` (counted in :attr:`opens`),
        with its interprocess ``event`` where it exported one (:meth:`event_handle`).

        Raises:
            CommError: it cannot be opened here (another host, no peer access).
        """

    @abstractmethod
    def close_opened(self, opened: Opened) -> None:
        """Close a peer's window opened here (its cache entry was invalidated)."""

    @abstractmethod
    def free(self, window: Window) -> None:
        """Free this rank's window (no peer reads it any more)."""

    def running(self) -> AbstractContextManager[Any]:
        """The context every collective's work runs in. Default: none (host memory)."""
        return nullcontext()

    def before_write(self, peers: list[Opened]) -> None:  # noqa: B027 - optional hook
        """Before this rank writes its slot: the peers' reads of it (two calls ago) are
        done. Default: nothing (host reads finish before the next handshake)."""

    def written(self) -> None:  # noqa: B027 - optional hook
        """This rank's writes reach its peers (before the host handshake). Default: nothing."""

    def before_read(self, peers: list[Opened]) -> None:  # noqa: B027 - optional hook
        """The peers' writes (before their handshake) are visible to this rank's reads."""

    def event_handle(self) -> bytes:
        """This rank's interprocess event, exported (empty: none)."""
        return b""

    def fresh(self) -> PeerMemory:
        """A new mechanism of the same kind, for a sub-communicator (its own stream)."""
        return type(self)()

    def synchronize(self) -> None:  # noqa: B027 - optional hook
        """Wait on the host for the work queued here (a barrier's). Default: nothing."""

    def settle(self, token: Any) -> None:  # noqa: B027 - optional hook
        """Wait on the host for the work a :meth:`ready_token` stands for (None: none)."""

    def completion_probe(self) -> Any:
        """What :meth:`~meshcomm.backends.base.Communicator.completion_probe` returns."""
        return None

    def ready_token(self) -> Any:
        """What :meth:`~meshcomm.backends.base.Communicator.ready_token` returns."""
        return None

    def to_host(self, x: Any) -> np.ndarray:
        """A host copy of ``x`` (point to point is staged through host memory)."""
        return np.ascontiguousarray(x)

    def from_host(self, host: np.ndarray, out: Any | None) -> Any:
        """``host`` in this mechanism's module: into ``out`` when given."""
        if out is None:
            return host
        out[...] = host.reshape(out.shape)
        return out

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the mechanism itself holds (streams, events)."""


class SharedMemoryStandIn(PeerMemory):
    """Host memory standing in for device memory: windows in a ``memfd`` mapped with
    ``mmap``, numpy views; a peer opens ``/proc/<pid>/fd/<n>``. The file has no name, so
    nothing is left behind when a rank dies.

    Example:
        >>> mem = SharedMemoryStandIn()
        >>> w = mem.allocate(8); w.view.nbytes, w.handle.startswith(b"/proc/")
        (8, True)
        >>> mem.free(w)
    """

    name = "shm"
    xp = np

    def allocate(self, nbytes: int) -> Window:
        fd = os.memfd_create("meshcomm-ipc-window", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, max(1, nbytes))
            mm = mmap.mmap(fd, max(1, nbytes))
        except OSError as exc:
            os.close(fd)
            raise CommError(f"cannot allocate a shared window of {nbytes} bytes: {exc}") from exc
        handle = f"/proc/{os.getpid()}/fd/{fd}".encode()
        view = np.frombuffer(mm, np.uint8, nbytes)
        return Window(view, handle, nbytes, (fd, mm))

    def open(self, handle: bytes, nbytes: int, event: bytes = b"") -> Opened:
        path = handle.decode("ascii", "replace")
        if not path.startswith("/proc/"):
            raise ProtocolError(f"a shared window's handle must be a /proc path, got {path!r}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise CommError(f"cannot open a peer's window {path}: {exc}") from exc
        try:
            if os.fstat(fd).st_size < nbytes:
                raise ProtocolError(f"{path} is smaller than the {nbytes} bytes announced")
            mm = mmap.mmap(fd, max(1, nbytes))
        finally:
            os.close(fd)
        self.opens += 1
        return Opened(np.frombuffer(mm, np.uint8, nbytes), mm)

    def close_opened(self, opened: Opened) -> None:
        opened.view = None
        _unmap(opened.token)

    def free(self, window: Window) -> None:
        fd, mm = window.token
        window.view = None
        _unmap(mm)
        os.close(fd)


def _unmap(mm: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a caller still holds a view: it keeps the mapping
        mm.close()


class CudaIpcMemory(PeerMemory):
    """Device memory shared by CUDA IPC (cupy's runtime bindings), on the current device.

    Windows are plain ``cudaMalloc`` allocations (not cupy's pool, whose blocks share one
    allocation: a handle names the whole allocation), exported with ``cudaIpcGetMemHandle``
    and opened with ``cudaIpcOpenMemHandle(..., cudaIpcMemLazyEnablePeerAccess)``, which
    works for ranks on one GPU and, with peer access, on two.

    The work of each call runs on a non-blocking stream of this object's, after an event
    recorded on the caller's current stream; the caller's stream then waits for it (the
    nccl backend's rule: no host synchronize for the caller). ``events`` (default
    :func:`events_requested`): peers' streams wait on this rank's interprocess event
    instead of this rank synchronizing its stream before the handshake.

    Raises:
        ImportError: cupy is missing.

    Example (needs a GPU and cupy):
        >>> mem = CudaIpcMemory()                          # doctest: +SKIP
        >>> window = mem.allocate(1 << 20)                 # doctest: +SKIP
        >>> len(window.handle)                             # doctest: +SKIP
        64
    """

    name = "cuda_ipc"

    def __init__(self, events: bool | None = None, device_id: int | None = None) -> None:
        super().__init__()
        import cupy

        self.xp = cupy
        self._rt = cupy.cuda.runtime
        self.device_id = int(self._rt.getDevice()) if device_id is None else device_id
        self.events = events_requested() if events is None else events
        with cupy.cuda.Device(self.device_id):
            self._stream = cupy.cuda.Stream(non_blocking=True)
            self._ready = cupy.cuda.Event(block=False, disable_timing=True)
            self._done = cupy.cuda.Event(block=False, disable_timing=True)
            self._mine = (
                cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
                if self.events
                else None
            )
        self._opened_events: dict[bytes, int] = {}

    def _array(self, ptr: int, nbytes: int, owner: Any) -> Any:
        cupy = self.xp
        memory = cupy.cuda.UnownedMemory(ptr, nbytes, owner, self.device_id)
        return cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))

    def allocate(self, nbytes: int) -> Window:
        ptr = int(self._rt.malloc(max(1, nbytes)))
        try:
            handle = bytes(self._rt.ipcGetMemHandle(ptr))
        except Exception:
            self._rt.free(ptr)
            raise
        return Window(self._array(ptr, nbytes, self), handle, nbytes, ptr)

    def open(self, handle: bytes, nbytes: int, event: bytes = b"") -> Opened:
        try:
            ptr = int(self._rt.ipcOpenMemHandle(handle, self._rt.cudaIpcMemLazyEnablePeerAccess))
        except Exception as exc:  # cupy's CUDARuntimeError
            raise CommError(
                f"cudaIpcOpenMemHandle failed on device {self.device_id}: {exc} (a peer on "
                "another host, or GPUs without peer access)"
            ) from exc
        self.opens += 1
        return Opened(
            self._array(ptr, nbytes, self), ptr, self.open_event(event) if event else None
        )

    def open_event(self, handle: bytes) -> int:
        """A peer's interprocess event (opened once per handle)."""
        found = self._opened_events.get(handle)
        if found is None:
            found = self._opened_events[handle] = int(self._rt.ipcOpenEventHandle(handle))
        return found

    def close_opened(self, opened: Opened) -> None:
        ptr, opened.view = opened.token, None
        self._stream.synchronize()  # no read of it is in flight
        self._rt.ipcCloseMemHandle(ptr)

    def free(self, window: Window) -> None:
        window.view = None
        self._stream.synchronize()
        self._rt.free(window.token)

    def running(self) -> AbstractContextManager[Any]:
        return _OnStream(self)

    def event_handle(self) -> bytes:
        if self._mine is None:
            return b""
        return bytes(self._rt.ipcGetEventHandle(self._mine.ptr))

    def before_write(self, peers: list[Opened]) -> None:
        self._wait(peers)

    def written(self) -> None:
        if self._mine is None:
            self._stream.synchronize()  # the copy into the window is done before the handshake
        else:
            self._mine.record(self._stream)

    def before_read(self, peers: list[Opened]) -> None:
        self._wait(peers)

    def _wait(self, peers: list[Opened]) -> None:
        if self._mine is None:
            return
        stream = self._stream.ptr
        for peer in peers:
            if peer.event is not None:
                self._rt.streamWaitEvent(stream, peer.event, 0)

    def completion_probe(self) -> Any:
        done = self.xp.cuda.Event(block=False, disable_timing=True)
        done.record(self.xp.cuda.get_current_stream())
        return lambda: bool(done.done)

    def ready_token(self) -> Any:
        ready = self.xp.cuda.Event(block=False, disable_timing=True)
        ready.record(self.xp.cuda.get_current_stream())
        return ready

    def fresh(self) -> PeerMemory:
        return CudaIpcMemory(self.events, self.device_id)  # a sub-group may be made elsewhere

    def synchronize(self) -> None:
        self._stream.synchronize()

    def settle(self, token: Any) -> None:
        if token is not None:
            token.synchronize()

    def to_host(self, x: Any) -> np.ndarray:
        return np.ascontiguousarray(self.xp.asnumpy(x))  # waits for the current stream

    def from_host(self, host: np.ndarray, out: Any | None) -> Any:
        if out is None:
            return self.xp.asarray(host)
        out.set(host.reshape(out.shape))
        return out

    def close(self) -> None:
        self._stream.synchronize()


class _OnStream:
    """The stream of a :class:`CudaIpcMemory` current for one call, after the caller's."""

    def __init__(self, mem: CudaIpcMemory) -> None:
        self._mem = mem

    def __enter__(self) -> None:
        mem = self._mem
        self._device = mem.xp.cuda.Device(mem.device_id)
        self._device.__enter__()  # the thread's current device may be another
        caller = mem.xp.cuda.get_current_stream()
        mem._ready.record(caller)
        mem._stream.wait_event(mem._ready)
        self._caller = caller
        mem._stream.__enter__()

    def __exit__(self, *exc: object) -> None:
        mem = self._mem
        mem._stream.__exit__(*exc)
        mem._done.record(mem._stream)
        self._caller.wait_event(mem._done)
        self._device.__exit__(*exc)
