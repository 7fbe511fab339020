"""One mesh for both: meshcomm meshes as torch DeviceMeshes, and back.

A meshcomm :class:`~meshcomm.mesh.DeviceMesh` hands torch a torch ``DeviceMesh`` over the
very same groups (:func:`to_torch_mesh`, also ``mesh.to_torch()``): each axis group is
wrapped once as a :class:`~meshcomm.c10d.MeshcommProcessGroup` and registered in torch's
world (so DTensor, FSDP2 and the functional collectives find it by name). The other way, a
torch ``DeviceMesh`` built on backend ``"meshcomm"`` gives :mod:`meshcomm.ops` a meshcomm
mesh whose axes are the meshcomm groups under torch's dim groups (:func:`from_torch_mesh`).
DTensor code and ``meshcomm.ops`` code then mix in one program, on one set of transports.

Example:
    >>> import torch.distributed as dist, meshcomm
    >>> dist.init_process_group("meshcomm", store=dist.HashStore(), rank=0, world_size=1)
    >>> mesh = meshcomm.init_device_mesh((1,), mesh_dim_names=("dp",))
    >>> tmesh = to_torch_mesh(mesh)
    >>> tmesh.mesh_dim_names, tmesh.get_group("dp").mesh_group is mesh.get_group("dp")
    (('dp',), True)
    >>> from_torch_mesh(tmesh).get_group("dp") is mesh.get_group("dp")
    True
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from meshcomm.c10d._process_group import BACKEND_NAME, MeshcommProcessGroup
from meshcomm.group import ProcessGroup as MeshGroup
from meshcomm.mesh import DeviceMesh

__all__ = ["from_torch_mesh", "to_torch_mesh", "torch_group"]

_LOCK = threading.Lock()
_WRAPPED: weakref.WeakKeyDictionary[MeshGroup, MeshcommProcessGroup] = weakref.WeakKeyDictionary()


def torch_group(group: MeshGroup) -> MeshcommProcessGroup:
    """Return the torch process group over a meshcomm group (made and registered once).

    The world's group is torch's default group when that runs on ``"meshcomm"``; any other
    group gets a torch name of its own, ``"meshcomm:<meshcomm name>"``, the same on every
    member, registered in torch's world with its global ranks.

    Raises:
        ValueError: torch's default group is not initialized (call
            ``init_process_group("meshcomm")``), or it runs on a world other than this
            group's.
    """
    if not dist.is_initialized():
        raise ValueError(
            "torch's default process group is not initialized: call "
            "torch.distributed.init_process_group('meshcomm') first (it adopts meshcomm's world)"
        )
    default = dist.distributed_c10d._get_default_group()
    if isinstance(default, MeshcommProcessGroup) and default.mesh_group is group:
        return default
    with _LOCK:
        made = _WRAPPED.get(group)
        if made is not None:
            return made
        pg = MeshcommProcessGroup(group)
        name = f"meshcomm:{group.name}"
        pg.setGroupName(name)
        pg.setGroupDesc(group.name)
        c10d: Any = dist.distributed_c10d
        c10d._register_pg_in_world(
            pg,
            BACKEND_NAME,
            c10d._get_default_store(),
            name,
            BACKEND_NAME,
            rank_mapping={int(g): i for i, g in enumerate(group.ranks)},
            add_to_default_tag=True,
        )
        _WRAPPED[group] = pg
        return pg


def to_torch_mesh(mesh: DeviceMesh, device_type: str | None = None) -> Any:
    """Return a torch ``DeviceMesh`` over the same ranks, names and groups as ``mesh``.

    Initializes torch's default group on ``"meshcomm"`` (adopting meshcomm's world) if
    nothing did yet: over the launcher's store (``env://``), or, where there is none (an
    MPI world under ``mpiexec``), a store of this process alone that only torch's
    bookkeeping sees.

    Args:
        mesh: the meshcomm mesh; this rank must be in it.
        device_type: torch's device type (default ``"cuda"`` where the world moves GPU
            arrays over a device backend and torch sees a GPU, else ``"cpu"``).

    Raises:
        ValueError: torch's default group runs on another world (see :func:`torch_group`).
    """
    if not dist.is_initialized():
        _init_torch_over_world()
    if device_type is None:
        on_gpu = mesh.get_group(0).device_backend is not None
        device_type = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
    groups: list[Any] = [torch_group(mesh.get_group(d)) for d in range(mesh.ndim)]
    from torch.distributed.device_mesh import DeviceMesh as TorchMesh

    grid = torch.tensor(mesh.mesh, dtype=torch.int)
    names = tuple(mesh.mesh_dim_names)
    if mesh.ndim == 1:
        return TorchMesh.from_group(groups[0], device_type, grid, mesh_dim_names=names)
    return TorchMesh.from_group(groups, device_type, grid, mesh_dim_names=names)


def _init_torch_over_world() -> None:
    """torch's default group on ``"meshcomm"``, adopting meshcomm's world.

    torch wants a store for its default group even though the adopted world needs none:
    the launcher's (``env://``) where there is one; under ``mpiexec`` (an MPI world has no
    store) a store of this process alone, which torch keeps for its bookkeeping only (groups
    on ``"meshcomm"`` never use it).
    """
    import os

    from meshcomm.world import get_world

    world = get_world()
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        dist.init_process_group(BACKEND_NAME, rank=world.rank, world_size=world.size)
    else:
        dist.init_process_group(
            BACKEND_NAME, store=dist.HashStore(), rank=world.rank, world_size=world.size
        )


def from_torch_mesh(torch_mesh: Any) -> DeviceMesh:
    """Return a meshcomm mesh over a torch ``DeviceMesh`` built on backend ``"meshcomm"``.

    Its axes are the meshcomm groups under torch's dim groups (no new group is made), so
    ``meshcomm.ops`` calls by axis name run on the same transports as the DTensor code.

    Raises:
        ValueError: a dim group of the mesh is not on the ``"meshcomm"`` backend, or the
            mesh has no dim names.
    """
    names = torch_mesh.mesh_dim_names
    if not names:
        raise ValueError("from_torch_mesh: the torch DeviceMesh needs mesh_dim_names")
    groups: list[MeshGroup] = []
    for dim, name in enumerate(names):
        pg = torch_mesh.get_group(dim)
        if not isinstance(pg, MeshcommProcessGroup):
            raise ValueError(
                f"from_torch_mesh: dim {name!r} runs on backend {pg.name()!r}, not "
                f"{BACKEND_NAME!r}; build the torch DeviceMesh after "
                f"init_process_group({BACKEND_NAME!r})"
            )
        groups.append(pg.mesh_group)
    grid = torch_mesh.mesh.cpu().numpy()
    return DeviceMesh.from_groups(grid, tuple(names), groups)
