"""The groups of a mesh: what a mesh shares with every mesh sliced or flattened from it.

:class:`MeshGroups` holds the full grid, the process group its ranks live in, and the groups
made so far, one per ordered tuple of axes; :mod:`meshcomm.mesh` asks it for the group of
some axes and it makes each one once (collective over that group's members only).

A group made for some axes is named by them, in the mesh's axis names, with the coordinates
of the other axes that pick this rank's slice (axes of length 1 left out):
``world/tp (dp=0)``, ``world/(tp,dp)``, ``world/tp (pp=1, dp=0)``. Errors, verdicts and
``MESHCOMM_TRACE``'s tracks show that name, so a user reads the axes they wrote.

Example:
    >>> import numpy as np
    >>> groups = MeshGroups(np.arange(4).reshape(2, 2), None, ("dp", "tp"))  # None: the world
    >>> groups.members((1,), (1, 0))  # the ranks of axis 1 through coordinate (1, 0)
    (2, 3)
    >>> groups.name_of("world", (1,), (1, 0)), groups.name_of("world", (1, 0), (1, 0))
    ('world/tp (dp=1)', 'world/(tp,dp)')
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from meshcomm.errors import CommError, InvalidArgument

if TYPE_CHECKING:
    from meshcomm.group import ProcessGroup

__all__ = ["MeshGroups"]


class MeshGroups:
    """What a mesh shares with every mesh sliced or flattened from it: the full grid, the
    process group its ranks live in, and the groups made so far (one lock guards them).

    Args:
        grid: the global ranks, one axis per mesh axis.
        group: the group whose ranks the grid holds (None: the world).
        names: the axes' names, for the groups' names (default ``dim0``, ``dim1``, ...).
    """

    def __init__(
        self, grid: np.ndarray, group: ProcessGroup | None, names: Sequence[str] = ()
    ) -> None:
        self.grid = grid
        self.names = tuple(names) or tuple(f"dim{a}" for a in range(grid.ndim))
        self._parent = group
        if group is not None:
            self.check_members(group)
        else:
            from meshcomm import world

            if world.is_initialized():  # a mesh made before init is checked at first need
                self.check_members(world.get_world())
        self._lock = threading.RLock()
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}
        self._base: ProcessGroup | None = None
        self._base_made = False
        self._coords: dict[int, tuple[int, ...]] | None = None
        self._rank: int | None = None

    # -- identity (no I/O) ---------------------------------------------------------------
    def parent(self) -> ProcessGroup:
        """The group whose global ranks the grid holds (the world unless one was given)."""
        if self._parent is None:
            from meshcomm.world import get_world

            self._parent = get_world()
        return self._parent

    def check_members(self, parent: ProcessGroup) -> None:
        """Raise unless every rank of the grid is a member of ``parent`` (no I/O).

        Raises:
            InvalidArgument: naming the ranks outside, the group and its members.
        """
        outside = sorted({int(r) for r in self.grid.flat} - set(parent.ranks))
        if outside:
            ranks = list(parent.ranks)
            members = f"ranks 0..{len(ranks) - 1}" if ranks == list(range(len(ranks))) else ranks
            raise InvalidArgument(
                f"rank {parent.ranks[parent.rank]}: mesh {self.grid.tolist()} holds ranks "
                f"{outside}, which are not members of group {parent.name!r} of size "
                f"{parent.size} (members: {members})"
            )

    def my_rank(self) -> int:
        if self._rank is None:
            parent = self.parent()
            self._rank = parent.ranks[parent.rank]
        return self._rank

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        if self._coords is None:
            self._coords = {int(r): tuple(int(i) for i in c) for c, r in np.ndenumerate(self.grid)}
        return self._coords.get(rank)

    def members(self, axes: tuple[int, ...], coord: tuple[int, ...]) -> tuple[int, ...]:
        """Global ranks of the group over root ``axes`` (in that order) through ``coord``."""
        others = [a for a in range(self.grid.ndim) if a not in axes]
        moved = self.grid.transpose([*others, *axes])
        return tuple(int(r) for r in moved[tuple(coord[a] for a in others)].reshape(-1))

    def name_of(self, base: str, axes: tuple[int, ...], coord: tuple[int, ...]) -> str:
        """The name of the group over root ``axes`` through ``coord``, made from ``base``:
        the axes as the mesh names them, then the coordinates of the other axes longer than
        1 (which slice it is: the same on every member, other on every other slice)."""
        words = [self.names[a] for a in axes]
        over = words[0] if len(words) == 1 else f"({','.join(words)})"
        shape = self.grid.shape
        where = [
            f"{self.names[a]}={coord[a]}"
            for a in range(self.grid.ndim)
            if a not in axes and shape[a] > 1
        ]
        return f"{base}/{over}" + (f" ({', '.join(where)})" if where else "")

    # -- groups (collective) -------------------------------------------------------------
    def base(self) -> ProcessGroup | None:
        """The group to split: the parent if the mesh covers it, else the mesh's ranks.

        Collective over the parent when the mesh covers only part of it (ranks outside
        the mesh take part and get None).
        """
        with self._lock:
            if self._base_made:
                return self._base
            parent = self.parent()
            self.check_members(parent)
            if self.grid.size == parent.size:
                self._base = parent
            else:
                me = self.my_rank()
                coord = self.coordinate(me)
                color = None if coord is None else 0
                key = 0 if coord is None else int(np.ravel_multi_index(coord, self.grid.shape))
                self._base = parent.split(color, key)
            self._base_made = True
            return self._base

    def axis_groups(self) -> None:
        """Make every axis's group in one grid split, where the backend has one (mpi).

        Only for a grid that is the parent's ranks in order, with at least two axes longer
        than 1 (else an axis could be the parent itself), and none made yet; otherwise, or
        on a backend without a grid primitive, :meth:`group` splits per axis later. Every
        rank takes the same branch: the grid and the groups made so far are the same on all.
        Collective over the parent.
        """
        with self._lock:
            shape = self.grid.shape
            if self._groups or sum(1 for n in shape if n > 1) < 2:
                return
            parent = self.parent()
            if tuple(int(r) for r in self.grid.flat) != tuple(parent.ranks):
                return
            coord = self.coordinate(self.my_rank())
            names = None
            if coord is not None:
                names = [self.name_of(parent.name, (a,), coord) for a in range(len(shape))]
            made = parent.grid_split(shape, names)
            if made is None or coord is None:
                return
            for axis, group in enumerate(made):
                members = self.members((axis,), coord)
                if tuple(group.ranks) != members:
                    raise CommError(
                        f"rank {self.my_rank()}: the grid split made ranks {list(group.ranks)} "
                        f"for mesh axis {axis}, expected {list(members)} (meshcomm bug)"
                    )
                self._groups[(axis,)] = group

    def adopt(self, axes: tuple[int, ...], group: ProcessGroup) -> None:
        """Use an existing group as the one over root ``axes`` (no I/O).

        Raises:
            InvalidArgument: its ranks are not those of the axes through this rank.
        """
        me = self.my_rank()
        coord = self.coordinate(me)
        if coord is None:
            raise InvalidArgument(f"rank {me} is not in this mesh: it belongs to no group")
        members = self.members(axes, coord)
        if tuple(group.ranks) != members:
            raise InvalidArgument(
                f"rank {me}: group {group.name!r} has ranks {list(group.ranks)}, but mesh axes "
                f"{axes} through this rank hold {list(members)}"
            )
        with self._lock:
            self._groups[axes] = group

    def group(self, axes: tuple[int, ...]) -> ProcessGroup:
        """The group over root ``axes``, in that order (rank = row-major index over them)."""
        with self._lock:
            cached = self._groups.get(axes)
            if cached is not None:
                return cached
            me = self.my_rank()
            coord = self.coordinate(me)
            if coord is None:
                raise InvalidArgument(f"rank {me} is not in this mesh: it belongs to no group")
            members = self.members(axes, coord)
            parent = self.parent()
            if members == tuple(parent.ranks):
                group = parent
            else:
                base = self.base()
                assert base is not None  # this rank is in the mesh
                if members == tuple(base.ranks):
                    group = base  # a mesh over part of the world, whole and in order
                else:
                    # Made by its members alone, so that a group may be used first on only
                    # the ranks that need it (ranks of other slices need not call).
                    group = base.subgroup(members, self.name_of(base.name, axes, coord))
            if tuple(group.ranks) != members:
                raise CommError(
                    f"rank {me}: the group made for mesh axes {axes} has ranks "
                    f"{list(group.ranks)}, expected {list(members)} (meshcomm bug)"
                )
            self._groups[axes] = group
            return group
