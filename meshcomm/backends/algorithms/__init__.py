"""Collective algorithms written once over a point-to-point :class:`~meshcomm.backends.link.Link`.

A transport (tcp sockets, in-memory threads, shared memory) implements ``Link.exchange``; these
functions turn it into the collective primitives of
:class:`~meshcomm.backends.base.Communicator`. Buffers are flat C-contiguous 1-D numpy arrays of
any dtype (bfloat16 included); reduce ops are the primitive ones (SUM PROD MIN MAX BAND BOR BXOR).

Which algorithm runs depends on the message size and the world size (the ``*_BYTES`` constants
below, read at call time), unless the caller forces one with ``algorithm=`` or the environment
names one in ``MESHCOMM_ALGO_<COLLECTIVE>`` (for example ``MESHCOMM_ALGO_ALL_REDUCE=ring``). The
choice must be the same on every rank, so set such variables on all ranks alike. As NCCL does
with ``NCCL_ALGO``, a variable is read once per process, at the collective's first use (reading
the environment costs microseconds, more than the rest of a small collective's bookkeeping);
:func:`select_algorithm` re-reads its collective's variable, :func:`reload_environment` all.

=================  ==========================================================================
collective         algorithms (auto choice; "bytes" is the size named in ``select_algorithm``)
=================  ==========================================================================
all_reduce         recursive_doubling (bytes < ALL_REDUCE_RING_MIN_BYTES), ring (pipelined)
all_gather         recursive_doubling (power-of-two size) / bruck (other sizes) below
                   ALL_GATHER_RING_MIN_BYTES, ring above
reduce_scatter     linear below REDUCE_SCATTER_RING_MIN_BYTES, ring (pipelined) above
all_to_all         linear below ALL_TO_ALL_PAIRWISE_MIN_BYTES, pairwise above
broadcast          binomial up to BROADCAST_TREE_MAX_BYTES or size 2; chain (pipelined) when
                   bytes >= size * CHUNK_BYTES; scatter_allgather between
reduce             binomial up to REDUCE_TREE_MAX_BYTES, reduce_scatter_gather above
gather / scatter   binomial up to GATHER_TREE_MAX_BYTES, linear above
barrier            dissemination
=================  ==========================================================================

All algorithms work at every world size and every root, with element counts that the world
size does not divide (blocks split ``np.array_split`` style) and with zero elements.

Example:
    >>> import numpy as np
    >>> from meshcomm.backends.memlink import run_threads
    >>> from meshcomm.reduction import ReduceOp
    >>> def step(link):
    ...     grads = np.arange(4.0) * (link.rank + 1)
    ...     all_reduce(link, grads, ReduceOp.SUM)
    ...     return grads
    >>> run_threads(3, step)[2]
    array([ 0.,  6., 12., 18.])
"""

from __future__ import annotations

import numbers
import os

import numpy as np

from meshcomm.backends.algorithms import _bcast, _gather, _reduce
from meshcomm.backends.link import Link
from meshcomm.errors import InvalidArgument
from meshcomm.reduction import PRIMITIVE_OP_KINDS, ReduceOp, check_op_dtype, parse_op

__all__ = [
    "ALGORITHMS",
    "ALL_GATHER_RING_MIN_BYTES",
    "ALL_REDUCE_RING_MIN_BYTES",
    "ALL_TO_ALL_PAIRWISE_MIN_BYTES",
    "BROADCAST_TREE_MAX_BYTES",
    "CHUNK_BYTES",
    "GATHER_TREE_MAX_BYTES",
    "REDUCE_SCATTER_RING_MIN_BYTES",
    "REDUCE_TREE_MAX_BYTES",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reload_environment",
    "scatter",
    "select_algorithm",
]

# The crossovers below were measured over loopback tcp with 2 and 4 processes on a 2-core
# host; re-tune them with MESHCOMM_ALGO_<COLLECTIVE> on real hardware.

