"""Reducing collectives: all_reduce, reduce_scatter, reduce.

Each function is one algorithm; :mod:`meshcomm.backends.algorithms` validates arguments and
picks which one runs. Combines go through :func:`meshcomm.reduction.combine` or
:func:`~meshcomm.backends.algorithms._common.combine_into` (a numpy ufunc
writing in place), on chunks of at most ``chunk`` elements where an algorithm pipelines.

Reproducibility: every all_reduce result element is either computed once and then copied to
every rank (ring), or computed on every rank by the same sequence of combines with the operands
in the same order (recursive doubling puts the lower rank's operand first), so all ranks end
with bitwise identical bytes, NaN payloads and signed zeros included.
"""

from __future__ import annotations

import numpy as np

from meshcomm.backends.algorithms._common import (
    block_bounds,
    combine_into,
    scratch,
    tree_children,
    tree_parent,
)
from meshcomm.backends.algorithms._gather import ring_allgather_inplace
from meshcomm.backends.link import Link
from meshcomm.reduction import ReduceOp, combine

__all__ = [
    "all_reduce_recursive_doubling",
    "all_reduce_ring",
    "reduce_binomial",
    "reduce_reduce_scatter_gather",
    "reduce_scatter_linear",
    "reduce_scatter_ring",
    "ring_reduce_scatter_inplace",
]


def all_reduce_recursive_doubling(
    link: Link, buf: np.ndarray, op: ReduceOp, send: np.ndarray | None = None
) -> None:
    """Recursive doubling: ``log2`` steps of whole-buffer swaps with partner ``rank ^ 2**k``.

    For ``p = 2**k + e`` ranks the first ``2e`` pair up: the even one sends its buffer to its
    odd neighbour before the doubling and receives the result after it. Each step receives
    into one scratch buffer and combines into ``buf`` in place (operands in rank order, so
    every rank computes the same bytes): no copy at the end. With ``send`` (out of place),
    the contribution is read from ``send`` until the first combine has written ``buf``.
    """
    p, r = link.size, link.rank
    p2 = 1 << (p.bit_length() - 1)
    extra = p - p2
    mine = buf if send is None else send  # this rank's partial result so far
    if r < 2 * extra and r % 2 == 0:
        link.exchange([(r + 1, mine)], [])
        link.exchange([], [(r + 1, buf)])
        return
    (spare,) = scratch(link, buf.dtype, buf.size)
    if r < 2 * extra:
        link.exchange([], [(r - 1, spare)])
        combine_into(op, spare, mine, buf)  # the even (lower) rank's operand first
        mine = buf
        new = r // 2
    else:
        new = r - extra
    mask = 1
    while mask < p2:  # at least one step: p >= 2 here
        partner = new ^ mask
        peer = 2 * partner + 1 if partner < extra else partner + extra
        link.exchange([(peer, mine)], [(peer, spare)])
        if new < partner:
            combine_into(op, mine, spare, buf)
        else:
            combine_into(op, spare, mine, buf)
        mine = buf
        mask <<= 1
    if r < 2 * extra:
        link.exchange([(r - 1, buf)], [])


def ring_reduce_scatter_inplace(
    link: Link,
    buf: np.ndarray,
    bounds: list[int],
    op: ReduceOp,
    chunk: int,
    send: np.ndarray | None = None,
) -> None:
    """Ring reduce-scatter in place: afterwards rank r's block of ``buf`` holds the reduction.

    Blocks are ``buf[bounds[b]:bounds[b+1]]``; other blocks are left holding partial results
    (and, with ``send``, block ``r - 1`` is left unwritten). The loop is chunk-major: each
    chunk goes round the ring before the next starts, so the receive scratch is one chunk and
    stays in cache while it is combined, straight into ``buf`` (``ufunc(..., out=)``, no
    temporary). With ``send`` (out of place) this rank's contributions are read from
    ``send``: each block's one combine on this rank reads ``send`` and writes ``buf``.
    """
    p, r = link.size, link.rank
    right, left = (r + 1) % p, (r - 1) % p
    largest = bounds[1] - bounds[0]
    own = buf if send is None else send
    (tmp,) = scratch(link, buf.dtype, min(chunk, largest))
    for off in range(0, largest, chunk):
        for s in range(p - 1):
            sb, rb = (r - s - 1) % p, (r - s - 2) % p
            s0 = bounds[sb] + off
            s1 = min(s0 + chunk, bounds[sb + 1])
            r0 = bounds[rb] + off
            r1 = min(r0 + chunk, bounds[rb + 1])
            # Step 0 forwards this rank's own contribution; later steps forward the block
            # combined at the step before.
            outgoing = own if s == 0 else buf
            sends = [(right, outgoing[s0:s1])] if s1 > s0 else []
            if r1 > r0:
                piece = tmp[: r1 - r0]
                link.exchange(sends, [(left, piece)])
                combine_into(op, own[r0:r1], piece, buf[r0:r1])
            elif sends:
                link.exchange(sends, [])


