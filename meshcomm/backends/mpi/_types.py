"""numpy dtypes and meshcomm reduce ops as MPI datatypes and MPI ops.

Data that is only moved (gathers, broadcasts, all-to-all, point to point) travels as
``MPI_BYTE``: every dtype moves the same way. Reductions use MPI's own datatype and op where
MPI defines them, so the MPI library reduces in C:

====================  =========================  ==========================================
dtype                 MPI datatype               ops
====================  =========================  ==========================================
int8..int64, uint*    MPI_INT8_T..MPI_UINT64_T   all seven, native
float32, float64      MPI_FLOAT, MPI_DOUBLE      sum prod min max, native
complex64/128         MPI_C_*_COMPLEX            sum prod, native
float16               MPIX_C_FLOAT16 if the      native when the library has it (MPICH),
                      library has it             else a user-defined op
bfloat16              MPIX_BFLOAT16 if any       a user-defined op (numpy over the raw bytes)
bool                  MPI_UINT8_T                sum/max -> BOR, prod/min -> BAND, bxor (numpy
                                                 bool sum is a logical or, prod a logical and)
====================  =========================  ==========================================

User-defined ops (``MPI.Op.Create``, commutative) view MPI's raw buffers as the numpy dtype
and apply the same ufunc as :func:`meshcomm.reduction.combine`; they are created once per
(dtype, op) and live as long as the process. ``MESHCOMM_MPI_USER_OPS=1`` sends float16 through
them too (tests use it to cover both paths).

Float min/max: MPI's native MIN/MAX do not promise numpy's NaN propagation; results with NaN
inputs may differ from the tcp backend's.

Example:
    >>> import numpy as np
    >>> bool_op_name(ReduceOp.PROD)
    'BAND'
    >>> native_name(np.dtype("uint64"))
    'UINT64_T'
"""

from __future__ import annotations

import os
import threading
from typing import Any, NamedTuple

import numpy as np

from meshcomm.backends.mpi._lib import load
from meshcomm.reduction import ReduceOp, combine

__all__ = ["USER_OPS_ENV", "Reduction", "bool_op_name", "native_name", "reduction"]

#: Set to 1 to reduce float16 through a user-defined op even where MPI has a native type.
USER_OPS_ENV = "MESHCOMM_MPI_USER_OPS"

_NATIVE = {
    "int8": "INT8_T",
    "int16": "INT16_T",
    "int32": "INT32_T",
    "int64": "INT64_T",
    "uint8": "UINT8_T",
    "uint16": "UINT16_T",
    "uint32": "UINT32_T",
    "uint64": "UINT64_T",
    "float16": "FLOAT16_T",
    "float32": "FLOAT",
    "float64": "DOUBLE",
    "complex64": "C_FLOAT_COMPLEX",
    "complex128": "C_DOUBLE_COMPLEX",
    "bfloat16": "BFLOAT16_T",
    "bool": "UINT8_T",
}
# Holders of raw bytes for user-defined ops: one MPI element is one numpy element.
_RAW = {1: "UINT8_T", 2: "UINT16_T", 4: "UINT32_T", 8: "UINT64_T"}
_BOOL_OPS = {
    ReduceOp.SUM: "BOR",
    ReduceOp.MAX: "BOR",
    ReduceOp.BOR: "BOR",
    ReduceOp.PROD: "BAND",
    ReduceOp.MIN: "BAND",
    ReduceOp.BAND: "BAND",
    ReduceOp.BXOR: "BXOR",
}
_OP_NAMES = {
    ReduceOp.SUM: "SUM",
    ReduceOp.PROD: "PROD",
    ReduceOp.MIN: "MIN",
    ReduceOp.MAX: "MAX",
    ReduceOp.BAND: "BAND",
    ReduceOp.BOR: "BOR",
    ReduceOp.BXOR: "BXOR",
}


