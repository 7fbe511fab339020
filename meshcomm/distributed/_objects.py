"""Object collectives: picklable Python objects instead of tensors, as torch.

.. warning::
    These functions **unpickle bytes received from other ranks**, exactly like torch's. Unpickling
    runs arbitrary code chosen by the sender, so use them only when you trust every process of
    the job (and the network between them). Everything else in meshcomm refuses to unpickle
    network bytes; prefer tensors, or ``json``/``msgpack`` encoded into a uint8 tensor, when
    a peer may not be trusted.

Each call is one or two meshcomm collectives on uint8 arrays: first the sizes of the pickles
(where the receivers cannot know them), then the bytes, padded to the largest.

Example:
    >>> import meshcomm.distributed as dist
    >>> dist.init_process_group(world_size=1, rank=0)
    >>> objs = [None]
    >>> dist.all_gather_object(objs, {"rank": dist.get_rank()}); objs
    [{'rank': 0}]
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from meshcomm.distributed._errors import DistBackendError, public
from meshcomm.distributed._groups import canonical_rank
from meshcomm.distributed._pg import ProcessGroup
from meshcomm.distributed._state import STATE, resolve, warn_not_in_group

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]


def _dump(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


def _load(raw: np.ndarray) -> Any:
    # Trusted peers only: see the module docstring.
    return pickle.loads(raw.tobytes())


def _member(group: Any, op: str) -> ProcessGroup | None:
    pg = resolve(group)
    if pg is None:
        warn_not_in_group(op)
        return None
    STATE.flush()
    return pg


def _padded(pieces: list[np.ndarray], width: int) -> np.ndarray:
    out = np.zeros((len(pieces), width), dtype=np.uint8)
    for i, p in enumerate(pieces):
        out[i, : p.size] = p
    return out


def _check_list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{name} must be a list, got {type(value).__name__}")
    return value


@public
def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: Any = None,
    group_src: int | None = None,
) -> None:
    """Replace ``object_list``'s entries with the source rank's, on every rank.

    Every rank passes a list of the same length (its entries are ignored off the source).
    Unpickles what the source sent: trusted peers only.

    Args:
        object_list: the objects on the source; the list to fill elsewhere.
        src: source rank in the world.
        group: the group.
        device: ignored (torch stages the bytes on it).
        group_src: source rank in ``group``.
    """
    _check_list(object_list, "object_list")
    pg = resolve(group)
    if pg is None:
        warn_not_in_group("broadcast_object_list")
        return
    if src is None and group_src is None:  # torch 2.13: global rank 0
        src = 0
    root = canonical_rank(pg, src, group_src, "src")
    STATE.flush()
    g, n = pg.mesh_group, len(object_list)
    mine = root == pg.rank()
    pieces = [_dump(o) for o in object_list] if mine else []
    sizes = np.array([p.size for p in pieces], dtype=np.int64) if mine else None
    sizes = g.broadcast(sizes, root, shape=(n,), dtype=np.int64)
    data = np.concatenate(pieces) if pieces else None
    data = g.broadcast(data, root, shape=(int(sizes.sum()),), dtype=np.uint8)
    if mine:
        return
    edges = np.cumsum([0, *sizes.tolist()])
    for i in range(n):
        object_list[i] = _load(data[edges[i] : edges[i + 1]])


@public
def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Fill ``object_list[r]`` with group rank ``r``'s ``obj``, on every rank.

    ``object_list`` has one entry per group rank. Unpickles what the peers sent: trusted
    peers only.

    Raises:
        ValueError: ``object_list`` has the wrong length.
    """
    _check_list(object_list, "object_list")
    pg = _member(group, "all_gather_object")
    if pg is None:
        return
    if len(object_list) != pg.size():
        raise ValueError(
            f"object_list must have one entry per rank of the group ({pg.size()}), got "
            f"{len(object_list)}"
        )
    g = pg.mesh_group
    mine = _dump(obj)
    sizes = g.all_gather(np.array(mine.size, dtype=np.int64), axis=0)
    table = g.all_gather(_padded([mine], int(sizes.max()))[0], axis=0)
    for r, n in enumerate(sizes.tolist()):
        object_list[r] = _load(table[r, :n])


