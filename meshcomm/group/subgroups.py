"""Sub-groups: the part of :class:`~meshcomm.group.ProcessGroup` that makes groups from a group.

:meth:`SubGroups.split` (``MPI_Comm_split``) and :meth:`SubGroups.new_group` are collective
over the group; :meth:`SubGroups.subgroup` is made by its members alone (a mesh's groups);
:meth:`SubGroups.grid_split` makes one group per axis of a grid at once where the backend
offers a grid primitive (:meth:`~meshcomm.backends.base.Communicator.grid_splitter`). Each
runs on the group's engine, in issue order; a group made from another is closed with it.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> g = ProcessGroup(SelfCommunicator())
    >>> g.split(color=0).ranks, g.new_group([0]).ranks, g.subgroup([0], "solo").ranks
    ((0,), (0,), (0,))
    >>> g.close()
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from meshcomm.backends.base import Communicator
from meshcomm.backends.local import SelfCommunicator  # noqa: F401 - the doctests use it
from meshcomm.errors import InvalidArgument
from meshcomm.group import lower as _lower
from meshcomm.store.base import Store
from meshcomm.work import ProgressEngine

if TYPE_CHECKING:
    from meshcomm.group import ProcessGroup

__all__ = ["SubGroups"]


class _Group(Protocol):
    """What these methods use of the group they are called on (a ProcessGroup)."""

    store: Store | None
    name: str
    _comm: Communicator
    _device: Communicator | None
    _children: int
    _where: str
    _engine: ProgressEngine

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def ranks(self) -> tuple[int, ...]: ...

    def _enter(self, op: str) -> _lower.Call: ...

    def _issue(
        self, op: str, lowered: _lower.Lowered, async_op: bool, device: ModuleType | None = None
    ) -> Any: ...

    def _child(
        self, comm: Communicator, name: str, device: Communicator | None = None
    ) -> ProcessGroup: ...


class SubGroups:
    """Sub-group methods of :class:`~meshcomm.group.ProcessGroup` (a mixin: each method
    works on the group it is called on, typed as such)."""

    def split(self: _Group, color: int | None, key: int | None = None) -> ProcessGroup | None:
        """Partition the group by ``color`` (``MPI_Comm_split``); collective over the group.

        Args:
            color: ranks passing the same int form one new group; None: this rank joins none.
            key: orders the new group's ranks (ties broken by the current rank); default is
                this rank's group rank, keeping the current order.

        Returns:
            The new group this rank belongs to, or None for ``color=None``.

        Raises:
            TypeError: color or key is not an int.
            CommError: communication failed.

        Example:
            >>> from meshcomm.group import ProcessGroup
            >>> g = ProcessGroup(SelfCommunicator())
            >>> g.split(color=0).ranks, g.split(color=None)
            ((0,), None)
        """
        c = self._enter("split")
        col = None if color is None else _lower.int64_arg(c.where, color, "color")
        k = self.rank if key is None else _lower.int64_arg(c.where, key, "key")
        self._children += 1
        name = f"{self.name}/split{self._children}:{col}"
        comm, size = self._comm, self.size

        device = self._device

        def body() -> ProcessGroup | None:
            # The last column says whether this rank's device communicator can split in one
            # collective step (nccl's ncclCommSplit); it does so only where every rank can.
            splits = device is not None and device.can_split()
            mine = np.array([0 if col is None else 1, col or 0, k, splits], dtype=np.int64)
            table = np.empty(4 * size, dtype=np.int64)
            comm.all_gather(mine, table)
            rows = table.reshape(size, 4)
            members = None
            if col is not None:
                order = sorted(
                    (int(rows[r, 2]), r) for r in range(size) if rows[r, 0] and rows[r, 1] == col
                )
                members = [r for _, r in order]
            split_device = None
            if device is not None and rows[:, 3].all():
                split_device = device.split_sub(members)
            if members is None:
                return None
            return self._child(comm.sub(members), name, split_device)

        return self._issue("split", (body, {}), False)

    def new_group(self: _Group, ranks: Iterable[int] | None = None) -> ProcessGroup | None:
        """Make a sub-group of the given global ranks; called by every rank of this group.

        As ``torch.distributed.new_group``: the members are ordered by global rank.

        Args:
            ranks: global ranks, all members of this group; None: all of them.

        Returns:
            The new group on its members; None on the other ranks.

        Raises:
            InvalidArgument: a rank that is not a member, a duplicate, or no ranks.
            CommError: communication failed.

        Example:
            >>> from meshcomm.group import ProcessGroup
            >>> g = ProcessGroup(SelfCommunicator())
            >>> g.new_group([0]).ranks
            (0,)
        """
        c = self._enter("new_group")
        if ranks is None:
            chosen = list(self.ranks)
        else:
            chosen = [_lower.int_arg(c.where, r, "rank") for r in ranks]
        if not chosen:
            raise InvalidArgument(f"{c.where}: new_group needs at least one rank, got none")
        if len(set(chosen)) != len(chosen):
            raise InvalidArgument(f"{c.where}: duplicate ranks in {chosen}")
        outside = [r for r in chosen if r not in self.ranks]
        if outside:
            raise InvalidArgument(
                f"{c.where}: ranks {outside} are not members of the group (members: "
                f"{list(self.ranks)})"
            )
        members = sorted(self.ranks.index(r) for r in chosen)
        self._children += 1
        name = f"{self.name}/group{self._children}"
        comm, me = self._comm, self.rank

        def body() -> ProcessGroup | None:
            if me not in members:
                return None
            return self._child(comm.sub(members), name)

        fields = {"args": tuple(sorted(chosen))}
        return self._issue("new_group", (body, fields), False)

    def subgroup(self: _Group, ranks: Sequence[int], name: str) -> ProcessGroup:
        """A group over global ``ranks`` (in that order), made by its members alone.

        Unlike :meth:`split` and :meth:`new_group`, no other rank of this group takes part,
        so a group can be made on first use by the ranks that use it (a mesh's groups are
        made this way). Every member must call it with the same ranks, in the same order
        relative to its other ``subgroup`` calls with those ranks.

        Args:
            ranks: global ranks of this group; this rank must be one of them.
            name: the new group's name in error messages (the same on every member).

        Raises:
            InvalidArgument: duplicate ranks, ranks outside this group, or this rank is not
                one of them.

        Example:
            >>> from meshcomm.group import ProcessGroup
            >>> ProcessGroup(SelfCommunicator()).subgroup([0], "world/solo").ranks
            (0,)
        """
        c = self._enter("subgroup")
        chosen = [_lower.int_arg(c.where, r, "rank") for r in ranks]
        outside = [r for r in chosen if r not in self.ranks]
        if outside or len(set(chosen)) != len(chosen) or self.ranks[self.rank] not in chosen:
            raise InvalidArgument(
                f"{c.where}: subgroup ranks must be distinct members of the group including "
                f"this rank {self.ranks[self.rank]}; got {chosen} (members: {list(self.ranks)})"
            )
        members = [self.ranks.index(r) for r in chosen]
        comm = self._comm

        def body() -> ProcessGroup:
            return self._child(comm.sub(members), name)

        # On the engine, after this group's earlier operations; no fingerprint: the other
        # ranks of this group do not take part.
        made: ProcessGroup = self._engine.submit(body, f"subgroup on {self._where}", False)
        return made

    def grid_split(
        self: _Group, dims: Sequence[int], names: Sequence[str] | None = None
    ) -> list[ProcessGroup] | None:
        """One group per axis of a row-major grid over this group's ranks, in one call.

        For a grid ``np.array(self.ranks).reshape(dims)``, axis ``d``'s group holds the ranks
        whose coordinates differ only along ``d``, ranked by that coordinate: the groups a
        :class:`~meshcomm.mesh.DeviceMesh` makes per axis. Backends with a grid primitive
        make them all at once (mpi: ``MPI_Cart_create`` and one ``MPI_Cart_sub`` per axis);
        the others return None without communicating, and the caller splits per axis.
        Collective: every rank of the group calls it.

        Args:
            dims: the grid's shape.
            names: this rank's group of each axis named so (a mesh names them by its axes);
                default ``<name>/grid<n>:axis<d>``.

        Raises:
            InvalidArgument: ``dims`` are not positive or do not multiply to the size, or
                ``names`` has not one name per axis.
            CommError: communication failed.

        Example:
            >>> from meshcomm.group import ProcessGroup
            >>> ProcessGroup(SelfCommunicator()).grid_split((1, 1)) is None  # no grid primitive
            True
        """
        c = self._enter("grid_split")
        shape = tuple(_lower.int_arg(c.where, d, "dims") for d in dims)
        if not shape or any(d < 1 for d in shape) or math.prod(shape) != self.size:
            raise InvalidArgument(
                f"{c.where}: dims must be positive and multiply to the group size {self.size}, "
                f"got {list(shape)}"
            )
        if names is not None and len(names) != len(shape):
            raise InvalidArgument(
                f"{c.where}: names must name each of the {len(shape)} axes, got {list(names)}"
            )
        cart_subs = self._comm.grid_splitter()
        if cart_subs is None:
            return None
        self._children += 1
        name = f"{self.name}/grid{self._children}"
        named = [f"{name}:axis{d}" for d in range(len(shape))] if names is None else names

        def body() -> list[ProcessGroup]:
            comms = cart_subs(shape)
            return [self._child(comm, str(named[d])) for d, comm in enumerate(comms)]

        result: list[ProcessGroup] = self._issue("grid_split", (body, {"args": shape}), False)
        return result
