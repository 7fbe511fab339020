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

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from meshcomm.backends.base import Runner
from meshcomm.backends.mpi._lib import comm_error
from meshcomm.backends.mpi._request import Patience, poll
from meshcomm.backends.mpi._types import Reduction
from meshcomm.errors import CommTimeout, InvalidArgument
from meshcomm.reduction import ReduceOp

__all__ = ["COPY_SLICE", "MpiRunners", "copy_while_sending"]

COPY_SLICE = 256 << 10
"""Bytes the broadcast root copies between ``MPI_Test`` calls."""


class _Comm(Protocol):
    """What the runners use of the communicator they are built on (an MpiCommunicator)."""

    mpi_comm: Any
    timeout: float
    _mpi: Any
    _error_type: type[BaseException]
    _patience: Patience
    _pending: list[Any]
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
        self, what: str, begin: Callable[[np.ndarray, np.ndarray], Any]
    ) -> Callable[[np.ndarray, np.ndarray], None]: ...

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

        # Not a persistent collective (MPI_Allreduce_init once, MPI_Start per call), though at
        # 8 bytes it cost 24k instructions a call in MPICH against Iallreduce's 89k: two
        # ranks that disagree on the dtype of same-sized calls start two different
        # persistent requests, which never match (a hang until the timeout), where
        # Iallreduce completes and the signature checks name both calls
        # (tests/test_mpi_verdicts.py).

        def begin(send: np.ndarray, recv: np.ndarray) -> Any:
            # [buffer, datatype]: mpi4py derives the count, faster than parsing a given one.
            return start([send, datatype], [recv, datatype], mpi_op)

        return self._runner("all_reduce", begin)

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
        self: _Comm, what: str, begin: Callable[[np.ndarray, np.ndarray], Any]
    ) -> Callable[[np.ndarray, np.ndarray], None]:
        """Wrap ``begin(send, recv) -> MPI request`` into a runner that completes it (poll,
        timeout, MPI errors as meshcomm errors; buffers kept alive if it never completes).
        Like every primitive, it refuses to run once the communicator is closed."""
        error_type = self._error_type

        def late() -> str:
            return self._late(what)

        def run(send: np.ndarray, recv: np.ndarray) -> None:
            if self._closed:  # MPI would run on a freed communicator
                self._check(what)
            request = None
            try:
                request = begin(send, recv)
                test = request.Test
                # Three tests before the poll: an 8-byte Iallreduce takes two or three
                # (MPICH's schedule moves a step per test), and entering poll cost more than
                # the tests (0.6-1.0 us a call at world 2).
                if not (test() or test() or test()):
                    poll(test, self.timeout, self._patience, late)
            except CommTimeout:
                self._pending.append(([request], (send, recv)))
                raise
            except error_type as exc:
                self._pending.append(([request], (send, recv)))
                raise comm_error(exc, self._at(what)) from exc

        return run
