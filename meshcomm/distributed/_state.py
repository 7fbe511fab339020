"""The default process group and its lifecycle: ``init_process_group`` and friends.

torch.distributed's API is global (every call defaults to "the" process group), so this
module keeps one :class:`DistState` for the process: the default group (a wrapper around
:func:`meshcomm.world.get_world`), the groups made since, and receives waiting to be issued.
Nothing else in :mod:`meshcomm.distributed` keeps state.

``init_process_group`` joins meshcomm's world (:func:`meshcomm.world.init`); if the world was
already joined with ``meshcomm.init()``, it adopts that world and ``destroy_process_group``
then leaves it open for its owner.

Example:
    >>> import meshcomm.distributed as dist
    >>> dist.init_process_group("gloo", world_size=1, rank=0)
    >>> dist.get_rank(), dist.get_world_size(), dist.get_backend(), dist.is_initialized()
    (0, 1, 'gloo', True)
    >>> dist.destroy_process_group(); dist.is_initialized()
    False
"""

from __future__ import annotations

import warnings
import weakref
from datetime import timedelta
from typing import Any

from meshcomm import world
from meshcomm.backends.spec import matches
from meshcomm.distributed._backend import meshcomm_backend
from meshcomm.distributed._errors import public
from meshcomm.distributed._pg import ProcessGroup
from meshcomm.distributed._work import Work
from meshcomm.group import ProcessGroup as MeshGroup
from meshcomm.store.base import Store as MeshStore

__all__ = [
    "NON_GROUP_MEMBER",
    "STATE",
    "DistState",
    "GroupMember",
    "destroy_process_group",
    "get_backend",
    "get_backend_config",
    "get_node_local_rank",
    "get_pg_count",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "is_initialized",
    "resolve",
    "warn_not_in_group",
]

#: What ``new_group`` returns on ranks outside the group (torch 2.13 uses this int).
NON_GROUP_MEMBER = -100

_NOT_INITIALIZED = (
    "Default process group has not been initialized, please make sure to call init_process_group."
)


class DistState:
    """The process's torch-style state: default group, groups made, receives not yet issued.

    Attributes:
        default: the default group, or None before ``init_process_group``.
        backend: the backend string the default group was made with.
        owns_world: whether ``destroy_process_group`` shuts meshcomm's world down.
        groups: every group made since ``init_process_group`` (destroyed ones removed).
        made_here: the groups this module made (``destroy_process_group()`` closes those;
            groups of meshcomm meshes are only wrapped, and left to their mesh).
        pending: deferred ``irecv`` works, issued in order before the next operation.
        coalescing: the calls queued in each group's open ``_coalescing_manager`` block.
    """

    def __init__(self) -> None:
        self.default: ProcessGroup | None = None
        self.backend = ""
        self.owns_world = False
        self.groups: list[ProcessGroup] = []
        self.made_here: set[int] = set()
        self.group_count = 0
        self.pending: list[Work] = []
        self.coalescing: dict[ProcessGroup, list[Any]] = {}
        self._wrappers: weakref.WeakKeyDictionary[MeshGroup, ProcessGroup] = (
            weakref.WeakKeyDictionary()
        )

    def require_default(self) -> ProcessGroup:
        """Return the default group.

        Raises:
            ValueError: not initialized (torch's message).
        """
        if self.default is None:
            raise ValueError(_NOT_INITIALIZED)
        return self.default

    def add(self, group: MeshGroup, backend: str, desc: str, timeout: Any) -> ProcessGroup:
        """Wrap a new meshcomm group and register it."""
        pg = ProcessGroup(group, backend, str(self.group_count), desc, _delta(timeout))
        self.group_count += 1
        self.groups.append(pg)
        self.made_here.add(id(pg))
        self._wrappers[group] = pg
        return pg

    def next_name(self) -> None:
        """Count a group this rank is not a member of (names stay aligned across ranks)."""
        self.group_count += 1

    def wrap(self, group: MeshGroup) -> ProcessGroup:
        """Return the handle of a meshcomm group made elsewhere (a mesh axis, ``split``)."""
        pg = self._wrappers.get(group)
        if pg is None:
            backend = self.backend if self.default is not None else group.backend
            pg = self.add(group, backend, group.name, None)
            self.made_here.discard(id(pg))
        return pg

    def flush(self) -> None:
        """Issue deferred receives, in the order they were posted."""
        while self.pending:
            self.pending.pop(0).start()

    def reset(self) -> None:
        """Forget every group (after ``destroy_process_group()``)."""
        self.__init__()  # type: ignore[misc]


#: The process's one state object.
STATE = DistState()


