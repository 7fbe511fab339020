"""``init_device_mesh`` and ``DeviceMesh`` with torch.distributed.device_mesh's signatures.

A thin layer over :class:`meshcomm.mesh.DeviceMesh` (available as ``.mesh_impl``, e.g. for
:mod:`meshcomm.ops` or ``with mesh.mesh_impl:``): the same grid, the same groups (one split
per mesh dim, made when the mesh is made), handed out as
:class:`meshcomm.distributed.ProcessGroup` handles that the in-place collectives accept.
``mesh.mesh`` is a numpy array of global ranks (torch returns a CPU tensor).

Example:
    >>> import meshcomm.distributed as dist
    >>> mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))  # joins a world of 1
    >>> mesh.shape, mesh.get_local_rank("tp"), mesh["dp"].mesh_dim_names
    ((1, 1), 0, ('dp',))
    >>> dist.get_world_size(mesh.get_group("tp"))
    1
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from meshcomm.distributed._errors import public
from meshcomm.distributed._pg import ProcessGroup
from meshcomm.distributed._state import STATE, init_process_group
from meshcomm.mesh import DeviceMesh as MeshImpl
from meshcomm.mesh import init_device_mesh as _mesh_init

__all__ = ["DeviceMesh", "init_device_mesh"]


class DeviceMesh:
    """An N-D grid of ranks with named dims, as ``torch.distributed.device_mesh.DeviceMesh``.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (recorded; meshcomm groups are not per device).
        mesh: the grid of global ranks (array-like), or a meshcomm ``DeviceMesh``.
        mesh_dim_names: one name per dim.

    Attributes:
        device_type: the device type.
        mesh_impl: the meshcomm :class:`~meshcomm.mesh.DeviceMesh`.
    """

    def __init__(
        self,
        device_type: str,
        mesh: Any,
        *,
        mesh_dim_names: Sequence[str] | None = None,
        _init_backend: bool = True,
    ) -> None:
        self.device_type = device_type
        self.mesh_impl = mesh if isinstance(mesh, MeshImpl) else MeshImpl(mesh, mesh_dim_names)

    @property
    def mesh(self) -> np.ndarray:
        """The grid of global ranks (read-only numpy array)."""
        return self.mesh_impl.mesh

    @property
    def shape(self) -> tuple[int, ...]:
        """The grid's shape."""
        return self.mesh_impl.shape

    @property
    def ndim(self) -> int:
        """The number of dims."""
        return self.mesh_impl.ndim

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        """The dim names."""
        return self.mesh_impl.mesh_dim_names

    def size(self, mesh_dim: int | str | None = None) -> int:
        """The number of ranks, in all or along ``mesh_dim``."""
        return self.mesh_impl.size(mesh_dim)

    @public
    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """Return this rank's group along ``mesh_dim`` (may be omitted on a 1-D mesh)."""
        return STATE.wrap(self.mesh_impl.get_group(mesh_dim))

    @public
    def get_all_groups(self) -> list[ProcessGroup]:
        """Return this rank's group along every dim."""
        return [STATE.wrap(g) for g in self.mesh_impl.get_all_groups()]

    def get_rank(self) -> int:
        """This process's global rank."""
        return self.mesh_impl.get_rank()

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's index along ``mesh_dim`` (its rank in that dim's group)."""
        return self.mesh_impl.get_local_rank(mesh_dim)

    def get_coordinate(self) -> list[int] | None:
        """This rank's index along every dim, or None if it is not in the mesh."""
        coord = self.mesh_impl.get_coordinate()
        return None if coord is None else list(coord)

    def __getitem__(self, mesh_dim_names: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh through this rank over the named dims (shares the groups)."""
        return DeviceMesh(self.device_type, self.mesh_impl[mesh_dim_names])

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """Merge every dim into one (torch's private ``_flatten``); collective."""
        return DeviceMesh(self.device_type, self.mesh_impl.flatten(name=mesh_dim_name))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return self.device_type == other.device_type and self.mesh_impl == other.mesh_impl

    def __hash__(self) -> int:
        return hash((self.device_type, self.mesh_impl))

    def __repr__(self) -> str:
        names = "" if self.mesh_dim_names is None else f", mesh_dim_names={self.mesh_dim_names}"
        return f"DeviceMesh('{self.device_type}', {self.mesh.tolist()}{names})"


@public
def init_device_mesh(
    device_type: str,
    mesh_shape: tuple[int, ...],
    *,
    mesh_dim_names: tuple[str, ...] | None = None,
    backend_override: Any = None,
) -> DeviceMesh:
    """Make a row-major mesh over every rank, initializing the default group if needed.

    Collective: every rank calls it. Each dim gets its group by one split.

    Args:
        device_type: ``"cpu"`` or ``"cuda"``; picks the default backend if the default group
            is not initialized (``gloo``, i.e. tcp, for ``cpu``; ``nccl`` for ``cuda``).
        mesh_shape: the size of each dim (product = world size).
        mesh_dim_names: one name per dim.
        backend_override: must be None (every dim uses the world's backend).

    Raises:
        ValueError: bad shape or names, a ``backend_override``.
    """
    if backend_override:
        raise ValueError(
            "backend_override is not supported: every mesh dim uses the world's backend"
        )
    if not isinstance(device_type, str) or not device_type:
        raise TypeError(f"device_type must be a str such as 'cpu' or 'cuda', got {device_type!r}")
    if STATE.default is None:
        from meshcomm.distributed._backend import get_default_backend_for_device

        init_process_group(get_default_backend_for_device(device_type))
    impl = _mesh_init(tuple(mesh_shape), mesh_dim_names)
    return DeviceMesh(device_type, impl)
