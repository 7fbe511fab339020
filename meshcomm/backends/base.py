"""The Communicator interface every backend (tcp, mpi, nccl, self) implements.

Backends see only flat (1-D), C-contiguous arrays that meshcomm owns and may overwrite.
Shapes, axes, ``tiled``, dtype checks, ``avg`` and ``premul_sum`` live above, once, in
:mod:`meshcomm.group`. Ranks here are ranks *within this communicator*; ``global_ranks``
maps them to world ranks for error messages.

Reduce ops reaching a backend are the primitive ones: SUM, PROD, MIN, MAX, BAND, BOR, BXOR.
Every blocking method raises :class:`~meshcomm.errors.CommTimeout` after the communicator's
timeout and :class:`~meshcomm.errors.PeerError` (naming the global rank) when a peer is gone.

Besides the abstract primitives, the class declares the optional routes a backend may offer
(the group layer asks for them by these names only, never by probing attributes):
``all_reduce_out`` and ``broadcast_out`` (out of place; the defaults copy, then run the
in-place primitive), :meth:`Communicator.runner` (a runner prepared for one call signature;
default None: not offered), :meth:`Communicator.check_all_gather` (default: ``all_gather``)
and its started form :meth:`Communicator.start_check_all_gather` (default: run now),
:meth:`Communicator.grid_splitter` (default None: no grid primitive), and the payload
routes of device point-to-point (:meth:`Communicator.send_payload`,
:meth:`Communicator.recv_payload`, :meth:`Communicator.ready_token`; defaults over
``permute``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshcomm.reduction import ReduceOp

__all__ = ["Communicator", "Runner"]

#: ``run(send, recv)``: one collective of one call signature from ``send`` into ``recv``, two
#: C-contiguous host arrays in the layout the collective has at axis 0 (any shape: a runner
#: reads the counts from the buffers).
Runner = Callable[[np.ndarray, np.ndarray], None]


class Communicator(ABC):
    """Collective primitives over contiguous 1-D buffers, for one group of processes.

    A communicator is used by one thread at a time (the group layer serializes calls).

    Attributes:
        rank: this process's rank in the communicator.
        size: number of processes in the communicator.
        global_ranks: world rank of each communicator rank.
        backend_name: "tcp", "mpi", "nccl" or "self".
        array_module: the module of the arrays it moves ("numpy"; nccl: "cupy").
        timeout: seconds a blocking call waits for a peer.
        label: how errors name this communicator's group, in the user's words ("on group
            'world'", "over 'tp'"; see :meth:`describe_as`); never an internal id.
    """

    backend_name: str = "abstract"
    array_module: str = "numpy"

    def __init__(self, rank: int, global_ranks: Sequence[int], timeout: float) -> None:
        self.rank = rank
        self.global_ranks: tuple[int, ...] = tuple(global_ranks)
        self.size = len(self.global_ranks)
        self.timeout = timeout
        self.label = f"on ranks {list(self.global_ranks)}"

    def describe_as(self, label: str) -> None:
        """Name this communicator's group in error messages from now on (the group layer
        calls it with the group's name or mesh axes)."""
        self.label = label

    # -- mismatch checks -----------------------------------------------------------------
    def stamp_holder(self) -> object | None:
        """An object whose ``stamp`` attribute the group layer sets before each collective
        (mismatch checks, :mod:`meshcomm.diagnostics.fingerprint`): the backend carries it in the
        frames it sends and raises :class:`~meshcomm.errors.MismatchError` (with ``peer``
        and ``theirs``) when a peer's differs. None (the default): no stamps; the group
        layer checks the first call of each signature instead."""
        return None

    def publish_mismatch(self, reason: str) -> str:
        """Make every rank of this communicator raise ``reason`` (both calls in words) as a
        :class:`~meshcomm.errors.MismatchError`; return the words to raise here (the first
        published, where another rank may have been first). Default: ``reason`` alone."""
        return reason

    def notice_mismatch(self, group: str, reason: str) -> None:  # noqa: B027 - optional hook
        """Another rank announced a mismatch (``reason``, both calls in words) on ``group`` of
        this world (as the backend names it): a backend that can (tcp) raises it in this
        rank's next call on any group, unless this rank raised it already. Default: nothing
        (the rank learns of it at its next call on that group, or its timeout)."""

    def check_all_gather(self, send: np.ndarray, recv: np.ndarray) -> None:
        """``all_gather`` of host arrays for the group layer's first-call mismatch checks
        (:func:`~meshcomm.diagnostics.fingerprint.check_first`). Default: :meth:`all_gather`; a
        backend
        that can keep the checks off its collectives' channel (mpi: the point-to-point
        duplicate) overrides it, so a rank alone in a check never matches the others'
        collective."""
        self.all_gather(send, recv)

    def start_check_all_gather(
        self, send: np.ndarray, recv: np.ndarray
    ) -> Callable[[float | None], None]:
        """:meth:`check_all_gather` started; returns the function that waits for it to
        complete (at most the given seconds, None: the communicator's timeout; raises
        :class:`~meshcomm.errors.CommTimeout` after it). ``send`` and ``recv`` must stay
        untouched until then. Every rank starts these in the same order relative to its
        other checks. Default: run now, and a wait that returns at once; mpi starts
        ``MPI_Iallgather`` on the point-to-point duplicate."""
        self.check_all_gather(send, recv)
        return _done

    # -- optional routes -----------------------------------------------------------------
    def runner(self, collective: str, dtype: np.dtype, arg: ReduceOp | int | None) -> Runner | None:
        """A :data:`Runner` prepared for one call signature, or None (the default): not
        offered, and the group layer runs the primitive on flat views instead.

        Args:
            collective: ``"all_reduce"``, ``"reduce_scatter"`` (``arg``: the primitive
                reduce op), ``"all_gather"``, ``"all_to_all"`` (``arg`` None) or
                ``"broadcast"`` (``arg``: the root).
            dtype: the arrays' dtype (native byte order).

        A runner must refuse to run once the communicator is closed, as the primitives do.

        Example:
            >>> from meshcomm.backends.local import SelfCommunicator
            >>> SelfCommunicator().runner("all_reduce", np.dtype(np.float32), ReduceOp.SUM)
        """
        return None

    def grid_splitter(self) -> Callable[[Sequence[int]], Sequence[Communicator]] | None:
        """``split(dims)``: one communicator per axis of a row-major grid of this
        communicator's ranks, made in one collective step (mpi: ``MPI_Cart_create`` and
        ``MPI_Cart_sub``); None (the default): no grid primitive, and the caller splits per
        axis.

        Example:
            >>> from meshcomm.backends.local import SelfCommunicator
            >>> SelfCommunicator().grid_splitter() is None
            True
        """
        return None

    def all_reduce_out(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
        """Out of place: ``recv`` gets the reduction of every rank's ``send`` (only read).

        The group layer hands a synchronous call's input over as ``send``. Default: copy
        ``send`` into ``recv``, then :meth:`all_reduce` in place; a backend that reduces
        straight from ``send`` overrides it (one pass over memory fewer)."""
        np.copyto(recv, send)
        self.all_reduce(recv, op)

    def all_reduce_out_of(self, dtype: np.dtype, op: ReduceOp) -> Callable[[Any, Any], None]:
        """:meth:`all_reduce_out` for buffers of ``dtype`` reduced with ``op``, prepared once
        (a device plan's per-call path). Default: ``all_reduce_out`` with ``op``; a backend
        with per-call lookups to save (nccl: NCCL's codes) overrides it.

        Example:
            >>> from meshcomm.backends.local import SelfCommunicator
            >>> recv = np.empty(2)
            >>> SelfCommunicator().all_reduce_out_of(recv.dtype, ReduceOp.SUM)(np.ones(2), recv)
            >>> recv.tolist()
            [1.0, 1.0]
        """
        reduce_out = self.all_reduce_out

        def run(send: Any, recv: Any) -> None:
            reduce_out(send, recv, op)

        return run

    def check_reduction(self, dtype: np.dtype, op: ReduceOp, what: str) -> None:
        """Raise ``TypeError`` (naming ``what``) if this backend cannot reduce ``dtype`` with
        ``op``. Default: nothing to raise (host backends reduce every pair the group layer
        accepts); a device backend with a smaller table (nccl) overrides it.

        Example:
            >>> from meshcomm.backends.local import SelfCommunicator
            >>> SelfCommunicator().check_reduction(np.dtype(np.int16), ReduceOp.BXOR, "x")
        """
        return

    def broadcast_out(self, send: np.ndarray | None, recv: np.ndarray, root: int) -> None:
        """Root's ``send`` into every rank's ``recv`` (root's too); ``send`` is only read, on
        root. Default: root copies ``send`` into ``recv``, then :meth:`broadcast`; a backend
        that sends from ``send`` while root copies overrides it."""
        if send is not None and self.rank == root:
            np.copyto(recv, send)
        self.broadcast(recv, root)

    # -- collectives ---------------------------------------------------------------------
    @abstractmethod
    def all_reduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        """Reduce ``buf`` across ranks, in place on every rank."""

    @abstractmethod
    def all_gather(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Fill ``recv`` (``size * len(send)`` elements) with every rank's ``send``, by rank."""

    @abstractmethod
    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
        """Reduce ``send`` (``size * n`` elements) across ranks; rank r gets block r in ``recv``."""

    @abstractmethod
    def all_to_all(self, send: np.ndarray, recv: np.ndarray) -> None:
        """Send block j of ``send`` to rank j; block i of ``recv`` comes from rank i."""

    @abstractmethod
    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Copy root's ``buf`` into every rank's ``buf``."""

    @abstractmethod
    def reduce(self, buf: np.ndarray, root: int, op: ReduceOp) -> None:
        """Reduce ``buf`` onto root, in place there; other ranks' ``buf`` may be clobbered."""

    @abstractmethod
    def gather(self, send: np.ndarray, recv: np.ndarray | None, root: int) -> None:
        """On root, fill ``recv`` (``size * len(send)``) with every rank's ``send``."""

    @abstractmethod
    def scatter(self, send: np.ndarray | None, recv: np.ndarray, root: int) -> None:
        """Rank r receives block r of root's ``send`` (``size * len(recv)``) into ``recv``."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""

    # -- point to point ------------------------------------------------------------------
    @abstractmethod
    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        """Send a contiguous array of any shape; its dtype and shape travel with it."""

    @abstractmethod
    def recv(self, src: int | None, tag: int) -> tuple[np.ndarray, int]:
        """Receive an array sent with ``tag`` from ``src`` (None: any rank).

        Returns:
            The array (a new one, with the sender's shape and dtype) and the sender's rank.
        """

    @abstractmethod
    def permute(self, send: np.ndarray, dst: int | None, recv: np.ndarray, src: int | None) -> None:
        """Send ``send`` to ``dst`` while receiving ``recv`` from ``src`` (either may be None)."""

    def completion_probe(self) -> Callable[[], bool] | None:
        """Whether the work queued so far on the caller's behalf has finished, as a function
        to ask later (nccl: an event recorded now on the caller's stream); None (the
        default): operations finish before they return."""
        return None

    def ready_token(self) -> Any:
        """What orders a later :meth:`send_payload` / :meth:`recv_payload` after the work
        the caller has queued so far, taken now, on the caller's thread (nccl: an event
        recorded on the caller's current CUDA stream, and that stream). Default None: host
        memory needs no ordering."""
        return None

    def send_payload(self, array: np.ndarray, dst: int, after: Any = None) -> None:
        """Send the bytes of C-contiguous ``array`` to ``dst`` (not this rank) with nothing
        around them: the receiver learned shape and dtype from a header sent its own way
        (:mod:`meshcomm.group.device_p2p`). Payloads between two ranks match in the order sent.
        ``after``: a :meth:`ready_token`. Default: :meth:`permute` with only a send."""
        self.permute(array, dst, array, None)

    def recv_payload(self, out: np.ndarray, src: int, after: Any = None) -> None:
        """Receive the next payload from ``src`` (not this rank) into C-contiguous ``out``
        (see :meth:`send_payload`). Default: :meth:`permute` with only a receive."""
        self.permute(out, None, out, src)

    # -- groups and lifetime -------------------------------------------------------------
    @abstractmethod
    def sub(self, ranks: Sequence[int]) -> Communicator:
        """Return a communicator over ``ranks`` (ranks of this communicator, in new-rank order).

        Called only by the members of ``ranks``, each passing the same list.
        """

    def can_split(self) -> bool:
        """Whether :meth:`split_sub` makes sub-communicators in one collective step now
        (nccl's native ``ncclCommSplit`` from a live communicator). Default: False.

        Example:
            >>> from meshcomm.backends.local import SelfCommunicator
            >>> SelfCommunicator().can_split()
            False
        """
        return False

    def split_sub(self, members: Sequence[int] | None) -> Communicator | None:
        """Collective over this communicator: every rank calls it at once, each with the
        members of its new communicator in new-rank order (None: it joins none), and only
        where every rank's :meth:`can_split` said True. Default: unsupported.

        Raises:
            NotImplementedError: this backend has no collective split.
        """
        raise NotImplementedError(f"{self.backend_name} has no collective split")

    @abstractmethod
    def close(self) -> None:
        """Release what this communicator holds. Idempotent."""

    def announce_abort(self, reason: str) -> None:  # noqa: B027 - optional, default nothing
        """Tell the peers, before :meth:`close`, that this rank aborts the world on purpose
        and why (a survivor re-forming an elastic mesh): their calls in flight end saying
        so. Default: nothing."""

    def abort(self) -> None:
        """Release it without waiting for work in flight (a peer may be gone: a device
        communicator aborts its queued collectives). Idempotent; default :meth:`close`."""
        self.close()


def _done(timeout: float | None = None) -> None:
    """The wait of an operation complete already."""