#: Pipelining unit of the ring reductions and the chain broadcast.
CHUNK_BYTES = 512 << 10
#: all_reduce: recursive doubling below this buffer size, ring at or above.
ALL_REDUCE_RING_MIN_BYTES = 256 << 10
#: all_gather: recursive doubling / Bruck below this result size, ring at or above.
ALL_GATHER_RING_MIN_BYTES = 1 << 20
#: reduce_scatter: linear (every block to its rank in one exchange) below this input size,
#: ring at or above.
REDUCE_SCATTER_RING_MIN_BYTES = 256 << 10
#: all_to_all: everything in one exchange below this input size, pairwise steps at or above.
ALL_TO_ALL_PAIRWISE_MIN_BYTES = 1 << 20
#: broadcast: binomial tree up to this size; above, scatter+allgather, or chain once the buffer
#: holds at least ``size`` chunks (enough to fill the pipeline).
BROADCAST_TREE_MAX_BYTES = 256 << 10
#: reduce: binomial tree up to this size, ring reduce-scatter + gather above.
REDUCE_TREE_MAX_BYTES = 256 << 10
#: gather and scatter: binomial tree up to this total size, direct (linear) above.
GATHER_TREE_MAX_BYTES = 64 << 10

#: Every collective's algorithms, in the order "small messages" to "large messages".
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("recursive_doubling", "ring"),
    "all_gather": ("recursive_doubling", "bruck", "ring"),
    "reduce_scatter": ("linear", "ring"),
    "all_to_all": ("linear", "pairwise"),
    "broadcast": ("binomial", "scatter_allgather", "chain"),
    "reduce": ("binomial", "reduce_scatter_gather"),
    "gather": ("binomial", "linear"),
    "scatter": ("binomial", "linear"),
    "barrier": ("dissemination",),
}


def _auto(collective: str, nbytes: int, size: int) -> str:
    if collective == "all_reduce":
        return "ring" if nbytes >= ALL_REDUCE_RING_MIN_BYTES else "recursive_doubling"
    if collective == "all_gather":
        if nbytes >= ALL_GATHER_RING_MIN_BYTES:
            return "ring"
        return "recursive_doubling" if size & (size - 1) == 0 else "bruck"
    if collective == "reduce_scatter":
        return "ring" if nbytes >= REDUCE_SCATTER_RING_MIN_BYTES else "linear"
    if collective == "all_to_all":
        return "pairwise" if nbytes >= ALL_TO_ALL_PAIRWISE_MIN_BYTES else "linear"
    if collective == "broadcast":
        if nbytes <= BROADCAST_TREE_MAX_BYTES or size <= 2:
            return "binomial"
        return "chain" if nbytes >= size * CHUNK_BYTES else "scatter_allgather"
    if collective == "reduce":
        return "binomial" if nbytes <= REDUCE_TREE_MAX_BYTES else "reduce_scatter_gather"
    if collective in ("gather", "scatter"):
        return "binomial" if nbytes <= GATHER_TREE_MAX_BYTES else "linear"
    return "dissemination"


# MESHCOMM_ALGO_<COLLECTIVE> as read (stripped, lower case; None when unset or empty), by
# collective. Filled on first use; see reload_environment.
_ENV: dict[str, str | None] = {}


def _read_env(collective: str) -> str | None:
    value = os.environ.get(f"MESHCOMM_ALGO_{collective.upper()}", "").strip().lower() or None
    _ENV[collective] = value
    return value


def reload_environment() -> None:
    """Re-read every ``MESHCOMM_ALGO_<COLLECTIVE>`` variable at the next collective.

    Example:
        >>> import os
        >>> os.environ["MESHCOMM_ALGO_ALL_REDUCE"] = "ring"; reload_environment()
        >>> select_algorithm("all_reduce", 8, 4)
        'ring'
        >>> del os.environ["MESHCOMM_ALGO_ALL_REDUCE"]; reload_environment()
    """
    _ENV.clear()


def _choose(collective: str, nbytes: int, size: int, algorithm: str | None) -> str:
    """:func:`select_algorithm` for the collectives: the environment as read at first use."""
    source = "algorithm="
    if algorithm is None:
        try:
            algorithm = _ENV[collective]
        except KeyError:
            algorithm = _read_env(collective)
        source = f"MESHCOMM_ALGO_{collective.upper()}"
    if algorithm is None or algorithm == "auto":
        return _auto(collective, nbytes, size)
    choices = ALGORITHMS[collective]
    if algorithm not in choices:
        raise InvalidArgument(
            f"{source} names unknown {collective} algorithm {algorithm!r}; "
            f"choose from auto, {', '.join(choices)}"
        )
    return algorithm


