"""DeviceMesh: an N-D grid of ranks with named axes, and one process group per axis.

A :class:`DeviceMesh` is two things kept apart:

* a **pure grid**: a frozen, read-only array of global ranks plus one name per axis. The
  constructor validates and freezes it and does no I/O; shapes, names, slicing,
  coordinates, ``repr`` and drawings work without communicating.
* **groups**, made when first needed (or eagerly by :func:`init_device_mesh`), one per axis
  and one per tuple of axes used: the ranks of this rank's slice along those axes, ranked
  row-major over them in the order given, so the new group's rank *is* the axis index. A
  group is made by its members alone (:meth:`~meshcomm.group.ProcessGroup.subgroup`): ranks
  of other slices need not take part, so an axis may be used first on only the ranks that
  use it. An axis whose group would be the whole world in world order reuses the world group.

**Every rank builds the same meshes, in the same order** (making a mesh over part of a
group splits that group, collective over it), and the members of a group make it in the
same order relative to their other groups with the same members (as SPMD code does).

Meshes made from a mesh (``mesh["tp"]``, ``mesh["tp", "dp"]``, :meth:`DeviceMesh.flatten`)
share its groups: a slice never makes a group again. A group over several axes (an ``ops``
call with ``axis_name=("dp", "tp")``, :meth:`DeviceMesh.flatten`, ``get_group(("dp",
"tp"))``) is made the first time that ordered tuple is used, unless it is the world.

Example:
    >>> import numpy as np
    >>> mesh = DeviceMesh(np.arange(8).reshape(2, 4), ("dp", "tp"))  # no I/O
    >>> mesh.shape, mesh.ndim, mesh.size(), mesh.size("tp")
    ((2, 4), 2, 8, 4)
    >>> mesh
    DeviceMesh([[0, 1, 2, 3], [4, 5, 6, 7]], mesh_dim_names=('dp', 'tp'))
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from meshcomm.backends.spec import matches
from meshcomm.common.timeout import Timeout
from meshcomm.errors import InvalidArgument
from meshcomm.mesh.axis_order import agree_order
from meshcomm.mesh.groups import MeshGroups
from meshcomm.topology import gpu_order_arg, mesh_ranks

if TYPE_CHECKING:
    from meshcomm.group import ProcessGroup

__all__ = ["DeviceMesh", "DimLike", "current_mesh", "init_device_mesh"]

#: A mesh dimension: its name, or its position (negative counts from the end).
DimLike = str | int

# The ambient mesh of ``with mesh:``, a stack per thread / asyncio task (contextvars make
# nested and concurrent ``with`` blocks independent without any lock).
_AMBIENT: ContextVar[tuple[DeviceMesh, ...]] = ContextVar("meshcomm_ambient_mesh", default=())


def current_mesh() -> DeviceMesh | None:
    """Return the innermost mesh of the enclosing ``with mesh:`` blocks, or None.

    Example:
        >>> mesh = DeviceMesh([0], ("x",))
        >>> current_mesh() is None
        True
        >>> with mesh:
        ...     current_mesh() is mesh
        True
    """
    stack = _AMBIENT.get()
    return stack[-1] if stack else None


def _check_grid(mesh: Any) -> np.ndarray:
    try:
        arr = np.array(mesh)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"mesh must be an array of ranks, got {mesh!r} ({exc})") from None
    if arr.dtype.kind not in "iu":
        if arr.size == 0 or arr.dtype == object:
            raise InvalidArgument(
                f"mesh must be a non-empty array of int ranks, got {arr.dtype} {arr.tolist()!r}"
            )
        raise InvalidArgument(f"mesh ranks must be ints, got dtype {arr.dtype}: {arr.tolist()!r}")
    if arr.ndim == 0:
        raise InvalidArgument(
            f"mesh must have at least one axis, got a 0-d array {arr.tolist()!r}; use [rank]"
        )
    if arr.size == 0:
        raise InvalidArgument(f"mesh must hold at least one rank, got shape {arr.shape}")
    if (arr < 0).any():
        raise InvalidArgument(f"mesh ranks must be >= 0, got {sorted(set(arr[arr < 0].tolist()))}")
    values, counts = np.unique(arr, return_counts=True)
    if (counts > 1).any():
        raise InvalidArgument(f"mesh ranks must be unique, got {values[counts > 1].tolist()} twice")
    grid = arr.astype(np.int64)
    grid.flags.writeable = False
    return grid


def check_mesh_names(names: Any, ndim: int) -> tuple[str, ...]:
    """``mesh_dim_names`` checked against ``ndim`` axes (None: ``dim0``, ``dim1``, ...).

    Shared with :mod:`meshcomm.jupyter`, which checks a mesh before starting engines.

    Example:
        >>> check_mesh_names(None, 2), check_mesh_names("tp", 1)
        (('dim0', 'dim1'), ('tp',))
    """
    if names is None:
        return tuple(f"dim{i}" for i in range(ndim))
    given = (names,) if isinstance(names, str) else names
    try:
        out = tuple(given)
    except TypeError:
        raise TypeError(
            f"mesh_dim_names must be a sequence of str, got {type(names).__name__}"
        ) from None
    for name in out:
        if not isinstance(name, str):
            raise TypeError(f"mesh_dim_names must be strs, got {name!r} in {out!r}")
        if not name:
            raise InvalidArgument(f"mesh_dim_names must be non-empty strs, got {out!r}")
    if len(out) != ndim:
        raise InvalidArgument(
            f"mesh_dim_names has {len(out)} names {out!r} but the mesh has {ndim} axes"
        )
    dups = sorted({n for n in out if out.count(n) > 1})
    if dups:
        raise InvalidArgument(f"mesh_dim_names must be unique, got {dups} twice in {out!r}")
    return out


class DeviceMesh:
    """An N-D grid of global ranks with named axes (a pure value; groups come lazily).

    Args:
        mesh: the global ranks, any array-like of ints in any layout (unique, >= 0). It is
            copied and frozen.
        mesh_dim_names: one name per axis (a single str for a 1-D mesh); default
            ``("dim0", "dim1", ...)``.
        group: the process group whose global ranks ``mesh`` holds and whose splits make the
            axis groups; default: the world, looked up at first need. The mesh may hold a
            subset of its ranks; then the first group creation is collective over all of
            ``group`` (ranks outside the mesh call :meth:`get_all_groups` and get ``[]``).

    Raises:
        InvalidArgument: empty or 0-d grid, negative or duplicate ranks, wrong number of
            names, duplicate or empty names.
        TypeError: names that are not strs.

    Example:
        >>> mesh = DeviceMesh([[0, 2], [1, 3]], mesh_dim_names=("x", "y"))
        >>> mesh.mesh
        array([[0, 2],
               [1, 3]])
        >>> mesh.mesh_dim_names, mesh.size("y")
        (('x', 'y'), 2)
    """

    _root: MeshGroups
    _grid: np.ndarray
    _names: tuple[str, ...]
    # Root axes behind each dim: one for a plain dim, several for a flattened one.
    _dims: tuple[tuple[int, ...], ...]
    # Filled on first use (not in the constructor): this rank and its coordinate, and
    # meshcomm.ops' resolved axis names.
    _mine_cache: tuple[int, tuple[int, ...] | None]
    _axis_cache: dict[Any, tuple[tuple[int, ...], int, int, str]]

    def __init__(
        self,
        mesh: Any,
        mesh_dim_names: Sequence[str] | str | None = None,
        *,
        group: ProcessGroup | None = None,
    ) -> None:
        grid = _check_grid(mesh)
        self._grid = grid
        self._names = check_mesh_names(mesh_dim_names, grid.ndim)
        self._root = MeshGroups(grid, group, self._names)
        self._dims = tuple((d,) for d in range(grid.ndim))

    @classmethod
    def _derive(
        cls,
        root: MeshGroups,
        grid: np.ndarray,
        names: tuple[str, ...],
        dims: tuple[tuple[int, ...], ...],
    ) -> DeviceMesh:
        out = cls.__new__(cls)
        frozen = np.ascontiguousarray(grid)
        frozen.flags.writeable = False
        out._grid, out._names, out._root, out._dims = frozen, names, root, dims
        return out

    @classmethod
    def from_groups(
        cls,
        mesh: Any,
        mesh_dim_names: Sequence[str],
        groups: Sequence[ProcessGroup],
        *,
        group: ProcessGroup | None = None,
    ) -> DeviceMesh:
        """Return a mesh whose axes are existing groups (no group is made, no I/O).

        ``groups[d]`` must hold the ranks of axis ``d`` through this rank, in axis order:
        the groups of a torch ``DeviceMesh`` on backend ``"meshcomm"``
        (:func:`meshcomm.c10d.from_torch_mesh`), or of another meshcomm mesh.

        Args:
            mesh: the global ranks, as for the constructor.
            mesh_dim_names: one name per axis.
            groups: one group per axis.
            group: the group whose ranks ``mesh`` holds (default: the world).

        Raises:
            InvalidArgument: a group whose ranks are not its axis's, or one group too many
                or too few.

        Example:
            >>> import meshcomm.world as world
            >>> w = world.init(world_size=1)
            >>> mesh = DeviceMesh.from_groups([[0]], ("dp", "tp"), [w, w])
            >>> mesh.get_group("tp") is w
            True
            >>> world.shutdown()
        """
        out = cls(mesh, mesh_dim_names, group=group)
        if len(groups) != out.ndim:
            raise InvalidArgument(
                f"from_groups: {len(groups)} groups for a mesh of {out.ndim} dims "
                f"{out.mesh_dim_names}; give one group per dim"
            )
        for d, g in enumerate(groups):
            out._root.adopt((d,), g)
        return out

    def to_torch(self, device_type: str | None = None) -> Any:
        """Return torch's ``DeviceMesh`` over this mesh's ranks, names and groups.

        See :func:`meshcomm.c10d.to_torch_mesh` (torch's default group on backend
        ``"meshcomm"`` is initialized first if nothing did).
        """
        from meshcomm.c10d import to_torch_mesh

        return to_torch_mesh(self, device_type)

    # -- the grid ------------------------------------------------------------------------
    @property
    def mesh(self) -> np.ndarray:
        """The rank grid, a read-only int64 numpy array."""
        return self._grid

    @property
    def shape(self) -> tuple[int, ...]:
        """The grid's shape."""
        return tuple(self._grid.shape)

    @property
    def ndim(self) -> int:
        """The number of axes."""
        return self._grid.ndim

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """One name per axis."""
        return self._names

    @property
    def axis_sizes(self) -> dict[str, int]:
        """``{name: size}`` for every axis, in order (JAX's ``Mesh.shape``).

        Example:
            >>> DeviceMesh([[0, 1, 2]], ("dp", "tp")).axis_sizes
            {'dp': 1, 'tp': 3}
        """
        return dict(zip(self._names, self.shape, strict=True))

    def size(self, dim: DimLike | None = None) -> int:
        """Return the number of ranks in the mesh, or along ``dim``.

        Raises:
            InvalidArgument: unknown dim (the message lists the valid ones).

        Example:
            >>> DeviceMesh([[0, 1, 2], [3, 4, 5]], ("dp", "tp")).size(-1)
            3
        """
        if dim is None:
            return int(self._grid.size)
        return self.shape[self._dim(dim)]

    def _valid_dims(self) -> str:
        names = ", ".join(repr(n) for n in self._names)
        return f"valid dims: {names} (or 0..{self.ndim - 1})"

    def _dim(self, dim: Any) -> int:
        """Resolve a dim name or position (negative counts from the end)."""
        if isinstance(dim, str):
            if dim in self._names:
                return self._names.index(dim)
            raise InvalidArgument(f"unknown mesh dim {dim!r}; {self._valid_dims()}")
        if isinstance(dim, bool):
            raise TypeError(f"a mesh dim is a name or an int, got {dim!r}")
        try:
            i = operator.index(dim)
        except TypeError:
            raise TypeError(
                f"a mesh dim is a name or an int, got {type(dim).__name__} {dim!r}"
            ) from None
        if not -self.ndim <= i < self.ndim:
            raise InvalidArgument(f"mesh dim {i} is out of range; {self._valid_dims()}")
        return i % self.ndim

    def _dim_list(self, dims: Any, what: str) -> tuple[int, ...]:
        """Resolve one dim or a tuple/list of dims; reject duplicates and an empty tuple."""
        given = tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)
        if not given:
            raise InvalidArgument(f"{what} needs at least one mesh dim; {self._valid_dims()}")
        out = tuple(self._dim(d) for d in given)
        if len(set(out)) != len(out):
            names = [self._names[i] for i in out]
            raise InvalidArgument(f"{what}: mesh dims repeat in {names}; each may appear once")
        return out

    def _root_axes(self, dims: tuple[int, ...]) -> tuple[int, ...]:
        axes = tuple(a for d in dims for a in self._dims[d])
        if len(set(axes)) != len(axes):
            names = [self._names[d] for d in dims]
            raise InvalidArgument(
                f"mesh dims {names} overlap: a flattened dim already contains one of the others"
            )
        return axes

    # -- this rank -----------------------------------------------------------------------
    def get_rank(self) -> int:
        """Return this process's global rank (needs the world, or the mesh's ``group``).

        Raises:
            RendezvousError: no ``group`` was given and meshcomm is not initialized.

        Example:
            >>> import meshcomm.world as world
            >>> _ = world.init(world_size=1)
            >>> DeviceMesh([0]).get_rank()
            0
            >>> world.shutdown()
        """
        return self._root.my_rank()

    def get_coordinate(self) -> tuple[int, ...] | None:
        """Return this rank's index along every axis, or None if it is not in the mesh.

        Example:
            >>> import meshcomm.world as world
            >>> _ = world.init(world_size=1)
            >>> DeviceMesh([[0]], ("dp", "tp")).get_coordinate()
            (0, 0)
            >>> world.shutdown()
        """
        return self._mine()[1]

    def _coordinate_of(self, rank: int) -> tuple[int, ...] | None:
        hits = np.argwhere(self._grid == rank)
        return tuple(int(i) for i in hits[0]) if len(hits) else None

    def _mine(self) -> tuple[int, tuple[int, ...] | None]:
        """This rank and its coordinate, computed once (ops ask on every call)."""
        cached: tuple[int, tuple[int, ...] | None] | None = getattr(self, "_mine_cache", None)
        if cached is None:
            rank = self.get_rank()
            cached = (rank, self._coordinate_of(rank))
            self._mine_cache = cached
        return cached

    def _my_coordinate(self, what: str) -> tuple[int, ...]:
        rank, coord = self._mine()
        if coord is None:
            raise InvalidArgument(
                f"{what}: rank {rank} is not in this mesh (ranks {sorted(self._grid.flat)})"
            )
        return coord

    def get_local_rank(self, dim: DimLike | None = None) -> int:
        """Return this rank's index along ``dim`` (its rank in that axis' group).

        Args:
            dim: a name or position; may be omitted on a 1-D mesh.

        Raises:
            InvalidArgument: unknown dim, no dim on an N-D mesh, or this rank is not in the mesh.

        Example:
            >>> import meshcomm.world as world
            >>> _ = world.init(world_size=1)
            >>> DeviceMesh([[0]], ("dp", "tp")).get_local_rank("tp")
            0
            >>> world.shutdown()
        """
        d = self._single_dim(dim, "get_local_rank")
        return self._my_coordinate("get_local_rank")[d]

    def _single_dim(self, dim: Any, what: str) -> int:
        if dim is None:
            if self.ndim != 1:
                raise InvalidArgument(
                    f"{what}: a {self.ndim}-D mesh needs a dim; {self._valid_dims()}"
                )
            return 0
        return self._dim(dim)

    # -- groups --------------------------------------------------------------------------
    def get_group(self, dim: DimLike | Sequence[DimLike] | None = None) -> ProcessGroup:
        """Return the process group of this rank along ``dim`` (made on first need).

        The group's rank is this rank's coordinate along ``dim``. A tuple of dims gives the
        group over those axes together, ranked row-major in the order given (as
        ``ops.psum(x, ("dp", "tp"))`` uses); its first use is one split. As in
        ``meshcomm.ops``, the first use of a tuple checks that every rank of its group names
        the dims in the same order (one small all_gather over the group of the same dims in
        mesh order): ranks that name ``("tp", "dp")`` where others name ``("dp", "tp")``
        raise :class:`~meshcomm.errors.MismatchError` naming both, rather than waiting on
        groups the others never make.

        Args:
            dim: a name or position, or a tuple of them; may be omitted on a 1-D mesh.

        Returns:
            A :class:`~meshcomm.group.ProcessGroup`.

        Raises:
            InvalidArgument: unknown or repeated dims, or this rank is not in the mesh.
            MismatchError: ranks named a tuple's dims in different orders.
            CommError: making the group failed.

        Example:
            >>> import meshcomm.world as world
            >>> _ = world.init(world_size=1)
            >>> DeviceMesh([[0]], ("dp", "tp")).get_group("tp").size
            1
            >>> DeviceMesh([[0]], ("dp", "tp")).get_group(("tp", "dp")).size
            1
            >>> world.shutdown()
        """
        if dim is None:
            dims: tuple[int, ...] = (self._single_dim(None, "get_group"),)
        else:
            dims = self._dim_list(dim, "get_group")
        if len(dims) > 1:
            agree_order(self, dims, "get_group")
        return self._group_for_dims(dims)

    def _group_for_dims(self, dims: tuple[int, ...]) -> ProcessGroup:
        group = self._root.group(self._root_axes(dims))
        root = self._root
        if group is not root.parent() and group is not root._base:  # (no I/O here)
            # A group made for these axes alone: errors and verdicts name it by them.
            names = tuple(self._names[d] for d in dims)
            group.label = f"over {names[0]!r}" if len(names) == 1 else f"over {names!r}"
        return group

    def get_all_groups(self) -> list[ProcessGroup]:
        """Return the group of every axis, in axis order, making the missing ones.

        Collective: every rank of the mesh calls it (``init_device_mesh`` does). On a mesh
        that holds only part of its ``group``, ranks outside the mesh call it too (they
        take part in one split) and get ``[]``.

        Example:
            >>> import meshcomm.world as world
            >>> _ = world.init(world_size=1)
            >>> [g.size for g in DeviceMesh([[0]], ("dp", "tp")).get_all_groups()]
            [1, 1]
            >>> world.shutdown()
        """
        if self._mine()[1] is None:
            self._root.base()
            return []
        if self._dims == tuple((a,) for a in range(self._root.grid.ndim)):
            self._root.axis_groups()
        return [self._group_for_dims((d,)) for d in range(self.ndim)]

    # -- slicing and flattening ----------------------------------------------------------
    def __getitem__(self, dims: DimLike | Sequence[DimLike]) -> DeviceMesh:
        """Return the sub-mesh through this rank over ``dims``, in the order given.

        ``mesh["tp"]`` is the 1-D mesh of this rank's tp group; ``mesh["tp", "dp"]`` is the
        transposed mesh. Slices share the mesh's groups (no new split).

        Raises:
            InvalidArgument: unknown or repeated dims, or this rank is not in the mesh.

        Example:
            >>> import meshcomm.world as world
            >>> _ = world.init(world_size=1)
            >>> mesh = DeviceMesh([[0]], ("dp", "tp"))
            >>> mesh["tp"], mesh["tp", "dp"].mesh_dim_names
            (DeviceMesh([0], mesh_dim_names=('tp',)), ('tp', 'dp'))
            >>> world.shutdown()
        """
        chosen = self._dim_list(dims, "mesh[...]")
        if chosen == tuple(range(self.ndim)):
            return self
        coord = self._my_coordinate("mesh[...]")
        rest = [d for d in range(self.ndim) if d not in chosen]
        moved = self._grid.transpose([*rest, *chosen])
        sub = moved[tuple(coord[d] for d in rest)]
        names = tuple(self._names[d] for d in chosen)
        return DeviceMesh._derive(self._root, sub, names, tuple(self._dims[d] for d in chosen))

    def flatten(self, dims: Sequence[DimLike] | None = None, name: str | None = None) -> DeviceMesh:
        """Merge ``dims`` into one dim, ranked row-major in the order given.

        The merged dim takes the place of the first of ``dims`` in mesh order; the other
        dims keep theirs. Its group is made here (one split, unless it is the world), so
        this is collective over the mesh: every rank calls it.

        Args:
            dims: the dims to merge (names or positions), default all of them.
            name: the merged dim's name, default the names joined by ``"_"``.

        Returns:
            A new mesh sharing this mesh's groups.

        Raises:
            InvalidArgument: unknown or repeated dims, or ``name`` clashes with a dim kept.

        Example:
            >>> import meshcomm.world as world
            >>> _ = world.init(world_size=1)
            >>> mesh = DeviceMesh([[[0]]], ("pp", "dp", "tp"))
            >>> mesh.flatten(("dp", "tp")).mesh_dim_names
            ('pp', 'dp_tp')
            >>> world.shutdown()
        """
        merged = self._dim_list(tuple(range(self.ndim)) if dims is None else dims, "flatten")
        axes = self._root_axes(merged)
        new_name = "_".join(self._names[d] for d in merged) if name is None else name
        if not isinstance(new_name, str) or not new_name:
            raise InvalidArgument(f"flatten: name must be a non-empty str, got {new_name!r}")
        kept = [self._names[d] for d in range(self.ndim) if d not in merged]
        if new_name in kept:
            raise InvalidArgument(
                f"flatten: name {new_name!r} clashes with a dim that stays; dims kept: {kept}"
            )
        first = min(merged)
        order: list[int] = []
        for d in range(self.ndim):
            if d == first:
                order.extend(merged)
            elif d not in merged:
                order.append(d)
        moved = self._grid.transpose(order)
        shape = [self.shape[d] for d in range(self.ndim) if d not in merged]
        at = sum(1 for d in range(first) if d not in merged)
        shape.insert(at, math.prod(self.shape[d] for d in merged))
        names = [self._names[d] for d in range(self.ndim) if d not in merged]
        names.insert(at, new_name)
        dim_axes = [self._dims[d] for d in range(self.ndim) if d not in merged]
        dim_axes.insert(at, axes)
        out = DeviceMesh._derive(self._root, moved.reshape(shape), tuple(names), tuple(dim_axes))
        if out._coordinate_of(self.get_rank()) is not None:
            out._group_for_dims((at,))
        return out

    # -- ambient mesh --------------------------------------------------------------------
    def __enter__(self) -> DeviceMesh:
        _AMBIENT.set((*_AMBIENT.get(), self))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack = _AMBIENT.get()
        if not stack or stack[-1] is not self:
            raise InvalidArgument("`with mesh:` blocks must exit in the order they entered")
        _AMBIENT.set(stack[:-1])

    # -- values, display -----------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return self._names == other._names and np.array_equal(self._grid, other._grid)

    def __hash__(self) -> int:
        return hash((self._names, self.shape, self._grid.tobytes()))

    def __repr__(self) -> str:
        return f"DeviceMesh({self._grid.tolist()}, mesh_dim_names={self._names!r})"

    def visualize(self, *, rank: int | None = None, gpus: bool | None = None) -> None:
        """Print the grid, this rank's position and each axis' groups.

        Args:
            rank: the global rank to mark; default this process's rank (none if meshcomm
                is not initialized).
            gpus: also print this host's GPU link matrix (:func:`meshcomm.topology`);
                default: in a world with a device backend (``cpu:tcp,cuda:nccl``).

        Example:
            >>> DeviceMesh([[0, 1], [2, 3]], ("dp", "tp")).visualize(rank=3)
            DeviceMesh 2 x 2 (dp=2, tp=2), 4 ranks; rank 3 at dp=1, tp=1
            <BLANKLINE>
                    tp=0  tp=1
              dp=0     0     1
              dp=1     2  [ 3]
            <BLANKLINE>
              dp groups: (0, 2)  *(1, 3)
              tp groups: (0, 1)  *(2, 3)
        """
        from meshcomm.mesh.drawing import render_text

        text = render_text(self, self._rank_to_show(rank))
        if gpus is None:
            from meshcomm.world import get_world, is_initialized

            gpus = is_initialized() and get_world().device_backend is not None
        if gpus:
            from meshcomm.topology import topology

            text += "\n\nGPU links on this host (NV = NVLink, SYS = across sockets):\n"
            text += "\n".join("  " + line for line in topology().describe().splitlines())
        print(text)

    def _rank_to_show(self, rank: int | None) -> int | None:
        if rank is not None:
            return operator.index(rank)
        from meshcomm.world import is_initialized

        if self._root._parent is None and not is_initialized():
            return None
        return self.get_rank()

    def _repr_html_(self) -> str:
        from meshcomm.mesh.drawing import render_html

        return render_html(self, self._rank_to_show(None))


