"""The MPI communicator's runners: one function per (collective, dtype, op or root), built once.

The group layer's plans (:mod:`meshcomm.group.lower`) ask a communicator for a runner through the
:meth:`~meshcomm.backends.base.Communicator.runner` hook and call it for every synchronous call
of that signature: the MPI datatype and op are looked up once, when the runner is built, and a
call is one nonblocking MPI call from the caller's arrays, polled to completion within the
timeout. :class:`MpiRunners` is a mixin of
:class:`~meshcomm.backends.mpi.communicator.MpiCommunicator`: each method works on the
communicator it is called on, typed as such.

Example:
    A sketch (needs an MPI world: ``mpiexec -n 2``)::

        comm = MpiCommunicator.create_world(rank, size, timeout=60.0)
        run = comm.runner("all_reduce", np.dtype(np.float32), ReduceOp.SUM)
        out = np.empty_like(x)
        run(x, out)  # out == the sum of every rank's x
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from meshcomm.backends.base import Runner
from meshcomm.backends.mpi._lib import comm_error
from meshcomm.backends.mpi._request import Patience, poll
from meshcomm.backends.mpi._types import Reduction
from meshcomm.errors import CommTimeout, InvalidArgument
from meshcomm.reduction import ReduceOp

__all__ = ["COPY_SLICE", "PERSISTENT_MAX", "MpiRunners", "copy_while_sending"]

COPY_SLICE = 256 << 10
"""Bytes the broadcast root copies between ``MPI_Test`` calls."""

PERSISTENT_MAX = 16 << 10
"""Largest all_reduce (bytes) that the runner runs as a persistent collective (two copies
of its bytes per call against a schedule built once)."""

#: Persistent all_reduces a runner keeps (one per shape).
_PERSISTENT_KEPT = 16


class _Comm(Protocol):
    """What the runners use of the communicator they are built on (an MpiCommunicator)."""

    mpi_comm: Any
    timeout: float
    _mpi: Any
    _error_type: type[BaseException]
    _patience: Patience
    _pending: list[Any]
    _persistent: list[Any] | None
    _closed: bool
    _reductions: dict[tuple[np.dtype, ReduceOp], Reduction]

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def _at(self, what: str) -> str: ...

    def _check(self, what: str) -> None: ...

    def _peer(self, peer: object, what: str) -> int: ...

    def _late(self, what: str) -> str: ...

    def _reduction(self, dtype: np.dtype, op: ReduceOp) -> Reduction: ...

    def _runner(
        self,
        what: str,
        begin: Callable[[np.ndarray, np.ndarray], Any],
        small: Callable[[np.ndarray, np.ndarray], bool] | None = None,
    ) -> Callable[[np.ndarray, np.ndarray], None]: ...

    def _persistent_all_reduce(
        self, dtype: np.dtype, init: Callable[..., Any], red: Reduction
    ) -> Callable[[np.ndarray, np.ndarray], bool]: ...

    def all_reduce_runner(
        self, dtype: np.dtype, op: ReduceOp
    ) -> Callable[[np.ndarray, np.ndarray], None]: ...

    def reduce_scatter_runner(
        self, dtype: np.dtype, op: ReduceOp
    ) -> Callable[[np.ndarray, np.ndarray], None]: ...

    def all_gather_runner(self) -> Callable[[np.ndarray, np.ndarray], None]: ...

    def all_to_all_runner(self) -> Callable[[np.ndarray, np.ndarray], None]: ...

    def broadcast_runner(self, root: int) -> Callable[[np.ndarray, np.ndarray], None]: ...


def copy_while_sending(request: Any, send: np.ndarray, recv: np.ndarray) -> None:
    """Copy ``send`` into ``recv`` (C-contiguous, the same shape and dtype) in slices, testing the
    broadcast ``request`` that sends ``send`` between them: the root's own copy overlaps the
    transfer instead of preceding it.

    Example:
        >>> class Sent:  # stands in for the MPI request of a broadcast already under way
        ...     def Test(self) -> bool:
        ...         return False
        >>> send, recv = np.arange(4.0), np.zeros(4)
        >>> copy_while_sending(Sent(), send, recv)
        >>> recv
        array([0., 1., 2., 3.])
    """
    if send.nbytes <= COPY_SLICE:
        np.copyto(recv, send)
        return
    src, dst = send.reshape(-1).view(np.uint8), recv.reshape(-1).view(np.uint8)
    for start in range(0, src.size, COPY_SLICE):
        dst[start : start + COPY_SLICE] = src[start : start + COPY_SLICE]
        request.Test()  # keeps MPI moving while the root copies


class MpiRunners:
    """Runner methods of :class:`~meshcomm.backends.mpi.communicator.MpiCommunicator` (a
    mixin: each method works on the communicator it is called on)."""

    #: The persistent collectives the runners made (None: this MPI offers none, or closed).
    _persistent: list[Any] | None

    def all_reduce_runner(
        self: _Comm, dtype: np.dtype, op: ReduceOp
    ) -> Callable[[np.ndarray, np.ndarray], None]:
        """Return ``run(send, recv)``: :meth:`all_reduce_out` for host arrays of ``dtype``.

        The group layer's plans call it for every synchronous ``all_reduce`` of that
        (dtype, op): the MPI datatype and op are looked up once, here, and ``send`` and
        ``recv`` may have any shape (both C-contiguous numpy arrays, the same shape): MPI
        reads the count from the buffers.

        Example:
            A sketch (needs an MPI world)::

                run = comm.all_reduce_runner(np.dtype(np.float32), ReduceOp.SUM)
                out = np.empty_like(x)
                run(x, out)  # out == the sum of every rank's x
        """
        red = self._reductions.get((dtype, op)) or self._reduction(dtype, op)
        datatype, mpi_op, start = red.datatype, red.op, self.mpi_comm.Iallreduce

        def begin(send: np.ndarray, recv: np.ndarray) -> Any:
            # [buffer, datatype]: mpi4py derives the count, faster than parsing a given one.
            return start([send, datatype], [recv, datatype], mpi_op)

        init = getattr(self.mpi_comm, "Allreduce_init", None)
        if init is None or self._persistent is None:  # MPI (or mpi4py) before MPI 4
            return self._runner("all_reduce", begin)
        return self._runner("all_reduce", begin, self._persistent_all_reduce(dtype, init, red))

    def _persistent_all_reduce(
        self: _Comm, dtype: np.dtype, init: Callable[..., Any], red: Reduction
    ) -> Callable[[np.ndarray, np.ndarray], bool]:
        """``small(send, recv)`` for the all_reduces of at most :data:`PERSISTENT_MAX` bytes:
        a persistent all_reduce of the call's shape, made on the first call of that shape
        (the same call on every rank: the calls match) and started again by each later one,
        through two buffers of its own; False (nothing done) where this MPI has none.

        Measured under callgrind at 8 bytes, world 2 (MPICH 5): ``MPI_Iallreduce`` with its
        tests cost 89 k instructions a call, blocking ``MPI_Allreduce`` 33 k, and
        ``MPI_Start`` of a persistent one with both copies 24 k: MPICH builds a nonblocking
        collective's schedule anew for each call, and a persistent one once.
        """
        kept: dict[tuple[int, ...], tuple[Any, np.ndarray, np.ndarray]] = {}
        datatype, mpi_op, error_type = red.datatype, red.op, self._error_type
        copyto, poll_ = np.copyto, poll

        def late() -> str:
            return self._late("all_reduce")

        def make(shape: tuple[int, ...]) -> tuple[Any, np.ndarray, np.ndarray] | None:
            persistent = self._persistent
            if persistent is None:
                return None
            if len(kept) >= _PERSISTENT_KEPT:
                # Every rank drops the same one (the oldest): their calls are the same.
                request = kept.pop(next(iter(kept)))[0]
                persistent.remove(request)
                request.Free()
            sbuf, rbuf = np.empty(shape, dtype), np.empty(shape, dtype)
            try:
                request = init([sbuf, datatype], [rbuf, datatype], mpi_op)
            except (NotImplementedError, error_type):
                # No persistent collectives in this MPI: every later call is started (the
                # same on every rank: one library).
                self._persistent = None
                return None
            persistent.append(request)
            slot = kept[shape] = (request, sbuf, rbuf)
            return slot

        def small(send: np.ndarray, recv: np.ndarray) -> bool:
            shape = recv.shape
            slot = kept.get(shape) or make(shape)
            if slot is None:
                return False
            request, sbuf, rbuf = slot
            copyto(sbuf, send)
            try:
                request.Start()
                if not request.Test():
                    poll_(request.Test, self.timeout, self._patience, late)
            except BaseException:
                # Still active: never started again, nor freed at close (a pending entry
                # keeps it and its buffers alive, and the communicator too).
                del kept[shape]
                self._pending.append(([request], (sbuf, rbuf)))
                raise
            copyto(recv, rbuf)
            return True

        return small

    def free_persistent(self: _Comm) -> None:
        """Free the persistent collectives the runners made (before the communicator; they
        are inactive: a call that timed out took its own out of the list)."""
        persistent, self._persistent = self._persistent or [], None
        for request in persistent:
            with contextlib.suppress(self._error_type):
                request.Free()

    def all_gather_runner(self: _Comm) -> Callable[[np.ndarray, np.ndarray], None]:
        """Return ``run(send, recv)``: :meth:`all_gather` for C-contiguous host arrays of any
        shape, ``recv`` holding ``size`` times ``send``'s bytes (rank-major)."""
        byte, start = self._mpi.BYTE, self.mpi_comm.Iallgather

        def begin(send: np.ndarray, recv: np.ndarray) -> Any:
            count = send.nbytes
            return start([send, count, byte], [recv, count, byte])

        return self._runner("all_gather", begin)

    def all_to_all_runner(self: _Comm) -> Callable[[np.ndarray, np.ndarray], None]:
        """Return ``run(send, recv)``: :meth:`all_to_all` for C-contiguous host arrays of any
        shape, block ``j`` (``1/size`` of the bytes, rank-major) going to rank ``j``."""
        byte, start, size = self._mpi.BYTE, self.mpi_comm.Ialltoall, self.size

        def begin(send: np.ndarray, recv: np.ndarray) -> Any:
            count = send.nbytes // size
            return start([send, count, byte], [recv, count, byte])

        return self._runner("all_to_all", begin)

    def reduce_scatter_runner(
        self: _Comm, dtype: np.dtype, op: ReduceOp
    ) -> Callable[[np.ndarray, np.ndarray], None]:
        """Return ``run(send, recv)``: :meth:`reduce_scatter` for C-contiguous host arrays of
        ``dtype``, of any shape, ``send`` holding ``size`` times ``recv``'s elements."""
        red = self._reductions.get((dtype, op)) or self._reduction(dtype, op)
        datatype, mpi_op, start = red.datatype, red.op, self.mpi_comm.Ireduce_scatter_block

        def begin(send: np.ndarray, recv: np.ndarray) -> Any:
            count = recv.size  # per block, as in MPI's call
            return start([send, count, datatype], [recv, count, datatype], mpi_op)

        return self._runner("reduce_scatter", begin)

    def broadcast_runner(self: _Comm, root: int) -> Callable[[np.ndarray, np.ndarray], None]:
        """Return ``run(send, recv)``: :meth:`broadcast_out` from group rank ``root`` for
        C-contiguous host arrays of any shape, ``send`` and ``recv`` the same bytes.

        On root, MPI sends from ``send`` while root copies it into ``recv``; elsewhere
        ``recv`` receives and ``send`` is not read.

        Raises:
            InvalidArgument: ``root`` is not a rank of this communicator.

        Example:
            A sketch (needs an MPI world)::

                run = comm.broadcast_runner(0)
                out = np.empty_like(x)
                run(x, out)  # out == rank 0's x, on every rank
        """
        root = self._peer(root, "broadcast root")
        byte, start = self._mpi.BYTE, self.mpi_comm.Ibcast
        begin: Callable[[np.ndarray, np.ndarray], Any]
        if self.rank == root:

            def begin(send: np.ndarray, recv: np.ndarray) -> Any:
                request = start([send, send.nbytes, byte], root)
                copy_while_sending(request, send, recv)
                return request

        else:

            def begin(send: np.ndarray, recv: np.ndarray) -> Any:
                return start([recv, recv.nbytes, byte], root)

        return self._runner("broadcast", begin)

    def runner(self: _Comm, collective: str, dtype: np.dtype, arg: ReduceOp | int | None) -> Runner:
        """The runner of :meth:`all_reduce_runner`, :meth:`reduce_scatter_runner`,
        :meth:`all_gather_runner`, :meth:`all_to_all_runner` or :meth:`broadcast_runner`
        for ``collective`` (the :class:`~meshcomm.backends.base.Communicator` hook).

        Raises:
            InvalidArgument: an unknown collective, or ``arg`` wrong for it.
        """
        if collective in ("all_reduce", "reduce_scatter") and isinstance(arg, ReduceOp):
            if collective == "all_reduce":
                return self.all_reduce_runner(dtype, arg)
            return self.reduce_scatter_runner(dtype, arg)
        if collective == "all_gather" and arg is None:
            return self.all_gather_runner()
        if collective == "all_to_all" and arg is None:
            return self.all_to_all_runner()
        if collective == "broadcast" and isinstance(arg, int):
            return self.broadcast_runner(arg)
        raise InvalidArgument(f"{self._at('runner')}: no runner for {collective}({arg!r})")

    def _runner(
        self: _Comm,
        what: str,
        begin: Callable[[np.ndarray, np.ndarray], Any],
        small: Callable[[np.ndarray, np.ndarray], bool] | None = None,
    ) -> Callable[[np.ndarray, np.ndarray], None]:
        """Wrap ``begin(send, recv) -> MPI request`` into a runner that completes it (poll,
        timeout, MPI errors as meshcomm errors; buffers kept alive if it never completes).
        Like every primitive, it refuses to run once the communicator is closed.

        ``small``: runs a call of at most :data:`PERSISTENT_MAX` bytes its own way instead
        (True), or declines (False); its failures take the same path as ``begin``'s."""
        error_type = self._error_type

        def late() -> str:
            return self._late(what)

        def run(send: np.ndarray, recv: np.ndarray) -> None:
            if self._closed:  # MPI would run on a freed communicator
                self._check(what)
            request = None
            try:
                if small is not None and recv.nbytes <= PERSISTENT_MAX and small(send, recv):
                    return
                request = begin(send, recv)
                if not request.Test():
                    poll(request.Test, self.timeout, self._patience, late)
            except CommTimeout:
                self._pending.append(([request], (send, recv)))
                raise
            except error_type as exc:
                self._pending.append(([request], (send, recv)))
                raise comm_error(exc, self._at(what)) from exc

        return run
