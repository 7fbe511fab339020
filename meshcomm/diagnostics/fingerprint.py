"""Collective fingerprints: catch ranks that disagree on the collective they call.

Two levels (``MESHCOMM_DEBUG``, read when a group is made; :func:`level`):

* default (unset, ``INFO`` or anything but the two below): every collective carries a
  62-bit *stamp* (:func:`stamp`): 16 bits of its sequence number and a 46-bit hash of its
  op, dtype, shape, reduce op, root, axes, other arguments and device kind
  (:func:`signature`). Backends that can carry it in frames they already send (tcp: the tag
  of every link frame, on sockets and shared-memory rings alike, and a word of the board)
  compare it on every receive; a difference raises
  :class:`~meshcomm.errors.MismatchError`, which the group layer turns into both calls in
  words (:mod:`meshcomm.group`).
* ``OFF``: no stamp, no check.
* ``DETAIL``: the full check below, before each collective (no stamps).

With ``DETAIL``, before each collective, every rank all-gathers a fixed-size int64 row
describing what it is about to run (op, sequence number, dtype, shape, root, reduce op,
axes, a checksum of other arguments, and whether its array is on a GPU or the host). Every
rank sees the same table, so on a mismatch every rank raises the same
:class:`~meshcomm.errors.CommError`, naming the disagreeing ranks and what each called.

Example:
    >>> row = encode("all_reduce", 3, dtype=np.dtype(np.float32), shape=(4, 2), reduce=ReduceOp.SUM)
    >>> describe(row)
    'all_reduce(seq=3, dtype=float32, shape=(4, 2), op=sum)'
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshcomm.backends.base import Communicator
from meshcomm.errors import CommError, MismatchError
from meshcomm.group.arrays import SUPPORTED_DTYPES, dtype_name
from meshcomm.reduction import ReduceOp

__all__ = [
    "DEBUG_ENV_VARS",
    "DETAIL",
    "LENGTH",
    "OFF",
    "ON",
    "SEQ_BITS",
    "STAMP_BITS",
    "base",
    "check",
    "check_first",
    "describe",
    "describe_call",
    "encode",
    "level",
    "signature",
    "signature_of",
    "stamp",
    "stamp_seq",
]

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


#: Debug levels (see the module docstring).
OFF, ON, DETAIL = "OFF", "ON", "DETAIL"


def level() -> str:
    """The debug level the environment asks for: :data:`DETAIL` if ``MESHCOMM_DEBUG`` or
    ``TORCH_DISTRIBUTED_DEBUG`` says ``DETAIL``, :data:`OFF` if ``MESHCOMM_DEBUG`` says
    ``OFF``, else :data:`ON` (the default: stamps).

    Example:
        >>> level() in (OFF, ON, DETAIL)
        True
    """
    values = [os.environ.get(k, "").strip().upper() for k in DEBUG_ENV_VARS]
    if DETAIL in values:
        return DETAIL
    return OFF if values[0] == OFF else ON


#: Bits of a stamp, and of the sequence number in it (the low bits).
STAMP_BITS, SEQ_BITS = 62, 16
_SEQ_MASK = (1 << SEQ_BITS) - 1
_SIG_MASK = (1 << (STAMP_BITS - SEQ_BITS)) - 1
_BASES: dict[tuple[Any, ...], int] = {}


def base(
    op: str,
    dtype: np.dtype | None = None,
    reduce: ReduceOp | None = None,
    root: int = -1,
    axis: int = -1,
    axis2: int = -1,
) -> int:
    """The part of a call's signature known from its op, dtype, reduce op, root and axes (cached).

    Deterministic across processes (CRC-32 of the words, never ``hash`` of a string, which
    Python salts per process).
    """
    key = (op, dtype, reduce, root, axis, axis2)
    value = _BASES.get(key)
    if value is None:
        words = (op, None if dtype is None else np.dtype(dtype).str, getattr(reduce, "value", None))
        value = _crc((*words, int(root), int(axis), int(axis2)))
        if len(_BASES) < 4096:
            _BASES[key] = value
    return value


def signature(
    first: int, shape: tuple[int, ...] | None, tiled: int = -1, args: int = -1, device: int = 0
) -> int:
    """A call's 46-bit signature from its :func:`base` and the rest (ints only, so that
    ``hash`` is the same in every process).

    Example:
        >>> b = base("all_reduce", np.dtype(np.float32), ReduceOp.SUM)
        >>> signature(b, (4,)) == signature(b, (4,)) != signature(b, (2, 2))
        True
    """
    return hash((first, tiled, args, device, -1 if shape is None else shape)) & _SIG_MASK


def signature_of(op: str, fields: dict[str, Any], on_device: bool) -> int:
    """:func:`signature` of a lowered call's fingerprint ``fields`` (the general path)."""
    tiled = fields.get("tiled")
    args = _args_of(fields.get("args"), fields.get("tree"), fields.get("uargs"))
    first = base(
        op,
        fields.get("dtype"),
        fields.get("reduce"),
        fields.get("root", -1),
        fields.get("axis", -1),
        fields.get("axis2", -1),
    )
    return signature(
        first,
        fields.get("shape"),
        -1 if tiled is None else int(tiled),
        -1 if args is None else _crc(args),
        int(on_device),
    )


