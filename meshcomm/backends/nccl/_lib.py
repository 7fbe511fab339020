"""NCCL through cupy, loaded on first use, and what NCCL can do with which dtype and op.

cupy's ``cupy.cuda.nccl`` binds the NCCL calls this backend makes (communicator init,
every collective, send/recv in groups, abort, the asynchronous error) and passes datatype
and op codes to NCCL as plain integers, so codes cupy names no constant for (bfloat16,
NCCL >= 2.10) work through it too: no binding of our own is needed for them.

NCCL reduces int8, uint8, int32, uint32, int64, uint64, float16, float32, float64 and
bfloat16 with sum, prod, min and max. meshcomm maps the rest where the meaning is exact:

* bool travels as uint8: ``sum``/``bor`` are ``max`` (logical or), ``prod``/``band`` are
  ``min`` (logical and). ``bxor`` has no NCCL op.
* complex sums are sums of the float pairs (``complex64`` as twice as many float32).
* Collectives that only move data (all_gather, broadcast, all_to_all, gather, scatter,
  send/recv) move bytes, so every dtype goes.

Anything else (int16, a bitwise op on integers, complex prod) raises ``TypeError`` saying
that NCCL lacks it, before any call.

Example:
    >>> import numpy as np
    >>> from meshcomm.reduction import ReduceOp
    >>> reduction_codes(np.dtype(np.bool_), ReduceOp.BOR, "all_reduce")
    (1, 2, 1)
    >>> reduction_codes(np.dtype(np.complex64), ReduceOp.SUM, "all_reduce")
    (7, 0, 2)
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from meshcomm.group.arrays import dtype_name
from meshcomm.reduction import ReduceOp

__all__ = [
    "BYTES",
    "UNIQUE_ID_BYTES",
    "id_from_bytes",
    "id_to_bytes",
    "load",
    "make_communicator",
    "reduction_codes",
]

#: ncclDataType_t values (nccl.h).
_INT8, _UINT8, _INT32, _UINT32, _INT64, _UINT64 = 0, 1, 2, 3, 4, 5
_FLOAT16, _FLOAT32, _FLOAT64, _BFLOAT16 = 6, 7, 8, 9
#: The datatype that moves raw bytes.
BYTES = _UINT8
#: ncclRedOp_t values (nccl.h).
_SUM, _PROD, _MAX, _MIN = 0, 1, 2, 3
#: Bytes of an ncclUniqueId.
UNIQUE_ID_BYTES = 128

_REDUCIBLE = {
    "int8": _INT8,
    "uint8": _UINT8,
    "int32": _INT32,
    "uint32": _UINT32,
    "int64": _INT64,
    "uint64": _UINT64,
    "float16": _FLOAT16,
    "float32": _FLOAT32,
    "float64": _FLOAT64,
    "bfloat16": _BFLOAT16,
}
_ARITHMETIC = {ReduceOp.SUM: _SUM, ReduceOp.PROD: _PROD, ReduceOp.MIN: _MIN, ReduceOp.MAX: _MAX}
_LOGICAL = {ReduceOp.SUM: _MAX, ReduceOp.BOR: _MAX, ReduceOp.MAX: _MAX}
_LOGICAL.update({ReduceOp.PROD: _MIN, ReduceOp.BAND: _MIN, ReduceOp.MIN: _MIN})
_COMPLEX_PARTS = {"complex64": _FLOAT32, "complex128": _FLOAT64}

_CUPY: Any = None
_NCCL: Any = None


def load() -> tuple[Any, Any]:
    """Import cupy and its NCCL binding; return ``(cupy, cupy.cuda.nccl)``.

    Raises:
        ImportError: cupy or NCCL is missing; the message names the extra to install.
    """
    global _CUPY, _NCCL
    if _NCCL is None:
        hint = (
            "the nccl backend needs cupy and NCCL: pip install 'meshcomm[cuda12]' or "
            "'meshcomm[cuda13]' (cupy-cuda12x / cupy-cuda13x with nvidia-nccl-cu12 / -cu13, "
            "matching your CUDA major version)"
        )
        try:
            cupy = importlib.import_module("cupy")
        except ImportError as exc:
            raise ImportError(f"{hint}; cupy: {exc}", name="cupy") from exc
        try:
            nccl = importlib.import_module("cupy.cuda.nccl")
        except ImportError as exc:
            raise ImportError(
                f"{hint}; cupy found, NCCL not: {exc}", name="cupy.cuda.nccl"
            ) from exc
        if not getattr(nccl, "available", False):
            raise ImportError(f"{hint}; cupy was built without NCCL", name="cupy.cuda.nccl")
        _CUPY, _NCCL = cupy, nccl
    return _CUPY, _NCCL


def reduction_codes(dtype: np.dtype, op: ReduceOp, what: str) -> tuple[int, int, int]:
    """NCCL's ``(datatype, op, elements per element)`` for reducing ``dtype`` with ``op``.

    Raises:
        TypeError: NCCL has no reduction for that pair (said with what to do instead).

    Example:
        >>> reduction_codes(np.dtype(np.float32), ReduceOp.MAX, "all_reduce")
        (7, 2, 1)
    """
    name = dtype_name(dtype)
    if name == "bool":
        code = _LOGICAL.get(op)
        if code is not None:
            return _UINT8, code, 1
    elif name in _REDUCIBLE:
        code = _ARITHMETIC.get(op)
        if code is not None:
            return _REDUCIBLE[name], code, 1
    elif name in _COMPLEX_PARTS and op is ReduceOp.SUM:
        return _COMPLEX_PARTS[name], _SUM, 2
    raise TypeError(
        f"{what}: NCCL has no {op.value} reduction for {name} (it reduces int8, uint8, "
        "int32, uint32, int64, uint64, float16, float32, float64 and bfloat16 with sum, "
        "prod, min and max; bool with and/or; complex with sum); reduce a host copy over "
        "the tcp or mpi backend instead"
    )


def id_to_bytes(unique_id: bytes | tuple[int, ...]) -> bytes:
    """cupy's unique id as the 128 bytes the store carries.

    cupy 14 hands the id out as ``bytes``; earlier versions as a tuple of signed chars.

    Example:
        >>> id_to_bytes((-1, 0, 1) + (0,) * 125)[:3]
        b'\\xff\\x00\\x01'
    """
    return bytes(b & 0xFF for b in unique_id)


def id_from_bytes(raw: bytes) -> bytes:
    """The id's 128 bytes, checked (what :func:`make_communicator` takes).

    Raises:
        ValueError: not :data:`UNIQUE_ID_BYTES` bytes.

    Example:
        >>> id_from_bytes(id_to_bytes((-1, 0, 1) + (0,) * 125))[:3]
        b'\\xff\\x00\\x01'
    """
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return bytes(raw)


def make_communicator(nccl: Any, size: int, unique_id: bytes, rank: int) -> Any:
    """``ncclCommInitRank`` through cupy, whichever form of the id this cupy takes.

    cupy 14 takes the id as ``bytes``; cupy 13 and earlier as a tuple of signed chars and
    refuse ``bytes`` with a ``TypeError`` before calling NCCL, so trying one form then the
    other is safe.
    """
    try:
        return nccl.NcclCommunicator(size, unique_id, rank)
    except TypeError:
        signed = tuple(b - 256 if b > 127 else b for b in unique_id)
        return nccl.NcclCommunicator(size, signed, rank)
