"""The "self" backend: a world of one process, where every collective is the identity.

``meshcomm.init()`` in a plain ``python script.py`` gets this communicator, so code
written for N ranks runs unchanged (and fast) on one. Point-to-point messages to oneself
are queued in memory per tag.

Example:
    >>> import numpy as np
    >>> comm = SelfCommunicator(timeout=5.0)
    >>> recv = np.empty(3); comm.all_gather(np.arange(3.0), recv); recv
    array([0., 1., 2.])
    >>> comm.close()
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from meshcomm.backends.base import Communicator
from meshcomm.common.timeout import default_timeout
from meshcomm.errors import CommError, CommTimeout, InvalidArgument, ProtocolError
from meshcomm.reduction import ReduceOp

__all__ = ["SelfCommunicator"]


class SelfCommunicator(Communicator):
    """A communicator of size one (rank 0, world rank ``global_rank``).

    Args:
        timeout: seconds (kept for the interface; nothing here ever waits).
        global_rank: the world rank this communicator stands for (0 for a world of one;
            a one-member sub-group of a larger world may pass its world rank).
    """

    backend_name = "self"

    def __init__(self, timeout: float | None = None, global_rank: int = 0) -> None:
        super().__init__(0, (global_rank,), default_timeout() if timeout is None else timeout)
        self._mailbox: dict[int, deque[np.ndarray]] = {}
        self._closed = False

    def _check(self, what: str) -> None:
        if self._closed:
            raise CommError(f"rank {self.global_ranks[0]}: {what} on a closed self communicator")

    @staticmethod
    def _copy(src: np.ndarray, dst: np.ndarray, what: str) -> None:
        if src.size != dst.size:
            raise ProtocolError(
                f"{what}: a world of one needs equal send and receive sizes, got {src.size} "
                f"and {dst.size} elements"
            )
        dst[...] = src.reshape(dst.shape)

    def _peer(self, peer: int | None, what: str) -> None:
        if peer not in (None, 0):
            raise InvalidArgument(f"{what}: rank must be 0 in a world of one, got {peer}")

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        self._check("all_reduce")

    def all_gather(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._check("all_gather")
        self._copy(send, recv, "all_gather")

    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
        self._check("reduce_scatter")
        self._copy(send, recv, "reduce_scatter")

    def all_to_all(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._check("all_to_all")
        self._copy(send, recv, "all_to_all")

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self._check("broadcast")
        self._peer(root, "broadcast")

    def reduce(self, buf: np.ndarray, root: int, op: ReduceOp) -> None:
        self._check("reduce")
        self._peer(root, "reduce")

    def gather(self, send: np.ndarray, recv: np.ndarray | None, root: int) -> None:
        self._check("gather")
        self._peer(root, "gather")
        if recv is not None:
            self._copy(send, recv, "gather")

    def scatter(self, send: np.ndarray | None, recv: np.ndarray, root: int) -> None:
        self._check("scatter")
        self._peer(root, "scatter")
        if send is None:
            raise InvalidArgument("scatter: the root (rank 0) needs a send buffer")
        self._copy(send, recv, "scatter")

    def barrier(self) -> None:
        self._check("barrier")

    # -- point to point ------------------------------------------------------------------
    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        self._check("send")
        self._peer(dst, "send")
        self._mailbox.setdefault(tag, deque()).append(np.array(array, copy=True))

    def recv(self, src: int | None, tag: int) -> tuple[np.ndarray, int]:
        self._check("recv")
        self._peer(src, "recv")
        box = self._mailbox.get(tag)
        if not box:
            # Nothing else can ever send in a world of one: waiting would only delay the error.
            raise CommTimeout(
                f"recv: rank 0 waits for a message with tag {tag} that nobody sent (in a world "
                "of one only this process can send it, before the recv)"
            )
        return box.popleft(), 0

    def permute(self, send: np.ndarray, dst: int | None, recv: np.ndarray, src: int | None) -> None:
        self._check("permute")
        self._peer(dst, "permute")
        self._peer(src, "permute")
        if (dst is None) != (src is None):
            raise ProtocolError("permute: in a world of one, rank 0 sends to itself or not at all")
        if src is not None:
            self._copy(send, recv, "permute")

    # -- groups and lifetime -------------------------------------------------------------
    def sub(self, ranks: Sequence[int]) -> Communicator:
        self._check("sub")
        if list(ranks) != [0]:
            raise InvalidArgument(f"sub: a world of one has only rank 0, got ranks {list(ranks)}")
        return SelfCommunicator(self.timeout, self.global_ranks[0])

    def close(self) -> None:
        self._closed = True
        self._mailbox.clear()