def select_algorithm(collective: str, nbytes: int, size: int, algorithm: str | None = None) -> str:
    """Return the algorithm ``collective`` runs for ``nbytes`` on ``size`` ranks.

    ``algorithm`` wins when given; otherwise ``MESHCOMM_ALGO_<COLLECTIVE>`` when set (read now,
    and remembered for the collectives that follow); otherwise the size rules. ``"auto"`` (or
    an empty variable) means the size rules.

    Args:
        collective: a key of ``ALGORITHMS``, such as ``"all_reduce"``.
        nbytes: the size the rules look at: the buffer for all_reduce, broadcast and reduce;
            the whole input for reduce_scatter and all_to_all; the whole (root-side) result
            for all_gather, gather and scatter.
        size: the world size.
        algorithm: a name from ``ALGORITHMS[collective]``, ``"auto"``, or None.

    Raises:
        InvalidArgument: unknown collective or algorithm name (from either source).

    Example:
        >>> select_algorithm("all_reduce", 1 << 30, 8)
        'ring'
        >>> select_algorithm("all_gather", 64, 6)
        'bruck'
    """
    if collective not in ALGORITHMS:
        raise InvalidArgument(f"unknown collective {collective!r}; known: {', '.join(ALGORITHMS)}")
    if algorithm is None:
        _read_env(collective)
    return _choose(collective, nbytes, size, algorithm)


# -- argument checks (all before any I/O) ---------------------------------------------------


def _check_array(rank: int, where: str, name: str, arr: object, *, writable: bool) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"rank {rank}: {where} {name} must be a numpy array, got {type(arr)!r}")
    if arr.ndim != 1 or not arr.flags.c_contiguous:
        raise InvalidArgument(
            f"rank {rank}: {where} {name} must be a flat C-contiguous array, "
            f"got shape {arr.shape} with strides {arr.strides}"
        )
    if writable and not arr.flags.writeable:
        raise InvalidArgument(f"rank {rank}: {where} {name} is read-only")
    return arr


def _check_same_dtype(rank: int, where: str, send: np.ndarray, recv: np.ndarray) -> None:
    if send.dtype != recv.dtype:
        raise TypeError(
            f"rank {rank}: {where} send and recv dtypes differ: {send.dtype} and {recv.dtype}"
        )


def _check_op(rank: int, where: str, op: ReduceOp | str, dtype: np.dtype) -> ReduceOp:
    parsed = op if isinstance(op, ReduceOp) else parse_op(op)
    if (parsed, dtype.kind) in PRIMITIVE_OP_KINDS:
        return parsed
    if parsed in (ReduceOp.AVG, ReduceOp.PREMUL_SUM):
        raise InvalidArgument(
            f"rank {rank}: {where} takes primitive reduce ops; {parsed.value!r} is composed "
            "from 'sum' above the backend"
        )
    check_op_dtype(parsed, dtype)
    return parsed


def _check_root(rank: int, where: str, root: object, size: int) -> int:
    value = None
    if not isinstance(root, bool) and isinstance(root, numbers.Integral):
        value = int(root)
    if value is None or not 0 <= value < size:
        raise InvalidArgument(f"rank {rank}: {where} root must be in [0, {size}), got {root!r}")
    return value


def _check_blocks(
    rank: int, where: str, send: object, recv: object, size: int, *, whole: str
) -> None:
    """The checks of an all_gather (``whole="recv"``) or reduce_scatter (``whole="send"``),
    flat or host-aware, before any I/O: two flat arrays of one dtype, ``whole`` holding
    ``size`` times the other's elements."""
    send = _check_array(rank, where, "send", send, writable=False)
    recv = _check_array(rank, where, "recv", recv, writable=True)
    _check_same_dtype(rank, where, send, recv)
    big, part = (recv, send) if whole == "recv" else (send, recv)
    if big.size != size * part.size:
        other = "send" if whole == "recv" else "recv"
        raise InvalidArgument(
            f"rank {rank}: {where} {whole} must hold size * len({other}) = {size} * "
            f"{part.size} = {size * part.size} elements, got {big.size}"
        )


