"""Host-aware collectives: shared memory inside each host, one flow per rank slice across.

A group that spans several hosts, with more than one rank on some host, moves fewer bytes
over the host links when each collective runs in three phases instead of one flat ring:

* ``all_reduce``: reduce-scatter inside every host (local rank i ends with the host's
  partial sum of slice i), all-reduce of each slice across hosts among the ranks that own
  it (one per host), all-gather inside every host. Each host sends ``2 (k-1)/k`` of the
  buffer over its link for ``k`` hosts (a flat ring over 2 hosts x 2 ranks sends 1.5x the
  buffer over each of two host crossings: 3x in all, against 2x here).
* ``broadcast``: root scatters its buffer inside its host, each slice is broadcast across
  hosts among its owners, then all-gather inside every host.
* ``all_gather``: every rank sends its block once to one rank of each other host, then
  every rank hands what it holds to its host's other ranks.
* ``reduce_scatter``: inside each host, one rank reduces the host's contributions to each
  destination's block; it sends that partial to the destination, once per other host.

Hosts are given as a layout: one tuple of communicator ranks per host (see
:func:`host_layout`); every rank must pass the same layout. Hosts may hold different
numbers of ranks (2 + 1): each host splits the buffer into as many slices as it has ranks,
and the cross-host step runs once per *segment* (a piece of the buffer that one rank of
each host owns), so the slicing of one host never has to match another's. With equal hosts
the segments are the slices and every rank takes part in exactly one cross-host step.

The phases run over the same :class:`~meshcomm.backends.link.Link` as every algorithm,
through :class:`SubLink` views of a subset of its ranks; on the tcp backend peers on one
host talk over their shared-memory rings, so only the cross-host step touches sockets.
Every element of an ``all_reduce`` result is combined on one rank and copied to the
others, so all ranks end with the same bytes.

Example:
    >>> import numpy as np
    >>> from meshcomm.backends.memlink import run_threads
    >>> hosts = host_layout([0, 0, 1])  # ranks 0 and 1 share a host; rank 2 is alone
    >>> def fn(link):
    ...     buf = np.arange(5.0) * (link.rank + 1)
    ...     all_reduce(link, buf, "sum", hosts)
    ...     return buf.tolist()
    >>> run_threads(3, fn)[2]
    [0.0, 6.0, 12.0, 18.0, 24.0]
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from meshcomm.backends import algorithms
from meshcomm.backends.algorithms._common import block_bounds, combine_into, scratch
from meshcomm.backends.link import Link
from meshcomm.errors import InvalidArgument
from meshcomm.reduction import ReduceOp

__all__ = [
    "MAX_PIECES",
    "PIECE_BYTES",
    "Layout",
    "SubLink",
    "all_gather",
    "all_reduce",
    "broadcast",
    "host_layout",
    "reduce_scatter",
    "worth_it",
]

#: Hosts of equal rank counts pipeline their all_reduce in pieces of about this many bytes
#: per slice (128 KiB: big enough that a piece's per-message costs stay small, small enough
#: that filling and draining the four-stage pipeline costs little). Measured with
#: ``bench/hierarchy.py --piece-kib`` on 1 Gbit/s links: 32 KiB to 1 MiB within noise on
#: 2 hosts x 2 ranks; on 4 x 2 at 64 MiB, 128 KiB 865 ms against 886-903 ms (512 KiB,
#: 1 MiB) and 894 ms (32 KiB); see docs/benchmarks.md.
PIECE_BYTES = 1 << 17
#: ... and in at most this many pieces per slice.
MAX_PIECES = 64

#: One tuple of communicator ranks per host, hosts ordered by their lowest rank.
Layout = tuple[tuple[int, ...], ...]


def host_layout(keys: Sequence[Hashable]) -> Layout:
    """Group ranks by host: ``keys[r]`` names rank r's host (equal keys: same host).

    Hosts come in the order of their lowest rank, ranks in rank order, so every rank that
    sees the same keys builds the same layout.

    Example:
        >>> host_layout(["b", "a", "b", "a"])
        ((0, 2), (1, 3))
    """
    hosts: dict[Hashable, list[int]] = {}
    for rank, key in enumerate(keys):
        hosts.setdefault(key, []).append(rank)
    return tuple(tuple(ranks) for ranks in hosts.values())


def worth_it(hosts: Layout) -> bool:
    """Whether the hierarchy can save bytes: more than one host, and some host holds more
    than one rank (with one rank per host the flat algorithms already cross each link once).

    Example:
        >>> worth_it(((0, 1), (2,))), worth_it(((0,), (1,))), worth_it(((0, 1),))
        (True, False, False)
    """
    return len(hosts) > 1 and any(len(h) > 1 for h in hosts)


class SubLink:
    """A :class:`~meshcomm.backends.link.Link` over some ranks of another link.

    Rank ``i`` of the view is rank ``members[i]`` of ``parent``; messages travel over the
    parent, so they keep its per-pair order with everything else the parent carries.

    Args:
        parent: the link of the whole communicator.
        members: the parent ranks in this view, in view-rank order; holds ``parent.rank``.
    """

    def __init__(self, parent: Link, members: Sequence[int]) -> None:
        self.parent = parent
        self.members = tuple(members)
        self.rank = self.members.index(parent.rank)
        self.size = len(self.members)

    def exchange(
        self,
        sends: Sequence[tuple[int, np.ndarray]],
        recvs: Sequence[tuple[int, np.ndarray]],
    ) -> None:
        """:meth:`Link.exchange <meshcomm.backends.link.Link.exchange>` with view ranks."""
        m = self.members
        self.parent.exchange([(m[p], b) for p, b in sends], [(m[p], b) for p, b in recvs])


class _Plan:
    """What one rank does in a hierarchical collective over ``count`` elements."""

    def __init__(self, rank: int, hosts: Layout, count: int) -> None:
        self.hosts = hosts
        self.host = next(h for h, members in enumerate(hosts) if rank in members)
        self.local = hosts[self.host]
        self.index = self.local.index(rank)
        # bounds[h]: how host h slices the buffer, one slice per local rank.
        self.bounds = [block_bounds(count, len(members)) for members in hosts]
        cuts = sorted({b for bounds in self.bounds for b in bounds})
        # Segments this rank owns: (lo, hi, the owner on each host). Every owner walks its
        # segments in the same (ascending) order, so the cross-host steps cannot deadlock.
        self.segments: list[tuple[int, int, tuple[int, ...]]] = []
        for lo, hi in itertools.pairwise(cuts):
            owners = tuple(
                members[_slice_of(lo, bounds)]
                for members, bounds in zip(hosts, self.bounds, strict=True)
            )
            if rank in owners:
                self.segments.append((lo, hi, owners))

    def my_slice(self) -> tuple[int, int]:
        bounds = self.bounds[self.host]
        return bounds[self.index], bounds[self.index + 1]

    def local_peers(self) -> list[tuple[int, int, int]]:
        """(rank, lo, hi) of every other rank on this host, from the next one round."""
        n, i, bounds = len(self.local), self.index, self.bounds[self.host]
        out = []
        for k in range(1, n):
            j = (i + k) % n
            out.append((self.local[j], bounds[j], bounds[j + 1]))
        return out


def _slice_of(position: int, bounds: list[int]) -> int:
    # The slice holding element ``position`` (slices may be empty: take the last that starts
    # at or before it and is not empty).
    for j in range(len(bounds) - 1):
        if bounds[j] <= position < bounds[j + 1]:
            return j
    raise AssertionError("position outside the buffer")  # internal: segments lie inside


def _local_reduce_scatter(
    link: Link, plan: _Plan, own: np.ndarray, out: np.ndarray, op: ReduceOp
) -> None:
    """``out[my slice] = op over this host's ranks of own[my slice]``."""
    lo, hi = plan.my_slice()
    peers = plan.local_peers()
    if not peers or hi == lo:
        if own is not out:
            np.copyto(out[lo:hi], own[lo:hi])
        # Still send our parts of the other slices.
        sends = [(p, own[a:b]) for p, a, b in peers if b > a]
        if sends:
            link.exchange(sends, [])
        return
    tmps = scratch(link, out.dtype, *([hi - lo] * len(peers)))
    sends = [(p, own[a:b]) for p, a, b in peers if b > a]
    link.exchange(sends, [(p, t) for (p, _, _), t in zip(peers, tmps, strict=True)])
    first = own[lo:hi]
    acc = out[lo:hi]
    for t in tmps:
        combine_into(op, first, t, acc)
        first = acc


