"""Sub-groups: ``new_group``, ``new_subgroups``, ``split_group`` and rank translation.

Every constructor here is one meshcomm operation however many sub-groups it describes
(:meth:`~meshcomm.group.ProcessGroup.new_group` or one
:meth:`~meshcomm.group.ProcessGroup.split`), so a rank only ever builds the group it belongs
to; the others are ``GroupMember.NON_GROUP_MEMBER`` in the lists returned, as in torch.
Arguments are checked before anything is sent.

Example:
    >>> import meshcomm.distributed as dist
    >>> dist.init_process_group(world_size=1, rank=0)
    >>> g = dist.new_group([0])
    >>> dist.get_process_group_ranks(g), dist.get_group_rank(g, 0), dist.get_global_rank(g, 0)
    ([0], 0, 0)
    >>> cur, groups = dist.new_subgroups(group_size=1)
    >>> cur.size(), len(groups)
    (1, 1)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from meshcomm.distributed._errors import public
from meshcomm.distributed._pg import ProcessGroup
from meshcomm.distributed._state import NON_GROUP_MEMBER, STATE, resolve

__all__ = [
    "canonical_rank",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
]


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def _rank_list(ranks: Any, world: int, what: str) -> list[int]:
    """Check a list of global ranks: ints in ``[0, world)``, no duplicates."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"{what} must be a list of ints, got {type(ranks).__name__}")
    out = [_int(r, f"{what} entry") for r in ranks]
    bad = [r for r in out if not 0 <= r < world]
    if bad:
        raise ValueError(
            f"{what} has ranks {bad} outside the world (valid: 0..{world - 1}); every rank of "
            "a new group must be within the world_size set by init_process_group"
        )
    if len(set(out)) != len(out):
        raise ValueError(f"{what} has duplicate ranks: {out}")
    return out


def canonical_rank(pg: ProcessGroup, global_rank: Any, group_rank: Any, what: str) -> int:
    """Return the group rank named by a global rank (``src``/``dst``) or a group rank
    (``group_src``/``group_dst``), exactly one of which is given, as torch.

    Raises:
        ValueError: both or neither given, or a rank outside the group.
    """
    if group_rank is not None:
        if global_rank is not None:
            raise ValueError(
                f"Can't specify both {what} and group_{what} (got {what}={global_rank}, "
                f"group_{what}={group_rank})"
            )
        chosen = _int(group_rank, f"group_{what}")
        pg.global_rank_of(chosen)  # range check
        return chosen
    if global_rank is None:
        raise ValueError(f"Must specify {what} or group_{what}")
    return pg.group_rank_of(_int(global_rank, what))


