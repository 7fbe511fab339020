"""``ProcessGroup``: torch's process-group handle over a meshcomm group.

torch's handle has methods (``rank()``, ``size()``, ``name()``) where meshcomm's
:class:`meshcomm.group.ProcessGroup` has properties, so the in-place API hands out this thin
wrapper. ``pg.mesh_group`` is the meshcomm group underneath, for :mod:`meshcomm.ops` or the
functional methods.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup as MeshGroup
    >>> pg = ProcessGroup(MeshGroup(SelfCommunicator()), "gloo", "0", "default_pg")
    >>> pg.rank(), pg.size(), pg.name(), pg.group_name, pg.ranks
    (0, 1, 'gloo', '0', [0])
"""

from __future__ import annotations

from datetime import timedelta

from meshcomm.group import ProcessGroup as MeshGroup

__all__ = ["ProcessGroup"]


class ProcessGroup:
    """A group of ranks, as ``torch.distributed.ProcessGroup`` (made by ``new_group`` & co).

    Args:
        group: the meshcomm group.
        backend: the backend name reported by ``get_backend`` (``"gloo"``, ``"tcp"``, ...).
        group_name: torch's unique name (``"0"`` is the default group).
        group_desc: torch's description (``"default_pg"``, ``"undefined"``).
        timeout: the timeout given at creation, if any.

    Attributes:
        mesh_group: the meshcomm :class:`~meshcomm.group.ProcessGroup`.
        group_name: the unique name.
        group_desc: the description.
        bound_device_id: the ``device_id`` given to ``init_process_group`` (or None).
    """

    def __init__(
        self,
        group: MeshGroup,
        backend: str,
        group_name: str,
        group_desc: str = "undefined",
        timeout: timedelta | None = None,
    ) -> None:
        self.mesh_group = group
        self.backend_name = backend
        self.group_name = group_name
        self.group_desc = group_desc
        self.timeout = timeout
        self.bound_device_id: object = None
        # A sibling group for meshcomm's own point-to-point traffic (uneven all_to_all),
        # made on first need so it never collides with the user's tags.
        self.shadow: MeshGroup | None = None
        # Sequence number of monitored_barrier calls (keys in the store).
        self.monitor_seq = 0

    def rank(self) -> int:
        """This process's rank in the group."""
        return self.mesh_group.rank

    def size(self) -> int:
        """The number of ranks in the group."""
        return self.mesh_group.size

    def name(self) -> str:
        """The backend's name, as torch's ``ProcessGroup.name()``."""
        return self.backend_name

    @property
    def ranks(self) -> list[int]:
        """The global rank of each group rank."""
        return list(self.mesh_group.ranks)

    def group_rank_of(self, global_rank: int) -> int:
        """Return the group rank of a global rank.

        Raises:
            ValueError: ``global_rank`` is not a member.
        """
        ranks = self.mesh_group.ranks
        if global_rank not in ranks:
            raise ValueError(
                f"Global rank {global_rank} is not part of group {self.group_name!r} "
                f"(members: {list(ranks)})"
            )
        return ranks.index(global_rank)

    def global_rank_of(self, group_rank: int) -> int:
        """Return the global rank of a group rank.

        Raises:
            ValueError: ``group_rank`` is out of range.
        """
        if not isinstance(group_rank, int) or isinstance(group_rank, bool):
            raise TypeError(f"group rank must be an int, got {type(group_rank).__name__}")
        if not 0 <= group_rank < self.size():
            raise ValueError(
                f"Group rank {group_rank} is not part of group {self.group_name!r} "
                f"(size {self.size()})"
            )
        return self.mesh_group.ranks[group_rank]

    def close(self) -> None:
        """Close the meshcomm group (and the shadow group). Idempotent."""
        if self.shadow is not None:
            self.shadow.close()
        self.mesh_group.close()

    def __repr__(self) -> str:
        return (
            f"<ProcessGroup {self.group_name!r} ({self.group_desc}) rank={self.rank()} "
            f"size={self.size()} backend={self.backend_name!r}>"
        )