class Reduction(NamedTuple):
    """How one (dtype, op) reduces in MPI.

    Attributes:
        datatype: the MPI datatype of one element.
        op: the MPI op.
        user_defined: True when ``op`` is ours (Python code, host memory only).
    """

    datatype: Any
    op: Any
    user_defined: bool


_CACHE: dict[tuple[np.dtype, ReduceOp], Reduction] = {}
_LOCK = threading.Lock()


def native_name(dtype: np.dtype) -> str:
    """Return the name of the ``mpi4py.MPI`` datatype that holds ``dtype`` for reductions."""
    return _NATIVE[np.dtype(dtype).name]


def bool_op_name(op: ReduceOp) -> str:
    """Return the MPI op that computes numpy's bool reduction ``op`` on 0/1 bytes."""
    return _BOOL_OPS[op]


def reduction(dtype: np.dtype, op: ReduceOp) -> Reduction:
    """Return the MPI datatype and op that reduce ``dtype`` with the primitive ``op``.

    Raises:
        TypeError: ``dtype`` is not one meshcomm supports (checked above, so a bug here).
    """
    key = (dtype, op)
    found = _CACHE.get(key)
    if found is not None:
        return found
    with _LOCK:
        found = _CACHE.get(key)
        if found is None:
            found = _CACHE[key] = _make(dtype, op)
    return found


def _make(dtype: np.dtype, op: ReduceOp) -> Reduction:
    mpi = load()
    name = dtype.name
    if name not in _NATIVE:
        raise TypeError(f"the mpi backend cannot reduce dtype {name}")
    if name == "bool":
        return Reduction(mpi.UINT8_T, getattr(mpi, _BOOL_OPS[op]), False)
    datatype = getattr(mpi, _NATIVE[name], None)
    force_user = name == "float16" and os.environ.get(USER_OPS_ENV, "").strip() == "1"
    if (
        datatype is not None
        and datatype != mpi.DATATYPE_NULL
        and not force_user
        and (dtype.kind != "f" or dtype.itemsize >= 4 or _native_works(mpi, datatype, op))
    ):
        return Reduction(datatype, getattr(mpi, _OP_NAMES[op]), False)
    return Reduction(getattr(mpi, _RAW[dtype.itemsize]), _user_op(dtype, op), True)


_PROBED: dict[tuple[int, str], bool] = {}


def _native_works(mpi: Any, datatype: Any, op: ReduceOp) -> bool:
    """Whether the library really reduces a half-precision extension type with ``op``.

    MPIX types are extensions: a library may define the type but not every op on it. One
    local MPI_Reduce_local (no communication) answers on MPICH, which returns an error for
    an unsupported pair. Other libraries are not asked: Open MPI 4.1 crashes (SIGSEGV in
    MPI_Reduce_local, seen with float16) instead of returning an error, so they get the
    user-defined op, which is correct everywhere.
    """
    key = (int(datatype.handle), op.value)
    if key not in _PROBED and not mpi.Get_library_version().startswith("MPICH"):
        _PROBED[key] = False
    if key not in _PROBED:
        a = np.ones(2, np.uint16)
        b = np.ones(2, np.uint16)
        try:
            getattr(mpi, _OP_NAMES[op]).Reduce_local([a, 2, datatype], [b, 2, datatype])
            _PROBED[key] = True
        except mpi.Exception:
            _PROBED[key] = False
    return _PROBED[key]


_USER_OPS: dict[tuple[np.dtype, ReduceOp], Any] = {}


def _user_op(dtype: np.dtype, op: ReduceOp) -> Any:
    """Create (once) the commutative user-defined MPI op computing ``op`` on ``dtype``."""
    key = (dtype, op)
    if key not in _USER_OPS:

        def apply(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            # MPI: inoutbuf = inbuf (op) inoutbuf; every op here is commutative.
            combine(op, np.frombuffer(inoutbuf, dtype=dtype), np.frombuffer(inbuf, dtype=dtype))

        _USER_OPS[key] = load().Op.Create(apply, commute=True)
    return _USER_OPS[key]