def _local_all_gather(link: Link, plan: _Plan, buf: np.ndarray) -> None:
    """Every rank of this host sends its slice of ``buf`` to the others."""
    lo, hi = plan.my_slice()
    peers = plan.local_peers()
    if not peers:
        return
    sends = [(p, buf[lo:hi]) for p, _, _ in peers] if hi > lo else []
    recvs = [(p, buf[a:b]) for p, a, b in peers if b > a]
    if sends or recvs:
        link.exchange(sends, recvs)


# SubLinks by parent link and owners: kept so that the algorithms' scratch cache (keyed by
# link) survives from call to call. A communicator uses a few owner sets at most.
_VIEWS: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], SubLink]] = weakref.WeakKeyDictionary()


def _cross(link: Link, owners: tuple[int, ...]) -> SubLink:
    try:
        per_link = _VIEWS.setdefault(link, {})
    except TypeError:  # a link that cannot be weakly referenced: no cache
        return SubLink(link, owners)
    view = per_link.get(owners)
    if view is None:
        view = per_link[owners] = SubLink(link, owners)
    return view


def _check(link: Link, where: str, buf: np.ndarray, hosts: Layout) -> None:
    algorithms._check_array(link.rank, where, "buf", buf, writable=True)
    _check_layout(link, where, hosts)


