"""Collective fingerprints for ``MESHCOMM_DEBUG=DETAIL``: catch ranks that disagree.

Before each collective, every rank all-gathers a fixed-size int64 row describing what it
is about to run (op, sequence number, dtype, shape, root, reduce op, axes, a checksum of
other arguments, and whether its array is on a GPU or the host). Every rank sees the same
table, so on a mismatch every rank raises the same :class:`~meshcomm.errors.CommError`,
naming the disagreeing ranks and what each called.

Example:
    >>> row = encode("all_reduce", 3, dtype=np.dtype(np.float32), shape=(4, 2), reduce=ReduceOp.SUM)
    >>> describe(row)
    'all_reduce(seq=3, dtype=float32, shape=(4, 2), op=sum)'
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from meshcomm._arrays import SUPPORTED_DTYPES, dtype_name
from meshcomm.backends.base import Communicator
from meshcomm.errors import CommError
from meshcomm.reduction import ReduceOp

__all__ = ["DEBUG_ENV_VARS", "LENGTH", "check", "describe", "encode"]

#: Environment variables that turn fingerprint checks on (value ``DETAIL``).
DEBUG_ENV_VARS = ("MESHCOMM_DEBUG", "TORCH_DISTRIBUTED_DEBUG")

_OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "permute",
    "barrier",
    "split",
    "new_group",
    "grid_split",
)
_REDUCE_OPS = tuple(ReduceOp)
_DIMS = 6  # dims stored as such; longer shapes add a checksum
# op, seq, dtype, ndim, dims..., shape checksum, then the _TAIL fields
_TAIL = ("root", "op", "axis", "axis2", "tiled", "args", "device")
_HEAD = 4 + _DIMS + 1
#: int64 entries in one fingerprint.
LENGTH = _HEAD + len(_TAIL)


def _crc(value: object) -> int:
    return zlib.crc32(repr(value).encode())


def encode(
    op: str,
    seq: int,
    *,
    dtype: np.dtype | None = None,
    shape: tuple[int, ...] | None = None,
    root: int = -1,
    reduce: ReduceOp | None = None,
    axis: int = -1,
    axis2: int = -1,
    tiled: bool | None = None,
    args: object = None,
    on_device: bool | None = None,
) -> np.ndarray:
    """Return what this rank is about to run as a row of ``LENGTH`` int64 (-1: not set).

    ``on_device``: whether the caller's array lives on a GPU (ranks must agree: a GPU
    backend will move those arrays over its own communicators).
    """
    row = np.full(LENGTH, -1, dtype=np.int64)
    row[0], row[1] = _OPS.index(op), seq
    if dtype is not None:
        dt = np.dtype(dtype)
        row[2] = SUPPORTED_DTYPES.index(dt) if dt in SUPPORTED_DTYPES else 1000 + _crc(dt.str)
    if shape is not None:
        row[3] = len(shape)
        row[4 : 4 + min(len(shape), _DIMS)] = shape[:_DIMS]
        row[4 + _DIMS] = _crc(shape) if len(shape) > _DIMS else 0
    row[_HEAD:] = (
        root,
        -1 if reduce is None else _REDUCE_OPS.index(reduce),
        axis,
        axis2,
        -1 if tiled is None else int(tiled),
        -1 if args is None else _crc(args),
        -1 if on_device is None else int(on_device),
    )
    return row


def describe(row: np.ndarray) -> str:
    """Render a fingerprint row for an error message."""
    r = [int(v) for v in row]
    op = _OPS[r[0]] if 0 <= r[0] < len(_OPS) else f"op#{r[0]}"
    parts = [f"seq={r[1]}"]
    if r[2] >= 0:
        known = r[2] < len(SUPPORTED_DTYPES)
        parts.append(f"dtype={dtype_name(SUPPORTED_DTYPES[r[2]]) if known else r[2]}")
    if r[3] >= 0:
        dims = [str(d) for d in r[4 : 4 + min(r[3], _DIMS)]]
        if r[3] > _DIMS:
            dims.append("...")
        parts.append(f"shape=({', '.join(dims)}{',' if r[3] == 1 else ''})")
    for name, v in zip(_TAIL, r[_HEAD:], strict=True):
        if v == -1:
            continue
        if name == "op":
            parts.append(f"op={_REDUCE_OPS[v].value}")
        elif name == "tiled":
            parts.append(f"tiled={bool(v)}")
        elif name == "args":
            parts.append(f"args=#{v:08x}")
        elif name == "device":
            parts.append("on a GPU" if v else "on the host")
        else:
            parts.append(f"{name}={v}")
    return f"{op}({', '.join(parts)})"


def check(comm: Communicator, row: np.ndarray, ranks: Sequence[int], label: str) -> None:
    """All-gather ``row`` over ``comm``; raise on every rank if any two rows differ.

    Args:
        comm: the group's communicator.
        row: this rank's fingerprint (from :func:`encode`).
        ranks: the global rank of each group rank, for the message.
        label: names the operation, rank and group.

    Raises:
        CommError: the ranks are not all about to run the same collective.
    """
    size = comm.size
    gathered = np.empty(size * LENGTH, dtype=np.int64)
    comm.all_gather(row, gathered)
    rows = gathered.reshape(size, LENGTH)
    if all(np.array_equal(rows[0], rows[r]) for r in range(1, size)):
        return
    calls: dict[bytes, list[int]] = {}
    for r in range(size):
        calls.setdefault(rows[r].tobytes(), []).append(ranks[r])
    described = "; ".join(
        f"global ranks {members} called {describe(np.frombuffer(key, dtype=np.int64))}"
        for key, members in calls.items()
    )
    raise CommError(f"{label}: the ranks disagree on the collective: {described}")
