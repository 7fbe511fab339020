"""Collectives of ranks that share a GPU (or whose GPUs reach each other), through CUDA IPC.

NCCL refuses two ranks on one GPU. This device communicator lets them collect on the device
anyway: every rank keeps a *window* of device memory, exports it once as a CUDA IPC handle
through the job's (authenticated) store, and every peer opens it once; a collective copies
each rank's contribution into its window, and each rank reads its peers' windows with device
kernels (the array module's own operations: ``cupy.add(out, peer, out=out)`` and copies).
The host communicator it is given (a tcp communicator of the same members, its own) keeps
the order and finds the failures: one small all_gather per call is the handshake.

**One call** (:meth:`IpcCommunicator._exchange`), on every rank:

1. the window is grown if this call's contribution does not fit a slot (a new *generation*,
   its handle put in the store under ``<prefix>/window/<rank>/<generation>``);
2. the peers' reads of this rank's slot two calls ago are done
   (:meth:`~.memory.PeerMemory.before_write`), the contribution is copied into the slot of
   this call's parity (two slots: double buffering), and the copy is made visible to peers
   (:meth:`~.memory.PeerMemory.written`: a stream synchronize, or an interprocess event);
3. the handshake: an all_gather over the host communicator of six numbers per rank (window
   generation, slot bytes, collective, bytes, root and op, dtype). Every rank checks that
   every other called the same collective with the same sizes, root, op and dtype (a
   ``MismatchError`` naming both ranks and both calls otherwise: a wrong size must never
   read past a peer's window), and opens a peer's window whose generation it has not seen;
4. each rank reads what it needs from the peers' slots of this parity into its result.

A rank writes the slot of parity ``k % 2`` at call ``k`` only after the handshake of call
``k - 1``, which every peer enters after its reads of call ``k - 2`` are done (step 2 of
their call ``k - 1``), so one handshake per call is enough.

**The cache of opened windows** (:attr:`IpcCommunicator.opened`): a peer's window is opened
once per generation (``cudaIpcOpenMemHandle`` takes tens of microseconds to milliseconds)
and kept; it is invalidated (closed) where the peer's handshake shows a new generation (its
window grew) and at :meth:`IpcCommunicator.close` / ``abort``. A window this rank outgrew
is freed after the next call's handshake, when no peer reads it any more.

**Faults.** A dead or silent peer fails the handshake: the host communicator raises
``PeerError`` naming the rank, or ``CommTimeout`` after the timeout. A communicator that
failed refuses every later call with the first reason.

Point to point of device arrays is staged through host memory over the host communicator
(the collectives are what this path is for).

Example (the shared-memory stand-in, a world of one):
    >>> import numpy as np
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.store import HashStore
    >>> from meshcomm.backends.cuda_ipc.memory import SharedMemoryStandIn
    >>> comm = IpcCommunicator(SelfCommunicator(), SharedMemoryStandIn(), HashStore(), "ipc")
    >>> x = np.arange(4.0)
    >>> comm.all_reduce(x, ReduceOp.SUM); x
    array([0., 1., 2., 3.])
    >>> comm.close()
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshcomm.backends.base import Communicator
from meshcomm.backends.cuda_ipc.memory import Opened, PeerMemory, Window
from meshcomm.errors import CommError, InvalidArgument, MismatchError, ProtocolError
from meshcomm.group.arrays import dtype_name
from meshcomm.reduction import PRIMITIVE_OPS, ReduceOp, check_op_dtype
from meshcomm.store.base import Store

__all__ = ["MIN_SLOT_BYTES", "IpcCommunicator"]

#: The smallest slot of a window (two slots make a window).
MIN_SLOT_BYTES = 1 << 16
#: The handshake's numbers per rank: generation, slot bytes, collective, bytes, arg, dtype.
_HEAD = 6
_COLLECTIVES = (
    "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce",
    "gather", "scatter", "barrier",
)  # fmt: skip
_OPS = tuple(sorted(op.value for op in PRIMITIVE_OPS))
#: On bool, every primitive op is a logical one (numpy's add is or, multiply is and).
_BOOL_UFUNCS = {
    ReduceOp.SUM: "logical_or",
    ReduceOp.PROD: "logical_and",
    ReduceOp.MIN: "logical_and",
    ReduceOp.MAX: "logical_or",
    ReduceOp.BAND: "logical_and",
    ReduceOp.BOR: "logical_or",
    ReduceOp.BXOR: "logical_xor",
}
_UFUNCS = {
    ReduceOp.SUM: "add",
    ReduceOp.PROD: "multiply",
    ReduceOp.MIN: "minimum",
    ReduceOp.MAX: "maximum",
    ReduceOp.BAND: "bitwise_and",
    ReduceOp.BOR: "bitwise_or",
    ReduceOp.BXOR: "bitwise_xor",
}


def _dtype_code(dtype: Any) -> int:
    """A number every process gives the same dtype (numpy's type numbers of ml_dtypes'
    types depend on the import order)."""
    return zlib.crc32(dtype_name(np.dtype(dtype)).encode())


class IpcCommunicator(Communicator):
    """A device communicator for ranks of one host that share memory through ``memory``.

    Args:
        host: a host communicator of the same members, used by this one alone (the
            handshakes, point to point); closed with it.
        memory: the mechanism (:class:`~.memory.CudaIpcMemory`, or the CPU stand-in
            :class:`~.memory.SharedMemoryStandIn`); its module is the buffers' module.
        store: the job's store (window handles travel through it).
        prefix: this communicator's keys in the store (the same on every member).

    Attributes:
        opened: the cache of peers' windows opened here, ``{rank: (generation, Opened)}``.

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> from meshcomm.store import HashStore
        >>> from meshcomm.backends.cuda_ipc.memory import SharedMemoryStandIn
        >>> comm = IpcCommunicator(SelfCommunicator(), SharedMemoryStandIn(), HashStore(), "x")
        >>> recv = np.empty(3, np.int64)
        >>> comm.all_gather(np.array([1, 2, 3]), recv); recv.tolist(), comm.backend_name
        ([1, 2, 3], 'cuda_ipc')
        >>> comm.close()
    """

    backend_name = "cuda_ipc"

    def __init__(self, host: Communicator, memory: PeerMemory, store: Store, prefix: str) -> None:
        super().__init__(host.rank, host.global_ranks, host.timeout)
        self.array_module = memory.xp.__name__
        self.label = host.label
        self._host, self._mem, self._store, self._prefix = host, memory, store, prefix
        self._window: Window | None = None
        self._generation = 0
        self._slot = 0
        self._retired: list[tuple[int, Window]] = []  # (the call that retired it, window)
        self.opened: dict[int, tuple[int, Opened]] = {}
        self._calls = 0
        self._failure: str | None = None
        self._closed = False
        self._lock = threading.RLock()
        self._subs: dict[tuple[int, ...], int] = {}

    def describe_as(self, label: str) -> None:
        """Name the group in errors, here and in the host communicator's."""
        super().describe_as(label)
        self._host.describe_as(label)

    # -- argument checks (before any I/O) --------------------------------------------------
    def _me(self) -> str:
        return f"rank {self.global_ranks[self.rank]}"

    def _flat(self, what: str, name: str, x: Any) -> Any:
        """``x`` as a flat view, refused unless a C-contiguous array of the memory's module."""
        xp = self._mem.xp
        if not isinstance(x, xp.ndarray):
            raise InvalidArgument(
                f"{what} {self.label}: {self._me()}: {name} must be a {xp.__name__} array "
                f"(the {self._mem.name} path's memory), got {type(x).__name__}"
            )
        if not x.flags.c_contiguous:
            raise InvalidArgument(f"{what} {self.label}: {self._me()}: {name} must be C-contiguous")
        return x.reshape(-1)

    def _pair(self, what: str, send: Any, recv: Any) -> tuple[Any, Any]:
        send, recv = self._flat(what, "send", send), self._flat(what, "recv", recv)
        if send.dtype != recv.dtype:
            raise InvalidArgument(
                f"{what} {self.label}: {self._me()}: send is {send.dtype} but recv is {recv.dtype}"
            )
        return send, recv

    def _sizes(self, what: str, got: int, needed: int, name: str, why: str) -> None:
        if got != needed:
            raise InvalidArgument(
                f"{what} {self.label}: {self._me()}: {name} has {got} elements, {what} needs "
                f"{needed} ({why})"
            )

    def _root(self, what: str, root: int) -> int:
        if not isinstance(root, (int, np.integer)) or not 0 <= int(root) < self.size:
            raise InvalidArgument(
                f"{what} {self.label}: {self._me()}: root must be a rank in [0, {self.size}), "
                f"got {root!r}"
            )
        return int(root)

    def _op(self, what: str, op: ReduceOp, dtype: Any) -> ReduceOp:
        if op not in PRIMITIVE_OPS:
            raise InvalidArgument(
                f"{what} {self.label}: {self._me()}: the device path reduces with "
                f"{', '.join(_OPS)}, not {getattr(op, 'value', op)!r} (composed above it)"
            )
        check_op_dtype(op, np.dtype(dtype))
        return op

    def _peer_rank(self, what: str, name: str, r: int | None) -> int | None:
        if r is not None and not (isinstance(r, (int, np.integer)) and 0 <= int(r) < self.size):
            raise InvalidArgument(
                f"{what} {self.label}: {self._me()}: {name} must be a rank in "
                f"[0, {self.size}) or None, got {r!r}"
            )
        return None if r is None else int(r)

    # -- the protocol --------------------------------------------------------------------
    def _ready(self, what: str) -> None:
        if self._closed:
            raise CommError(f"{what} {self.label}: the communicator was closed")
        if self._failure is not None:
            raise CommError(
                f"{what} {self.label}: this communicator failed earlier: {self._failure}"
            )

    def _key(self, rank: int, generation: int) -> str:
        return f"{self._prefix}/window/{rank}/{generation}"

    def _grow(self, nbytes: int) -> None:
        """A window whose slots hold ``nbytes`` (a new generation, published) if this one's
        do not."""
        if self._window is not None and nbytes <= self._slot:
            return
        slot = max(MIN_SLOT_BYTES, 1 << max(0, nbytes - 1).bit_length())
        window = self._mem.allocate(2 * slot)
        if self._window is not None:
            self._retired.append((self._calls, self._window))
        self._window, self._slot = window, slot
        self._generation += 1
        handle, event = window.handle, self._mem.event_handle()
        value = len(handle).to_bytes(2, "little") + handle + event
        self._store.set(self._key(self.rank, self._generation), value)

    def _open(self, what: str, r: int, generation: int, slot: int) -> Opened:
        """Peer ``r``'s window of ``generation``: from the cache, else opened now (and the
        one it replaces closed: the cache's invalidation)."""
        cached = self.opened.get(r)
        if cached is not None and cached[0] == generation:
            return cached[1]
        if cached is not None:
            del self.opened[r]
            self._mem.close_opened(cached[1])
        key = self._key(r, generation)
        self._store.wait([key], timeout=self.timeout)
        value = self._store.get(key)
        length = int.from_bytes(value[:2], "little")
        if len(value) < 2 + length:
            raise ProtocolError(
                f"{what} {self.label}: rank {self.global_ranks[r]}'s window key {key} is "
                f"{len(value)} bytes, shorter than its handle"
            )
        handle, event = bytes(value[2 : 2 + length]), bytes(value[2 + length :])
        opened = self._mem.open(handle, 2 * slot, event)
        self.opened[r] = (generation, opened)
        return opened

    def _exchange(
        self,
        what: str,
        size: int,
        arg: int,
        dtype: Any,
        contribution: Any | None,
    ) -> list[Any]:
        """One call's steps 1-3 (module docstring); returns every rank's slot of this call
        as uint8 arrays (this rank's too), to be read under :meth:`PeerMemory.running`.

        ``size``: the call's bytes every rank agrees on; ``contribution``: this rank's flat
        input (None: it writes nothing)."""
        nbytes = 0 if contribution is None else int(contribution.nbytes)
        self._grow(nbytes)
        assert self._window is not None
        parity = self._calls % 2
        self._calls += 1
        base = parity * self._slot
        mine = self._window.view[base : base + nbytes]
        peers = [opened for _, opened in self.opened.values()]
        self._mem.before_write(peers)
        if contribution is not None and nbytes:
            mine.view(contribution.dtype)[...] = contribution
        self._mem.written()
        code = _COLLECTIVES.index(what)
        head = np.array(
            [self._generation, self._slot, code, size, arg, _dtype_code(dtype)], np.int64
        )
        heads = np.empty(self.size * _HEAD, np.int64)
        self._host.all_gather(head, heads)
        table = heads.reshape(self.size, _HEAD)
        self._check_heads(what, table)
        slots = []
        for r in range(self.size):
            if r == self.rank:
                slots.append(self._window.view[base : base + self._slot])
                continue
            generation, slot = int(table[r, 0]), int(table[r, 1])
            opened = self._open(what, r, generation, slot)
            slots.append(opened.view[parity * slot : (parity + 1) * slot])
        self._free_retired()
        self._mem.before_read([opened for _, opened in self.opened.values()])
        return slots

    def _check_heads(self, what: str, table: np.ndarray) -> None:
        mine = table[self.rank, 2:]
        for r in range(self.size):
            theirs = table[r, 2:]
            if (theirs != mine).any():
                raise MismatchError(
                    f"{what} {self.label}: rank {self.global_ranks[self.rank]} called "
                    f"{self._words(mine)}, rank {self.global_ranks[r]} called "
                    f"{self._words(theirs)}"
                )

    @staticmethod
    def _words(head: np.ndarray) -> str:
        code, size, arg = (int(v) for v in head[:3])
        name = _COLLECTIVES[code] if 0 <= code < len(_COLLECTIVES) else f"collective {code}"
        root, op = divmod(arg, 16)
        op_name = _OPS[op - 1] if 0 < op <= len(_OPS) else None
        words = f"{name} of {size} bytes (dtype code {int(head[3])}"
        words += f", root {root}" if name in ("broadcast", "reduce", "gather", "scatter") else ""
        return words + (f", op {op_name})" if op_name else ")")

    def _free_retired(self) -> None:
        """Free the windows this rank outgrew before this call: every peer passed this
        call's handshake, so none reads them any more."""
        keep = []
        for retired_at, window in self._retired:
            if retired_at < self._calls - 1:
                self._mem.before_write([opened for _, opened in self.opened.values()])
                self._mem.free(window)
            else:
                keep.append((retired_at, window))
        self._retired = keep

    def _run(self, what: str, body: Callable[[], None]) -> None:
        """Run ``body`` (the protocol) under the lock and the memory's context; a failure
        is remembered, and refuses every later call."""
        with self._lock:
            self._ready(what)
            try:
                with self._mem.running():
                    body()
            except Exception as exc:
                self._failure = f"{type(exc).__name__}: {exc}"
                raise

    def _arg(self, root: int = 0, op: ReduceOp | None = None) -> int:
        return root * 16 + (0 if op is None else _OPS.index(op.value) + 1)

    def _reduce_into(self, out: Any, parts: list[Any], op: ReduceOp) -> None:
        """``out = parts[0] op parts[1] op ...``, in rank order on every rank (the same bits
        everywhere)."""
        xp = self._mem.xp
        name = (_BOOL_UFUNCS if out.dtype == np.bool_ else _UFUNCS)[op]
        ufunc = getattr(xp, name)
        out[...] = parts[0]
        for part in parts[1:]:
            ufunc(out, part, out=out)

    @staticmethod
    def _typed(slot: Any, dtype: Any, count: int, start: int = 0) -> Any:
        itemsize = np.dtype(dtype).itemsize
        return slot[start * itemsize : (start + count) * itemsize].view(dtype)

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(self, buf: Any, op: ReduceOp) -> None:
        """Reduce ``buf`` across ranks, in place."""
        self.all_reduce_out(buf, buf, op)

    def all_reduce_out(self, send: Any, recv: Any, op: ReduceOp) -> None:
        """Reduce every rank's ``send`` into ``recv`` (``send`` only read; it may be ``recv``)."""
        send, recv = self._pair("all_reduce", send, recv)
        self._sizes("all_reduce", recv.size, send.size, "recv", "send's size")
        op = self._op("all_reduce", op, send.dtype)

        def body() -> None:
            slots = self._exchange("all_reduce", send.nbytes, self._arg(0, op), send.dtype, send)
            self._reduce_into(recv, [self._typed(s, send.dtype, send.size) for s in slots], op)

        self._run("all_reduce", body)

    def reduce_scatter(self, send: Any, recv: Any, op: ReduceOp) -> None:
        """Reduce ``send`` (``size * n`` elements) across ranks; rank r gets block r."""
        send, recv = self._pair("reduce_scatter", send, recv)
        n = recv.size
        why = f"group size {self.size} x recv's {n}"
        self._sizes("reduce_scatter", send.size, self.size * n, "send", why)
        op = self._op("reduce_scatter", op, send.dtype)

        def body() -> None:
            slots = self._exchange(
                "reduce_scatter", send.nbytes, self._arg(0, op), send.dtype, send
            )
            parts = [self._typed(s, send.dtype, n, self.rank * n) for s in slots]
            self._reduce_into(recv, parts, op)

        self._run("reduce_scatter", body)

    def reduce(self, buf: Any, root: int, op: ReduceOp) -> None:
        """Reduce ``buf`` onto ``root``, in place there (others' ``buf`` unchanged)."""
        buf = self._flat("reduce", "buf", buf)
        root, op = self._root("reduce", root), self._op("reduce", op, buf.dtype)

        def body() -> None:
            slots = self._exchange("reduce", buf.nbytes, self._arg(root, op), buf.dtype, buf)
            if self.rank == root:
                self._reduce_into(buf, [self._typed(s, buf.dtype, buf.size) for s in slots], op)

        self._run("reduce", body)

    def all_gather(self, send: Any, recv: Any) -> None:
        """Fill ``recv`` with every rank's ``send``, by rank."""
        send, recv = self._pair("all_gather", send, recv)
        n = send.size
        why = f"group size {self.size} x send's {n}"
        self._sizes("all_gather", recv.size, self.size * n, "recv", why)

        def body() -> None:
            slots = self._exchange("all_gather", send.nbytes, 0, send.dtype, send)
            for r, slot in enumerate(slots):
                recv[r * n : (r + 1) * n] = self._typed(slot, send.dtype, n)

        self._run("all_gather", body)

    def all_to_all(self, send: Any, recv: Any) -> None:
        """Block j of ``send`` to rank j; block i of ``recv`` from rank i."""
        send, recv = self._pair("all_to_all", send, recv)
        self._sizes("all_to_all", recv.size, send.size, "recv", "send's size")
        if send.size % self.size:
            raise InvalidArgument(
                f"all_to_all {self.label}: {self._me()}: send has {send.size} elements, not "
                f"a multiple of the group size {self.size}"
            )
        b = send.size // self.size

        def body() -> None:
            slots = self._exchange("all_to_all", send.nbytes, 0, send.dtype, send)
            for r, slot in enumerate(slots):
                recv[r * b : (r + 1) * b] = self._typed(slot, send.dtype, b, self.rank * b)

        self._run("all_to_all", body)

    def broadcast(self, buf: Any, root: int) -> None:
        """Copy root's ``buf`` into every rank's ``buf``."""
        buf = self._flat("broadcast", "buf", buf)
        root = self._root("broadcast", root)

        def body() -> None:
            mine = buf if self.rank == root else None
            slots = self._exchange("broadcast", buf.nbytes, self._arg(root), buf.dtype, mine)
            if self.rank != root:
                buf[...] = self._typed(slots[root], buf.dtype, buf.size)

        self._run("broadcast", body)

    def gather(self, send: Any, recv: Any | None, root: int) -> None:
        """On root, fill ``recv`` with every rank's ``send``."""
        send = self._flat("gather", "send", send)
        root, n = self._root("gather", root), send.size
        if self.rank == root:
            send, recv = self._pair("gather", send, recv)
            why = f"group size {self.size} x send's {n}"
            self._sizes("gather", recv.size, self.size * n, "recv", why)

        def body() -> None:
            slots = self._exchange("gather", send.nbytes, self._arg(root), send.dtype, send)
            if self.rank == root:
                assert recv is not None  # checked above
                for r, slot in enumerate(slots):
                    recv[r * n : (r + 1) * n] = self._typed(slot, send.dtype, n)

        self._run("gather", body)

    def scatter(self, send: Any | None, recv: Any, root: int) -> None:
        """Rank r receives block r of root's ``send`` into ``recv``."""
        recv = self._flat("scatter", "recv", recv)
        root, n = self._root("scatter", root), recv.size
        if self.rank == root:
            send, recv = self._pair("scatter", send, recv)
            why = f"group size {self.size} x recv's {n}"
            self._sizes("scatter", send.size, self.size * n, "send", why)

        def body() -> None:
            mine = send if self.rank == root else None
            slots = self._exchange("scatter", recv.nbytes, self._arg(root), recv.dtype, mine)
            recv[...] = self._typed(slots[root], recv.dtype, n, self.rank * n)

        self._run("scatter", body)

    def barrier(self) -> None:
        """Return once every rank has entered (and its earlier device work here is done)."""

        def body() -> None:
            self._mem.synchronize()
            self._host.barrier()

        self._run("barrier", body)

    # -- point to point: staged through host memory ---------------------------------------
    def send(self, array: Any, dst: int, tag: int) -> None:
        """Send ``array`` to ``dst`` (a host copy, over the host communicator)."""
        self._peer_rank("send", "dst", dst)
        self._run("send", lambda: self._host.send(self._mem.to_host(array), dst, tag))

    def recv(self, src: int | None, tag: int) -> tuple[Any, int]:
        """Receive an array sent with ``tag`` (a new array of the memory's module)."""
        self._peer_rank("recv", "src", src)
        got: list[Any] = []

        def body() -> None:
            arr, source = self._host.recv(src, tag)
            got.extend((self._mem.from_host(arr, None), source))

        self._run("recv", body)
        return got[0], got[1]

    def permute(self, send: Any, dst: int | None, recv: Any, src: int | None) -> None:
        """Send ``send`` to ``dst`` while receiving ``recv`` from ``src`` (host copies)."""
        dst, src = self._peer_rank("permute", "dst", dst), self._peer_rank("permute", "src", src)

        def body() -> None:
            out = self._mem.to_host(send) if dst is not None else np.empty(0, np.uint8)
            into = np.empty(recv.shape, recv.dtype) if src is not None else out
            self._host.permute(out, dst, into, src)
            if src is not None:
                self._mem.from_host(into, recv)

        self._run("permute", body)

    def send_payload(self, array: Any, dst: int, after: Any = None) -> None:
        """Send ``array``'s bytes to ``dst`` (after the work ``after`` stands for)."""
        self._mem.settle(after)
        self.permute(array, dst, array, None)

    def recv_payload(self, out: Any, src: int, after: Any = None) -> None:
        """Receive the next payload from ``src`` into ``out``."""
        self._mem.settle(after)
        self.permute(out, None, out, src)

    def completion_probe(self) -> Callable[[], bool] | None:
        """Whether the work queued so far finished (CUDA: an event on the caller's stream)."""
        return self._mem.completion_probe()

    def ready_token(self) -> Any:
        """An event recorded now on the caller's stream (CUDA), else None."""
        return self._mem.ready_token()

    # -- groups and lifetime -------------------------------------------------------------
    def sub(self, ranks: Sequence[int]) -> IpcCommunicator:
        """A communicator over ``ranks``: a host communicator of theirs, a memory of its own.

        Raises:
            InvalidArgument: duplicate or out-of-range ranks, or this rank is not a member.
        """
        members = tuple(int(r) for r in ranks)
        if len(set(members)) != len(members) or not all(0 <= r < self.size for r in members):
            raise InvalidArgument(
                f"sub {self.label}: {self._me()}: ranks must be distinct ranks in "
                f"[0, {self.size}), got {list(ranks)}"
            )
        if self.rank not in members:
            raise InvalidArgument(
                f"sub {self.label}: {self._me()}: sub is called by members only, not {members}"
            )
        made = self._subs.get(members, 0)
        self._subs[members] = made + 1
        glob = "-".join(str(self.global_ranks[r]) for r in members)
        host = self._host.sub(list(members))
        return IpcCommunicator(
            host, self._mem.fresh(), self._store, f"{self._prefix}/sub/{glob}/{made}"
        )

    def close(self) -> None:
        """Wait until every member closes (a host barrier, bounded by the timeout; none
        after a failure), then close the peers' windows opened here, free this rank's and
        close the host communicator. Collective, like the group's close. Idempotent."""
        self._release(abort=False)

    def abort(self) -> None:
        """As :meth:`close` without waiting for the members, aborting the host
        communicator (a peer may be gone)."""
        self._release(abort=True)

    def _release(self, abort: bool) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if not abort and self._failure is None and self._calls:
                    # Peers may still read this rank's window in their last call: wait for
                    # them all to close (bounded by the timeout) before it is freed.
                    with contextlib.suppress(CommError):
                        self._mem.synchronize()
                        self._host.barrier()
                for _, opened in self.opened.values():
                    self._mem.close_opened(opened)
                self.opened.clear()
                for _, window in self._retired:
                    self._mem.free(window)
                if self._window is not None:
                    self._mem.free(self._window)
                self._retired, self._window = [], None
                self._mem.close()
            finally:
                if abort:
                    self._host.abort()
                else:
                    self._host.close()
