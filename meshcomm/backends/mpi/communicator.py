"""MpiCommunicator: the Communicator interface on mpi4py's buffer API.

Each primitive is one nonblocking MPI call, completed by polling with the communicator's
timeout (:mod:`meshcomm.backends.mpi._request`)::

    all_reduce      MPI_Iallreduce(MPI_IN_PLACE, buf)   (the group's snapshot is the result)
    all_reduce_out  MPI_Iallreduce(send, recv)          (a synchronous call's input, uncopied)
    all_gather      MPI_Iallgather
    reduce_scatter  MPI_Ireduce_scatter_block
    all_to_all      MPI_Ialltoall
    broadcast       MPI_Ibcast
    reduce          MPI_Ireduce (MPI_IN_PLACE on the root)
    gather/scatter  MPI_Igather / MPI_Iscatter
    barrier         MPI_Ibarrier
    permute         MPI_Isend + MPI_Irecv
    send/recv       MPI_Isend of a header (dtype, shape, tag) then of the payload;
                    MPI_Improbe (any source) + MPI_Imrecv, then MPI_Irecv of the payload
    sub             MPI_Comm_create_group (only the members call it)

Synchronous group calls take runners built once per signature instead
(:mod:`meshcomm.backends.mpi.runners`: the same MPI calls from the caller's arrays).

Data that is only moved travels as ``MPI_BYTE``; reductions use MPI's datatypes and ops, or
user-defined ops for bfloat16 (:mod:`meshcomm.backends.mpi._types`). Counts above 2**31 go
through MPI-4's large-count functions, which mpi4py picks by itself.

Every communicator owns two duplicates of its MPI communicator: one for collectives and
``permute``, one for ``send``/``recv`` (and ``check_all_gather``, the group layer's
first-call mismatch checks), so user tags never meet meshcomm's own traffic or
the user's direct mpi4py traffic on ``MPI.COMM_WORLD``. MPI errors come back as exceptions
(``MPI_ERRORS_RETURN``) and become :class:`~meshcomm.errors.CommError` (or PeerError).

Example:
    Under ``mpiexec -n 2``, on every rank (``meshcomm.init(backend="mpi")`` does this)::

        comm = MpiCommunicator.create_world(rank, size, timeout=60.0)
        buf = np.ones(4, np.float32)
        comm.all_reduce(buf, ReduceOp.SUM)  # buf == 2 everywhere
"""

from __future__ import annotations

import contextlib
import functools
import operator
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshcomm.backends.base import Communicator
from meshcomm.backends.mpi import _device
from meshcomm.backends.mpi._lib import comm_error, cuda_support, load, require_thread_level
from meshcomm.backends.mpi._request import MpiRequest, Patience, default_patience, poll
from meshcomm.backends.mpi._types import Reduction, reduction
from meshcomm.backends.mpi.runners import MpiRunners, copy_while_sending
from meshcomm.errors import CommError, CommTimeout, InvalidArgument, ProtocolError, RendezvousError
from meshcomm.group.arrays import SUPPORTED_DTYPES
from meshcomm.reduction import ReduceOp

__all__ = ["MpiCommunicator"]

#: What a ``_start_*`` method returns: MPI requests, what to run after they complete, and
#: the buffers MPI uses until then.
Started = tuple[list[Any], Callable[[], None] | None, tuple[Any, ...]]

_MAGIC = 0x4D434D50  # "MCMP": the first word of a send/recv header
_PERMUTE_TAG = 1
_SUB_TAG = 0x4D43
_CODES = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}
_FIXED = 4  # header words before the shape: magic, dtype code, tag, ndim
_MAX_HEADER = _FIXED + 64  # numpy arrays have at most 64 axes
_AT_START = Patience(0, True)  # before we know whether ranks share cores: nap, never hog


def _nbytes(buf: Any) -> list[Any]:
    return [buf, int(buf.nbytes), load().BYTE]