def _check_layout(link: Link, where: str, hosts: Layout) -> None:
    ranks = sorted(r for members in hosts for r in members)
    if ranks != list(range(link.size)):
        raise InvalidArgument(
            f"rank {link.rank}: {where} hosts must hold each of the {link.size} ranks once, "
            f"got {[list(h) for h in hosts]}"
        )


def all_reduce(
    link: Link,
    buf: np.ndarray,
    op: ReduceOp | str,
    hosts: Layout,
    *,
    send: np.ndarray | None = None,
) -> None:
    """Reduce ``buf`` across all ranks in three phases (see the module docstring).

    Args:
        link: this rank's link.
        buf: the local contribution, overwritten by the result (with ``send``: only the
            result).
        op: a primitive reduce op (or its name) defined for the dtype.
        hosts: the host layout (:func:`host_layout`), the same on every rank.
        send: the local contribution for an out-of-place call (left untouched).

    Raises:
        InvalidArgument: bad buffer, op or layout (before any I/O).
        TypeError: ``op`` is not defined for the dtype, or ``send`` has another dtype.
        CommTimeout, PeerError: from the link.
    """
    r = link.rank
    _check(link, "all_reduce", buf, hosts)
    if send is not None:
        algorithms._check_array(r, "all_reduce", "send", send, writable=False)
        algorithms._check_same_dtype(r, "all_reduce", send, buf)
        if send.size != buf.size:
            raise InvalidArgument(
                f"rank {r}: all_reduce send and buf sizes differ: {send.size} and {buf.size}"
            )
        send = algorithms._detach(send, buf) if send is not buf else None
    rop = algorithms._check_op(r, "all_reduce", op, buf.dtype)
    if buf.size == 0:
        return
    own = buf if send is None else send
    plan = _Plan(r, hosts, buf.size)
    if len({len(members) for members in hosts}) == 1:
        _pipelined_all_reduce(link, plan, own, buf, rop)
        return
    _local_reduce_scatter(link, plan, own, buf, rop)
    for lo, hi, owners in plan.segments:
        algorithms.all_reduce(_cross(link, owners), buf[lo:hi], rop)
    _local_all_gather(link, plan, buf)