def _chunk_elems(rank: int, chunk_bytes: int | None, itemsize: int) -> int:
    if chunk_bytes is None and itemsize:
        return max(1, CHUNK_BYTES // itemsize)
    nbytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise InvalidArgument(f"rank {rank}: chunk_bytes must be a positive int, got {nbytes!r}")
    return max(1, nbytes // max(itemsize, 1))


def _detach(send: np.ndarray, recv: np.ndarray) -> np.ndarray:
    # Algorithms write recv while still reading send; an overlapping send is read from a copy.
    return send.copy() if np.may_share_memory(send, recv) else send


# -- the collectives ------------------------------------------------------------------------


def all_reduce(
    link: Link,
    buf: np.ndarray,
    op: ReduceOp | str,
    *,
    send: np.ndarray | None = None,
    algorithm: str | None = None,
    chunk_bytes: int | None = None,
) -> None:
    """Reduce ``buf`` across all ranks, in place; every rank ends with identical bytes.

    With ``send``, out of place: ``send`` is this rank's contribution (left untouched) and
    ``buf`` only receives the result. The first combine of each block then reads ``send``
    and writes ``buf`` in one pass, so no copy of the input is ever made (an in-place call on
    a copy of the input costs one more pass over memory).

    Args:
        link: this rank's link.
        buf: the local contribution, overwritten by the result (with ``send``: only the
            result; its contents are ignored).
        op: a primitive reduce op (or its name) defined for ``buf.dtype``.
        send: the local contribution for an out-of-place call: a flat C-contiguous array of
            ``buf``'s dtype and size (one that overlaps ``buf`` is read from a copy).
        algorithm: ``"recursive_doubling"``, ``"ring"``, ``"auto"``, or None (see
            :func:`select_algorithm`).
        chunk_bytes: pipelining unit of the ring (default ``CHUNK_BYTES``).

    Raises:
        InvalidArgument: bad buffer, op, or algorithm (before any I/O).
        TypeError: ``op`` is not defined for the dtype, or ``send`` has another dtype.
        CommTimeout, PeerError: from the link.

    Example:
        >>> import numpy as np
        >>> from meshcomm.backends.memlink import run_threads
        >>> def fn(link):
        ...     buf = np.array([link.rank, 10], np.int32)
        ...     all_reduce(link, buf, "max", algorithm="ring")
        ...     return buf.tolist()
        >>> run_threads(3, fn)
        [[2, 10], [2, 10], [2, 10]]
        >>> def out_of_place(link):
        ...     x, out = np.full(2, link.rank + 1.0), np.empty(2)
        ...     all_reduce(link, out, "sum", send=x)
        ...     return x.tolist(), out.tolist()
        >>> run_threads(3, out_of_place)[2]
        ([3.0, 3.0], [6.0, 6.0])
    """
    r, p = link.rank, link.size
    _check_array(r, "all_reduce", "buf", buf, writable=True)
    if send is not None:
        _check_array(r, "all_reduce", "send", send, writable=False)
        _check_same_dtype(r, "all_reduce", send, buf)
        if send.size != buf.size:
            raise InvalidArgument(
                f"rank {r}: all_reduce send and buf sizes differ: {send.size} and {buf.size}"
            )
        if send is buf:
            send = None
    rop = _check_op(r, "all_reduce", op, buf.dtype)
    name = _choose("all_reduce", buf.nbytes, p, algorithm)
    chunk = _chunk_elems(r, chunk_bytes, buf.itemsize)
    if send is not None:
        if p == 1:
            np.copyto(buf, send)
            return
        send = _detach(send, buf)
    if p == 1 or buf.size == 0:
        return
    if name == "ring":
        _reduce.all_reduce_ring(link, buf, rop, chunk, send)
    else:
        _reduce.all_reduce_recursive_doubling(link, buf, rop, send)


def all_gather(
    link: Link, send: np.ndarray, recv: np.ndarray, *, algorithm: str | None = None
) -> None:
    """Fill ``recv`` with every rank's ``send``, in rank order.

    Args:
        link: this rank's link.
        send: this rank's block (``n`` elements; the same ``n`` on every rank).
        recv: ``size * n`` elements, the same dtype; may hold ``send`` as its own block.
        algorithm: ``"recursive_doubling"``, ``"bruck"``, ``"ring"``, ``"auto"``, or None.

    Raises:
        InvalidArgument: bad buffers, sizes, or algorithm (before any I/O).
        TypeError: the dtypes differ.
        CommTimeout, PeerError: from the link.

    Example:
        >>> import numpy as np
        >>> from meshcomm.backends.memlink import run_threads
        >>> def fn(link):
        ...     recv = np.empty(2 * link.size, np.int64)
        ...     all_gather(link, np.array([link.rank, -link.rank]), recv)
        ...     return recv.tolist()
        >>> run_threads(3, fn)[0]
        [0, 0, 1, -1, 2, -2]
    """
    r, p = link.rank, link.size
    _check_blocks(r, "all_gather", send, recv, p, whole="recv")
    name = _choose("all_gather", recv.nbytes, p, algorithm)
    if send.size == 0:
        return
    send = _detach(send, recv)
    if p == 1:
        np.copyto(recv, send)
    elif name == "ring":
        _gather.all_gather_ring(link, send, recv)
    elif name == "bruck":
        _gather.all_gather_bruck(link, send, recv)
    else:
        _gather.all_gather_recursive_doubling(link, send, recv)


def reduce_scatter(
    link: Link,
    send: np.ndarray,
    recv: np.ndarray,
    op: ReduceOp | str,
    *,
    algorithm: str | None = None,
    chunk_bytes: int | None = None,
) -> None:
    """Reduce ``send`` (``size * n`` elements) across ranks; rank r gets block r in ``recv``.

    ``send`` is left untouched.

    Args:
        link: this rank's link.
        send: ``size * n`` elements.
        recv: ``n`` elements of the same dtype.
        op: a primitive reduce op (or its name) defined for the dtype.
        algorithm: ``"linear"``, ``"ring"``, ``"auto"``, or None.
        chunk_bytes: pipelining unit of the ring (default ``CHUNK_BYTES``).

    Raises:
        InvalidArgument: bad buffers, sizes, op, or algorithm (before any I/O).
        TypeError: the dtypes differ, or ``op`` is not defined for the dtype.
        CommTimeout, PeerError: from the link.

    Example:
        >>> import numpy as np
        >>> from meshcomm.backends.memlink import run_threads
        >>> def fn(link):
        ...     recv = np.empty(1, np.int64)
        ...     reduce_scatter(link, np.arange(link.size), recv, "sum")
        ...     return int(recv[0])
        >>> run_threads(3, fn)
        [0, 3, 6]
    """
    r, p = link.rank, link.size
    _check_blocks(r, "reduce_scatter", send, recv, p, whole="send")
    rop = _check_op(r, "reduce_scatter", op, send.dtype)
    name = _choose("reduce_scatter", send.nbytes, p, algorithm)
    chunk = _chunk_elems(r, chunk_bytes, send.itemsize)
    if recv.size == 0:
        return
    send = _detach(send, recv)
    if p == 1:
        np.copyto(recv, send)
    elif name == "ring":
        _reduce.reduce_scatter_ring(link, send, recv, rop, chunk)
    else:
        _reduce.reduce_scatter_linear(link, send, recv, rop)


def all_to_all(
    link: Link, send: np.ndarray, recv: np.ndarray, *, algorithm: str | None = None
) -> None:
    """Send block j of ``send`` to rank j; block i of ``recv`` comes from rank i.

    Args:
        link: this rank's link.
        send: ``size * n`` elements.
        recv: ``size * n`` elements of the same dtype.
        algorithm: ``"linear"``, ``"pairwise"``, ``"auto"``, or None.

    Raises:
        InvalidArgument: bad buffers, sizes, or algorithm (before any I/O).
        TypeError: the dtypes differ.
        CommTimeout, PeerError: from the link.

    Example:
        >>> import numpy as np
        >>> from meshcomm.backends.memlink import run_threads
        >>> def fn(link):
        ...     recv = np.empty(link.size, np.int64)
        ...     all_to_all(link, 10 * link.rank + np.arange(link.size), recv)
        ...     return recv.tolist()
        >>> run_threads(3, fn)[1]
        [1, 11, 21]
    """
    r, p = link.rank, link.size
    _check_array(r, "all_to_all", "send", send, writable=False)
    _check_array(r, "all_to_all", "recv", recv, writable=True)
    _check_same_dtype(r, "all_to_all", send, recv)
    if send.size != recv.size or send.size % p:
        raise InvalidArgument(
            f"rank {r}: all_to_all send and recv must both hold size * n elements (size {p}), "
            f"got {send.size} and {recv.size}"
        )
    name = _choose("all_to_all", send.nbytes, p, algorithm)
    if send.size == 0:
        return
    send = _detach(send, recv)
    if p == 1:
        np.copyto(recv, send)
    elif name == "pairwise":
        _gather.all_to_all_pairwise(link, send, recv)
    else:
        _gather.all_to_all_linear(link, send, recv)


def broadcast(
    link: Link,
    buf: np.ndarray,
    root: int,
    *,
    algorithm: str | None = None,
    chunk_bytes: int | None = None,
) -> None:
    """Copy root's ``buf`` into every rank's ``buf``.

    Args:
        link: this rank's link.
        buf: the data on root; overwritten elsewhere. Same size on every rank.
        root: the sending rank.
        algorithm: ``"binomial"``, ``"scatter_allgather"``, ``"chain"``, ``"auto"``, or None.
        chunk_bytes: pipelining unit of the chain (default ``CHUNK_BYTES``).

    Raises:
        InvalidArgument: bad buffer, root, or algorithm (before any I/O).
        CommTimeout, PeerError: from the link.

    Example:
        >>> import numpy as np
        >>> from meshcomm.backends.memlink import run_threads
        >>> def fn(link):
        ...     buf = np.full(2, link.rank, np.float32)
        ...     broadcast(link, buf, root=2)
        ...     return buf.tolist()
        >>> run_threads(4, fn)
        [[2.0, 2.0], [2.0, 2.0], [2.0, 2.0], [2.0, 2.0]]
    """
    r, p = link.rank, link.size
    _check_array(r, "broadcast", "buf", buf, writable=True)
    root = _check_root(r, "broadcast", root, p)
    name = _choose("broadcast", buf.nbytes, p, algorithm)
    chunk = _chunk_elems(r, chunk_bytes, buf.itemsize)
    if p == 1 or buf.size == 0:
        return
    if name == "chain":
        _bcast.broadcast_chain(link, buf, root, chunk)
    elif name == "scatter_allgather":
        _bcast.broadcast_scatter_allgather(link, buf, root)
    else:
        _bcast.broadcast_binomial(link, buf, root)


def reduce(
    link: Link,
    buf: np.ndarray,
    root: int,
    op: ReduceOp | str,
    *,
    algorithm: str | None = None,
    chunk_bytes: int | None = None,
) -> None:
    """Reduce ``buf`` onto root, in place there; other ranks' ``buf`` may be clobbered.

    Args:
        link: this rank's link.
        buf: the local contribution (same size on every rank).
        root: the rank that receives the result.
        op: a primitive reduce op (or its name) defined for ``buf.dtype``.
        algorithm: ``"binomial"``, ``"reduce_scatter_gather"``, ``"auto"``, or None.
        chunk_bytes: pipelining unit of the ring reduce-scatter (default ``CHUNK_BYTES``).

    Raises:
        InvalidArgument: bad buffer, root, op, or algorithm (before any I/O).
        TypeError: ``op`` is not defined for the dtype.
        CommTimeout, PeerError: from the link.

    Example:
        >>> import numpy as np
        >>> from meshcomm.backends.memlink import run_threads
        >>> def fn(link):
        ...     buf = np.array([link.rank + 1])
        ...     reduce(link, buf, root=1, op="prod")
        ...     return int(buf[0])
        >>> run_threads(4, fn)[1]
        24
    """
    r, p = link.rank, link.size
    _check_array(r, "reduce", "buf", buf, writable=True)
    root = _check_root(r, "reduce", root, p)
    rop = _check_op(r, "reduce", op, buf.dtype)
    name = _choose("reduce", buf.nbytes, p, algorithm)
    chunk = _chunk_elems(r, chunk_bytes, buf.itemsize)
    if p == 1 or buf.size == 0:
        return
    if name == "reduce_scatter_gather":
        _reduce.reduce_reduce_scatter_gather(link, buf, root, rop, chunk)
    else:
        _reduce.reduce_binomial(link, buf, root, rop)


def gather(
    link: Link,
    send: np.ndarray,
    recv: np.ndarray | None,
    root: int,
    *,
    algorithm: str | None = None,
) -> None:
    """On root, fill ``recv`` (``size * n`` elements) with every rank's ``send``, in rank order.

    Args:
        link: this rank's link.
        send: this rank's block (``n`` elements; the same ``n`` on every rank).
        recv: on root, ``size * n`` elements of the same dtype; ignored elsewhere (may be None).
        root: the receiving rank.
        algorithm: ``"binomial"``, ``"linear"``, ``"auto"``, or None.

    Raises:
        InvalidArgument: bad buffers, sizes, root, or algorithm (before any I/O).
        TypeError: the dtypes differ (on root).
        CommTimeout, PeerError: from the link.

    Example:
        >>> import numpy as np
        >>> from meshcomm.backends.memlink import run_threads
        >>> def fn(link):
        ...     recv = np.empty(link.size, np.int64) if link.rank == 0 else None
        ...     gather(link, np.array([link.rank * link.rank]), recv, root=0)
        ...     return None if recv is None else recv.tolist()
        >>> run_threads(4, fn)
        [[0, 1, 4, 9], None, None, None]
    """
    r, p = link.rank, link.size
    _check_array(r, "gather", "send", send, writable=False)
    root = _check_root(r, "gather", root, p)
    if r == root:
        if recv is None:
            raise InvalidArgument(f"rank {r}: gather root needs a recv buffer, got None")
        _check_array(r, "gather", "recv", recv, writable=True)
        _check_same_dtype(r, "gather", send, recv)
        if recv.size != p * send.size:
            raise InvalidArgument(
                f"rank {r}: gather recv must hold size * len(send) = {p} * {send.size} = "
                f"{p * send.size} elements, got {recv.size}"
            )
        send = _detach(send, recv)
    name = _choose("gather", p * send.nbytes, p, algorithm)
    if send.size == 0:
        return
    if p == 1:
        if recv is not None:  # always true: root's recv was checked above
            np.copyto(recv, send)
    elif name == "linear":
        _gather.gather_linear(link, send, recv, root)
    else:
        _gather.gather_binomial(link, send, recv, root)


def scatter(
    link: Link,
    send: np.ndarray | None,
    recv: np.ndarray,
    root: int,
    *,
    algorithm: str | None = None,
) -> None:
    """Rank r receives block r of root's ``send`` (``size * n`` elements) into ``recv``.

    Args:
        link: this rank's link.
        send: on root, ``size * n`` elements; ignored elsewhere (may be None).
        recv: ``n`` elements (the same ``n`` on every rank), the same dtype as ``send``.
        root: the sending rank.
        algorithm: ``"binomial"``, ``"linear"``, ``"auto"``, or None.

    Raises:
        InvalidArgument: bad buffers, sizes, root, or algorithm (before any I/O).
        TypeError: the dtypes differ (on root).
        CommTimeout, PeerError: from the link.

    Example:
        >>> import numpy as np
        >>> from meshcomm.backends.memlink import run_threads
        >>> def fn(link):
        ...     send = np.arange(100, 100 + link.size) if link.rank == 1 else None
        ...     recv = np.empty(1, np.int64)
        ...     scatter(link, send, recv, root=1)
        ...     return int(recv[0])
        >>> run_threads(3, fn)
        [100, 101, 102]
    """
    r, p = link.rank, link.size
    _check_array(r, "scatter", "recv", recv, writable=True)
    root = _check_root(r, "scatter", root, p)
    if r == root:
        if send is None:
            raise InvalidArgument(f"rank {r}: scatter root needs a send buffer, got None")
        _check_array(r, "scatter", "send", send, writable=False)
        _check_same_dtype(r, "scatter", send, recv)
        if send.size != p * recv.size:
            raise InvalidArgument(
                f"rank {r}: scatter send must hold size * len(recv) = {p} * {recv.size} = "
                f"{p * recv.size} elements, got {send.size}"
            )
        send = _detach(send, recv)
    name = _choose("scatter", p * recv.nbytes, p, algorithm)
    if recv.size == 0:
        return
    if p == 1:
        if send is not None:  # always true: root's send was checked above
            np.copyto(recv, send)
    elif name == "linear":
        _gather.scatter_linear(link, send, recv, root)
    else:
        _gather.scatter_binomial(link, send, recv, root)


def barrier(link: Link, *, algorithm: str | None = None) -> None:
    """Return once every rank has entered the barrier.

    Args:
        link: this rank's link.
        algorithm: ``"dissemination"``, ``"auto"``, or None.

    Raises:
        InvalidArgument: unknown algorithm (before any I/O).
        CommTimeout, PeerError: from the link.

    Example:
        >>> from meshcomm.backends.memlink import run_threads
        >>> run_threads(5, barrier)
        [None, None, None, None, None]
    """
    _choose("barrier", 0, link.size, algorithm)
    if link.size > 1:
        _bcast.barrier_dissemination(link)