class MpiCommunicator(MpiRunners, Communicator):
    """A communicator over an MPI communicator (``MPI.COMM_WORLD`` for the world).

    Use :meth:`create_world` for the world, :meth:`sub` / :meth:`split` /
    :meth:`cart_subs` for groups. Besides the blocking primitives of
    :class:`~meshcomm.backends.base.Communicator`, every collective has a nonblocking twin
    (``iall_reduce``, ``iall_gather``, ...) that returns an
    :class:`~meshcomm.backends.mpi._request.MpiRequest`.

    Attributes:
        mpi_comm: the ``mpi4py`` communicator the collectives run on (do not free it).
        cuda_aware: whether device buffers go to MPI directly (None until one is seen).
    """

    backend_name = "mpi"

    def __init__(
        self,
        comm: Any,
        p2p: Any,
        global_ranks: Sequence[int],
        timeout: float,
        patience: Patience,
    ) -> None:
        super().__init__(comm.Get_rank(), global_ranks, timeout)
        mpi = load()
        self._mpi = mpi
        self._error_type: type[BaseException] = mpi.Exception
        self.mpi_comm = comm
        self._p2p = p2p
        self._patience = patience
        # Tags at or above MPI's limit share one MPI tag; their headers carry the real one.
        self._tag_limit = int(mpi.COMM_WORLD.Get_attr(mpi.TAG_UB))
        self._sends: list[MpiRequest] = []
        self._stash: list[tuple[int, int, np.ndarray]] = []
        self._pending: list[Any] = []
        self.cuda_aware: bool | None = None
        self._reductions: dict[tuple[np.dtype, ReduceOp], Reduction] = {}
        self._closed = False
        self._where = f"rank {self.global_ranks[self.rank]} in MPI communicator of size {self.size}"

    # -- creation ------------------------------------------------------------------------
    @classmethod
    def create_world(cls, rank: int, size: int, timeout: float) -> MpiCommunicator:
        """Return the world communicator: duplicates of ``MPI.COMM_WORLD``.

        Args:
            rank: this process's rank, as the launcher said (must be MPI's).
            size: the world size, as the launcher said (must be MPI's).
            timeout: seconds every blocking call waits for its peers.

        Raises:
            ImportError: mpi4py is not installed.
            RendezvousError: MPI's rank or size differ from the launcher's (the processes
                were not started as one MPI job).
            CommError: MPI runs below ``MPI_THREAD_MULTIPLE``, or duplicating failed.
            CommTimeout: a rank did not join within ``timeout``.
        """
        mpi = load()
        world = mpi.COMM_WORLD
        mine = (world.Get_rank(), world.Get_size())
        if mine != (rank, size):
            raise RendezvousError(
                f"rank {rank}: the mpi backend's world is MPI_COMM_WORLD, where this process is "
                f"rank {mine[0]} of {mine[1]}, but the launcher's environment says rank {rank} "
                f"of {size}; start the ranks as one MPI job (mpiexec, srun), or pick another "
                "backend"
            )
        require_thread_level(rank)
        timeout = float(timeout)
        where = f"rank {rank} in MPI_COMM_WORLD of size {size}"
        try:
            comm = _dup(world, timeout, where)
            p2p = _dup(world, timeout, where)
            patience = default_patience(_ranks_on_host(comm, timeout, where))
        except mpi.Exception as exc:
            raise comm_error(exc, f"creating the world: {where}") from exc
        return cls(comm, p2p, range(size), timeout, patience)

    def _child(self, comm: Any, where: str) -> MpiCommunicator:
        """Wrap an MPI communicator made from this one (this process is a member)."""
        try:
            p2p = _dup(comm, self.timeout, where)
            ours = list(range(comm.Get_size()))
            parent = self.mpi_comm.Get_group()
            group = comm.Get_group()
            try:
                theirs = group.Translate_ranks(ours, parent)
            finally:
                group.Free()
                parent.Free()
        except self._error_type as exc:
            raise comm_error(exc, where) from exc
        members = [self.global_ranks[int(r)] for r in theirs]
        child = MpiCommunicator(comm, p2p, members, self.timeout, self._patience)
        child.cuda_aware = self.cuda_aware
        return child

    def sub(self, ranks: Sequence[int]) -> MpiCommunicator:
        """Return a communicator over ``ranks`` (``MPI_Comm_create_group``; members only).

        Raises:
            InvalidArgument: duplicate or out-of-range ranks, or this rank is not a member.
            CommError: MPI failed.
        """
        self._check("sub")
        members = [self._peer(r, "sub") for r in ranks]
        where = self._at("sub")
        if len(set(members)) != len(members):
            raise InvalidArgument(f"{where}: sub ranks must be distinct, got {list(ranks)}")
        if self.rank not in members:
            raise InvalidArgument(
                f"{where}: sub is called by members only; rank {self.rank} is not in {members}"
            )
        try:
            parent = self.mpi_comm.Get_group()
            try:
                group = parent.Incl(members)
            finally:
                parent.Free()
            try:
                # Collective over the members only, as sub's contract asks; the members have
                # just agreed on the list (the group layer all-gathers it), so none is absent.
                comm = self.mpi_comm.Create_group(group, _SUB_TAG)
            finally:
                group.Free()
        except self._error_type as exc:
            raise comm_error(exc, where) from exc
        return self._child(comm, where)

    def split(self, color: int | None, key: int = 0) -> MpiCommunicator | None:
        """``MPI_Comm_split``: every rank calls it; ranks of one color form a communicator.

        A faster path than ``all_gather`` + :meth:`sub` for the group layer's split: one MPI
        call. Ranks are ordered by ``key``, ties by rank.

        Args:
            color: a non-negative int, or None to join no communicator.
            key: the order within the color.

        Returns:
            The new communicator, or None where ``color`` is None.

        Raises:
            InvalidArgument: a negative color.
            CommError: MPI failed.
        """
        self._check("split")
        where = self._at("split")
        if color is not None and (isinstance(color, bool) or operator.index(color) < 0):
            raise InvalidArgument(f"{where}: color must be a non-negative int or None, got {color}")
        mpi_color = self._mpi.UNDEFINED if color is None else operator.index(color)
        try:
            comm = self.mpi_comm.Split(mpi_color, operator.index(key))
        except self._error_type as exc:
            raise comm_error(exc, where) from exc
        if comm == self._mpi.COMM_NULL:
            return None
        return self._child(comm, where)

    def cart_subs(self, dims: Sequence[int]) -> list[MpiCommunicator]:
        """One communicator per axis of a row-major grid of this communicator's ranks.

        ``MPI_Cart_create`` (no reordering: rank ``r`` sits at ``np.unravel_index(r, dims)``)
        then ``MPI_Cart_sub`` once per axis. Axis ``d``'s communicator holds the ranks whose
        coordinates differ only along ``d``, ranked by that coordinate: exactly the group
        :class:`~meshcomm.mesh.DeviceMesh` makes for axis ``d`` of a mesh whose grid is
        ``arange(size).reshape(dims)``. Collective: every rank calls it.

        Raises:
            InvalidArgument: ``dims`` do not multiply to the size.
            CommError: MPI failed.
        """
        self._check("cart_subs")
        where = self._at("cart_subs")
        shape = [operator.index(d) for d in dims]
        if not shape or any(d < 1 for d in shape) or int(np.prod(shape)) != self.size:
            raise InvalidArgument(
                f"{where}: dims must be positive and multiply to the size {self.size}, got "
                f"{list(dims)}"
            )
        try:
            cart = self.mpi_comm.Create_cart(shape, [False] * len(shape), reorder=False)
            try:
                axes = [
                    cart.Sub([d == axis for d in range(len(shape))]) for axis in range(len(shape))
                ]
            finally:
                cart.Free()
        except self._error_type as exc:
            raise comm_error(exc, where) from exc
        return [self._child(comm, where) for comm in axes]

    # -- helpers -------------------------------------------------------------------------
    def _at(self, what: str) -> str:
        return f"{what}: {self._where}"

    def _check(self, what: str) -> None:
        if self._closed:
            raise CommError(f"{self._at(what)}: the communicator was closed")

    def _peer(self, peer: object, what: str) -> int:
        try:
            value = -1 if isinstance(peer, bool) else operator.index(peer)  # type: ignore[arg-type]
        except TypeError:
            value = -1
        if not 0 <= value < self.size:
            raise InvalidArgument(
                f"{self._at(what)}: rank must be in [0, {self.size}), got {peer!r}"
            )
        return value

    def _tag(self, tag: object, what: str) -> int:
        try:
            value = -1 if isinstance(tag, bool) else operator.index(tag)  # type: ignore[arg-type]
        except TypeError:
            value = -1
        if not 0 <= value < 2**63:
            raise InvalidArgument(
                f"{self._at(what)}: tag must be an int in [0, 2**63), got {tag!r}"
            )
        return value

    def _device(self, x: Any, copy_in: bool, copy_back: bool, host_only: bool = False) -> Any:
        """Return (buffer for MPI, finish) for a possibly-device array."""
        if type(x) is np.ndarray:
            return x, None
        if self.cuda_aware is None:
            self.cuda_aware = cuda_support()[0]
        return _device.stage(x, bool(self.cuda_aware) and not host_only, copy_in, copy_back)

    def _run(self, what: str, start: Callable[..., Started], *args: Any) -> None:
        """Start an operation and wait for it within the timeout: the blocking primitives
        are their nonblocking twins, waited on (one completion route, MpiRequest's)."""
        self._start(what, start, *args).wait()

    def _reduction(self, dtype: np.dtype, op: ReduceOp) -> Reduction:
        red = self._reductions[(dtype, op)] = reduction(dtype, op)
        return red

    def _start(self, what: str, start: Callable[..., Started], *args: Any) -> MpiRequest:
        """Start an operation; return its MpiRequest."""
        self._check(what)
        try:
            requests, finish, keep = start(*args)
        except self._error_type as exc:
            raise comm_error(exc, self._at(what)) from exc
        statuses = [self._mpi.Status() for _ in requests] if len(requests) > 1 else []
        request = MpiRequest(
            requests,
            self._at(what),
            self.timeout,
            self._patience,
            finish,
            keep,
            self._error,
            statuses,
            late=lambda: self._late(what),
        )
        self._pending.append(request)  # dropped by _prune once complete
        self._prune()
        return request

    def _prune(self) -> None:
        if len(self._pending) > 64:
            self._pending = [
                r for r in self._pending if not (isinstance(r, MpiRequest) and r.is_completed())
            ]

    def _error(self, exc: BaseException, statuses: Sequence[Any] = ()) -> BaseException:
        if isinstance(exc, self._error_type):
            return comm_error(exc, self._where, statuses=statuses)
        return exc

    def _late(self, what: str) -> str:
        return (
            f"{self._at(what)} (global ranks {list(self.global_ranks)}): not complete after "
            f"{self.timeout:g} s; a peer may be stopped, slow, or in a different operation "
            "(MPI cannot cancel it: this world is unusable now)"
        )

    # -- collectives: starting -----------------------------------------------------------
    def _start_all_reduce(self, buf: Any, op: ReduceOp) -> Started:
        red = self._reductions.get((buf.dtype, op)) or self._reduction(buf.dtype, op)
        data, back = self._device(buf, True, True, red.user_defined)
        count = int(buf.size)
        req = self.mpi_comm.Iallreduce(self._mpi.IN_PLACE, [data, count, red.datatype], red.op)
        return [req], back, (data,)

    def _start_all_reduce_out(self, send: Any, recv: Any, op: ReduceOp) -> Started:
        red = self._reductions.get((send.dtype, op)) or self._reduction(send.dtype, op)
        s, _ = self._device(send, True, False, red.user_defined)
        r, back = self._device(recv, False, True, red.user_defined)
        count = int(send.size)
        req = self.mpi_comm.Iallreduce([s, count, red.datatype], [r, count, red.datatype], red.op)
        return [req], back, (s, r)

    def _start_all_gather(self, send: Any, recv: Any) -> Started:
        s, _ = self._device(send, True, False)
        r, back = self._device(recv, False, True)
        return [self.mpi_comm.Iallgather(_nbytes(s), _nbytes_per(r, self.size))], back, (s, r)

    def _start_check_gather(self, send: np.ndarray, recv: np.ndarray) -> Started:
        req = self._p2p.Iallgather(_nbytes(send), _nbytes_per(recv, self.size))
        return [req], None, (send, recv)

    def check_all_gather(self, send: np.ndarray, recv: np.ndarray) -> None:
        """``all_gather`` of host arrays on the point-to-point duplicate, for the group
        layer's first-call mismatch checks: a rank alone in a check (the others in a
        collective they called before) then never matches their collective on the
        collectives' communicator; both wait until the timeout instead of reading each
        other's bytes as their own."""
        self._run("all_gather", self._start_check_gather, send, recv)

    def start_check_all_gather(
        self, send: np.ndarray, recv: np.ndarray
    ) -> Callable[[float | None], None]:
        """:meth:`check_all_gather` started (``MPI_Iallgather`` on the point-to-point
        duplicate); returns its request's wait (the communicator's timeout by default)."""
        return self._start("all_gather", self._start_check_gather, send, recv).wait

    def _start_reduce_scatter(self, send: Any, recv: Any, op: ReduceOp) -> Started:
        red = self._reductions.get((send.dtype, op)) or self._reduction(send.dtype, op)
        s, _ = self._device(send, True, False, red.user_defined)
        r, back = self._device(recv, False, True, red.user_defined)
        count = int(recv.size)  # mpi4py: an explicit count is per block, as in MPI's call
        req = self.mpi_comm.Ireduce_scatter_block(
            [s, count, red.datatype], [r, count, red.datatype], red.op
        )
        return [req], back, (s, r)

    def _start_all_to_all(self, send: Any, recv: Any) -> Started:
        s, _ = self._device(send, True, False)
        r, back = self._device(recv, False, True)
        req = self.mpi_comm.Ialltoall(_nbytes_per(s, self.size), _nbytes_per(r, self.size))
        return [req], back, (s, r)

    def _start_broadcast(self, buf: Any, root: int) -> Started:
        root = self._peer(root, "broadcast root")
        mine = self.rank == root
        data, back = self._device(buf, mine, not mine)
        return [self.mpi_comm.Ibcast(_nbytes(data), root)], back, (data,)

    def _start_broadcast_copying(self, send: np.ndarray, recv: np.ndarray, root: int) -> Started:
        root = self._peer(root, "broadcast root")
        request = self.mpi_comm.Ibcast(_nbytes(send), root)
        copy_while_sending(request, send, recv)
        return [request], None, (send,)

    def _start_reduce(self, buf: Any, root: int, op: ReduceOp) -> Started:
        root = self._peer(root, "reduce root")
        red = self._reductions.get((buf.dtype, op)) or self._reduction(buf.dtype, op)
        mine = self.rank == root
        data, back = self._device(buf, True, mine, red.user_defined)
        spec = [data, int(buf.size), red.datatype]
        if mine:
            req = self.mpi_comm.Ireduce(self._mpi.IN_PLACE, spec, red.op, root)
        else:
            req = self.mpi_comm.Ireduce(spec, None, red.op, root)
        return [req], back, (data,)

    def _start_gather(self, send: Any, recv: Any, root: int) -> Started:
        root = self._peer(root, "gather root")
        s, _ = self._device(send, True, False)
        if self.rank != root:
            return [self.mpi_comm.Igather(_nbytes(s), None, root)], None, (s,)
        if recv is None:
            raise InvalidArgument(f"{self._at('gather')}: the root needs a receive buffer")
        r, back = self._device(recv, False, True)
        req = self.mpi_comm.Igather(_nbytes(s), _nbytes_per(r, self.size), root)
        return [req], back, (s, r)

    def _start_scatter(self, send: Any, recv: Any, root: int) -> Started:
        root = self._peer(root, "scatter root")
        r, back = self._device(recv, False, True)
        if self.rank != root:
            return [self.mpi_comm.Iscatter(None, _nbytes(r), root)], back, (r,)
        if send is None:
            raise InvalidArgument(f"{self._at('scatter')}: the root needs a send buffer")
        s, _ = self._device(send, True, False)
        req = self.mpi_comm.Iscatter(_nbytes_per(s, self.size), _nbytes(r), root)
        return [req], back, (s, r)

    def _start_barrier(self) -> Started:
        return [self.mpi_comm.Ibarrier()], None, ()

    def _start_permute(self, send: Any, dst: int | None, recv: Any, src: int | None) -> Started:
        requests: list[Any] = []
        back = None
        keep: list[Any] = []
        if src is not None:
            peer = self._peer(src, "permute src")
            r, back = self._device(recv, False, True)
            requests.append(self.mpi_comm.Irecv(_nbytes(r), peer, _PERMUTE_TAG))
            keep.append(r)
        if dst is not None:
            peer = self._peer(dst, "permute dst")
            s, _ = self._device(send, True, False)
            requests.append(self.mpi_comm.Isend(_nbytes(s), peer, _PERMUTE_TAG))
            keep.append(s)
        return requests, back, tuple(keep)

    # -- collectives: blocking -----------------------------------------------------------
    def all_reduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        # Synchronous group calls take all_reduce_runner (their plan's runner); this
        # in-place form serves the lowered calls (async snapshots, composed ops).
        self._run("all_reduce", self._start_all_reduce, buf, op)

    def all_reduce_out(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
        """Out of place: ``recv`` gets the reduction of every rank's ``send`` (unchanged).

        ``MPI_Iallreduce(send, recv)``, as raw mpi4py's ``Allreduce(x, out)``: the group layer
        hands a synchronous call's input over as is, so nobody copies it first.
        """
        self._run("all_reduce", self._start_all_reduce_out, send, recv, op)

    def grid_splitter(self) -> Callable[[Sequence[int]], Sequence[Communicator]]:
        """:meth:`cart_subs` (the :class:`~meshcomm.backends.base.Communicator` hook)."""
        return self.cart_subs

    def all_gather(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._run("all_gather", self._start_all_gather, send, recv)

    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
        self._run("reduce_scatter", self._start_reduce_scatter, send, recv, op)

    def all_to_all(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._run("all_to_all", self._start_all_to_all, send, recv)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self._run("broadcast", self._start_broadcast, buf, root)

    def broadcast_out(self, send: np.ndarray | None, recv: np.ndarray, root: int) -> None:
        """Root's ``send`` into every rank's ``recv`` (root's too); ``send`` is only read.

        The group layer calls it on the root of a synchronous broadcast: MPI sends from the
        caller's array itself, and the root copies it into its own result in slices between
        ``MPI_Test`` calls, so the copy overlaps the transfer instead of preceding it.
        """
        if send is None or self.rank != root:
            self._run("broadcast", self._start_broadcast, recv, root)
        else:
            self._run("broadcast", self._start_broadcast_copying, send, recv, root)

    def reduce(self, buf: np.ndarray, root: int, op: ReduceOp) -> None:
        self._run("reduce", self._start_reduce, buf, root, op)

    def gather(self, send: np.ndarray, recv: np.ndarray | None, root: int) -> None:
        self._run("gather", self._start_gather, send, recv, root)

    def scatter(self, send: np.ndarray | None, recv: np.ndarray, root: int) -> None:
        self._run("scatter", self._start_scatter, send, recv, root)

    def barrier(self) -> None:
        self._run("barrier", self._start_barrier)

    def permute(self, send: np.ndarray, dst: int | None, recv: np.ndarray, src: int | None) -> None:
        if dst is None and src is None:
            self._check("permute")
            return
        self._run("permute", self._start_permute, send, dst, recv, src)

    # -- collectives: nonblocking --------------------------------------------------------
    def iall_reduce(self, buf: np.ndarray, op: ReduceOp) -> MpiRequest:
        """Start :meth:`all_reduce`; ``buf`` holds the result once the request completes."""
        return self._start("iall_reduce", self._start_all_reduce, buf, op)

    def iall_gather(self, send: np.ndarray, recv: np.ndarray) -> MpiRequest:
        """Start :meth:`all_gather`."""
        return self._start("iall_gather", self._start_all_gather, send, recv)

    def ireduce_scatter(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> MpiRequest:
        """Start :meth:`reduce_scatter`."""
        return self._start("ireduce_scatter", self._start_reduce_scatter, send, recv, op)

    def iall_to_all(self, send: np.ndarray, recv: np.ndarray) -> MpiRequest:
        """Start :meth:`all_to_all`."""
        return self._start("iall_to_all", self._start_all_to_all, send, recv)

    def ibroadcast(self, buf: np.ndarray, root: int) -> MpiRequest:
        """Start :meth:`broadcast`."""
        return self._start("ibroadcast", self._start_broadcast, buf, root)

    def ireduce(self, buf: np.ndarray, root: int, op: ReduceOp) -> MpiRequest:
        """Start :meth:`reduce`."""
        return self._start("ireduce", self._start_reduce, buf, root, op)

    def igather(self, send: np.ndarray, recv: np.ndarray | None, root: int) -> MpiRequest:
        """Start :meth:`gather`."""
        return self._start("igather", self._start_gather, send, recv, root)

    def iscatter(self, send: np.ndarray | None, recv: np.ndarray, root: int) -> MpiRequest:
        """Start :meth:`scatter`."""
        return self._start("iscatter", self._start_scatter, send, recv, root)

    def ibarrier(self) -> MpiRequest:
        """Start :meth:`barrier`."""
        return self._start("ibarrier", self._start_barrier)

    def ipermute(
        self, send: np.ndarray, dst: int | None, recv: np.ndarray, src: int | None
    ) -> MpiRequest:
        """Start :meth:`permute`."""
        return self._start("ipermute", self._start_permute, send, dst, recv, src)

    # -- point to point ------------------------------------------------------------------
    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        """Send an array of any shape; its dtype, shape and tag travel in a header message.

        Returns once MPI has the message: the payload is copied first, so the caller may
        reuse ``array`` at once. :meth:`close` waits (up to the timeout) for sends that are
        still in flight.

        Raises:
            InvalidArgument: bad ``dst`` or ``tag``.
            TypeError: not an array, or a dtype meshcomm does not move.
            CommError: MPI failed.
        """
        self._check("send")
        peer = self._peer(dst, "send dst")
        t = self._tag(tag, "send")
        if not isinstance(array, np.ndarray) and not _device.is_device(array):
            raise TypeError(f"{self._at('send')}: needs an array, got {type(array).__name__}")
        dt = np.dtype(array.dtype)
        code = _CODES.get(dt.newbyteorder("=") if dt.kind in "biufc" else dt)
        if code is None:
            raise TypeError(f"{self._at('send')}: dtype {dt} cannot be sent")
        header = np.array([_MAGIC, code, t, array.ndim, *array.shape], dtype=np.int64)
        if _device.is_device(array):
            # A device payload goes through host memory: send owns a copy either way.
            payload = _device.stage(array, False, True, False)[0].reshape(-1)
        else:
            payload = np.array(array, dtype=dt.newbyteorder("="), copy=True, order="C")
        mpi_tag = min(t, self._tag_limit)
        what = self._at(f"send to rank {peer} tag {t}")
        try:
            requests = [
                self._p2p.Isend([header, self._mpi.INT64_T], peer, mpi_tag),
                self._p2p.Isend(_nbytes(payload), peer, mpi_tag),
            ]
        except self._error_type as exc:
            raise comm_error(exc, what, self.global_ranks[peer]) from exc
        statuses = [self._mpi.Status(), self._mpi.Status()]
        keep = (header, payload)
        request = MpiRequest(
            requests, what, self.timeout, self._patience, None, keep, self._error, statuses
        )
        request.test()  # small messages complete here (eager)
        self._sends = [r for r in self._sends if not r.test()]
        if not request.is_completed():
            self._sends.append(request)

    def recv(self, src: int | None, tag: int) -> tuple[np.ndarray, int]:
        """Receive an array sent with ``tag`` from ``src`` (None: any rank) and its sender.

        Raises:
            InvalidArgument: bad ``src`` or ``tag``.
            CommTimeout: nothing arrived within the timeout.
            ProtocolError: the header is not one :meth:`send` writes.
            CommError: MPI failed.
        """
        self._check("recv")
        peer = None if src is None else self._peer(src, "recv src")
        t = self._tag(tag, "recv")
        what = self._at(f"recv from {'any rank' if peer is None else f'rank {peer}'} tag {t}")
        for i, (source, stashed_tag, array) in enumerate(self._stash):
            if stashed_tag == t and peer in (None, source):
                del self._stash[i]
                return array, source
        mpi_tag = min(t, self._tag_limit)
        any_source = self._mpi.ANY_SOURCE if peer is None else peer
        try:
            while True:
                source, full_tag, array = self._recv_one(any_source, mpi_tag, what)
                if full_tag == t:
                    return array, source
                # Another overflow tag that shares the MPI tag: keep it for its own recv.
                self._stash.append((source, full_tag, array))
        except self._error_type as exc:
            raise comm_error(exc, what, None if peer is None else self.global_ranks[peer]) from exc

    def _recv_one(self, source: int, mpi_tag: int, what: str) -> tuple[int, int, np.ndarray]:
        mpi = self._mpi
        status = mpi.Status()
        found: list[Any] = []

        def probe() -> bool:
            message = self._p2p.Improbe(source, mpi_tag, status)
            if message is None:
                return False
            found.append(message)
            return True

        late = functools.partial(self._late_recv, what)
        poll(probe, self.timeout, self._patience, late)
        sender = status.Get_source()
        # A matched message must be received whatever it holds: take its bytes, then judge.
        raw = np.empty(max(0, status.Get_count(mpi.BYTE)), dtype=np.uint8)
        self._complete(found[0].Irecv([raw, mpi.BYTE]), raw, late)
        words = raw.size // 8
        if raw.size % 8 or not _FIXED <= words <= _MAX_HEADER:
            raise ProtocolError(
                f"{what}: a header from rank {sender} has {raw.size} bytes; expected "
                f"{8 * _FIXED}..{8 * _MAX_HEADER} in 8-byte words (a foreign message on "
                "meshcomm's communicator?)"
            )
        header = raw.view(np.int64)
        magic, code, full_tag, ndim = (int(v) for v in header[:_FIXED])
        shape = tuple(int(v) for v in header[_FIXED:])
        if magic != _MAGIC or not 0 <= code < len(SUPPORTED_DTYPES) or ndim != len(shape):
            raise ProtocolError(
                f"{what}: rank {sender} sent a header meshcomm does not write: {header.tolist()}"
            )
        if any(d < 0 for d in shape):
            raise ProtocolError(f"{what}: rank {sender} sent a negative shape {shape}")
        array = np.empty(shape, dtype=SUPPORTED_DTYPES[code])
        self._complete(self._p2p.Irecv(_nbytes(array), sender, mpi_tag), array, late)
        return sender, full_tag, array

    def _complete(self, request: Any, buf: np.ndarray, late: Callable[[], str]) -> None:
        """Poll one receive; on timeout keep its buffer alive (MPI may still write it)."""
        if request.Test():
            return
        try:
            poll(request.Test, self.timeout, self._patience, late)
        except CommTimeout:
            self._pending.append(([request], (buf,)))
            raise

    def _late_recv(self, what: str) -> str:
        return (
            f"{what}: nothing arrived within {self.timeout:g} s (global ranks "
            f"{list(self.global_ranks)})"
        )

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Wait (up to the timeout) for sends in flight, then free the MPI communicators.

        Idempotent. Never raises for a send that did not complete: its buffers are kept
        for the life of the process instead (MPI may still read them).
        """
        if self._closed:
            return
        self._closed = True
        for request in self._sends:
            try:
                request.wait()
            except Exception:
                _LEAKED.append(request)
        self._sends = []
        if any(isinstance(r, tuple) or not r.is_completed() for r in self._pending):
            # A timed-out operation is still pending on these communicators: keep them and
            # their buffers; freeing them could only hang or crash.
            _LEAKED.append((self.mpi_comm, self._p2p, self._pending))
            return
        for comm in (self._p2p, self.mpi_comm):
            with contextlib.suppress(self._error_type):
                comm.Free()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return (
            f"MpiCommunicator(rank={self.rank}, size={self.size}, "
            f"global_ranks={self.global_ranks}{state})"
        )


#: Requests (and buffers) that never completed: referenced here so their memory is never
#: reused while MPI may still touch it.
_LEAKED: list[Any] = []


def _nbytes_per(buf: Any, parts: int) -> list[Any]:
    """``buf`` split into ``parts`` equal MPI_BYTE blocks (one per rank)."""
    nbytes = int(buf.nbytes)
    if nbytes % parts:
        raise InvalidArgument(
            f"a buffer of {nbytes} bytes does not split into {parts} equal blocks"
        )
    return [buf, nbytes // parts, load().BYTE]


def _dup(comm: Any, timeout: float, where: str) -> Any:
    """``MPI_Comm_idup`` polled with ``timeout``; errors are returned, not fatal."""
    mpi = load()
    new, request = comm.Idup()
    poll(
        request.Test,
        timeout,
        _AT_START,
        lambda: f"duplicating a communicator: {where}: not every rank joined within {timeout:g} s",
    )
    new.Set_errhandler(mpi.ERRORS_RETURN)
    return new


def _ranks_on_host(comm: Any, timeout: float, where: str) -> int:
    """How many ranks of ``comm`` share this host (an all-gather of host-name hashes)."""
    mpi = load()
    name = mpi.Get_processor_name().encode()
    mine = np.array([zlib.crc32(name), len(name)], dtype=np.int64)
    every = np.empty(2 * comm.Get_size(), dtype=np.int64)
    request = comm.Iallgather([mine, mpi.INT64_T], [every, mpi.INT64_T])
    poll(
        request.Test,
        timeout,
        _AT_START,
        lambda: f"{where}: not every rank joined within {timeout:g} s",
    )
    pairs = every.reshape(-1, 2)
    return int(np.count_nonzero((pairs == mine).all(axis=1)))
