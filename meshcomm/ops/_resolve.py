"""Axis names to process groups: which mesh, which dims, this rank's index and the axis size.

Everything here is local (no I/O) except :meth:`Axis.group`, which may make a group over a
tuple of axes the first time that tuple is used (one split, collective over the mesh).

Example:
    >>> from meshcomm.mesh import DeviceMesh
    >>> mesh = DeviceMesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("dp", "tp"))
    >>> axis_dims(("tp", "dp"), mesh, "psum")
    (1, 0)
    >>> axis_dims(0, mesh, "psum")
    Traceback (most recent call last):
    ...
    TypeError: psum: axis_name must be a mesh dim name or a tuple of names, got int 0 \
(in JAX an int is a positional axis); mesh dims: 'dp', 'tp'
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshcomm.errors import InvalidArgument
from meshcomm.mesh import DeviceMesh, current_mesh
from meshcomm.mesh.axis_order import agree_order
from meshcomm.ops._calls import Note, NotedGroup

if TYPE_CHECKING:
    from meshcomm.group import ProcessGroup

__all__ = ["Axis", "AxisName", "agree_order", "axis_dims", "get_mesh", "resolve"]

#: A mesh dim name, or a tuple (or list) of names reduced over together, row-major.
AxisName = str | tuple[str, ...] | list[str]


def get_mesh(mesh: DeviceMesh | None, op: str) -> DeviceMesh:
    """Return ``mesh``, or the ambient mesh of ``with mesh:`` when it is None.

    Raises:
        InvalidArgument: no mesh given and none is ambient.
        TypeError: ``mesh`` is not a DeviceMesh.

    Example:
        >>> get_mesh(None, "psum")
        Traceback (most recent call last):
        ...
        meshcomm.errors.InvalidArgument: psum: no mesh: pass mesh=, or call inside `with mesh:`
    """
    if mesh is None:
        found = current_mesh()
        if found is None:
            raise InvalidArgument(f"{op}: no mesh: pass mesh=, or call inside `with mesh:`")
        return found
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{op}: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    return mesh


def axis_dims(axis_name: Any, mesh: DeviceMesh, op: str) -> tuple[int, ...]:
    """Resolve ``axis_name`` (a name or a tuple/list of names) to mesh dims, in order.

    Raises:
        InvalidArgument: an unknown or repeated name (the message lists the mesh's dims).
        TypeError: a name that is not a str.
    """
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    valid = ", ".join(repr(n) for n in mesh.mesh_dim_names)
    dims = []
    for name in names:
        if not isinstance(name, str):
            hint = " (in JAX an int is a positional axis)" if isinstance(name, int) else ""
            raise TypeError(
                f"{op}: axis_name must be a mesh dim name or a tuple of names, got "
                f"{type(name).__name__} {name!r}{hint}; mesh dims: {valid}"
            )
        if name not in mesh.mesh_dim_names:
            raise InvalidArgument(f"{op}: unbound axis name: {name!r}; mesh dims: {valid}")
        dims.append(mesh.mesh_dim_names.index(name))
    if len(set(dims)) != len(dims):
        raise InvalidArgument(f"{op}: axis names repeat in {names!r}; each may appear once")
    return tuple(dims)


class Axis:
    """One resolved ``axis_name`` on one rank (made once per op, names and mesh; reused).

    Attributes:
        mesh: the mesh the names belong to.
        dims: the mesh dims, in the order given.
        size: the number of ranks along them (1 for an empty tuple).
        index: this rank's row-major index along them (its rank in the group).
        where: names the op, the axis and the rank for error messages.
        note: the axes as the user named them, for the group calls' words
            (:mod:`meshcomm.ops._calls`): ``(("over", "'tp'"),)``.
    """

    __slots__ = ("_group", "_noted", "dims", "index", "mesh", "note", "size", "where")

    def __init__(
        self,
        mesh: DeviceMesh,
        dims: tuple[int, ...],
        size: int,
        index: int,
        where: str,
        over: str = "()",
    ) -> None:
        self.mesh, self.dims, self.size, self.index, self.where = mesh, dims, size, index, where
        self.note: Note = (("over", over),)
        self._group: ProcessGroup | None = None
        self._noted: NotedGroup | None = None

    def noted(self) -> NotedGroup | None:
        """:meth:`group` whose calls carry :attr:`note` (None for an empty tuple)."""
        group = self.group()
        return None if group is None else self.noted_group(group)

    def noted_group(self, group: ProcessGroup) -> NotedGroup:
        """``group`` (this axis's, from :meth:`group`) whose calls carry :attr:`note`."""
        noted = self._noted
        if noted is None:
            noted = self._noted = NotedGroup(group, self.note)
        return noted

    def group(self) -> ProcessGroup | None:
        """The group along these dims (None for an empty tuple: nothing to communicate).

        The first use of a tuple of axes on a mesh checks that every rank of it names them
        in the same order (:func:`agree_order`) before the group is made.
        """
        if self._group is None and self.dims:
            if len(self.dims) > 1:
                agree_order(self.mesh, self.dims, self.where)
            # The mesh keeps the groups it made for good, so remembering ours is exact.
            self._group = self.mesh._group_for_dims(self.dims)
        return self._group

    def __repr__(self) -> str:
        return f"Axis(dims={self.dims}, size={self.size}, index={self.index}, {self.where!r})"


_AXES = "_ops_axes"  # the per-mesh cache of Axis objects, in the mesh's __dict__
#: Set once an op was staged into a jax program (``_jax_jit.settle``): every op then first
#: waits for the programs dispatched before it, whose callbacks may not have run yet.
_settle: Callable[[], None] | None = None


def resolve(axis_name: Any, mesh: DeviceMesh | None, op: str) -> Axis:
    """Resolve ``axis_name`` on ``mesh`` (or the ambient mesh) for this rank, without I/O.

    Raises:
        InvalidArgument: no mesh, unknown or repeated names, this rank is not in the mesh.
        TypeError: ``mesh`` or a name of the wrong type.

    Example:
        >>> import meshcomm.world as world
        >>> _ = world.init(world_size=1)
        >>> ax = resolve(("dp", "tp"), DeviceMesh([[0]], ("dp", "tp")), "psum")
        >>> ax.size, ax.index, ax.where
        (1, 0, "psum over ('dp', 'tp') (size 1) on rank 0")
        >>> world.shutdown()
    """
    if _settle is not None:
        _settle()
    m = get_mesh(mesh, op)
    key = axis_name if isinstance(axis_name, str) else _key(axis_name)
    # Per-mesh caches: ops resolve the same few axis names on every call. The Axis objects
    # live in the mesh's own __dict__ so they go away with it.
    axes: dict[Any, Axis] | None = m.__dict__.get(_AXES)
    if axes is None:
        axes = m.__dict__[_AXES] = {}
    if key is not None:
        found = axes.get((op, key))
        if found is not None:
            return found
    cache: dict[Any, tuple[tuple[int, ...], int, int, str]] | None = getattr(m, "_axis_cache", None)
    if cache is None:
        cache = {}
        m._axis_cache = cache
    hit = cache.get(key) if key is not None else None
    if hit is None:
        dims = axis_dims(axis_name, m, op)
        coord = m._my_coordinate(op)
        size = math.prod(m.shape[d] for d in dims)
        index = 0
        for d in dims:
            index = index * m.shape[d] + coord[d]
        names = tuple(m.mesh_dim_names[d] for d in dims)
        shown = repr(names[0]) if isinstance(axis_name, str) else repr(names)
        hit = (dims, size, index, f"over {shown} (size {size}) on rank {m.get_rank()}")
        if key is not None:
            cache[key] = hit
    dims, size, index, tail = hit
    shown = tail[len("over ") : tail.rindex(" (size ")]  # the axes as the user named them
    axis = Axis(m, dims, size, index, f"{op} {tail}", shown)
    if key is not None:
        axes[(op, key)] = axis
    return axis


def _key(axis_name: Any) -> tuple[str, ...] | None:
    """A hashable cache key for a tuple/list of names, None if it is not one."""
    if not isinstance(axis_name, (tuple, list)):
        return None
    if not all(isinstance(n, str) for n in axis_name):
        return None
    return ("__tuple__", *axis_name)