@public
def new_group(
    ranks: Any = None,
    timeout: Any = None,
    backend: Any = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> Any:
    """Make a group of the given global ranks.

    Every rank of the world calls it with the same ``ranks`` (with
    ``use_local_synchronization=True`` only the members do, as in torch).

    Args:
        ranks: global ranks of the members; None: all ranks.
        timeout: kept as the group's ``timeout`` (meshcomm groups time out with the world's
            timeout; ``monitored_barrier`` uses this one).
        backend: the name ``get_backend`` reports for the group; the group runs on the
            world's meshcomm backend.
        pg_options: ignored (meshcomm backends take no options).
        use_local_synchronization: only the members call. Not with
            ``MESHCOMM_DEBUG=DETAIL``, whose checks need every rank.
        group_desc: a description.
        device_id: ignored.
        sort_ranks: order members by global rank (torch's default); False keeps the order
            of ``ranks`` (then every rank of the world calls, as for a split).

    Returns:
        The group on its members; ``GroupMember.NON_GROUP_MEMBER`` elsewhere.

    Raises:
        ValueError: ranks outside the world, duplicates, not initialized.
    """
    default = STATE.require_default()
    STATE.flush()
    world = default.size()
    chosen = list(range(world)) if ranks is None else _rank_list(ranks, world, "ranks")
    if not chosen:
        raise ValueError("new_group needs at least one rank, got an empty list")
    name = default.backend_name if backend is None else str(backend)
    desc = group_desc or "undefined"
    me = default.rank()
    if not sort_ranks and chosen != sorted(chosen):
        color = 0 if me in chosen else None
        key = chosen.index(me) if me in chosen else 0
        made = default.mesh_group.split(color, key)
    elif use_local_synchronization and me not in chosen:
        made = None
    else:
        made = default.mesh_group.new_group(chosen)
    if made is None:
        STATE.next_name()
        return NON_GROUP_MEMBER
    return STATE.add(made, name, desc, timeout)


def _check_partition(lists: Any, world: int) -> list[list[int]]:
    if lists is None or not isinstance(lists, Sequence) or len(lists) == 0:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    out: list[list[int]] = []
    seen: dict[int, list[int]] = {}
    for entry in lists:
        ranks = _rank_list(entry, world, "subgroup")
        if not ranks:
            raise ValueError("a subgroup needs at least one rank, got an empty list")
        for r in ranks:
            if r in seen:
                raise ValueError(f"Rank {r} has appeared in both subgroup {seen[r]} and {ranks}")
            seen[r] = ranks
        out.append(ranks)
    return out


def _split_into(
    parent: ProcessGroup, members: list[list[int]], name: str, desc: str, timeout: Any
) -> tuple[ProcessGroup | None, int | None]:
    """One split of ``parent`` into ``members`` (lists of parent group ranks, each sorted by
    its own order); return this rank's group and its index."""
    me = parent.rank()
    index = next((i for i, m in enumerate(members) if me in m), None)
    key = 0 if index is None else members[index].index(me)
    made = parent.mesh_group.split(index, key)
    if made is None:
        return None, None
    return STATE.add(made, name, desc, timeout), index


@public
def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Any,
    timeout: Any = None,
    backend: Any = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[Any, list[Any]]:
    """Make disjoint groups from lists of global ranks; every rank of the world calls it.

    Returns:
        ``(cur_subgroup, subgroups)``: this rank's group (None if it is in none) and one
        entry per list: this rank's group, or ``GroupMember.NON_GROUP_MEMBER``.

    Raises:
        ValueError: an empty list, overlapping groups, ranks outside the world.
    """
    default = STATE.require_default()
    STATE.flush()
    lists = _check_partition(ranks_per_subgroup_list, default.size())
    name = default.backend_name if backend is None else str(backend)
    ordered = [sorted(m) for m in lists]  # new_group orders members by global rank
    cur, index = _split_into(default, ordered, name, group_desc or "undefined", timeout)
    subgroups: list[Any] = [NON_GROUP_MEMBER] * len(lists)
    if index is not None:
        subgroups[index] = cur
    return cur, subgroups


@public
def new_subgroups(
    group_size: int | None = None,
    group: Any = None,
    timeout: Any = None,
    backend: Any = None,
    pg_options: Any = None,
    group_desc: str | None = None,
) -> tuple[Any, list[Any]]:
    """Split ``group`` (default: the world) into consecutive groups of ``group_size`` ranks.

    Args:
        group_size: ranks per group; None: the number of ranks on this host (torch uses the
            number of CUDA devices).
        group: the group to split.
        timeout: as for :func:`new_group`.
        backend: as for :func:`new_group`.
        pg_options: ignored.
        group_desc: a description.

    Returns:
        ``(cur_subgroup, subgroups)`` as :func:`new_subgroups_by_enumeration`.

    Raises:
        ValueError: a size that is not positive, exceeds or does not divide the group size.
    """
    parent = resolve(group)
    if parent is None:
        raise ValueError("Invalid process group specified")
    if group_size is None:
        from meshcomm import world

        local = world.get_world_info().local_world_size
        if local is None:
            raise ValueError(
                "Default group size needs the number of ranks per host (LOCAL_WORLD_SIZE); "
                "pass group_size"
            )
        group_size = local
    size = _int(group_size, "group_size")
    world_size = parent.size()
    if size <= 0:
        raise ValueError(f"The arg 'group_size' ({size}) must be positive")
    if world_size < size:
        raise ValueError(
            f"The arg 'group_size' ({size}) must not exceed the world size ({world_size})"
        )
    if world_size % size:
        raise ValueError(f"The world size ({world_size}) must be divisible by 'group_size={size}'")
    STATE.flush()
    members = [list(range(i, i + size)) for i in range(0, world_size, size)]
    name = parent.backend_name if backend is None else str(backend)
    cur, index = _split_into(parent, members, name, group_desc or "undefined", timeout)
    subgroups: list[Any] = [NON_GROUP_MEMBER] * len(members)
    if index is not None:
        subgroups[index] = cur
    return cur, subgroups


@public
def split_group(
    parent_pg: Any = None,
    split_ranks: Any = None,
    timeout: Any = None,
    pg_options: Any = None,
    group_desc: str | None = None,
    backend: Any = None,
) -> ProcessGroup | None:
    """Split ``parent_pg`` into disjoint groups of its *group* ranks (one split).

    Every rank of ``parent_pg`` calls it with the same ``split_ranks``. Unlike torch (NCCL
    only), every meshcomm backend supports it.

    Returns:
        This rank's group, or None if it is in none of ``split_ranks``.

    Raises:
        ValueError: ``split_ranks`` empty or overlapping, ranks outside the parent.
    """
    if split_ranks is None or not isinstance(split_ranks, Sequence) or len(split_ranks) == 0:
        raise ValueError("split_ranks cannot be None or empty")
    parent = resolve(parent_pg)
    if parent is None:
        raise ValueError("Invalid process group specified: this rank is not in parent_pg")
    lists = _check_partition(split_ranks, parent.size())
    STATE.flush()
    name = parent.backend_name if backend is None else str(backend)
    cur, _ = _split_into(parent, lists, name, group_desc or "undefined", timeout)
    return cur


def get_group_rank(group: Any, global_rank: int) -> int:
    """Translate a global rank into a rank of ``group``.

    Raises:
        ValueError: ``global_rank`` is not a member, or this rank is not in ``group``.
    """
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified: this rank is not a member")
    return pg.group_rank_of(_int(global_rank, "global_rank"))


def get_global_rank(group: Any, group_rank: int) -> int:
    """Translate a rank of ``group`` into a global rank.

    Raises:
        ValueError: ``group_rank`` is out of range, or this rank is not in ``group``.
    """
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified: this rank is not a member")
    return pg.global_rank_of(_int(group_rank, "group_rank"))


def get_process_group_ranks(group: Any) -> list[int]:
    """Return the global ranks of ``group`` (None: the default group), by group rank.

    Raises:
        ValueError: this rank is not a member of ``group`` (torch answers with the ranks of
            the last group it was not in; meshcomm does not keep those).
    """
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified: this rank is not a member")
    return pg.ranks