def _delta(timeout: Any) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        return timedelta(seconds=timeout)
    raise TypeError(f"Expected timeout argument to be of type datetime.timedelta, got {timeout!r}")


class _WorldMeta(type):
    """Gives ``group`` and ``GroupMember`` the class property ``WORLD``."""

    @property
    def WORLD(cls) -> ProcessGroup | None:
        return STATE.default


class group(metaclass=_WorldMeta):
    """Placeholder whose ``group.WORLD`` is the default group (None before init)."""


class GroupMember(metaclass=_WorldMeta):
    """``GroupMember.WORLD`` (the default group) and ``GroupMember.NON_GROUP_MEMBER``."""

    NON_GROUP_MEMBER = NON_GROUP_MEMBER


def _is_non_member(g: Any) -> bool:
    return isinstance(g, int) and not isinstance(g, bool) and g == NON_GROUP_MEMBER


def resolve(g: Any) -> ProcessGroup | None:
    """Return the group a ``group=`` argument names, or None if this rank is not a member.

    Accepts None / ``group.WORLD`` (the default group), a handle from this module, a meshcomm
    :class:`~meshcomm.group.ProcessGroup`, or ``GroupMember.NON_GROUP_MEMBER``.

    Raises:
        ValueError: not initialized, or the group was destroyed.
        TypeError: something else.
    """
    if g is None:
        return STATE.require_default()
    if _is_non_member(g):
        return None
    if isinstance(g, ProcessGroup):
        pg = g
    elif isinstance(g, MeshGroup):
        pg = STATE.wrap(g)
    else:
        raise TypeError(f"group must be a ProcessGroup or None, got {type(g).__name__} {g!r}")
    if pg.mesh_group.closed:
        raise ValueError(f"process group {pg.group_name!r} was destroyed")
    return pg


def warn_not_in_group(op: str) -> None:
    """Warn as torch does when a rank runs ``op`` on a group it is not a member of."""
    default = STATE.default
    rank = -1 if default is None else default.rank()
    warnings.warn(
        f"Running {op} on global rank {rank} which does not belong to the given group.",
        stacklevel=3,
    )


