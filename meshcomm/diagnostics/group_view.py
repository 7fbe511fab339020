"""What the diagnostics read of a group, as a Protocol: the group core sits above them.

:class:`~meshcomm.group.ProcessGroup` admits every call through the diagnostics (ledger,
fingerprints, verdicts), so they cannot import it, not even for annotations, without closing
an import circle. They are typed against :class:`GroupView` instead, which every
``ProcessGroup`` satisfies structurally; this module imports nothing above the ledger.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> def label_of(group: GroupView) -> str:
    ...     return group.label
    >>> g = ProcessGroup(SelfCommunicator(), name="world")
    >>> label_of(g)
    "on group 'world'"
    >>> g.close()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from meshcomm.backends.base import Communicator
    from meshcomm.diagnostics.ledger import Ledger
    from meshcomm.store.base import Store

__all__ = ["GroupView"]


class GroupView(Protocol):
    """A process group as its diagnostics see it: identity, store, ledger and sub-groups."""

    @property
    def name(self) -> str:
        """The group's name (``"world"``, a mesh axis, ...)."""
        ...

    @property
    def store(self) -> Store | None:
        """The world's key-value store, or None (the mpi backend without meshrun)."""
        ...

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        ...

    @property
    def size(self) -> int:
        """The number of ranks in the group."""
        ...

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global (world) rank of each group rank."""
        ...

    @property
    def timeout(self) -> float:
        """Seconds a blocking operation waits for a peer."""
        ...

    @property
    def label(self) -> str:
        """How messages name the group: ``"on group 'world'"``."""
        ...

    @property
    def closed(self) -> bool:
        """Whether the group was closed."""
        ...

    @property
    def _comm(self) -> Communicator:
        """The group's host communicator (the responder hands it a peer's mismatch alarm)."""
        ...

    @property
    def _book(self) -> Ledger:
        """The group's ledger of calls."""
        ...

    @property
    def _kids(self) -> Sequence[GroupView]:
        """The groups made from this one."""
        ...

    def ledger(self) -> list[dict[str, Any]]:
        """The group's recent calls, oldest first."""
        ...
