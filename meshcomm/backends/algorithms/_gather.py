"""Data-movement collectives: all_gather, gather, scatter, all_to_all (no arithmetic).

Each function is one algorithm; :mod:`meshcomm.backends.algorithms` validates arguments and
picks which one runs. Buffers are flat C-contiguous arrays; ``send`` never overlaps ``recv``.
"""

from __future__ import annotations

import numpy as np

from meshcomm.backends.algorithms._common import (
    rel_pieces,
    scratch,
    subtree_size,
    tree_children,
    tree_parent,
    wrap_ranges,
)
from meshcomm.backends.link import Link
from meshcomm.errors import InvalidArgument

__all__ = [
    "all_gather_bruck",
    "all_gather_recursive_doubling",
    "all_gather_ring",
    "all_to_all_linear",
    "all_to_all_pairwise",
    "gather_binomial",
    "gather_linear",
    "ring_allgather_inplace",
    "scatter_binomial",
    "scatter_linear",
]

Message = tuple[int, np.ndarray]


def _no_buffer(name: str, which: str, rank: int) -> InvalidArgument:
    return InvalidArgument(f"rank {rank}: {name} root needs a {which} buffer, got None")


def ring_allgather_inplace(link: Link, buf: np.ndarray, bounds: list[int]) -> None:
    """Ring all-gather of uneven blocks: rank r holds ``buf[bounds[r]:bounds[r+1]]`` on entry.

    Step s sends block ``r - s`` right and receives block ``r - s - 1`` from the left, straight
    into place: ``size - 1`` exchanges, each moving one block each way.
    """
    p, r = link.size, link.rank
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        sb, rb = (r - s) % p, (r - s - 1) % p
        sends = [(right, buf[bounds[sb] : bounds[sb + 1]])] if bounds[sb + 1] > bounds[sb] else []
        recvs = [(left, buf[bounds[rb] : bounds[rb + 1]])] if bounds[rb + 1] > bounds[rb] else []
        if sends or recvs:
            link.exchange(sends, recvs)


def all_gather_ring(link: Link, send: np.ndarray, recv: np.ndarray) -> None:
    """Ring all-gather: ``size - 1`` neighbour steps; bandwidth-optimal, latency linear."""
    n, p, r = send.size, link.size, link.rank
    np.copyto(recv[r * n : (r + 1) * n], send)
    ring_allgather_inplace(link, recv, [i * n for i in range(p + 1)])


def all_gather_recursive_doubling(link: Link, send: np.ndarray, recv: np.ndarray) -> None:
    """Recursive doubling all-gather, with a fold for world sizes that are not powers of two.

    With ``p = 2**k + e``, the first ``2e`` ranks pair up: each even one hands its block to its
    odd neighbour, sits out, and receives the whole result at the end. The remaining ``2**k``
    ranks double what they hold each step; what one holds is always a contiguous rank range.
    """
    n, p, r = send.size, link.size, link.rank
    np.copyto(recv[r * n : (r + 1) * n], send)
    p2 = 1 << (p.bit_length() - 1)
    extra = p - p2

    def first_old(j: int) -> int:
        return 2 * j if j < extra else j + extra

    def end_old(j: int) -> int:
        return 2 * j + 2 if j < extra else j + extra + 1

    if r < 2 * extra:
        if r % 2 == 0:
            link.exchange([(r + 1, recv[r * n : (r + 1) * n])], [])
            link.exchange([], [(r + 1, recv)])
            return
        link.exchange([], [(r - 1, recv[(r - 1) * n : r * n])])
        new = r // 2
    else:
        new = r - extra
    mask = 1
    while mask < p2:
        partner = new ^ mask
        peer = 2 * partner + 1 if partner < extra else partner + extra
        mine, theirs = new & ~(mask - 1), partner & ~(mask - 1)
        link.exchange(
            [(peer, recv[first_old(mine) * n : end_old(mine + mask - 1) * n])],
            [(peer, recv[first_old(theirs) * n : end_old(theirs + mask - 1) * n])],
        )
        mask <<= 1
    if r < 2 * extra:
        link.exchange([(r - 1, recv)], [])


def all_gather_bruck(link: Link, send: np.ndarray, recv: np.ndarray) -> None:
    """Bruck all-gather: ``ceil(log2 size)`` steps at any world size, no final rotation.

    After the step with distance d, rank r holds blocks ``r .. r + 2d - 1`` (mod size). Blocks
    are kept at their final rank-ordered place, so a range that wraps past the last rank
    travels as two messages; sender and receiver split it at the same place.
    """
    n, p, r = send.size, link.size, link.rank
    np.copyto(recv[r * n : (r + 1) * n], send)
    dist = 1
    while dist < p:
        cnt = min(dist, p - dist)
        dst, src = (r - dist) % p, (r + dist) % p
        link.exchange(
            [(dst, recv[a * n : b * n]) for a, b in wrap_ranges(r, cnt, p)],
            [(src, recv[a * n : b * n]) for a, b in wrap_ranges(src, cnt, p)],
        )
        dist <<= 1