@public
def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Join the job's world and make it the default process group.

    Args:
        backend: ``"gloo"`` (an alias of meshcomm's ``"tcp"``), ``"tcp"``, ``"mpi"``,
            ``"nccl"``, or a per-device string such as ``"cpu:gloo,cuda:nccl"`` (the group
            then runs on the CPU entry's backend). None: the backend ``meshcomm.init``
            would pick (``MESHCOMM_BACKEND``, else ``"mpi"`` when ``mpiexec``/``srun``
            started the process and mpi4py is installed, else ``"tcp"``), or the backend
            of a world joined earlier with ``meshcomm.init``.
        init_method: ``"env://"`` (default), ``"tcp://host:port"`` or ``"file:///path"``.
        timeout: for the rendezvous and every blocking operation (default:
            ``MESHCOMM_TIMEOUT`` or 300 s; torch's is 30 minutes).
        world_size: number of processes; -1 reads the launcher's environment.
        rank: this process's rank; -1 reads the launcher's environment.
        store: a store shared by all ranks (a ``meshcomm.distributed`` store, any meshcomm
            store, or a torch store), instead of ``init_method``.
        group_name: ignored (deprecated in torch as well).
        pg_options: backend options; meshcomm has none, so anything but None warns.
        device_id: the device this process uses; kept as ``bound_device_id``.

    Raises:
        ValueError: already initialized, unknown backend, bad arguments.
        DistError: the rendezvous failed.

    Example:
        >>> import meshcomm.distributed as dist
        >>> dist.init_process_group(world_size=1, rank=0)
        >>> dist.get_backend()
        'tcp'
        >>> dist.destroy_process_group()
    """
    if STATE.default is not None:
        raise ValueError("trying to initialize the default process group twice!")
    if backend is not None:
        name = meshcomm_backend(backend)
    elif world.is_initialized() and world.get_world().backend != "self":
        name = world.get_world().backend
    else:
        name = world.choose_backend(None, init_method, store)
    if pg_options is not None:
        warnings.warn("pg_options are ignored: meshcomm backends take no options", stacklevel=3)
    seconds = _delta(timeout)
    if store is not None and not isinstance(store, MeshStore):
        from meshcomm.store.torch_adapter import TorchStore

        store = TorchStore(store, timeout=seconds)
    size = None if world_size in (-1, None) else world_size
    me = None if rank in (-1, None) else rank
    owns = not world.is_initialized()
    if owns and store is None and init_method in (None, "env://"):
        _check_launcher_world(size, me)
    if owns:
        mesh = world.init(name, init_method, size, me, seconds, store)
    else:
        mesh = _adopt(name, size, me)
    STATE.reset()
    STATE.backend = backend if backend is not None else name
    STATE.owns_world = owns
    pg = STATE.add(mesh, STATE.backend, "default_pg", seconds)
    pg.bound_device_id = device_id
    STATE.default = pg


def _check_launcher_world(size: int | None, rank: int | None) -> None:
    """Refuse, before any I/O, a ``world_size``/``rank`` that contradicts a launcher hosting
    the store (meshrun, ``meshcomm.spawn``): it serves exactly ``WORLD_SIZE`` ranks, so the
    rendezvous would wait out the whole timeout for ranks that never come."""
    import os

    from meshcomm.launch import detect_launch

    info = detect_launch(os.environ)
    if info.store_host != "launcher":
        return
    problems = []
    if size is not None and size != info.world_size:
        problems.append(f"world_size={size} but WORLD_SIZE={info.world_size}")
    if rank is not None and rank != info.rank:
        problems.append(f"rank={rank} but RANK={info.rank}")
    if problems:
        raise ValueError(
            f"rank {info.rank}: init_process_group got " + " and ".join(problems) + " from the "
            f"launcher that hosts this job's store for {info.world_size} "
            "ranks (MESHCOMM_STORE_HOSTED=1); pass the launcher's values, or leave them out"
        )


def _adopt(backend: str, size: int | None, rank: int | None) -> MeshGroup:
    """Use a world joined earlier with ``meshcomm.init()`` (checking it matches)."""
    mesh = world.get_world()
    problems = []
    if size is not None and size != mesh.size:
        problems.append(f"world_size={size} but the world has {mesh.size} ranks")
    if rank is not None and rank != mesh.rank:
        problems.append(f"rank={rank} but this process is rank {mesh.rank}")
    if not matches(backend, mesh.backend):
        problems.append(f"backend {backend!r} but the world runs on {mesh.backend!r}")
    if problems:
        raise ValueError(
            "meshcomm's world is already initialized and does not match: " + "; ".join(problems)
        )
    return mesh


@public
def destroy_process_group(group: Any = None) -> None:
    """Destroy one group, or (None / ``group.WORLD``) every group and leave the world.

    Raises:
        ValueError: not initialized, or an unknown group.

    Example:
        >>> import meshcomm.distributed as dist
        >>> dist.init_process_group(world_size=1, rank=0)
        >>> dist.destroy_process_group(dist.new_group([0]))
        >>> dist.destroy_process_group()
    """
    if _is_non_member(group):
        return
    default = STATE.require_default()
    if group is None or group is default:
        STATE.flush()
        for pg in reversed(STATE.groups):
            if pg is not default and id(pg) in STATE.made_here:
                pg.close()
        owns = STATE.owns_world
        STATE.reset()
        if owns:
            world.shutdown()
        return
    target = resolve(group)
    if target is None or target not in STATE.groups:
        raise ValueError("Invalid process group specified")
    STATE.flush()
    STATE.groups.remove(target)
    target.close()


def is_initialized() -> bool:
    """Return True if the default process group is initialized.

    Example:
        >>> import meshcomm.distributed as dist
        >>> dist.is_initialized()
        False
    """
    return STATE.default is not None


def get_rank(group: Any = None) -> int:
    """Return this process's rank in ``group`` (default: the default group); -1 if not a
    member.

    Raises:
        ValueError: not initialized.
    """
    pg = resolve(group)
    return -1 if pg is None else pg.rank()


def get_world_size(group: Any = None) -> int:
    """Return the number of ranks in ``group`` (default: the default group); -1 if not a
    member.

    Raises:
        ValueError: not initialized.
    """
    pg = resolve(group)
    return -1 if pg is None else pg.size()


def get_backend(group: Any = None) -> str:
    """Return the backend name of ``group`` (as passed to ``init_process_group``/``new_group``).

    Raises:
        ValueError: not initialized, or this rank is not a member of ``group``.
    """
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    return pg.backend_name


def get_backend_config(group: Any = None) -> str:
    """Return the backend configuration string (``"cpu:gloo"`` style) of ``group``."""
    name = get_backend(group)
    return name if ":" in name else f"cpu:{name}"


def get_pg_count() -> int:
    """Return how many process groups were made since ``init_process_group`` (the default
    group included), as torch."""
    return STATE.group_count


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """Return ``LOCAL_RANK`` from the launcher's environment, else ``fallback_rank``.

    Raises:
        RuntimeError: neither is available.
    """
    import os

    raw = os.environ.get("LOCAL_RANK")
    if raw is not None:
        return int(raw)
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not in the environment; pass fallback_rank or start the job with "
        "meshrun/torchrun"
    )
