"""The ``"meshcomm"`` backend's registration with torch, and the groups it makes.

:func:`register` (run by ``import meshcomm.c10d``, by torch's backend autoload, and by
``import meshcomm`` when torch is already imported) tells torch that
``init_process_group("meshcomm")`` and ``new_group(..., backend="meshcomm")`` make their
groups with :func:`create_group`:

- the default group is meshcomm's world. If ``meshcomm.init()`` already ran, torch's
  default group adopts that world (same ranks, same transports) and leaves it open when
  destroyed; otherwise the world is joined over the store torch rendezvoused on (any
  launcher: torchrun, meshrun, ``mp.spawn``, an explicit store) and shut down with the group.
- every other group is a subgroup of that world made by its members alone
  (:meth:`meshcomm.group.ProcessGroup.subgroup`), which is what torch's ``new_group`` asks:
  only members construct the backend.

Example:
    >>> import torch.distributed as dist
    >>> register()
    >>> "meshcomm" in dist.Backend.backend_list
    True
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshcomm import world
from meshcomm.c10d._errors import as_torch_error
from meshcomm.c10d._process_group import BACKEND_NAME, MeshcommProcessGroup
from meshcomm.group import ProcessGroup as MeshGroup

__all__ = ["create_group", "register", "registered"]

_LOCK = threading.Lock()


def registered() -> bool:
    """Return True if torch knows the ``"meshcomm"`` backend.

    Example:
        >>> register(); registered()
        True
    """
    return BACKEND_NAME.upper() in dist.Backend._plugins


def register() -> None:
    """Register the ``"meshcomm"`` backend with torch (idempotent).

    Example:
        >>> register(); register()  # a second call changes nothing
    """
    with _LOCK:
        if registered():
            return
        dist.Backend.register_backend(
            BACKEND_NAME, create_group, extended_api=True, devices=["cpu", "cuda"]
        )


def create_group(options: Any, backend_options: Any = None) -> MeshcommProcessGroup:
    """torch's creator: the process group for one ``init_process_group`` or ``new_group``.

    Args:
        options: torch's ``_DistributedBackendOptions`` (store, group rank and size, timeout,
            group name, the global ranks of the group).
        backend_options: torch's options object for the backend; meshcomm takes none.

    Raises:
        ValueError: the ranks torch assigned differ from those of a meshcomm world this
            process already joined (both named).
        DistError: joining the world failed (torch's family; meshcomm's words).
    """
    timeout: timedelta = options.timeout
    seconds = timeout.total_seconds() if timeout.total_seconds() > 0 else None
    try:
        if not dist.is_initialized():
            return _world_group(options, seconds)
        return _subgroup(options, seconds, timeout)
    except BaseException as exc:
        new = as_torch_error(exc)
        if new is exc:
            raise
        raise new from None


def _world_group(options: Any, seconds: float | None) -> MeshcommProcessGroup:
    rank, size = int(options.group_rank), int(options.group_size)
    if world.is_initialized():
        group = world.get_world()
        if (group.rank, group.size) != (rank, size):
            raise ValueError(
                f"torch's default group is rank {rank} of {size}, but this process joined "
                f"meshcomm's world as rank {group.rank} of {group.size}; start both from the "
                "same launcher (or pass the same rank and world_size to both)"
            )
        return MeshcommProcessGroup(group, options.timeout)
    from meshcomm.store.torch_adapter import TorchStore

    store = TorchStore(options.store, timeout=seconds)
    backend = os.environ.get("MESHCOMM_BACKEND") or None
    group = world.init(backend=backend, rank=rank, world_size=size, timeout=seconds, store=store)
    return MeshcommProcessGroup(group, options.timeout, on_close=world.shutdown)


def _subgroup(options: Any, seconds: float | None, timeout: timedelta) -> MeshcommProcessGroup:
    parent = _world_of_default()
    ranks = [int(r) for r in options.global_ranks_in_group]
    name = f"torch group {options.group_id}"
    group = parent.subgroup(ranks, name)
    return MeshcommProcessGroup(group, timeout, on_close=group.close)


def _world_of_default() -> MeshGroup:
    """The meshcomm world under torch's default group (which may be another backend's)."""
    default = dist.distributed_c10d._get_default_group()
    if isinstance(default, MeshcommProcessGroup):
        return default.mesh_group
    if world.is_initialized():
        return world.get_world()
    raise ValueError(
        "new_group(backend='meshcomm') needs meshcomm's world: initialize the default group "
        "with backend 'meshcomm' (or call meshcomm.init() first); the default group's "
        f"backend is {dist.get_backend()!r}"
    )