def _args_of(args: object, tree: str | None, uargs: object) -> object:
    """The value whose checksum stands for a call's other arguments: ``args`` alone, or with
    what the ops layer adds (the pytree's structure, the op's own arguments) when it does.

    A packed pytree moves one buffer whose dtype and shape say nothing of the leaves it
    holds, so ranks that packed different trees (other keys, leaf shapes, axes) would
    exchange bytes each reads wrongly: the tree joins the signature the checks compare.
    """
    if tree is None and uargs is None:
        return args
    return (args, tree, uargs)


def stamp(sig: int, seq: int) -> int:
    """The stamp of call ``seq`` with signature ``sig``: in ``[0, 2**62)``, the sequence
    number's low :data:`SEQ_BITS` in its low bits.

    Example:
        >>> stamp(5, 3) & 0xFFFF, stamp(5, 3) >> 16
        (3, 5)
    """
    return (sig << SEQ_BITS) | (seq & _SEQ_MASK)


def stamp_seq(theirs: int, near: int) -> int:
    """The sequence number a stamp was made for: the one nearest ``near`` (this rank's)
    with the stamp's low bits.

    Example:
        >>> stamp_seq(stamp(5, 70000), 69999)
        70000
    """
    low = theirs & _SEQ_MASK
    guess = (near & ~_SEQ_MASK) | low
    candidates = (guess - (1 << SEQ_BITS), guess, guess + (1 << SEQ_BITS))
    return min((c for c in candidates if c > 0), key=lambda c: abs(c - near), default=low)


def describe_call(
    name: str,
    dtype: Any = None,
    shape: Any = None,
    reduce: Any = None,
    root: Any = None,
    device: bool = False,
    *,
    tree: str | None = None,
    args: Sequence[str] = (),
    over: str | None = None,
) -> str:
    """A call in the user's words: ``psum(float32[4], sum)``, ``broadcast(int64[2, 3], root=1)``.

    ``tree``: the pytree the user passed (``{'b': float32[2], 'w': float32[3]}``), shown
    instead of the buffer it was packed into; ``args``: other arguments to show
    (``"tiled=True"``); ``over``: the mesh axes the user named (``"'tp'"``).

    Example:
        >>> describe_call("all_reduce", np.dtype(np.float32), (4,), ReduceOp.SUM)
        'all_reduce(float32[4], sum)'
        >>> describe_call("barrier")
        'barrier()'
        >>> describe_call("all_gather", "float32", (4,), args=["tiled=True"], over="'tp'")
        "all_gather(float32[4], tiled=True) over 'tp'"
    """
    parts = []
    if tree is not None:
        parts.append(tree)
    elif dtype is not None:
        dims = "" if shape is None else ", ".join(str(int(d)) for d in shape)
        # A name as a ledger record has it (maybe another process's), or a dtype.
        kind = dtype if isinstance(dtype, str) else dtype_name(np.dtype(dtype))
        parts.append(f"{kind}[{dims}]")
    if reduce is not None:
        parts.append(str(getattr(reduce, "value", reduce)))
    if root is not None and root != -1:
        parts.append(f"root={root}")
    parts.extend(args)
    if device:
        parts.append("on a GPU")
    return f"{name}({', '.join(parts)})" + ("" if over is None else f" over {over}")


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
    tree: str | None = None,
    uargs: object = None,
    over: str | None = None,
) -> np.ndarray:
    """Return what this rank is about to run as a row of ``LENGTH`` int64 (-1: not set).

    ``on_device``: whether the caller's array lives on a GPU (ranks must agree: a GPU
    backend will move those arrays over its own communicators). ``tree``, ``uargs``: what
    the ops layer adds (a pytree's structure, the op's own arguments), checked with
    ``args``; ``over``: the axes the user named, words only (the group is the check).
    """
    args = _args_of(args, tree, uargs)
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