def all_reduce_ring(
    link: Link, buf: np.ndarray, op: ReduceOp, chunk: int, send: np.ndarray | None = None
) -> None:
    """Ring all-reduce: pipelined ring reduce-scatter, then ring all-gather of the blocks."""
    bounds = block_bounds(buf.size, link.size)
    ring_reduce_scatter_inplace(link, buf, bounds, op, chunk, send)
    ring_allgather_inplace(link, buf, bounds)


def reduce_scatter_ring(
    link: Link, send: np.ndarray, recv: np.ndarray, op: ReduceOp, chunk: int
) -> None:
    """Ring reduce-scatter that leaves ``send`` untouched, pipelined in chunks.

    A chunk's running partial lives in one of two chunk-sized scratch arrays; each step sends
    one while receiving into the other, then folds this rank's contribution into the received
    one. The last step receives straight into ``recv``.
    """
    p, r = link.size, link.rank
    n = recv.size
    right, left = (r + 1) % p, (r - 1) % p
    width = min(chunk, n)
    a_buf, b_buf = scratch(link, send.dtype, width, width)
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        partial, spare = a_buf[: c1 - c0], b_buf[: c1 - c0]
        for s in range(p - 1):
            sb, rb = (r - s - 1) % p, (r - s - 2) % p
            outgoing = send[sb * n + c0 : sb * n + c1] if s == 0 else partial
            incoming = recv[c0:c1] if s == p - 2 else spare
            link.exchange([(right, outgoing)], [(left, incoming)])
            combine(op, incoming, send[rb * n + c0 : rb * n + c1])
            partial, spare = incoming, partial


def reduce_scatter_linear(link: Link, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
    """Every rank sends block j to rank j in one exchange, then combines in rank order."""
    p, r = link.size, link.rank
    n = recv.size
    (tmp,) = scratch(link, send.dtype, (p - 1) * n)
    peers = [(r + i) % p for i in range(1, p)]
    slot = {j: tmp[i * n : (i + 1) * n] for i, j in enumerate(peers)}
    slot[r] = send[r * n : (r + 1) * n]
    link.exchange([(j, send[j * n : (j + 1) * n]) for j in peers], [(j, slot[j]) for j in peers])
    # In rank order, the first combine writing straight into recv (no copy of slot 0).
    combine_into(op, slot[0], slot[1], recv)
    for j in range(2, p):
        combine(op, recv, slot[j])


def reduce_binomial(link: Link, buf: np.ndarray, root: int, op: ReduceOp) -> None:
    """Binomial-tree reduce: receive every child's partial at once, combine, pass to parent."""
    p, r = link.size, link.rank
    v = (r - root) % p
    children = tree_children(v, p)
    if children:
        parts = scratch(link, buf.dtype, *([buf.size] * len(children)))
        link.exchange([], [((c + root) % p, t) for c, t in zip(children, parts, strict=True)])
        for part in parts:
            combine(op, buf, part)
    if v:
        link.exchange([((tree_parent(v) + root) % p, buf)], [])


def reduce_reduce_scatter_gather(
    link: Link, buf: np.ndarray, root: int, op: ReduceOp, chunk: int
) -> None:
    """Ring reduce-scatter in place, then every rank sends its reduced block to root."""
    p, r = link.size, link.rank
    bounds = block_bounds(buf.size, p)
    ring_reduce_scatter_inplace(link, buf, bounds, op, chunk)
    if r == root:
        recvs = [(j, buf[bounds[j] : bounds[j + 1]]) for j in range(p) if j != root]
        link.exchange([], [m for m in recvs if m[1].size])
    elif bounds[r + 1] > bounds[r]:
        link.exchange([(root, buf[bounds[r] : bounds[r + 1]])], [])
