"""TcpLink: one communicator's :class:`~meshcomm.backends.link.Link` over the transport."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from meshcomm.backends.tcp.matching import LINK_TAG, as_bytes
from meshcomm.errors import InvalidArgument

if TYPE_CHECKING:
    from meshcomm.backends.tcp.transport import Transport

__all__ = ["TcpLink"]


class TcpLink:
    """The :class:`~meshcomm.backends.link.Link` of one communicator over a transport.

    Args:
        transport: the world's transport.
        comm_id: the communicator's id (frames of other communicators never match).
        global_ranks: world rank of each communicator rank.
        rank: this process's communicator rank.

    Attributes:
        stamp: the stamp of the call in progress (:mod:`meshcomm.diagnostics.fingerprint`; the group
            layer sets it before each collective when mismatch checks are on), or None: its
            frames carry ``-2 - stamp`` as their tag and every receive compares it.
    """

    def __init__(
        self, transport: Transport, comm_id: int, global_ranks: Sequence[int], rank: int
    ) -> None:
        self.transport = transport
        self.comm_id = comm_id
        self.global_ranks = tuple(global_ranks)
        self.rank = rank
        self.size = len(self.global_ranks)
        self.stamp: int | None = None

    def exchange(
        self,
        sends: Sequence[tuple[int, np.ndarray]],
        recvs: Sequence[tuple[int, np.ndarray]],
    ) -> None:
        """Post every send and receive at once; return when all have completed.

        Raises:
            InvalidArgument: a peer rank outside the communicator, or a bad buffer.
            CommTimeout: no progress for the timeout.
            PeerError: a peer is gone (names its global rank).
        """
        g = self.global_ranks
        size = self.size
        try:
            gsends = [(g[p], as_bytes(b)) for p, b in sends if 0 <= p < size]
            grecvs = [(g[p], as_bytes(b, writable=True)) for p, b in recvs if 0 <= p < size]
        except TypeError:
            gsends = grecvs = []
        if len(gsends) != len(sends) or len(grecvs) != len(recvs):
            bad = [p for p, _ in (*sends, *recvs) if not (isinstance(p, int) and 0 <= p < size)]
            raise InvalidArgument(
                f"rank {self.rank}: exchange peers must be ranks in [0, {size}), got {bad}"
            )
        stamp = self.stamp
        tag = LINK_TAG if stamp is None else -2 - stamp
        self.transport.exchange(self.comm_id, tag, gsends, grecvs)
