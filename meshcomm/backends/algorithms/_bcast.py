"""One-to-all and synchronizing collectives: broadcast and barrier.

Each function is one algorithm; :mod:`meshcomm.backends.algorithms` validates arguments and
picks which one runs.
"""

from __future__ import annotations

import numpy as np

from meshcomm.backends.algorithms._common import block_bounds, tree_children, tree_parent
from meshcomm.backends.algorithms._gather import ring_allgather_inplace
from meshcomm.backends.link import Link

__all__ = [
    "barrier_dissemination",
    "broadcast_binomial",
    "broadcast_chain",
    "broadcast_scatter_allgather",
]


def broadcast_binomial(link: Link, buf: np.ndarray, root: int) -> None:
    """Binomial tree: receive from the parent, then send to every child in one exchange."""
    p, r = link.size, link.rank
    v = (r - root) % p
    if v:
        link.exchange([], [((tree_parent(v) + root) % p, buf)])
    # Farthest child first: it heads the largest subtree.
    children = tree_children(v, p)[::-1]
    if children:
        link.exchange([((c + root) % p, buf) for c in children], [])


def broadcast_chain(link: Link, buf: np.ndarray, root: int, chunk: int) -> None:
    """Pipelined chain ``root -> root+1 -> ...``: forward chunk j-1 while receiving chunk j.

    Takes ``nchunks + size - 2`` chunk times instead of ``log2(size)`` whole-buffer times.
    """
    p, r = link.size, link.rank
    v = (r - root) % p
    prev, nxt = (r - 1) % p, (r + 1) % p
    has_prev, has_next = v > 0, v < p - 1
    count = buf.size
    nchunks = -(-count // chunk)
    for j in range(nchunks + 1):
        sends = []
        recvs = []
        if has_next and j > 0:
            sends.append((nxt, buf[(j - 1) * chunk : min(j * chunk, count)]))
        if has_prev and j < nchunks:
            recvs.append((prev, buf[j * chunk : min((j + 1) * chunk, count)]))
        if sends or recvs:
            link.exchange(sends, recvs)


def broadcast_scatter_allgather(link: Link, buf: np.ndarray, root: int) -> None:
    """Root scatters ``size`` uneven blocks (one exchange), then a ring all-gather."""
    p, r = link.size, link.rank
    bounds = block_bounds(buf.size, p)
    if r == root:
        sends = [(j, buf[bounds[j] : bounds[j + 1]]) for j in range(p) if j != root]
        link.exchange([m for m in sends if m[1].size], [])
    elif bounds[r + 1] > bounds[r]:
        link.exchange([], [(root, buf[bounds[r] : bounds[r + 1]])])
    ring_allgather_inplace(link, buf, bounds)


def barrier_dissemination(link: Link) -> None:
    """Dissemination barrier: ``ceil(log2 size)`` rounds of empty messages at distance 2**k."""
    p, r = link.size, link.rank
    token_out = np.empty(0, np.uint8)
    token_in = np.empty(0, np.uint8)
    dist = 1
    while dist < p:
        link.exchange([((r + dist) % p, token_out)], [((r - dist) % p, token_in)])
        dist <<= 1