@public
def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Any = None,
    group_dst: int | None = None,
) -> None:
    """Gather every rank's ``obj`` into ``object_gather_list`` on the destination rank.

    Unpickles what the peers sent: trusted peers only.

    Raises:
        ValueError: the list is missing on the destination, given elsewhere, or the wrong
            length.
    """
    pg = resolve(group)
    if pg is None:
        warn_not_in_group("gather_object")
        return
    if dst is None and group_dst is None:  # torch 2.13: global rank 0
        dst = 0
    root = canonical_rank(pg, dst, group_dst, "dst")
    mine = root == pg.rank()
    if mine:
        if not object_gather_list:
            raise ValueError("Argument ``gather_list`` must be specified on destination rank.")
        _check_list(object_gather_list, "object_gather_list")
        if len(object_gather_list) != pg.size():
            raise ValueError(
                f"object_gather_list must have one entry per rank of the group ({pg.size()}), "
                f"got {len(object_gather_list)}"
            )
    elif object_gather_list:
        raise ValueError("Argument ``gather_list`` must NOT be specified on non-destination ranks.")
    STATE.flush()
    g = pg.mesh_group
    piece = _dump(obj)
    sizes = g.all_gather(np.array(piece.size, dtype=np.int64), axis=0)
    table = g.gather(_padded([piece], int(sizes.max()))[0], root)
    if table is None or object_gather_list is None:
        return
    for r, n in enumerate(sizes.tolist()):
        object_gather_list[r] = _load(table[r, :n])


@public
def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Any = None,
    group_src: int | None = None,
) -> None:
    """Give group rank ``r`` the source rank's ``scatter_object_input_list[r]``, in
    ``scatter_object_output_list[0]``.

    Unpickles what the source sent: trusted peers only.

    Raises:
        ValueError: the output list is empty, or the input list has the wrong length on the
            source.
    """
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError(
            "Expected argument scatter_object_output_list to be a list of size at least 1."
        )
    pg = resolve(group)
    if pg is None:
        warn_not_in_group("scatter_object_list")
        return
    if src is None and group_src is None:  # torch 2.13: global rank 0
        src = 0
    root = canonical_rank(pg, src, group_src, "src")
    size, mine = pg.size(), root == pg.rank()
    if mine:
        inputs = _check_list(scatter_object_input_list, "scatter_object_input_list")
        if len(inputs) != size:
            raise ValueError(
                f"scatter_object_input_list must have one entry per rank of the group ({size}), "
                f"got {len(inputs)}"
            )
    STATE.flush()
    g = pg.mesh_group
    pieces = [_dump(o) for o in scatter_object_input_list or []] if mine else []
    sizes = np.array([p.size for p in pieces], dtype=np.int64) if mine else None
    sizes = g.broadcast(sizes, root, shape=(size,), dtype=np.int64)
    width = int(sizes.max())
    table = _padded(pieces, width) if mine else None
    row = g.scatter(table, root, shape=(width,), dtype=np.uint8)
    scatter_object_output_list[0] = _load(row[: int(sizes[pg.rank()])])


@public
def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: Any = None,
    device: Any = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send the objects of ``object_list`` to ``dst`` (one message of pickled bytes).

    Raises:
        ValueError: this rank is not in ``group``, bad or own ``dst``.
    """
    _check_list(object_list, "object_list")
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    peer = canonical_rank(pg, dst, group_dst, "dst")
    if peer == pg.rank():
        raise ValueError(
            "Invalid destination rank: destination rank should not be the same as the rank "
            "of the current process."
        )
    pg.mesh_group.send(_dump(list(object_list)), peer)


@public
def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: Any = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    """Receive objects sent with :func:`send_object_list` into ``object_list``.

    Unpickles what the sender sent: trusted peers only.

    Returns:
        The sender's global rank.

    Raises:
        ValueError: this rank is not in ``group``.
        DistBackendError: the sender sent a different number of objects, or no objects.
    """
    _check_list(object_list, "object_list")
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    peer = None if src is None and group_src is None else canonical_rank(pg, src, group_src, "src")
    STATE.flush()
    raw, source = pg.mesh_group.recv(peer, return_source=True)
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise DistBackendError(
            f"recv_object_list: rank {pg.global_rank_of(source)} sent a {raw.dtype} tensor of "
            f"shape {raw.shape}, not objects (was it a plain send?)"
        )
    got = _load(raw)
    if not isinstance(got, list) or len(got) != len(object_list):
        count = len(got) if isinstance(got, list) else "no list"
        raise DistBackendError(
            f"recv_object_list: rank {pg.global_rank_of(source)} sent {count} objects but "
            f"object_list has room for {len(object_list)}"
        )
    object_list[:] = got
    return pg.global_rank_of(source)