def _pieces(count: int, itemsize: int) -> int:
    """How many pieces a slice of ``count`` elements is pipelined in (see PIECE_BYTES)."""
    return max(1, min(MAX_PIECES, count * itemsize // PIECE_BYTES))


def _pipelined_all_reduce(
    link: Link, plan: _Plan, own: np.ndarray, buf: np.ndarray, op: ReduceOp
) -> None:
    """All-reduce over hosts of equal rank counts, the phases overlapped piece by piece.

    Local rank i of every host owns slice i; each slice is cut into the same number of
    pieces, and each piece of slice i into one block per host. Step s of the loop posts, in
    one exchange: the local reduce-scatter of piece s (this host's contributions to every
    slice's piece s), the cross-host reduce-scatter of piece s - 1 (block g of this rank's
    piece to the owner of slice i on host g), the cross-host all-gather of piece s - 2 and
    the local all-gather of piece s - 3. So the link carries piece s - 1 while shared memory
    carries pieces s and s - 3, and the combines of one step run while nothing waits on them
    but the next step. Each element is combined on one rank (its slice's owner, then its
    block's owner) and copied everywhere: every rank ends with the same bytes.
    """
    n, i, k, g = len(plan.local), plan.index, len(plan.hosts), plan.host
    slices = plan.bounds[g]
    count = slices[1] - slices[0]  # the largest slice (block_bounds puts it first)
    pieces = _pieces(count, buf.itemsize)
    # piece_bounds[j][t]: piece t of slice j, as absolute element offsets.
    piece_bounds = [
        [slices[j] + b for b in block_bounds(slices[j + 1] - slices[j], pieces)] for j in range(n)
    ]
    mine = piece_bounds[i]
    largest = mine[1] - mine[0] if pieces else 0
    peers = [((i + d) % n, plan.local[(i + d) % n]) for d in range(1, n)]
    owners = [(h, members[i]) for h, members in enumerate(plan.hosts) if h != g]
    block_max = -(-max(piece_bounds[0][1] - piece_bounds[0][0], 1) // k)
    tmps = scratch(link, buf.dtype, *([largest] * len(peers)), *([block_max] * len(owners)))
    tmp_local, tmp_cross = tmps[: len(peers)], tmps[len(peers) :]

    def blocks(t: int) -> list[int]:
        lo, hi = mine[t], mine[t + 1]
        return [lo + b for b in block_bounds(hi - lo, k)]

    for step in range(pieces + 3):
        sends: list[tuple[int, np.ndarray]] = []
        recvs: list[tuple[int, np.ndarray]] = []
        t = step  # local reduce-scatter
        if t < pieces:
            lo, hi = mine[t], mine[t + 1]
            for (j, peer), tmp in zip(peers, tmp_local, strict=True):
                a, b = piece_bounds[j][t], piece_bounds[j][t + 1]
                if b > a:
                    sends.append((peer, own[a:b]))
                if hi > lo:
                    recvs.append((peer, tmp[: hi - lo]))
        t = step - 1  # cross-host reduce-scatter
        if 0 <= t < pieces:
            cuts = blocks(t)
            m = cuts[g + 1] - cuts[g]
            for (h, peer), tmp in zip(owners, tmp_cross, strict=True):
                if cuts[h + 1] > cuts[h]:
                    sends.append((peer, buf[cuts[h] : cuts[h + 1]]))
                if m:
                    recvs.append((peer, tmp[:m]))
        t = step - 2  # cross-host all-gather
        if 0 <= t < pieces:
            cuts = blocks(t)
            for h, peer in owners:
                if cuts[g + 1] > cuts[g]:
                    sends.append((peer, buf[cuts[g] : cuts[g + 1]]))
                if cuts[h + 1] > cuts[h]:
                    recvs.append((peer, buf[cuts[h] : cuts[h + 1]]))
        t = step - 3  # local all-gather
        if 0 <= t < pieces:
            lo, hi = mine[t], mine[t + 1]
            for j, peer in peers:
                if hi > lo:
                    sends.append((peer, buf[lo:hi]))
                a, b = piece_bounds[j][t], piece_bounds[j][t + 1]
                if b > a:
                    recvs.append((peer, buf[a:b]))
        if sends or recvs:
            link.exchange(sends, recvs)
        t = step  # fold this host's contributions to piece t of our slice
        if t < pieces and mine[t + 1] > mine[t]:
            lo, hi = mine[t], mine[t + 1]
            first, acc = own[lo:hi], buf[lo:hi]
            for tmp in tmp_local:
                combine_into(op, first, tmp[: hi - lo], acc)
                first = acc
            if not tmp_local and own is not buf:
                np.copyto(acc, first)
        t = step - 1  # fold the other hosts' partials of our block of piece t
        if 0 <= t < pieces:
            cuts = blocks(t)
            lo, hi = cuts[g], cuts[g + 1]
            if hi > lo:
                acc = buf[lo:hi]
                for tmp in tmp_cross:
                    combine_into(op, acc, tmp[: hi - lo], acc)


def broadcast(link: Link, buf: np.ndarray, root: int, hosts: Layout) -> None:
    """Copy root's ``buf`` to every rank in three phases (see the module docstring).

    Raises:
        InvalidArgument: bad buffer, root or layout (before any I/O).
        CommTimeout, PeerError: from the link.
    """
    r = link.rank
    _check(link, "broadcast", buf, hosts)
    root = algorithms._check_root(r, "broadcast", root, link.size)
    if buf.size == 0:
        return
    plan = _Plan(r, hosts, buf.size)
    root_host = next(h for h, members in enumerate(hosts) if root in members)
    if plan.host == root_host:
        # Root hands every rank of its host that rank's slice.
        bounds = plan.bounds[root_host]
        if r == root:
            sends = [
                (p, buf[bounds[j] : bounds[j + 1]])
                for j, p in enumerate(plan.local)
                if p != root and bounds[j + 1] > bounds[j]
            ]
            if sends:
                link.exchange(sends, [])
        else:
            lo, hi = plan.my_slice()
            if hi > lo:
                link.exchange([], [(root, buf[lo:hi])])
    for lo, hi, owners in plan.segments:
        algorithms.broadcast(_cross(link, owners), buf[lo:hi], root_host)
    _local_all_gather(link, plan, buf)


def all_gather(link: Link, send: np.ndarray, recv: np.ndarray, hosts: Layout) -> None:
    """Fill ``recv`` with every rank's ``send``, in rank order, crossing each host link once
    per block and destination host (see the module docstring).

    Raises:
        InvalidArgument: bad buffers, sizes or layout (before any I/O).
        TypeError: the dtypes differ.
        CommTimeout, PeerError: from the link.
    """
    r, p = link.rank, link.size
    algorithms._check_blocks(r, "all_gather", send, recv, p, whole="recv")
    _check_layout(link, "all_gather", hosts)
    n = send.size
    if n == 0:
        return
    send = algorithms._detach(send, recv)
    plan = _Plan(r, hosts, 0)
    i, local = plan.index, plan.local
    recv[r * n : (r + 1) * n] = send

    def block(rank: int) -> np.ndarray:
        return recv[rank * n : (rank + 1) * n]

    def held(rank_index: int) -> list[int]:
        # The blocks local rank ``rank_index`` of this host holds after the cross step: its
        # own and those the other hosts' ranks j with j % len(local) == rank_index sent it.
        mine = [local[rank_index]]
        for h, members in enumerate(hosts):
            if h != plan.host:
                mine += [q for j, q in enumerate(members) if j % len(local) == rank_index]
        return sorted(mine)

    sends, recvs = [], []
    for h, members in enumerate(hosts):
        if h == plan.host:
            continue
        sends.append((members[i % len(members)], send))
        recvs += [(q, block(q)) for j, q in enumerate(members) if j % len(local) == i]
    link.exchange(sends, recvs)
    sends, recvs = [], []
    mine = held(i)
    for j, q in enumerate(local):
        if q != r:
            sends += [(q, block(b)) for b in mine]
            recvs += [(q, block(b)) for b in held(j)]
    if sends or recvs:
        link.exchange(sends, recvs)


def reduce_scatter(
    link: Link, send: np.ndarray, recv: np.ndarray, op: ReduceOp | str, hosts: Layout
) -> None:
    """Reduce ``send`` (``size * n`` elements) across ranks; rank r gets block r in ``recv``.

    Two exchanges. Inside each host, the block of rank q is reduced by one rank of the host
    (the one whose local index is q's local index modulo the host's rank count), which
    receives the host's other ranks' contributions to it; then that rank sends the host's
    partial of block q to q, once per other host. Each host's link carries ``(k-1)/k`` of
    its ranks' inputs out for ``k`` hosts, each byte once.

    Raises:
        InvalidArgument: bad buffers, sizes, op or layout (before any I/O).
        TypeError: the dtypes differ, or ``op`` is not defined for the dtype.
        CommTimeout, PeerError: from the link.
    """
    r, p = link.rank, link.size
    algorithms._check_blocks(r, "reduce_scatter", send, recv, p, whole="send")
    rop = algorithms._check_op(r, "reduce_scatter", op, send.dtype)
    _check_layout(link, "reduce_scatter", hosts)
    m = recv.size
    if m == 0:
        return
    send = algorithms._detach(send, recv)
    host_of = {q: (h, members.index(q)) for h, members in enumerate(hosts) for q in members}
    g = host_of[r][0]
    local = hosts[g]

    def owner(h: int, q: int) -> int:
        return hosts[h][host_of[q][1] % len(hosts[h])]

    owned = {j: [q for q in range(p) if owner(g, q) == j] for j in local}
    mine = owned[r]
    peers = [j for j in local if j != r]
    others = [h for h in range(len(hosts)) if h != g]
    tmps = scratch(link, recv.dtype, *([m] * (len(peers) * len(mine) + len(others))))
    got = {(j, q): tmps[a * len(mine) + b] for a, j in enumerate(peers) for b, q in enumerate(mine)}
    sends = [(j, send[q * m : (q + 1) * m]) for j in peers for q in owned[j]]
    recvs = [(j, got[j, q]) for j in peers for q in mine]
    if sends or recvs:
        link.exchange(sends, recvs)
    # This host's partial of every block we own; ours goes straight into recv.
    partial = {}
    for q in mine:
        acc = recv if q == r else np.empty(m, recv.dtype)
        first = send[q * m : (q + 1) * m]
        for j in peers:
            combine_into(rop, first, got[j, q], acc)
            first = acc
        if not peers:
            np.copyto(acc, first)
        partial[q] = acc
    incoming = tmps[len(peers) * len(mine) :]
    sends = [(q, partial[q]) for q in mine if q != r]
    recvs = [(owner(h, r), t) for h, t in zip(others, incoming, strict=True)]
    link.exchange(sends, recvs)
    for t in incoming:
        combine_into(rop, recv, t, recv)
