"""Point to point: ``send``, ``recv``, ``isend``, ``irecv``, ``P2POp``, ``batch_isend_irecv``.

The sender's dtype and shape travel with each message; a receive checks them against the
caller's tensor (same dtype and number of elements) before writing into it, where torch's
backends copy raw bytes (or abort the process, for a size mismatch).

Device tensors (cupy arrays, torch CUDA tensors other than bfloat16) in a world with a
device backend (``init_process_group("nccl")`` where cupy sees a GPU) go over it: a CUDA
tensor sent arrives over NCCL, and the receive copies it into the caller's tensor on the
device. Elsewhere they go through host memory.

Ordering: the operations of a group run one at a time in issue order (the group's
progress engine; groups progress independently). Sends complete once written (they never
wait for the matching receive), but a receive blocks the engine until its message arrives.
So that the common pattern "post ``irecv``, then ``isend``, then wait" works on every rank,
an ``irecv`` is *deferred*: it is issued when it is waited on (or tested), or when the next
operation other than a send is issued, whichever comes first; sends issued meanwhile go
first. Receives keep their
order among themselves, and a message is matched by (group, sender, tag) as in torch.

Example:
    >>> import numpy as np
    >>> import meshcomm.distributed as dist
    >>> dist.init_process_group(world_size=1, rank=0)
    >>> out = np.zeros(3)
    >>> reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, out, 0),
    ...                                dist.P2POp(dist.isend, np.arange(3.0), 0)])
    >>> [r.wait() for r in reqs]; out
    [True, True]
    array([0., 1., 2.])
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshcomm.distributed._errors import DistBackendError, public
from meshcomm.distributed._groups import canonical_rank
from meshcomm.distributed._pg import ProcessGroup
from meshcomm.distributed._state import STATE, resolve, warn_not_in_group
from meshcomm.distributed._tensors import Buffer, as_buffer, device_stream, dtype_text
from meshcomm.distributed._work import Work

__all__ = ["P2POp", "batch_isend_irecv", "fill_received", "irecv", "isend", "recv", "send"]


def fill_received(buf: Buffer, arr: np.ndarray, pg: ProcessGroup, source: int) -> None:
    """Write a received array into ``buf`` after checking dtype and size.

    Raises:
        DistBackendError: the message does not fit the tensor.
    """
    if arr.dtype != buf.dtype or arr.size != buf.numel:
        raise DistBackendError(
            f"recv: rank {pg.global_rank_of(pg.rank())} got {arr.size} elements of "
            f"{dtype_text(arr.dtype)} (shape {arr.shape}) from rank {pg.global_rank_of(source)}, "
            f"but {buf.name} holds {buf.numel} elements of {dtype_text(buf.dtype)} (shape "
            f"{buf.shape}); the sender's and receiver's tensors must match"
        )
    buf.write(arr)


def _send_target(tensor: Any, dst: Any, group: Any, group_dst: Any) -> tuple[ProcessGroup, int]:
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    return pg, canonical_rank(pg, dst, group_dst, "dst")


@public
def send(
    tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: Any = None
) -> None:
    """Send ``tensor`` to global rank ``dst`` (or group rank ``group_dst``) and wait.

    Args:
        tensor: a numpy array, torch tensor or cupy array.
        dst: destination rank in the world (whatever ``group`` is).
        group: the group to use (default: the default group).
        tag: matches the receiver's tag (a non-negative int below 2**31).
        group_dst: destination rank in ``group`` (instead of ``dst``).

    Raises:
        ValueError: ``dst`` is this rank, not in ``group``, or both/neither of ``dst`` and
            ``group_dst``; this rank is not in ``group``.
        TypeError: ``tensor`` is not an array or tensor.
        DistBackendError: the send failed.
    """
    buf = as_buffer(tensor, "tensor")
    pg, peer = _send_target(tensor, dst, group, group_dst)
    if peer == pg.rank():
        raise ValueError(
            "Invalid destination rank: destination rank should not be the same as the rank "
            "of the current process."
        )
    g = pg.mesh_group
    with device_stream(buf):
        g.send(buf.for_group(g), peer, tag)


@public
def isend(
    tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: Any = None
) -> Work | None:
    """Send ``tensor`` asynchronously; ``tensor`` is copied now, so it may be reused at once.

    Returns:
        A :class:`Work`; None if this rank is not in ``group``.
    """
    buf = as_buffer(tensor, "tensor")
    pg = resolve(group)
    if pg is None:
        warn_not_in_group("isend")
        return None
    peer = canonical_rank(pg, dst, group_dst, "dst")
    g = pg.mesh_group
    with device_stream(buf):
        inner = g.send(buf.for_group(g), peer, tag, async_op=True)
    return Work("isend", [tensor]).attach([inner])


def _recv_source(pg: ProcessGroup, src: Any, group_src: Any) -> int | None:
    if src is None and group_src is None:
        return None
    return canonical_rank(pg, src, group_src, "src")


@public
def irecv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: Any = None
) -> Work | None:
    """Receive into ``tensor`` asynchronously (from any rank if ``src`` is None).

    The receive is issued when first waited on or when the next non-send operation is
    issued (see the module docstring).

    Returns:
        A :class:`Work` (``source_rank()`` gives the sender's group rank); None if this rank
        is not in ``group``.
    """
    buf = as_buffer(tensor, "tensor")
    buf.check_writable()
    pg = resolve(group)
    if pg is None:
        warn_not_in_group("irecv")
        return None
    peer = _recv_source(pg, src, group_src)
    work = Work("irecv", [tensor])

    def finish(results: list[Any]) -> None:
        arr, source = results[0]
        work._source = source
        fill_received(buf, arr, pg, source)

    work._finish = finish
    work.defer(lambda: [pg.mesh_group.recv(peer, tag, return_source=True, async_op=True)])
    STATE.pending.append(work)
    return work


@public
def recv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: Any = None
) -> int:
    """Receive into ``tensor`` (from any rank if ``src`` and ``group_src`` are None).

    Returns:
        The sender's global rank; -1 if this rank is not in ``group``.

    Raises:
        DistBackendError: the message does not fit ``tensor`` (dtype or size), or the
            receive failed or timed out.
    """
    buf = as_buffer(tensor, "tensor")
    buf.check_writable()
    pg = resolve(group)
    if pg is None:
        warn_not_in_group("irecv")
        return -1
    peer = _recv_source(pg, src, group_src)
    STATE.flush()
    with device_stream(buf):  # a device array sent arrives as one, ordered on this stream
        arr, source = pg.mesh_group.recv(peer, tag, return_source=True)
    fill_received(buf, arr, pg, source)
    return pg.global_rank_of(source)


class P2POp:
    """One send or receive for :func:`batch_isend_irecv`.

    Args:
        op: :func:`isend` or :func:`irecv`.
        tensor: the tensor to send or receive into.
        peer: the other rank, in the world.
        group: the group (default: the default group).
        tag: the tag.
        group_peer: the other rank in ``group`` (instead of ``peer``).

    Raises:
        ValueError: ``op`` is neither function, bad peer.
        TypeError: ``tensor`` is not an array or tensor.
    """

    def __init__(
        self,
        op: Any,
        tensor: Any,
        peer: int | None = None,
        group: Any = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        if op is not isend and op is not irecv:
            raise ValueError(
                "Invalid ``op``. Expected ``op`` to be of type ``meshcomm.distributed.isend`` "
                "or ``meshcomm.distributed.irecv``."
            )
        as_buffer(tensor, "tensor")
        self.op = op
        self.tensor = tensor
        self.tag = tag
        pg = resolve(group)
        if pg is None:
            raise ValueError("Invalid process group specified")
        self.group = pg
        self.group_peer = canonical_rank(pg, peer, group_peer, "peer")
        self.peer = pg.global_rank_of(self.group_peer)

    def __repr__(self) -> str:
        return (
            f"P2POp({self.op.__name__} pg={self.group.group_name}, peer={self.peer}, "
            f"tag={self.tag})"
        )


@public
def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Issue a batch of sends and receives; return their Works in list order.

    The order of sends and receives in the list does not matter (sends are issued first);
    several messages between the same pair of ranks in the same direction match in order.

    Raises:
        ValueError: not a list of :class:`P2POp`, or ops on different groups.
    """
    if (
        not isinstance(p2p_op_list, list)
        or not p2p_op_list
        or not all(isinstance(p, P2POp) for p in p2p_op_list)
    ):
        raise ValueError(
            "Invalid ``p2p_op_list``. Each op is expected to to be of type "
            "``meshcomm.distributed.P2POp``."
        )
    first = p2p_op_list[0].group
    if not all(p.group is first for p in p2p_op_list):
        raise ValueError("All ops need to use the same group.")
    works: list[Work | None] = [None] * len(p2p_op_list)
    for i, p in enumerate(p2p_op_list):
        if p.op is isend:
            works[i] = isend(p.tensor, group=p.group, tag=p.tag, group_dst=p.group_peer)
    for i, p in enumerate(p2p_op_list):
        if p.op is irecv:
            works[i] = irecv(p.tensor, group=p.group, tag=p.tag, group_src=p.group_peer)
    STATE.flush()
    return [w for w in works if w is not None]