#: Bytes of one rank's words in :func:`check_first`'s second round (UTF-8, cut to fit):
#: room for a pytree's structure; the round runs only when the calls differ.
WORDS = 1024


def check_first(
    comm: Communicator,
    row: np.ndarray,
    ranks: Sequence[int],
    label: str,
    mine: Callable[[], str],
    gather: Callable[[np.ndarray, np.ndarray], None] | None = None,
    render: Callable[[list[str]], list[str]] | None = None,
) -> None:
    """The default check where the backend carries no stamps (mpi): all-gather ``row``
    (from :func:`encode`) before the first call of a signature; if any two rows differ,
    all-gather every rank's call in words (``mine()``: ``"psum(float32[4], sum) at
    train.py:12 (op #3)"``, at most :data:`WORDS` bytes) and raise on every rank.

    Every rank sees the same tables, so every rank raises the same words.

    Args:
        comm: the group's communicator.
        row: this rank's fingerprint.
        ranks: the global rank of each group rank.
        label: names the group (``"over 'tp'"``).
        mine: this rank's call in words (called only on a mismatch).
        gather: the all_gather to use (default ``comm.all_gather``; mpi's
            ``check_all_gather`` keeps checks off the collectives' communicator).
        render: every rank's ``mine()`` (in group rank order) to the words shown for each
            (default: as they are); the same on every rank, so it may show only the
            fields in which the calls differ.

    Raises:
        MismatchError: the ranks are not all about to run the same collective.
    """
    size = comm.size
    all_gather = gather or comm.all_gather
    gathered = np.empty(size * LENGTH, dtype=np.int64)
    all_gather(row, gathered)
    rows = gathered.reshape(size, LENGTH)
    if all(np.array_equal(rows[0], rows[r]) for r in range(1, size)):
        return
    text = np.zeros(WORDS, np.uint8)
    raw = mine().encode()[:WORDS]
    text[: len(raw)] = np.frombuffer(raw, np.uint8)
    texts = np.empty(size * WORDS, np.uint8)
    all_gather(text, texts)
    each = [
        bytes(texts[r * WORDS : (r + 1) * WORDS]).rstrip(b"\0").decode(errors="replace")
        for r in range(size)
    ]
    if render is not None:
        each = render(each)
    calls: dict[str, list[int]] = {}
    for r in range(size):
        calls.setdefault(each[r], []).append(ranks[r])
    if len(calls) == 1:  # they differ where the words do not look (axis, tiled, args)
        calls = {}
        for r in range(size):
            calls.setdefault(describe(rows[r]), []).append(ranks[r])
    described = "; ".join(
        f"{'rank' if len(members) == 1 else 'ranks'} {', '.join(map(str, members))} called {words}"
        for words, members in calls.items()
    )
    raise MismatchError(f"ranks disagree on the collective {label}: {described}")
