"""The order of a tuple of mesh axes, agreed by every member on its first use.

A tuple of axes orders the ranks of its group: ``("dp", "tp")`` and ``("tp", "dp")`` hold the
same ranks in another order, so they are other groups. Ranks that name them in different
orders would each wait for a group the others never make; :func:`agree_order` makes them
raise :class:`~meshcomm.errors.MismatchError` instead, naming both tuples. Both routes to a
tuple's group take it: ``meshcomm.ops`` (:mod:`meshcomm.ops._resolve`) and
:meth:`DeviceMesh.get_group <meshcomm.mesh.DeviceMesh.get_group>`.

Example:
    >>> import meshcomm.world as world
    >>> from meshcomm.mesh import DeviceMesh
    >>> _ = world.init(world_size=1)
    >>> mesh = DeviceMesh([[0]], ("dp", "tp"))
    >>> agree_order(mesh, (1, 0), "get_group")  # one rank agrees with itself
    >>> (1, 0) in mesh._root.__dict__[_AGREED]  # checked once per tuple of axes
    True
    >>> world.shutdown()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from meshcomm.errors import MismatchError

if TYPE_CHECKING:
    from meshcomm.group import ProcessGroup
    from meshcomm.mesh.groups import MeshGroups

__all__ = ["OrderedMesh", "agree_order"]

_AGREED = "_ops_agreed"  # the tuples of root axes whose order was agreed, on the mesh's root


class OrderedMesh(Protocol):
    """What :func:`agree_order` reads of a :class:`~meshcomm.mesh.DeviceMesh`, which imports
    this module (so this module types against the Protocol, not the mesh)."""

    @property
    def _root(self) -> MeshGroups:
        """The groups of the root mesh this one was sliced from."""
        ...

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """One name per axis."""
        ...

    def _root_axes(self, dims: tuple[int, ...]) -> tuple[int, ...]:
        """The root mesh's axes of this mesh's ``dims``."""
        ...

    def _group_for_dims(self, dims: tuple[int, ...]) -> ProcessGroup:
        """The group of ``dims`` (in that order) holding this rank."""
        ...

    def _my_coordinate(self, what: str) -> tuple[int, ...]:
        """This rank's coordinate; raises naming ``what`` when it is not in the mesh."""
        ...


def agree_order(mesh: OrderedMesh, dims: tuple[int, ...], where: str) -> None:
    """Check, on the first use of the tuple of axes ``dims`` on ``mesh``'s grid, that every
    rank of its group names the axes in the same order; raise on every one of them if not.

    The order of a tuple is the group's rank order: ``("dp", "tp")`` and ``("tp", "dp")``
    hold the same ranks in another order, so they are other groups, made apart (each by
    its members, through the store) and used apart. Ranks that disagree would each wait
    for a group the others never make, until the timeout, in the store's words. Instead,
    the first use of each tuple all-gathers every member's order over the group of the
    same axes in mesh order (the same ranks, whichever order each names; made first where
    it is not yet), so that every rank compares them all and raises the same error.

    Raises:
        MismatchError: the members' orders differ (the group's ranks differ with them).
        CommError: the check's collective failed.
    """
    root = mesh._root
    axes = mesh._root_axes(dims)
    agreed: set[tuple[int, ...]] = root.__dict__.setdefault(_AGREED, set())
    if axes in agreed:
        return
    canon = tuple(sorted(dims))
    group = mesh._group_for_dims(canon)
    coord = mesh._my_coordinate(where)
    members = root.members(axes, root.coordinate(root.my_rank()) or coord)
    order = [canon.index(d) for d in dims]  # this rank's order, as positions in mesh order
    row = np.array([*members, *order], np.int64)
    rows = group.all_gather(row).reshape(group.size, -1)
    size = len(members)
    if (rows[:, :size] == rows[0, :size]).all():  # other orders of one group's ranks agree
        agreed.add(axes)
        return
    named: dict[str, list[int]] = {}
    for r in range(group.size):
        positions = [int(p) for p in rows[r, size:]]
        valid = sorted(positions) == list(range(len(canon)))
        names = tuple(mesh.mesh_dim_names[canon[p]] for p in positions) if valid else positions
        ranks = [int(m) for m in rows[r, :size]]
        named.setdefault(f"{names!r} (group ranks {ranks})", []).append(group.ranks[r])
    said = "; ".join(
        f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))} named {text}"
        for text, rs in named.items()
    )
    # The same words on every rank: the axes in mesh order, not as this rank named them.
    call = f"{where.split(' ', 1)[0]} over {tuple(mesh.mesh_dim_names[d] for d in canon)!r}"
    raise MismatchError(
        f"{call}: ranks disagree on the order of the mesh axes, which orders the group's "
        f"ranks: {said}; every rank must name them in the same order"
    )
