"""Process groups: functional collectives over a set of ranks.

A :class:`ProcessGroup` wraps one communicator (flat buffers, primitive reductions) and
adds everything above it, once for every backend: array conversion, ``axis`` / ``tiled``
layouts (JAX semantics), ``avg`` and ``premul_sum``, argument checks before any I/O, op
sequence numbers, debug fingerprints, asynchronous :class:`~meshcomm.work.Work`, sub-groups
(:meth:`ProcessGroup.split`, :func:`new_group`), and fail-fast after a communication error.
How each collective maps onto the communicator's buffers is in :mod:`meshcomm.group.lower`.

Every collective is functional: it returns new arrays (C-contiguous, native byte order)
and never modifies its inputs; the one exception is asked for by name,
``all_reduce(x, out=buf)``. An asynchronous call copies its input when it is issued (so the
caller may reuse it at once). A synchronous call reads an input already in the
communicator's layout where it lies. Results come from a per-world
:class:`~meshcomm.group.arrays.ResultPool` that recycles large buffers, send snapshots from a
scratch pool reused from call to call.

One route: every collective method hands its arguments, as they are, to the group's
issuer (:meth:`meshcomm.group.issuing.Issuer.call`) with the collective's description
(:mod:`meshcomm.group.collectives`): ``call -> route -> plan -> run``. The route (host or
device communicator, a device array staged through host memory) is
:mod:`meshcomm.group.routes`'; ``all_reduce``, ``reduce_scatter``, ``all_gather``,
``all_to_all``, ``broadcast``, ``reduce``, ``gather`` and ``scatter`` (an array on every
rank) of a numpy array, and a device ``all_reduce``, run through the cached **plan** of
their call signature (:mod:`meshcomm.group.plans`), made on its first call with every
check; a call that finds its plan runs the runner on the claimed engine with only the
sequence number, the ledger entry and the stamp around it (docs/architecture.md, decision
3). The rest is lowered per
call (:mod:`meshcomm.group.lower`, :mod:`meshcomm.group.device_lower`): a plan used once.
Closing the group drops its plans, and a closed group's engine refuses every call. Every
argument error is raised before any I/O.

Return types: each collective returns an array (or None, as documented), or a
:class:`~meshcomm.work.Work` whose ``wait()`` returns that, with ``async_op=True``; the
methods are annotated ``Any`` for that reason.

Order and threads: every group has a progress engine of its own that runs the group's
operations one at a time, in issue order; operations of different groups never wait for
each other, so any thread may call collectives on any group and mesh axes overlap. A
synchronous call that finds nothing queued on its group runs inline on the caller's thread.
After a communication error the group fails fast: every later operation on it raises
:class:`~meshcomm.errors.CommError` naming the first failure (a dead peer fails every group
it belongs to; groups without it keep working).

Debugging: with ``MESHCOMM_DEBUG=DETAIL`` (or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``) when a
group is created, every collective first all-gathers a fingerprint of the call (see
:mod:`meshcomm.diagnostics.fingerprint`); if the ranks disagree, every rank raises CommError naming
the disagreeing ranks and both calls.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> g = ProcessGroup(SelfCommunicator(), name="world")
    >>> g.all_reduce(np.arange(3.0), "avg")
    array([0., 1., 2.])
    >>> g.all_gather(np.arange(3), axis=0).shape
    (1, 3)
    >>> g.close()
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from meshcomm.backends.base import Communicator
from meshcomm.backends.local import SelfCommunicator  # noqa: F401 - the doctests use it
from meshcomm.diagnostics import fingerprint as _fingerprint
from meshcomm.diagnostics.fingerprint import DEBUG_ENV_VARS
from meshcomm.errors import InvalidArgument
from meshcomm.group import collectives as _coll
from meshcomm.group import device_lower as _device_lower
from meshcomm.group import device_p2p as _device_p2p
from meshcomm.group import lower as _lower
from meshcomm.group import plans as _plans
from meshcomm.group import routes
from meshcomm.group.issuing import Issuer
from meshcomm.group.point_to_point import PointToPoint
from meshcomm.group.subgroups import SubGroups
from meshcomm.reduction import ReduceOp
from meshcomm.store.base import Store
from meshcomm.work import ProgressEngine, Work

__all__ = ["DEBUG_ENV_VARS", "ProcessGroup", "Work", "new_group"]

ArrayLike = npt.ArrayLike
OpLike = str | ReduceOp


class ProcessGroup(SubGroups, PointToPoint):
    """A group of ranks with functional collectives (JAX semantics, torch names).

    Args:
        comm: the communicator this group lowers onto (the group takes ownership).
        store: the world's key-value store, if any (exposed as ``.store``).
        name: used in error messages; the world is ``"world"``, sub-groups get
            ``"<parent>/split<n>:<color>"`` or ``"<parent>/group<n>"``.
        debug: check collective fingerprints before each collective; None reads
            ``MESHCOMM_DEBUG`` / ``TORCH_DISTRIBUTED_DEBUG`` (``DETAIL``) now. Sub-groups
            inherit their parent's setting.

    Attributes:
        store: the store given at creation (sub-groups share their parent's).
        name: the group's name.

    Example:
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> g = ProcessGroup(SelfCommunicator(), name="world")
        >>> g.rank, g.size, g.ranks, g.backend
        (0, 1, (0,), 'self')
        >>> g.close()
    """

    def __init__(
        self,
        comm: Communicator,
        store: Store | None = None,
        name: str = "world",
        *,
        debug: bool | None = None,
        device: Communicator | None = None,
        _parent: ProcessGroup | None = None,
    ) -> None:
        self._comm = comm
        # Device arrays go to this communicator (nccl) when there is one, else through
        # host memory over ``comm``.
        self._device = device
        self.store = store
        self.name = name
        comm.describe_as(f"on group {name!r}")
        me = comm.global_ranks[comm.rank]
        self._where = f"rank {me} in group {name!r} (size {comm.size})"
        # Every group has an engine of its own: its operations keep issue order among
        # themselves and never wait for another group's (MPI and NCCL order per communicator
        # too), so mesh axes overlap and threads on different groups cannot deadlock.
        pools = None if _parent is None else (_parent._engine.pool, _parent._engine.results)
        engine = ProgressEngine(f"rank {me} in group {name!r}", pools)
        if _parent is None:
            level = _fingerprint.level()
            debug = level == _fingerprint.DETAIL if debug is None else bool(debug)
            checks = level != _fingerprint.OFF
        else:
            debug = _parent.debug if debug is None else bool(debug)
            checks = _parent._issuer.checks
        # Its calls run through the issuer (checks, engine, ledger, plans): every collective
        # method below is one call of ``self._issuer.call``. ``_book`` is its ledger, for
        # the tools that read a group's.
        self._issuer: Issuer = Issuer(self, comm, engine, self._where, debug, checks, device)
        self._engine: ProgressEngine = engine
        self._book = self._issuer.book
        self._children = 0
        # Made with the group (not on first use: two threads would count messages apart).
        self._p2p = None if device is None else _device_p2p.for_communicators(comm, device)
        # Closing a group closes the groups made from it before its communicator (they may
        # share its resources: the MPI world, the tcp store).
        self._kids: list[ProcessGroup] = []
        if _parent is not None:
            _parent._kids.append(self)
        self._closed = False

    # -- identity ------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._comm.rank

    @property
    def size(self) -> int:
        """The number of ranks in the group."""
        return self._comm.size

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global (world) rank of each group rank."""
        return self._comm.global_ranks

    @property
    def backend(self) -> str:
        """The backend: "tcp", "mpi" or "self", or ``"cpu:tcp,cuda:nccl"`` where device
        arrays go over a device backend of their own."""
        host, device = self._comm.backend_name, self.device_backend
        return host if device is None else f"cpu:{host},cuda:{device}"

    @property
    def device_backend(self) -> str | None:
        """The backend device arrays go over (``"nccl"``), or None: through host memory.

        Example:
            >>> ProcessGroup(SelfCommunicator()).device_backend is None
            True
        """
        return None if self._device is None else self._device.backend_name

    @property
    def timeout(self) -> float:
        """Seconds a blocking operation waits for a peer."""
        return self._comm.timeout

    @property
    def label(self) -> str:
        """How messages name this group in the user's words: ``"on group 'world'"``, or
        ``"over 'tp'"`` for the group a mesh made for its axis ``'tp'`` (never an id).

        Example:
            >>> ProcessGroup(SelfCommunicator(), name="world").label
            "on group 'world'"
        """
        return self._comm.label

    @label.setter
    def label(self, text: str) -> None:
        if text == self._comm.label:
            return
        self._comm.describe_as(text)
        me = self.ranks[self.rank]
        self._where = f"rank {me} in group {self.name!r} {text} (size {self.size})"
        self._issuer.relabel(self._where)

    @property
    def debug(self) -> bool:
        """True if collectives check fingerprints first (``MESHCOMM_DEBUG=DETAIL``)."""
        return self._issuer.debug

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def ledger(self) -> list[dict[str, Any]]:
        """This rank's last collectives on this group, oldest first (``MESHCOMM_LEDGER``).

        Each record has ``seq``, ``op``, ``name`` (as called: ``psum``), ``dtype``,
        ``shape``, ``reduce`` (the reduce op's name) and ``root`` (each None where the
        operation has none), ``device`` (a GPU array), ``group`` (the group in words, by
        its mesh axes where a mesh made it: ``"over 'tp'"``), ``site`` (the caller's
        ``file:line``), ``state`` ("done", "failed" or "in flight") and ``seconds``.

        Example:
            >>> g = ProcessGroup(SelfCommunicator())
            >>> _ = g.all_reduce(np.ones(2))
            >>> [(r["seq"], r["op"], r["state"]) for r in g.ledger()]
            [(1, 'all_reduce', 'done')]
        """
        label = self.label
        return [{**r, "group": label} for r in self._book.records()]

    @property
    def seq(self) -> int:
        """The number of collectives issued on this group so far (the op sequence number)."""
        return self._issuer.seq

    def global_rank(self, group_rank: int) -> int:
        """Return the world rank of ``group_rank``.

        Raises:
            InvalidArgument: ``group_rank`` is not in ``[0, size)``.

        Example:
            >>> ProcessGroup(SelfCommunicator()).global_rank(0)
            0
        """
        engine = self._engine
        call = _lower.Call(self._comm, engine.pool, f"global_rank: {self._where}", engine.results)
        return self.ranks[_lower.rank_arg(call, group_rank, "group_rank")]

    def group_rank(self, global_rank: int) -> int:
        """Return the group rank of world rank ``global_rank``.

        Raises:
            InvalidArgument: ``global_rank`` is not a member of this group.

        Example:
            >>> ProcessGroup(SelfCommunicator()).group_rank(0)
            0
        """
        g = _lower.int_arg(f"group_rank: {self._where}", global_rank, "global_rank")
        if g not in self.ranks:
            raise InvalidArgument(
                f"group_rank: {self._where}: global rank {g} is not a member; members are "
                f"{list(self.ranks)}"
            )
        return self.ranks.index(g)

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return (
            f"<ProcessGroup {self.name!r} rank={self.rank} size={self.size} "
            f"backend={self.backend!r}{state}>"
        )

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(
        self,
        x: ArrayLike,
        op: OpLike = "sum",
        *,
        factor: Any = None,
        async_op: bool = False,
        out: np.ndarray | None = None,
    ) -> Any:
        """Reduce ``x`` across the group; every rank gets the result (``jax.lax.psum`` & co).

        Args:
            x: an array (or anything ``np.asarray`` accepts); same shape and dtype on all ranks.
            op: "sum", "prod", "min", "max", "avg" (sum, then divide by ``size``),
                "band", "bor", "bxor", or "premul_sum" (multiply by ``factor``, then sum).
                avg and premul_sum compute in ``x``'s dtype.
            factor: the scalar of "premul_sum" (only there).
            async_op: return a :class:`~meshcomm.work.Work` instead of the result.
            out: write the result here instead of into a new array: a writeable
                C-contiguous numpy array of ``x``'s shape and dtype (a numpy array too), or
                ``x`` itself to reduce in place; with a device backend, a device ``x`` and
                ``out`` of one shape and dtype (NCCL reduces in place when they are one).
                No copy of ``x`` is taken, so with ``async_op`` neither ``x`` nor ``out``
                may change until the Work completes (MPI's rule for nonblocking buffers,
                and torch's for ``async_op``); the DDP pattern, a gradient bucket reduced
                in place behind other work, needs no extra pass over memory this way.

        Returns:
            A new array with ``x``'s shape and dtype (``out`` when given).

        Raises:
            InvalidArgument: unknown op, or factor missing / misplaced; an ``out`` that is
                not such an array (or overlaps ``x`` without being it).
            TypeError: the op is undefined for the dtype (complex min, float band, int avg),
                or the dtype is unsupported.
            CommError: communication failed (or had failed before in this world).

        Example:
            >>> g = ProcessGroup(SelfCommunicator())
            >>> g.all_reduce([1.0, 2.0], "premul_sum", factor=3.0)
            array([3., 6.])
            >>> grads = np.ones(3)
            >>> g.all_reduce(grads, out=grads) is grads
            True
        """
        issuer = self._issuer
        if out is None:
            if type(x) is np.ndarray and factor is None:
                # Issuer.call's first step (the plan under all_reduce's key) without its
                # frame and the key function's: the 8-byte call's cost is mostly frames. The
                # last signature's plan is compared first (identity and a tuple comparison
                # cost less than building and hashing the key).
                plan: Any
                dtype, last = x.dtype, issuer.last_all_reduce
                if last[0] is dtype and last[2] is op and last[1] == x.shape:
                    return issuer.run_plan(last[3], x, async_op)
                try:
                    plan = issuer.plans.get(("all_reduce", dtype, x.shape, op))
                except TypeError:  # an unhashable op: Issuer.call's checks name it
                    plan = None
                if plan is not None:
                    issuer.last_all_reduce = (dtype, x.shape, op, plan)
                    return issuer.run_plan(plan, x, async_op)
            return issuer.call(_coll.ALL_REDUCE, x, async_op, op, factor)
        if (
            out is x
            and type(x) is np.ndarray
            and factor is None
            and x.flags.c_contiguous
            and x.flags.writeable
        ):  # in place (the DDP bucket, torch's all_reduce): what check_out asks holds
            plan = issuer.plan(("all_reduce", x.dtype, x.shape, op), _plans.plan_all_reduce, x, op)
            return issuer.run_plan(plan, x, async_op, x)
        return self._all_reduce_into(x, op, factor, async_op, out)

    def _all_reduce_into(self, x: Any, op: OpLike, factor: Any, async_op: bool, out: Any) -> Any:
        """:meth:`all_reduce` with ``out``: checked first, then the plan of the signature
        runs into ``out`` (a ``premul_sum``, whose factor is no part of a plan, is lowered
        per call and its result copied into ``out``)."""
        issuer = self._issuer
        c = issuer.enter("all_reduce")
        if (on_device := routes.device_route(self._device, x)) is not None:
            lowered = _device_lower.all_reduce_into(c, *on_device, x, op, factor, out)
            return issuer.issue_on_device("all_reduce", lowered, async_op)
        _lower.check_out(c, x, out)
        if factor is not None:
            body, fields = _lower.all_reduce(c, x, op, factor, snapshot=bool(async_op))

            def scaled_into_out() -> np.ndarray:
                np.copyto(out, body())
                return out

            return issuer.issue("all_reduce", (scaled_into_out, fields), async_op)
        plan = issuer.plan(("all_reduce", x.dtype, x.shape, op), _plans.plan_all_reduce, x, op)
        return issuer.run_plan(plan, x, async_op, out)

    def all_gather(
        self, x: ArrayLike, axis: int = 0, tiled: bool = False, *, async_op: bool = False
    ) -> Any:
        """Gather every rank's ``x`` (``jax.lax.all_gather``).

        Args:
            x: an array; same shape and dtype on all ranks.
            axis: not tiled: where the new rank axis goes (``-(ndim+1)..ndim``); tiled: the
                axis along which the pieces are concatenated (``-ndim..ndim-1``).
            tiled: concatenate instead of stacking.
            async_op: return a Work.

        Returns:
            Not tiled: shape ``x.shape`` with ``size`` inserted at ``axis``; tiled:
            ``x.shape`` with ``x.shape[axis] * size`` at ``axis``. Entry ``r`` along ``axis``
            comes from group rank ``r``.

        Raises:
            InvalidArgument: axis out of range (or tiled with a 0-d ``x``).
            TypeError: unsupported dtype.
            CommError: communication failed.

        Example:
            >>> g = ProcessGroup(SelfCommunicator())
            >>> x = np.ones((2, 3))
            >>> g.all_gather(x, axis=1).shape, g.all_gather(x, axis=1, tiled=True).shape
            ((2, 1, 3), (2, 3))
        """
        return self._issuer.call(_coll.ALL_GATHER, x, async_op, axis, tiled)

    def reduce_scatter(
        self,
        x: ArrayLike,
        op: OpLike = "sum",
        axis: int = 0,
        tiled: bool = False,
        *,
        factor: Any = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``x`` across ranks, scattering the result along ``axis`` (``psum_scatter``).

        Args:
            x: an array; same shape and dtype on all ranks.
            op: a reduce op, as for :meth:`all_reduce`.
            axis: the scatter axis (JAX's ``scatter_dimension``).
            tiled: not tiled: ``x.shape[axis]`` must equal ``size`` and rank ``r`` gets
                index ``r`` (the axis is removed); tiled: ``x.shape[axis]`` must be divisible
                by ``size`` and rank ``r`` gets the ``r``-th chunk (the axis shrinks).
            factor: the scalar of "premul_sum".
            async_op: return a Work.

        Returns:
            This rank's block of the reduction, a new array.

        Raises:
            InvalidArgument: bad axis, indivisible shape, unknown op.
            TypeError: op undefined for the dtype, unsupported dtype.
            CommError: communication failed.

        Example:
            >>> g = ProcessGroup(SelfCommunicator())
            >>> g.reduce_scatter(np.arange(4.0).reshape(1, 4), axis=0)
            array([0., 1., 2., 3.])
        """
        return self._issuer.call(_coll.REDUCE_SCATTER, x, async_op, op, axis, tiled, factor)

    def all_to_all(
        self,
        x: ArrayLike,
        split_axis: int = 0,
        concat_axis: int = 0,
        tiled: bool = False,
        *,
        async_op: bool = False,
    ) -> Any:
        """Send block ``j`` along ``split_axis`` to rank ``j`` (``jax.lax.all_to_all``).

        Args:
            x: an array; same shape and dtype on all ranks.
            split_axis: the axis cut into ``size`` blocks.
            concat_axis: where the received blocks are put together.
            tiled: not tiled: ``x.shape[split_axis]`` must equal ``size``; that axis is
                removed and a new axis of length ``size`` (indexed by source rank) is inserted
                at ``concat_axis`` (a position in the result). Tiled: ``x.shape[split_axis]``
                must be divisible by ``size``; it shrinks by ``size`` and the received chunks
                are concatenated along ``concat_axis``, which grows by ``size``.
            async_op: return a Work.

        Returns:
            A new array: ``out.take(i, concat_axis)`` (not tiled) is rank ``i``'s
            ``x.take(rank, split_axis)``.

        Raises:
            InvalidArgument: bad axes, indivisible shape.
            TypeError: unsupported dtype.
            CommError: communication failed.

        Example:
            >>> g = ProcessGroup(SelfCommunicator())
            >>> g.all_to_all(np.arange(6).reshape(1, 6), split_axis=0, concat_axis=1).shape
            (6, 1)
        """
        issuer = self._issuer
        return issuer.call(_coll.ALL_TO_ALL, x, async_op, split_axis, concat_axis, tiled)

    def broadcast(
        self,
        x: ArrayLike | None,
        root: int = 0,
        *,
        shape: Any = None,
        dtype: Any = None,
        async_op: bool = False,
    ) -> Any:
        """Return root's ``x`` on every rank.

        Args:
            x: the array on root; elsewhere an array of the same shape and dtype (its values
                are ignored) or None with ``shape=`` and ``dtype=``. In a group with a device
                backend, None receives a device array (cupy) where the device holds the
                dtype (every rank of a call takes the root's route: a root's host array of
                such a dtype needs arrays, not None, elsewhere; see ``routes.arrival_route``).
            root: the group rank that sends.
            shape: the array's shape, needed off root when ``x`` is None.
            dtype: the array's dtype, needed off root when ``x`` is None.
            async_op: return a Work.

        Returns:
            A new array equal to root's ``x``.

        Raises:
            InvalidArgument: root out of range, ``x`` missing on root, shape/dtype missing or
                disagreeing with ``x``.
            CommError: communication failed.

        Example:
            >>> g = ProcessGroup(SelfCommunicator())
            >>> g.broadcast(np.arange(3), root=0)
            array([0, 1, 2])
        """
        return self._issuer.call(_coll.BROADCAST, x, async_op, root, shape, dtype)

    def reduce(
        self,
        x: ArrayLike,
        root: int = 0,
        op: OpLike = "sum",
        *,
        factor: Any = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``x`` onto ``root``.

        Args:
            x: an array; same shape and dtype on all ranks.
            root: the group rank that gets the result.
            op: a reduce op, as for :meth:`all_reduce`.
            factor: the scalar of "premul_sum".
            async_op: return a Work.

        Returns:
            The reduction (a new array) on root; None on the other ranks.

        Raises:
            InvalidArgument: root out of range, unknown op.
            TypeError: op undefined for the dtype, unsupported dtype.
            CommError: communication failed.

        Example:
            >>> g = ProcessGroup(SelfCommunicator())
            >>> g.reduce(np.array([3, 1]), root=0, op="max")
            array([3, 1])
        """
        return self._issuer.call(_coll.REDUCE, x, async_op, root, op, factor)

    def gather(self, x: ArrayLike, root: int = 0, *, async_op: bool = False) -> Any:
        """Stack every rank's ``x`` on ``root``.

        Args:
            x: an array; same shape and dtype on all ranks.
            root: the group rank that gets the result.
            async_op: return a Work.

        Returns:
            On root a new array of shape ``(size, *x.shape)`` whose entry ``r`` is rank
            ``r``'s ``x``; None on the other ranks.

        Raises:
            InvalidArgument: root out of range.
            CommError: communication failed.

        Example:
            >>> g = ProcessGroup(SelfCommunicator())
            >>> g.gather(np.arange(2), root=0)
            array([[0, 1]])
        """
        return self._issuer.call(_coll.GATHER, x, async_op, root)

    def scatter(
        self,
        x: ArrayLike | None,
        root: int = 0,
        *,
        shape: Any = None,
        dtype: Any = None,
        async_op: bool = False,
    ) -> Any:
        """Give rank ``r`` entry ``r`` of root's stacked ``x``.

        Args:
            x: on root, an array of shape ``(size, *shape)``; elsewhere None (then pass
                ``shape=`` and ``dtype=``, the shape of one entry) or an array of the same
                stacked shape and dtype (its values are ignored). None in a group with a
                device backend: as for :meth:`broadcast`.
            root: the group rank that sends.
            shape: the shape of one entry (without the leading ``size``).
            dtype: the dtype.
            async_op: return a Work.

        Returns:
            A new array: root's ``x[rank]``.

        Raises:
            InvalidArgument: root out of range, ``x.shape[0] != size``, shape/dtype missing
                or disagreeing with ``x``.
            CommError: communication failed.

        Example:
            >>> g = ProcessGroup(SelfCommunicator())
            >>> g.scatter(np.array([[1, 2]]), root=0)
            array([1, 2])
        """
        return self._issuer.call(_coll.SCATTER, x, async_op, root, shape, dtype)

    def permute(
        self, x: ArrayLike, perm: Sequence[tuple[int, int]], *, async_op: bool = False
    ) -> Any:
        """Send ``x`` along ``(src, dst)`` pairs (``jax.lax.ppermute``).

        Args:
            x: an array; same shape and dtype on all ranks.
            perm: ``(src, dst)`` group-rank pairs; no rank appears twice as a source or twice
                as a destination. Every rank passes the same ``perm``.
            async_op: return a Work.

        Returns:
            A new array: the ``x`` of the rank that sends here, or zeros if none does.

        Raises:
            InvalidArgument: a rank out of range, a duplicate source or destination.
            CommError: communication failed.

        Example:
            >>> g = ProcessGroup(SelfCommunicator())
            >>> g.permute(np.array([1, 2]), [(0, 0)]), g.permute(np.array([1, 2]), [])
            (array([1, 2]), array([0, 0]))
        """
        return self._issuer.call(_coll.PERMUTE, x, async_op, perm)

    def barrier(self, *, async_op: bool = False) -> Any:
        """Return once every rank of the group has entered the barrier.

        Args:
            async_op: return a Work.

        Raises:
            CommError: communication failed.

        Example:
            >>> ProcessGroup(SelfCommunicator()).barrier()
        """
        return self._issuer.call(_coll.BARRIER, None, async_op)

    # -- what the point-to-point and sub-group methods lower with ---------------------------
    def _enter(self, op: str) -> _lower.Call:
        """The issuer's :meth:`~meshcomm.group.issuing.Issuer.enter`: refuse a closed or
        failed group; the call context for lowering ``op``."""
        return self._issuer.enter(op)

    def _issue(
        self, op: str, lowered: _lower.Lowered, async_op: bool, device: ModuleType | None = None
    ) -> Any:
        """The issuer's :meth:`~meshcomm.group.issuing.Issuer.issue`: run a lowered call in
        the group's order (its result handed back to ``device``'s module where given)."""
        return self._issuer.issue(op, lowered, async_op, device)

    def _child(
        self, comm: Communicator, name: str, device: Communicator | None = None
    ) -> ProcessGroup:
        """The group over ``comm``; its device communicator is ``device`` if one was made by
        a collective split, else one made from this group's on first use."""
        if device is None and self._device is not None:  # the same members, as our ranks
            device = self._device.sub([self.ranks.index(r) for r in comm.global_ranks])
        return ProcessGroup(comm, store=self.store, name=name, device=device, _parent=self)

    # -- lifetime ------------------------------------------------------------------------
    def close(self, reason: str | None = None, *, abort: bool = False) -> None:
        """Release the group's communicator once queued operations have run. Idempotent.

        Closing a group closes the groups made from it first (closing the world closes
        them all). Any later operation on a closed group raises CommError, saying
        ``reason`` when given (default: that the group was closed). ``abort``: the device
        communicators abort what they have in flight instead of waiting for it (a peer may
        be gone), and with a ``reason`` the peers' calls in flight end with
        :class:`~meshcomm.errors.PeerClosed` saying it (tcp: the whole world aborts).

        Example:
            >>> g = ProcessGroup(SelfCommunicator())
            >>> g.close(); g.closed
            True
        """
        if self._closed:
            return
        self._closed = True
        # Every call is refused from here on; queued operations finish, and only then do
        # the groups made from this one and the communicator go.
        if abort and reason is not None:  # first: calls in flight, here and on peers, say why
            self._comm.announce_abort(reason)
        self._issuer.close(reason or f"the group {self.name!r} was closed", self.timeout, reason)
        for kid in list(self._kids):
            kid.close(reason, abort=abort)
        if self._device is not None:
            if abort:
                self._device.abort()
            else:
                self._device.close()
        self._comm.close()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def new_group(
    ranks: Iterable[int] | None = None, group: ProcessGroup | None = None
) -> ProcessGroup | None:
    """Make a sub-group of ``group`` (default: the world) from global ``ranks``.

    Called by every rank of ``group``, as ``torch.distributed.new_group``; see
    :meth:`ProcessGroup.new_group`.

    Returns:
        The new group on its members, None elsewhere.

    Raises:
        RendezvousError: no ``group`` and meshcomm is not initialized.
        InvalidArgument: bad ranks.

    Example:
        >>> g = ProcessGroup(SelfCommunicator())
        >>> new_group([0], group=g).size
        1
    """
    if group is None:
        from meshcomm.world import get_world

        group = get_world()
    return group.new_group(ranks)