def check_mesh_shape(mesh_shape: Any) -> tuple[int, ...]:
    """``mesh_shape`` as a tuple of ints >= 1 (at most one -1, inferred later).

    Example:
        >>> check_mesh_shape(4), check_mesh_shape((2, -1))
        ((4,), (2, -1))
    """
    given = (mesh_shape,) if isinstance(mesh_shape, int) else mesh_shape
    try:
        dims = tuple(given)
    except TypeError:
        raise TypeError(
            f"mesh_shape must be a tuple of ints, got {type(mesh_shape).__name__}"
        ) from None
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"mesh_shape must be ints, got {d!r} in {dims!r}")
        if d == 0 or d < -1:
            raise InvalidArgument(f"mesh_shape entries must be >= 1 (or one -1), got {dims!r}")
        out.append(int(d))
    if not out:
        raise InvalidArgument("mesh_shape must have at least one axis, got ()")
    if out.count(-1) > 1:
        raise InvalidArgument(f"mesh_shape may infer only one axis (-1), got {dims!r}")
    return tuple(out)


def infer_mesh_shape(shape: tuple[int, ...], world_size: int) -> tuple[int, ...]:
    """``shape`` with its -1 filled in so that it covers ``world_size`` ranks exactly.

    Example:
        >>> infer_mesh_shape((-1, 4), 8)
        (2, 4)
    """
    known = math.prod(d for d in shape if d != -1)
    if -1 in shape:
        if world_size % known:
            raise InvalidArgument(
                f"mesh_shape {shape} cannot cover the world of {world_size} ranks: "
                f"{world_size} is not divisible by {known}"
            )
        return tuple(world_size // known if d == -1 else d for d in shape)
    if known != world_size:
        raise InvalidArgument(
            f"mesh_shape {shape} has {known} ranks but the world has {world_size}; the product "
            "of the shape must equal the world size"
        )
    return shape


def init_device_mesh(
    mesh_shape: int | Iterable[int],
    mesh_dim_names: Sequence[str] | str | None = None,
    *,
    backend: str | None = None,
    timeout: Timeout | None = None,
    gpu_order: str | None = None,
) -> DeviceMesh:
    """Join the world if needed and return a row-major mesh over all of it, groups made.

    Ranks are laid out row-major: the last axis holds consecutive ranks, so put the axis
    with the fastest links last. With ``gpu_order="topology"`` the ranks of each host are
    first ordered by how their GPUs are linked (:func:`meshcomm.topology.best_order`), so
    that each group of the last axis sits on the best-linked GPUs. Each axis gets its
    group by one split (an axis spanning the whole world reuses the world group).
    Collective: every rank calls it, and builds its meshes in the same order as the others.

    Args:
        mesh_shape: the size of each axis; one entry may be ``-1`` (inferred).
        mesh_dim_names: one name per axis; default ``("dim0", "dim1", ...)``.
        backend: the backend for :func:`meshcomm.world.init` if the world is not
            initialized yet (then also ``timeout``); if it is, ``backend`` must match it.
        timeout: seconds or ``timedelta`` for that init.
        gpu_order: ``"rank"`` (rank order) or ``"topology"`` (see above; one extra
            all_gather of the world). Default: ``MESHCOMM_GPU_ORDER``, else ``"topology"``
            in a world with a device backend (``cpu:tcp,cuda:nccl``) and ``"rank"``
            elsewhere.

    Returns:
        A :class:`DeviceMesh` whose :meth:`~DeviceMesh.get_all_groups` are made.

    Raises:
        InvalidArgument: bad shape or names, the shape's product differs from the world
            size, or ``backend`` differs from the initialized world's.
        RendezvousError: the world could not be formed.
        CommError: making the groups failed.

    Example:
        >>> import meshcomm.world as world
        >>> mesh = init_device_mesh((1, -1), ("dp", "tp"))  # a world of one here
        >>> mesh.shape, mesh.get_coordinate()
        ((1, 1), (0, 0))
        >>> world.shutdown()
    """
    from meshcomm import world

    shape = check_mesh_shape(mesh_shape)
    check_mesh_names(mesh_dim_names, len(shape))  # before joining the world: fail fast
    order = gpu_order_arg(gpu_order)
    if world.is_initialized():
        group = world.get_world()
        # A world of one runs on "self" whatever backend was asked for.
        if backend is not None and not matches(backend, group.backend):
            raise InvalidArgument(
                f"init_device_mesh(backend={backend!r}) but the world runs on "
                f"{group.backend!r}; omit backend= or shut the world down first"
            )
    else:
        group = world.init(backend=backend, timeout=timeout)
    if group.device_backend is not None:  # GPUs talk to each other: their links pick the order
        order = gpu_order_arg(gpu_order, default="topology")
    full = infer_mesh_shape(shape, group.size)
    ranks = mesh_ranks(group, full[-1]) if order == "topology" else group.ranks
    grid = np.array(ranks, dtype=np.int64).reshape(full)
    mesh = DeviceMesh(grid, mesh_dim_names, group=group)
    mesh.get_all_groups()
    return mesh