def gather_linear(link: Link, send: np.ndarray, recv: np.ndarray | None, root: int) -> None:
    """Every rank sends its block straight to root, which posts all receives at once."""
    n, p, r = send.size, link.size, link.rank
    if r != root:
        link.exchange([(root, send)], [])
        return
    if recv is None:
        raise _no_buffer("gather", "recv", r)
    np.copyto(recv[r * n : (r + 1) * n], send)
    link.exchange([], [(j, recv[j * n : (j + 1) * n]) for j in range(p) if j != root])


def scatter_linear(link: Link, send: np.ndarray | None, recv: np.ndarray, root: int) -> None:
    """Root sends block j straight to rank j, all sends posted at once."""
    n, p, r = recv.size, link.size, link.rank
    if r != root:
        link.exchange([], [(root, recv)])
        return
    if send is None:
        raise _no_buffer("scatter", "send", r)
    peers = [(root + i) % p for i in range(1, p)]
    link.exchange([(j, send[j * n : (j + 1) * n]) for j in peers], [])
    np.copyto(recv, send[r * n : (r + 1) * n])


def _pieces_into(
    peer: int, buf: np.ndarray, lo: int, hi: int, base: int | None, root: int, p: int, n: int
) -> list[Message]:
    """Messages for the relative blocks ``[lo, hi)`` of ``buf``, one per wrap-free piece.

    ``base`` is the relative rank of the block at the start of ``buf`` (a forwarding rank's
    subtree buffer); None means ``buf`` is rank-ordered (the root's own buffer), where relative
    block v lives at absolute place ``(v + root) % p``.
    """
    out = []
    for a, b in rel_pieces(lo, hi, root, p):
        start = (a + root) % p if base is None else a - base
        out.append((peer, buf[start * n : (start + b - a) * n]))
    return out


def gather_binomial(link: Link, send: np.ndarray, recv: np.ndarray | None, root: int) -> None:
    """Binomial-tree gather: ``ceil(log2 size)`` rounds; inner ranks forward their subtree."""
    n, p, r = send.size, link.size, link.rank
    v = (r - root) % p
    children = tree_children(v, p)
    if v == 0:
        if recv is None:
            raise _no_buffer("gather", "recv", r)
        np.copyto(recv[r * n : (r + 1) * n], send)
        recvs: list[Message] = []
        for c in children:
            peer = (c + root) % p
            recvs += _pieces_into(peer, recv, c, c + subtree_size(c, p), None, root, p, n)
        link.exchange([], recvs)
        return
    parent = (tree_parent(v) + root) % p
    if not children:
        link.exchange([(parent, send)], [])
        return
    mine = subtree_size(v, p)
    (tmp,) = scratch(link, send.dtype, mine * n)
    np.copyto(tmp[:n], send)
    recvs = []
    for c in children:
        recvs += _pieces_into((c + root) % p, tmp, c, c + subtree_size(c, p), v, root, p, n)
    link.exchange([], recvs)
    link.exchange(_pieces_into(parent, tmp, v, v + mine, v, root, p, n), [])


def scatter_binomial(link: Link, send: np.ndarray | None, recv: np.ndarray, root: int) -> None:
    """Binomial-tree scatter: the mirror of :func:`gather_binomial`."""
    n, p, r = recv.size, link.size, link.rank
    v = (r - root) % p
    # Farthest child first: it heads the largest subtree, so it should start forwarding soonest.
    children = tree_children(v, p)[::-1]
    if v == 0:
        if send is None:
            raise _no_buffer("scatter", "send", r)
        sends: list[Message] = []
        for c in children:
            peer = (c + root) % p
            sends += _pieces_into(peer, send, c, c + subtree_size(c, p), None, root, p, n)
        link.exchange(sends, [])
        np.copyto(recv, send[r * n : (r + 1) * n])
        return
    parent = (tree_parent(v) + root) % p
    if not children:
        link.exchange([], [(parent, recv)])
        return
    mine = subtree_size(v, p)
    (tmp,) = scratch(link, recv.dtype, mine * n)
    link.exchange([], _pieces_into(parent, tmp, v, v + mine, v, root, p, n))
    sends = []
    for c in children:
        sends += _pieces_into((c + root) % p, tmp, c, c + subtree_size(c, p), v, root, p, n)
    link.exchange(sends, [])
    np.copyto(recv, tmp[:n])


def all_to_all_pairwise(link: Link, send: np.ndarray, recv: np.ndarray) -> None:
    """Pairwise exchange: step i sends to ``rank + i`` and receives from ``rank - i``."""
    p, r = link.size, link.rank
    n = send.size // p
    np.copyto(recv[r * n : (r + 1) * n], send[r * n : (r + 1) * n])
    for i in range(1, p):
        dst, src = (r + i) % p, (r - i) % p
        link.exchange(
            [(dst, send[dst * n : (dst + 1) * n])], [(src, recv[src * n : (src + 1) * n])]
        )


def all_to_all_linear(link: Link, send: np.ndarray, recv: np.ndarray) -> None:
    """All ``size - 1`` sends and receives posted in one exchange: one round of latency."""
    p, r = link.size, link.rank
    n = send.size // p
    np.copyto(recv[r * n : (r + 1) * n], send[r * n : (r + 1) * n])
    peers = [(r + i) % p for i in range(1, p)]
    link.exchange(
        [(j, send[j * n : (j + 1) * n]) for j in peers],
        [(j, recv[j * n : (j + 1) * n]) for j in peers],
    )
