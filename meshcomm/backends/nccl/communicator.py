"""The nccl backend's Communicator: collectives on GPU buffers, queued on the caller's stream.

Buffers are 1-D, C-contiguous device arrays (cupy, or anything with
``__cuda_array_interface__``) on the device current when the communicator first ran.

**Streams.** A call queues its NCCL kernel on the caller's current stream: it runs after
the caller's earlier work there, the call returns without synchronizing the host, and the
result is safe to use on the caller's stream (torch's ``wait_tensor`` semantics). A call
run later on another thread (a :meth:`NcclCommunicator.ready_token` stands for its caller)
runs on a stream of the communicator's, between an event of the caller's and the caller's
stream. A call on another stream than the last waits for the last one first: NCCL runs a
communicator's calls in one order on every rank. Only ``barrier`` and ``recv`` (which must
learn the incoming shape) wait on the host.

**Bootstrap.** The NCCL communicator is made on the first call, by every member at once
(members make their collectives in the same order): rank 0 draws the unique id and puts it
in the job's store (authenticated with the job's secret), the others read it there.
``ncclCommInitRank`` has no timeout of its own, so it runs in a helper thread and a member
missing past the timeout is named from the store's arrival keys. With the native binding
(``MESHCOMM_NCCL_NATIVE=1``, :mod:`._native`) the init is NCCL's non-blocking one, polled
here and aborted at the timeout, and a live communicator's collective splits (a mesh's
axes) are ``ncclCommSplit`` (:meth:`NcclCommunicator.split_sub`).

**Faults.** An NCCL call returns once queued, so a peer that never calls is found by the
watchdog (:mod:`._watchdog`): past the timeout it aborts the NCCL communicator, and the
next call on this communicator raises ``CommTimeout`` naming the operation that did not
complete and the group; every later call fails fast with that reason.

Example (needs a GPU, cupy and NCCL):
    >>> import cupy as cp                                         # doctest: +SKIP
    >>> from meshcomm.store import HashStore                      # doctest: +SKIP
    >>> comm = NcclCommunicator.create_world(0, 1, HashStore(), 10.0)  # doctest: +SKIP
    >>> x = cp.arange(4, dtype=cp.float32)                        # doctest: +SKIP
    >>> comm.all_reduce(x, ReduceOp.SUM); x                       # doctest: +SKIP
    array([0., 1., 2., 3.], dtype=float32)
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshcomm.backends.base import Communicator
from meshcomm.backends.nccl import _lib, _native
from meshcomm.backends.nccl._watchdog import WATCHDOG
from meshcomm.errors import CommError, CommTimeout, InvalidArgument, ProtocolError
from meshcomm.reduction import ReduceOp
from meshcomm.store.base import Store

__all__ = ["NATIVE_VARIABLE", "NcclCommunicator", "native_requested"]

#: Key prefix of the world communicator's bootstrap in the job's store.
_PREFIX = "meshcomm/nccl"
#: A point-to-point header: tag, dtype index, ndim, then up to _MAX_NDIM extents.
_MAX_NDIM = 8
_HEADER = 3 + _MAX_NDIM
#: Dtypes a message can carry, by their index in the header.
_MESSAGE_DTYPES = (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128", "bfloat16",
)  # fmt: skip
#: How often host waits (barrier, recv, init) look at their event.
_HOST_POLL_SECONDS = 0.0005
#: The variable that turns the native binding on (off until it has run on a GPU).
NATIVE_VARIABLE = "MESHCOMM_NCCL_NATIVE"


def native_requested() -> bool:
    """Whether ``MESHCOMM_NCCL_NATIVE`` asks for the native binding (``1``/``on``/``true``).

    Example:
        >>> import os
        >>> os.environ.pop(NATIVE_VARIABLE, None) and None; native_requested()
        False
    """
    return os.environ.get(NATIVE_VARIABLE, "").strip().lower() in ("1", "on", "true", "yes")


def _address(x: Any) -> int:
    """The device pointer of a cupy array (or of anything with ``__cuda_array_interface__``)."""
    data = getattr(x, "data", None)
    ptr = getattr(data, "ptr", None)
    if isinstance(ptr, int):
        return ptr
    return int(x.__cuda_array_interface__["data"][0])


def _nbytes(x: Any) -> int:
    return int(x.size) * int(np.dtype(x.dtype).itemsize)


def _dtype_index(dtype: np.dtype) -> int:
    from meshcomm.group.arrays import dtype_name

    name = dtype_name(dtype)
    if name not in _MESSAGE_DTYPES:
        raise TypeError(f"send: the nccl backend cannot carry dtype {name}")
    return _MESSAGE_DTYPES.index(name)


def _dtype_at(index: int) -> np.dtype:
    name = _MESSAGE_DTYPES[index]
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class NcclCommunicator(Communicator):
    """Collectives over NCCL for one group, on cupy (or CUDA array interface) buffers.

    Args:
        rank: this process's rank in the communicator.
        global_ranks: the world rank of each member.
        timeout: seconds an operation may take before the watchdog aborts it.
        store: the job's store (the unique id and the arrival keys go through it).
        prefix: this communicator's keys in the store.
    """

    backend_name = "nccl"
    array_module = "cupy"

    def __init__(
        self,
        rank: int,
        global_ranks: Sequence[int],
        timeout: float,
        store: Store,
        prefix: str,
    ) -> None:
        super().__init__(rank, global_ranks, timeout)
        self._store = store
        self._prefix = prefix
        self._cp, self._nccl_mod = _lib.load()
        self._native = native_requested()
        if self._native:  # refused here, at init, rather than at the first GPU call
            try:
                _native.load_library()
            except ImportError as exc:
                asked = f"{NATIVE_VARIABLE}=1 asks for the native binding"
                raise ImportError(f"{asked}: {exc}") from exc
        self._nccl: Any = None
        self._grouping: Any = self._nccl_mod  # what has groupStart/groupEnd for self._nccl
        self._stream: Any = None
        self._failure: str | None = None
        self._failure_kind: type[CommError] = CommError
        self._closed = False
        self._subs: dict[tuple[int, ...], int] = {}
        self._lock = threading.Lock()
        # Messages this rank sent itself, by tag, oldest first: NCCL pairs a send to self
        # only with a receive in the same group call, which send() and recv() are not.
        self._to_self: dict[int, list[Any]] = {}
        self._codes: dict[tuple[Any, ReduceOp, str], tuple[int, int, int]] = {}
        # What the watchdog calls each operation ("all_reduce over 'tp'"), by its name.
        self._watch_names: dict[str, str] = {}
        # The last call's done event and the stream it ran on (see _queue).
        self._last_done: Any = None
        self._last_stream = 0
        self._spare_events: list[Any] = []  # completed events, refilled by the watchdog
        # The GPU this communicator's NCCL communicator binds to: the device current when the
        # world was made (init sets it from LOCAL_RANK), whichever thread bootstraps it.
        self._device_id: int | None = None

    @classmethod
    def create_world(cls, rank: int, size: int, store: Store, timeout: float) -> NcclCommunicator:
        """The world communicator (its NCCL communicator is made on the first call).

        Raises:
            ImportError: cupy or NCCL is missing (the message names the extra).
            InvalidArgument: bad rank or size.
        """
        if not 0 <= rank < size:
            raise InvalidArgument(f"nccl: rank {rank} is not in [0, {size})")
        world = cls(rank, range(size), timeout, store, _PREFIX)
        world._device_id = int(world._cp.cuda.runtime.getDevice())
        return world

    def describe_as(self, label: str) -> None:
        """Name the group in errors and in the watchdog's reports from now on."""
        super().describe_as(label)
        self._watch_names = {}

    # -- lifetime ------------------------------------------------------------------------
    def _ready(self, what: str) -> Any:
        """The NCCL communicator (made now if this is the first call); raises if failed."""
        if self._closed:
            raise CommError(f"{what} {self.label}: the communicator was closed")
        if self._failure is not None:
            raise self._failure_kind(
                f"{what} {self.label}: the NCCL communicator failed earlier: {self._failure}"
            )
        if self._nccl is None or self._stream is None:
            if self._device_id is None:
                self._device_id = int(self._cp.cuda.runtime.getDevice())
            with self._cp.cuda.Device(self._device_id):
                if self._nccl is None:
                    self._adopt(self._bootstrap(what))
                self._stream = self._cp.cuda.Stream(non_blocking=True)
        return self._nccl

    def _adopt(self, comm: Any) -> None:
        """Use ``comm`` (cupy's, or a :class:`~._native.NativeComm`, which groups its own
        calls: a non-blocking communicator is polled after ``ncclGroupEnd``)."""
        self._nccl = comm
        self._grouping = comm if isinstance(comm, _native.NativeComm) else self._nccl_mod

    def _event(self) -> Any:
        """A CUDA event without timing (cheaper to record and query than a timed one)."""
        return self._cp.cuda.Event(block=False, disable_timing=True)

    def check_reduction(self, dtype: np.dtype, op: ReduceOp, what: str) -> None:
        """Raise ``TypeError`` (naming ``what``) unless NCCL reduces ``dtype`` with ``op``."""
        self._reduction(dtype, op, what)

    def _reduction(self, dtype: Any, op: ReduceOp, what: str) -> tuple[int, int, int]:
        key = (dtype, op, what)
        codes = self._codes.get(key)
        if codes is None:
            codes = self._codes[key] = _lib.reduction_codes(np.dtype(dtype), op, what)
        return codes

    def _bootstrap(self, what: str) -> Any:
        store, key = self._store, f"{self._prefix}/uid"
        lib = _native.load_library() if self._native else None
        if self.rank == 0:
            drawn = lib.unique_id() if lib else self._nccl_mod.get_unique_id()
            store.set(key, _lib.id_to_bytes(drawn))
        store.set(f"{self._prefix}/arrived/{self.rank}", b"1")
        try:
            store.wait([key], timeout=self.timeout)
        except Exception as exc:
            raise CommTimeout(
                f"{what} {self.label}: rank {self.global_ranks[0]} did not publish the NCCL "
                f"unique id within {self.timeout:g} s"
            ) from exc
        unique_id = _lib.id_from_bytes(store.get(key))
        if lib is not None:
            return self._native_init(what, lib, unique_id)
        made: dict[str, Any] = {}

        device = self._cp.cuda.Device()  # the communicator's (``_ready`` made it current)

        def init() -> None:
            try:
                device.use()  # NCCL binds to the device current in the thread that inits
                made["comm"] = _lib.make_communicator(
                    self._nccl_mod, self.size, unique_id, self.rank
                )
            except Exception as exc:  # handed to the waiting thread
                made["error"] = exc

        thread = threading.Thread(target=init, name="meshcomm-nccl-init", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise self._init_timeout(what, "ncclCommInitRank")
        if "error" in made:
            raise CommError(f"{what} {self.label}: ncclCommInitRank failed: {made['error']}")
        return made["comm"]

    def _native_init(self, what: str, lib: _native.Library, unique_id: bytes) -> Any:
        """NCCL's non-blocking init on this thread, aborted past the timeout."""
        try:
            return _native.NativeComm.init_rank(lib, self.size, unique_id, self.rank, self.timeout)
        except TimeoutError:
            raise self._init_timeout(what, "ncclCommInitRankConfig") from None
        except _native.NcclFailure as exc:
            raise CommError(f"{what} {self.label}: {exc}") from exc

    def _init_timeout(self, what: str, call: str) -> CommTimeout:
        """The timeout of an init, naming the members that never arrived."""
        store = self._store
        missing = [
            self.global_ranks[r]
            for r in range(self.size)
            if not store.check([f"{self._prefix}/arrived/{r}"])
        ]
        who = f"ranks {missing} never arrived" if missing else "every rank arrived"
        return CommTimeout(
            f"{what} {self.label}: {call} did not complete within {self.timeout:g} s ({who})"
        )

    def async_error(self) -> str | None:
        """NCCL's asynchronous error of this communicator, in words, or None."""
        comm = self._nccl
        if comm is None:
            return None
        try:
            comm.check_async_error()
        except Exception as exc:  # cupy's NcclError
            return str(exc)
        return None

    def fail(self, reason: str, timed_out: bool) -> None:
        """Abort the NCCL communicator; every later call raises ``reason`` (the watchdog's:
        ``CommTimeout`` if ``timed_out``, else ``CommError``)."""
        with self._lock:
            if self._failure is None:
                self._failure = reason
                self._failure_kind = CommTimeout if timed_out else CommError
            comm = self._nccl
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        """Destroy the NCCL communicator (abort it if it failed). Idempotent."""
        self._release(abort=False)

    def abort(self) -> None:
        """``ncclCommAbort`` without waiting for the stream: a peer may be gone
        (:mod:`meshcomm.elastic` re-forms the world). Idempotent."""
        self._release(abort=True)

    def _release(self, abort: bool) -> None:
        if self._closed:
            return
        self._closed = True
        WATCHDOG.forget(self)
        comm, self._nccl = self._nccl, None
        if comm is not None:
            if self._failure is None and not abort:
                if self._last_done is not None:
                    self._last_done.synchronize()  # every call queued so far has ended
                comm.destroy()
            else:
                comm.abort()

    # -- queueing ------------------------------------------------------------------------
    def _queue(
        self,
        what: str,
        launch: Callable[[Any, int], None],
        reuse: bool = True,
        after: tuple[Any, Any] | None = None,
    ) -> Any:
        """Run ``launch(nccl_comm, stream_ptr)`` ordered after the caller's current stream
        and before its later work; return the done event.

        A call made on the caller's thread (``after`` None) is queued on the caller's
        current stream itself: the caller's later work waits for it there, as it would for
        a call on a stream of the communicator's that the caller's stream waited on, and
        the two events and two waits such a stream needs per call are saved (about 2.7 us
        on an H100, by the parts bench/nccl_overhead.py times). ``after``: a
        :meth:`ready_token` taken earlier (a call run later on another thread): its event
        and stream stand for the caller's, and the call runs on the communicator's own
        stream, between the two.

        NCCL runs one communicator's calls in the order they were queued on every rank,
        which two streams could break (two kernels of one communicator at once can wait
        on each other for good): a call queued on another stream than the last waits for
        the last call's done event first.

        ``reuse``: the done event may be recorded again once it completed (False where the
        caller waits on it: another thread's call could record it meanwhile)."""
        comm = self._ready(what)
        if after is None:
            caller = stream = self._cp.cuda.get_current_stream()
        else:
            ready, caller = after
            stream = self._stream
            stream.wait_event(ready)
        last = self._last_done
        if last is not None and stream.ptr != self._last_stream:
            stream.wait_event(last)
        try:
            launch(comm, stream.ptr)
        except TimeoutError as exc:  # the native binding's call stayed in progress (aborted)
            self.fail(f"{what} did not settle: {exc}", True)
            raise CommTimeout(f"{what} {self.label}: NCCL: {exc}") from exc
        except Exception as exc:  # NcclError: a bad argument or an aborted communicator
            raise CommError(f"{what} {self.label}: NCCL: {exc}") from exc
        spare = self._spare_events
        done = spare.pop() if spare and reuse else self._event()
        done.record(stream)
        if stream is not caller:
            caller.wait_event(done)
        self._last_done, self._last_stream = done, stream.ptr
        name = self._watch_names.get(what)
        if name is None:
            name = self._watch_names[what] = f"{what} {self.label}"
        WATCHDOG.watch(self, done, self.timeout, name, spare if reuse else None)
        return done

    def _grouped(self, what: str, launch: Callable[[Any, int], None], reuse: bool = True) -> Any:
        """:meth:`_queue` with the launches inside ``ncclGroupStart`` / ``ncclGroupEnd``."""

        def grouped(comm: Any, stream: int) -> None:
            grouping = self._grouping
            grouping.groupStart()
            try:
                launch(comm, stream)
            finally:
                grouping.groupEnd()

        return self._queue(what, grouped, reuse)

    def _host_wait(self, what: str, done: Any) -> None:
        """Wait on the host for ``done``, raising what the watchdog found, or a timeout."""
        deadline = time.monotonic() + self.timeout + 1.0
        while not done.done:
            if self._failure is not None:
                self._ready(what)  # raises the watchdog's reason
            if time.monotonic() > deadline:
                raise CommTimeout(f"{what} {self.label}: not completed within {self.timeout:g} s")
            time.sleep(_HOST_POLL_SECONDS)

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(self, buf: Any, op: ReduceOp) -> None:
        """Reduce ``buf`` across ranks, in place (see :mod:`._lib` for the dtypes and ops)."""
        dtype, code, per = self._reduction(buf.dtype, op, "all_reduce")
        count, ptr = buf.size * per, _address(buf)
        self._queue("all_reduce", lambda c, s: c.allReduce(ptr, ptr, count, dtype, code, s))

    def all_reduce_out(self, send: Any, recv: Any, op: ReduceOp) -> None:
        """Reduce ``send`` across ranks into ``recv`` (NCCL's out-of-place allReduce)."""
        self.all_reduce_out_of(send.dtype, op)(send, recv)

    def all_reduce_out_of(self, dtype: np.dtype, op: ReduceOp) -> Callable[[Any, Any], None]:
        """:meth:`all_reduce_out` for buffers of ``dtype`` reduced with ``op``, with the
        reduction's codes looked up now, once (a device plan's per-call path).

        Raises:
            TypeError: NCCL does not reduce ``dtype`` with ``op``.
        """
        nccl_dtype, code, per = self._reduction(dtype, op, "all_reduce")
        queue = self._queue

        def run(send: Any, recv: Any) -> None:
            count, src, dst = send.size * per, _address(send), _address(recv)
            queue("all_reduce", lambda c, s: c.allReduce(src, dst, count, nccl_dtype, code, s))

        return run

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp) -> None:
        """Reduce ``send`` across ranks; rank r gets block r in ``recv``."""
        dtype, code, per = self._reduction(send.dtype, op, "reduce_scatter")
        count, src, dst = recv.size * per, _address(send), _address(recv)
        self._queue("reduce_scatter", lambda c, s: c.reduceScatter(src, dst, count, dtype, code, s))

    def reduce(self, buf: Any, root: int, op: ReduceOp) -> None:
        """Reduce ``buf`` onto ``root``, in place there."""
        dtype, code, per = self._reduction(buf.dtype, op, "reduce")
        count, ptr = buf.size * per, _address(buf)
        self._queue("reduce", lambda c, s: c.reduce(ptr, ptr, count, dtype, code, root, s))

    def all_gather(self, send: Any, recv: Any) -> None:
        """Fill ``recv`` with every rank's ``send``, by rank (as bytes: any dtype)."""
        count, src, dst = _nbytes(send), _address(send), _address(recv)
        self._queue("all_gather", lambda c, s: c.allGather(src, dst, count, _lib.BYTES, s))

    def broadcast(self, buf: Any, root: int) -> None:
        """Copy root's ``buf`` into every rank's ``buf``."""
        count, ptr = _nbytes(buf), _address(buf)
        self._queue("broadcast", lambda c, s: c.bcast(ptr, count, _lib.BYTES, root, s))

    def all_to_all(self, send: Any, recv: Any) -> None:
        """Block j of ``send`` to rank j; block i of ``recv`` from rank i (grouped send/recv)."""
        block = _nbytes(send) // self.size
        src, dst = _address(send), _address(recv)

        def launch(c: Any, s: int) -> None:
            for peer in range(self.size):
                c.send(src + peer * block, block, _lib.BYTES, peer, s)
                c.recv(dst + peer * block, block, _lib.BYTES, peer, s)

        self._grouped("all_to_all", launch)

    def gather(self, send: Any, recv: Any | None, root: int) -> None:
        """On root, fill ``recv`` with every rank's ``send``."""
        block, src = _nbytes(send), _address(send)
        dst = _address(recv) if self.rank == root and recv is not None else 0

        def launch(c: Any, s: int) -> None:
            if self.rank == root:
                for peer in range(self.size):
                    c.recv(dst + peer * block, block, _lib.BYTES, peer, s)
            c.send(src, block, _lib.BYTES, root, s)

        self._grouped("gather", launch)

    def scatter(self, send: Any | None, recv: Any, root: int) -> None:
        """Rank r receives block r of root's ``send`` into ``recv``."""
        block, dst = _nbytes(recv), _address(recv)
        src = _address(send) if self.rank == root and send is not None else 0

        def launch(c: Any, s: int) -> None:
            if self.rank == root:
                for peer in range(self.size):
                    c.send(src + peer * block, block, _lib.BYTES, peer, s)
            c.recv(dst, block, _lib.BYTES, root, s)

        self._grouped("scatter", launch)

    def barrier(self) -> None:
        """Return once every rank has entered (a one-element all_reduce, waited on the host)."""
        token = self._cp.zeros(1, dtype=self._cp.int32)
        ptr = _address(token)
        dtype, code, _ = _lib.reduction_codes(np.dtype(np.int32), ReduceOp.SUM, "barrier")
        done = self._queue("barrier", lambda c, s: c.allReduce(ptr, ptr, 1, dtype, code, s), False)
        self._host_wait("barrier", done)

    # -- point to point ------------------------------------------------------------------
    def send(self, array: Any, dst: int, tag: int) -> None:
        """Send ``array`` (its dtype and shape travel first, in a small header)."""
        if array.ndim > _MAX_NDIM:
            raise InvalidArgument(
                f"send {self.label}: the nccl backend sends arrays of up to {_MAX_NDIM} "
                f"dimensions, got {array.ndim}"
            )
        if dst == self.rank:
            self._ready("send")
            copy = self._cp.array(array, copy=True)  # on the caller's stream, as NCCL's would be
            self._to_self.setdefault(int(tag), []).append(copy)
            return
        head = np.zeros(_HEADER, np.int64)
        head[:3] = (tag, _dtype_index(np.dtype(array.dtype)), array.ndim)
        head[3 : 3 + array.ndim] = array.shape
        header = self._cp.asarray(head)
        body = self._cp.ascontiguousarray(array)
        hptr, bptr, nbytes = _address(header), _address(body), _nbytes(body)

        def launch(c: Any, s: int) -> None:
            c.send(hptr, _HEADER * 8, _lib.BYTES, dst, s)
            if nbytes:
                c.send(bptr, nbytes, _lib.BYTES, dst, s)

        self._grouped("send", launch)

    def recv(self, src: int | None, tag: int) -> tuple[Any, int]:
        """Receive an array sent to this rank by ``src`` with ``tag``.

        Raises:
            InvalidArgument: ``src`` is None (NCCL receives from a named rank only).
            ProtocolError: the message carries another tag.
        """
        if src is None:
            raise InvalidArgument(
                f"recv {self.label}: the nccl backend receives from a named rank only "
                "(NCCL has no any-source receive)"
            )
        if src == self.rank:
            return self._recv_from_self(tag), src
        header = self._cp.empty(_HEADER, dtype=self._cp.int64)
        hptr = _address(header)
        done = self._queue(
            "recv", lambda c, s: c.recv(hptr, _HEADER * 8, _lib.BYTES, src, s), reuse=False
        )
        self._host_wait("recv", done)
        head = self._cp.asnumpy(header)
        if int(head[0]) != tag:
            raise ProtocolError(
                f"recv {self.label}: rank {self.global_ranks[src]} sent tag {int(head[0])}, "
                f"rank {self.global_ranks[self.rank]} expected tag {tag}"
            )
        shape = tuple(int(n) for n in head[3 : 3 + int(head[2])])
        out = self._cp.empty(shape, dtype=_dtype_at(int(head[1])))
        nbytes, optr = _nbytes(out), _address(out)
        if nbytes:
            self._queue("recv", lambda c, s: c.recv(optr, nbytes, _lib.BYTES, src, s))
        return out, src

    def _recv_from_self(self, tag: int) -> Any:
        """The oldest message this rank sent itself with ``tag``.

        Raises:
            ProtocolError: none is waiting (it would never come: a rank's own sends precede
                its receives), naming the tags that are.
        """
        self._ready("recv")
        waiting = self._to_self.get(int(tag))
        if not waiting:
            tags = sorted(t for t, queued in self._to_self.items() if queued)
            raise ProtocolError(
                f"recv {self.label}: rank {self.global_ranks[self.rank]} receives from itself "
                f"with tag {tag}, but it sent itself nothing with that tag (waiting: tags {tags})"
            )
        return waiting.pop(0)

    def completion_probe(self) -> Callable[[], bool]:
        """An event recorded now on the caller's stream (which waits for this
        communicator's calls): its query says whether they and the work before finished."""
        done = self._event()
        done.record(self._cp.cuda.get_current_stream())
        return lambda: bool(done.done)

    def ready_token(self) -> tuple[Any, Any]:
        """An event recorded now on the caller's current stream, and that stream."""
        caller = self._cp.cuda.get_current_stream()
        ready = self._event()
        ready.record(caller)
        return ready, caller

    def send_payload(self, array: Any, dst: int, after: Any = None) -> None:
        """Send ``array``'s bytes to ``dst`` alone (no header: see the base class)."""
        nbytes, ptr = _nbytes(array), _address(array)
        if nbytes:
            self._queue("send", lambda c, s: c.send(ptr, nbytes, _lib.BYTES, dst, s), True, after)

    def recv_payload(self, out: Any, src: int, after: Any = None) -> None:
        """Receive the next payload from ``src`` into ``out`` (see the base class)."""
        nbytes, ptr = _nbytes(out), _address(out)
        if nbytes:
            self._queue("recv", lambda c, s: c.recv(ptr, nbytes, _lib.BYTES, src, s), True, after)

    def permute(self, send: Any, dst: int | None, recv: Any, src: int | None) -> None:
        """Send ``send`` to ``dst`` while receiving ``recv`` from ``src`` (either may be None)."""
        sptr, rptr = _address(send), _address(recv)
        sbytes, rbytes = _nbytes(send), _nbytes(recv)

        def launch(c: Any, s: int) -> None:
            if dst is not None:
                c.send(sptr, sbytes, _lib.BYTES, dst, s)
            if src is not None:
                c.recv(rptr, rbytes, _lib.BYTES, src, s)

        self._grouped("permute", launch)

    # -- groups --------------------------------------------------------------------------
    def can_split(self) -> bool:
        """Whether :meth:`split_sub` is ``ncclCommSplit``: with the native binding (asked
        for, or this communicator made by it) and no failure. A communicator not made yet
        is made in :meth:`split_sub` first (every member is there: the split is collective),
        so a mesh's axes all come from one NCCL communicator, as torch's ``new_group`` after
        an eager init (``device_id=``)."""
        if self._nccl is None:
            made_here = self._native
        else:
            made_here = isinstance(self._nccl, _native.NativeComm) and self._nccl.comm != 0
        return made_here and self._failure is None and not self._closed

    def split_sub(self, members: Sequence[int] | None) -> NcclCommunicator | None:
        """``ncclCommSplit``: collective over this communicator, where every member's
        :meth:`can_split` is True (the caller agrees on that first).

        Args:
            members: this rank's new communicator, as ranks of this one in new-rank order
                (the same list on each of them); None: this rank joins none.

        Raises:
            InvalidArgument: bad members (as :meth:`sub`).
            CommTimeout: the split did not complete within the timeout.
            CommError: NCCL failed.
        """
        comm = self._ready("split")  # made now, by every member, if it was not yet
        child = None if members is None else self.sub(members)
        try:
            # A colour per new communicator: its lowest member, never NOCOLOR (-1).
            color = _native.NOCOLOR if members is None else min(members)
            key = 0 if members is None else list(members).index(self.rank)
            made = comm.split(color, key)
        except TimeoutError as exc:
            raise CommTimeout(f"split {self.label}: {exc}") from exc
        except _native.NcclFailure as exc:
            raise CommError(f"split {self.label}: {exc}") from exc
        if child is not None:
            if made is None:
                raise CommError(f"split {self.label}: ncclCommSplit gave no communicator")
            child._adopt(made)
        return child

    def sub(self, ranks: Sequence[int]) -> NcclCommunicator:
        """A communicator over ``ranks`` (its NCCL communicator made on its first call).

        Members call it with the same list, in the same order relative to their other
        ``sub`` calls with that list; the n-th such call of each member gets the same keys.

        Raises:
            InvalidArgument: duplicate or out-of-range ranks, or this rank is not a member.
        """
        members = tuple(int(r) for r in ranks)
        me = self.global_ranks[self.rank]
        if len(set(members)) != len(members) or not all(0 <= r < self.size for r in members):
            raise InvalidArgument(
                f"rank {me}: sub ranks must be distinct ranks in [0, {self.size}), got "
                f"{list(ranks)}"
            )
        if self.rank not in members:
            raise InvalidArgument(f"rank {me}: sub is called by members only, not {members}")
        made = self._subs.get(members, 0)
        self._subs[members] = made + 1
        glob = [self.global_ranks[r] for r in members]
        prefix = f"{self._prefix}/sub/{'-'.join(map(str, glob))}/{made}"
        child = NcclCommunicator(members.index(self.rank), glob, self.timeout, self._store, prefix)
        child._device_id = self._device_id
        return child
