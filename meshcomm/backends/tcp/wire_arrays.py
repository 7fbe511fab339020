"""ARRAY frames' metadata: which dtypes travel, their wire names, and the shape.

An ARRAY frame (:mod:`meshcomm.backends.tcp.wire`) carries an array's dtype and shape in its
metadata: a u8 name length, the dtype's wire name (ASCII: ``dtype.str`` for numpy numbers,
the name for ml_dtypes types), a u8 dimension count, then one u64 per dimension, all
little-endian. The set of names is closed, so a peer can never make us build an arbitrary
dtype. No I/O here.

Example:
    >>> decode_array_meta(encode_array_meta("<f4", (2, 3)))
    (dtype('float32'), (2, 3))
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from meshcomm.errors import ProtocolError

__all__ = [
    "MAX_NDIM",
    "decode_array_meta",
    "dtype_from_wire",
    "dtype_to_wire",
    "encode_array_meta",
]

#: Most dimensions an ARRAY frame's shape may have.
MAX_NDIM = 64
_MAX_NDIM = MAX_NDIM
_U8 = struct.Struct("<B")

# ml_dtypes types travel by name (their dtype.str is "<V2" and says nothing); the list is
# closed on purpose so a peer can never make us build an arbitrary dtype.
_ML_NAMES = (
    "bfloat16",
    "float4_e2m1fn",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "int2",
    "int4",
    "uint2",
    "uint4",
)


def _ml_dtypes_table() -> dict[str, np.dtype]:
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes is a core dependency
        return {}
    return {n: np.dtype(getattr(ml_dtypes, n)) for n in _ML_NAMES if hasattr(ml_dtypes, n)}


_ML_DTYPES = _ml_dtypes_table()
_ML_BY_DTYPE = {dt: name for name, dt in _ML_DTYPES.items()}


def dtype_to_wire(dtype: np.dtype | type | str) -> str:
    """Return the wire name of a dtype: ``dtype.str`` for numpy numbers, the name for ml_dtypes.

    Raises:
        TypeError: the dtype cannot travel (object, structured, string, datetime, void).

    Example:
        >>> dtype_to_wire(np.float32), dtype_to_wire("bfloat16")
        ('<f4', 'bfloat16')
    """
    if isinstance(dtype, str) and dtype in _ML_DTYPES:
        return dtype
    dt = np.dtype(dtype)
    name = _ML_BY_DTYPE.get(dt)
    if name is not None and dt.name == name:
        return name
    if dt.kind in "biufc" and dt.fields is None and dt.subdtype is None:
        return dt.str
    raise TypeError(
        f"dtype {dt} cannot be sent: only bool, integer, float, complex and ml_dtypes "
        f"({', '.join(sorted(_ML_DTYPES))}) arrays travel"
    )


def dtype_from_wire(name: str) -> np.dtype:
    """Return the dtype a wire name stands for.

    Raises:
        ProtocolError: the name is not one :func:`dtype_to_wire` produces.

    Example:
        >>> dtype_from_wire("<i8")
        dtype('int64')
    """
    found = _ML_DTYPES.get(name)
    if found is not None:
        return found
    if 3 <= len(name) <= 4 and name[0] in "<>|" and name[1] in "biufc" and name[2:].isdigit():
        try:
            dt = np.dtype(name)
        except TypeError:
            dt = None
        if dt is not None and dt.str == name and dt not in _ML_BY_DTYPE:
            return dt
    raise ProtocolError(f"unknown dtype {name!r} in an ARRAY frame")


def encode_array_meta(dtype: np.dtype | type | str, shape: Sequence[int]) -> bytes:
    """Encode an ARRAY frame's metadata: dtype name, then the shape.

    Raises:
        TypeError: the dtype cannot travel.
        ValueError: more than 64 dimensions, or a negative dimension.

    Example:
        >>> decode_array_meta(encode_array_meta("<f4", (2, 3)))
        (dtype('float32'), (2, 3))
    """
    name = dtype_to_wire(dtype).encode("ascii")
    if len(shape) > _MAX_NDIM:
        raise ValueError(f"arrays sent may have at most {_MAX_NDIM} dimensions, got {len(shape)}")
    if any(d < 0 for d in shape):
        raise ValueError(f"array shape must not be negative, got {tuple(shape)}")
    dims = struct.pack(f"<{len(shape)}Q", *shape)
    return _U8.pack(len(name)) + name + _U8.pack(len(shape)) + dims


def decode_array_meta(meta: bytes | bytearray | memoryview) -> tuple[np.dtype, tuple[int, ...]]:
    """Decode what :func:`encode_array_meta` wrote.

    Raises:
        ProtocolError: the metadata is malformed (lengths, dtype name, dimensions).
    """
    meta = bytes(meta)
    if len(meta) < 2:
        raise ProtocolError(f"ARRAY metadata of {len(meta)} bytes is too short")
    name_len = meta[0]
    if len(meta) < 2 + name_len:
        raise ProtocolError(
            f"ARRAY metadata of {len(meta)} bytes is too short for a dtype name of {name_len}"
        )
    try:
        name = meta[1 : 1 + name_len].decode("ascii")
    except UnicodeDecodeError as exc:
        raise ProtocolError("ARRAY metadata: dtype name is not ASCII") from exc
    dtype = dtype_from_wire(name)
    ndim = meta[1 + name_len]
    dims_at = 2 + name_len
    if ndim > _MAX_NDIM or len(meta) != dims_at + 8 * ndim:
        raise ProtocolError(
            f"ARRAY metadata: {ndim} dimensions need {dims_at + 8 * ndim} bytes, got {len(meta)}"
        )
    shape = struct.unpack_from(f"<{ndim}Q", meta, dims_at)
    return dtype, tuple(shape)
