"""The point-to-point contract that collective algorithms are written against.

A :class:`Link` moves raw bytes between the ranks of one communicator. Algorithms in
:mod:`meshcomm.backends.algorithms` are written once over it; each transport (tcp sockets,
same-host shared memory, an in-memory one for tests) implements it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

__all__ = ["Link"]


class Link(Protocol):
    """Ordered, reliable byte messages between the ranks of one communicator.

    Attributes:
        rank: this process's rank in the communicator.
        size: the number of ranks.
    """

    rank: int
    size: int

    def exchange(
        self,
        sends: Sequence[tuple[int, np.ndarray]],
        recvs: Sequence[tuple[int, np.ndarray]],
    ) -> None:
        """Post every send and receive at once; return when all have completed.

        Each entry is ``(peer_rank, buffer)``. Buffers are C-contiguous arrays (any dtype; the
        bytes move). Messages between one pair of ranks are matched in the order they were
        posted, and a receive buffer has exactly the byte size of the matching send. Sends and
        receives progress together, so a ring step (send right, receive left) cannot deadlock.
        Send buffers may be reused once ``exchange`` returns.

        Raises:
            CommTimeout: no progress for the link's timeout.
            PeerError: a peer is gone (names its global rank).
        """
        ...
