"""The one exception tree of meshcomm.

Every error meshcomm raises on purpose is a :class:`MeshCommError`, so ``except
MeshCommError`` catches them all. The tree::

    MeshCommError
    ├── StoreError              the key-value store failed (connection, protocol, closed)
    │   └── StoreTimeout        a get/wait did not see its keys in time (also a TimeoutError)
    ├── RendezvousError         ranks could not agree on who they are (duplicate rank, world size)
    ├── CommError               a collective or point-to-point operation failed
    │   ├── CommTimeout         a peer stayed silent past the timeout (also a TimeoutError)
    │   ├── PeerError           a peer went away (its process died, its connection closed)
    │   └── ProtocolError       bytes on the wire were not what the protocol allows
    └── InvalidArgument         bad input, raised before any I/O (also a ValueError)

Messages name the rank, the address or key, and both values where two disagree.

Example:
    >>> from meshcomm.errors import InvalidArgument, MeshCommError
    >>> try:
    ...     raise InvalidArgument("rank 3: root must be in [0, 2), got 5")
    ... except MeshCommError as exc:
    ...     print(type(exc).__name__, isinstance(exc, ValueError))
    InvalidArgument True
"""

from __future__ import annotations

__all__ = [
    "CommError",
    "CommTimeout",
    "InvalidArgument",
    "MeshCommError",
    "PeerError",
    "ProtocolError",
    "RendezvousError",
    "StoreError",
    "StoreTimeout",
]


class MeshCommError(Exception):
    """Base class of every error meshcomm raises on purpose."""


class StoreError(MeshCommError):
    """The key-value store failed: unreachable server, closed store, protocol violation."""


class StoreTimeout(StoreError, TimeoutError):
    """A store ``get``/``wait`` did not see its keys within the timeout."""


class RendezvousError(MeshCommError):
    """Ranks could not agree on the world: duplicate rank, differing world sizes, bad rank."""


class CommError(MeshCommError):
    """A collective or point-to-point operation failed."""


class CommTimeout(CommError, TimeoutError):
    """A peer stayed silent past the timeout (it may be stopped, slow, or deadlocked)."""


class PeerError(CommError):
    """A peer went away: its process died or its connection closed.

    Attributes:
        rank: the global rank of the peer that failed, when known.
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class ProtocolError(CommError):
    """Bytes received were not what the protocol allows (foreign or corrupt peer)."""


class InvalidArgument(MeshCommError, ValueError):
    """Bad input, detected before any byte left this process."""
