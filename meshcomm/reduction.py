"""Reduce operations: names, dtype rules, and the numpy kernels every backend shares."""

from __future__ import annotations

import enum

import numpy as np

from meshcomm.errors import InvalidArgument

__all__ = [
    "OP_KINDS",
    "PRIMITIVE_OPS",
    "PRIMITIVE_OP_KINDS",
    "ReduceOp",
    "check_op_dtype",
    "combine",
    "parse_op",
]


class ReduceOp(str, enum.Enum):
    """A reduction. ``AVG`` and ``PREMUL_SUM`` are composed from ``SUM`` above the backends.

    Example:
        >>> ReduceOp("sum") is ReduceOp.SUM
        True
    """

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    PREMUL_SUM = "premul_sum"

    # Enum's own __hash__ is Python code; ops are dictionary keys on every collective's hot
    # path, and str's hash agrees with the equality this str mix-in already has.
    __hash__ = str.__hash__


_ALIASES = {"product": ReduceOp.PROD, "mean": ReduceOp.AVG}

_UFUNCS: dict[ReduceOp, np.ufunc] = {
    ReduceOp.SUM: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

_BITWISE = {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}
_ORDERED = {ReduceOp.MIN, ReduceOp.MAX}
_INEXACT_ONLY = {ReduceOp.AVG, ReduceOp.PREMUL_SUM}

#: The ops backends implement; avg and premul_sum are composed from sum above them.
PRIMITIVE_OPS = frozenset(_UFUNCS)


def _defined(op: ReduceOp, kind: str) -> bool:
    if op in _ORDERED:
        return kind != "c"  # complex numbers have no order
    if op in _BITWISE:
        return kind in "biu"
    if op in _INEXACT_ONLY:
        return kind in "fcV"
    return True


#: Every (op, dtype kind) pair a reduction is defined for (kind ``V``: ml_dtypes' bfloat16
#: and float8 types). The one statement of the rules: the group and ops layers and the
#: backends' fast paths test membership, a set lookup where ``check_op_dtype`` would format
#: a dtype name, and ``check_op_dtype`` says why a pair is missing.
OP_KINDS = frozenset((op, kind) for op in ReduceOp for kind in "biufcV" if _defined(op, kind))
#: The pairs of :data:`OP_KINDS` whose op is primitive: what a backend may be handed.
PRIMITIVE_OP_KINDS = frozenset(pair for pair in OP_KINDS if pair[0] in PRIMITIVE_OPS)


def parse_op(op: str | ReduceOp) -> ReduceOp:
    """Return the ``ReduceOp`` named by ``op`` (case-insensitive; ``ReduceOp`` passes through).

    Raises:
        InvalidArgument: the name is not a reduce op; lists the valid names.

    Example:
        >>> parse_op("MAX")
        <ReduceOp.MAX: 'max'>
    """
    if isinstance(op, ReduceOp):
        return op
    name = getattr(op, "name", op)  # accepts foreign enums such as torch's ReduceOp.SUM
    if isinstance(name, str):
        lowered = name.lower()
        if lowered in _ALIASES:
            return _ALIASES[lowered]
        try:
            return ReduceOp(lowered)
        except ValueError:
            pass
    valid = ", ".join(o.value for o in ReduceOp)
    raise InvalidArgument(f"unknown reduce op {op!r}; valid ops: {valid}")


def check_op_dtype(op: ReduceOp, dtype: np.dtype) -> None:
    """Raise ``TypeError`` when ``op`` is undefined for ``dtype``.

    Complex numbers have no order (min/max) and no bits (band/bor/bxor); floats have no bits;
    avg and premul_sum need an inexact (float or complex) dtype.

    Example:
        >>> check_op_dtype(ReduceOp.MAX, np.dtype("complex64"))
        Traceback (most recent call last):
        ...
        TypeError: reduce op 'max' is not defined for complex64 (complex numbers have no order)
    """
    dtype = np.dtype(dtype)
    kind = dtype.kind  # the name only when raising: numpy builds it in Python, per call
    if (op, kind) in OP_KINDS:
        return
    if op in _ORDERED and kind == "c":
        raise TypeError(
            f"reduce op {op.value!r} is not defined for {dtype.name} (complex numbers have no "
            "order)"
        )
    if op in _BITWISE and kind not in "biu":
        raise TypeError(f"reduce op {op.value!r} needs a bool or integer dtype, got {dtype.name}")
    if op in _INEXACT_ONLY and kind not in "fcV":
        raise TypeError(
            f"reduce op {op.value!r} needs a float or complex dtype, got {dtype.name}; "
            "use 'sum' and divide"
        )


def combine(op: ReduceOp, acc: np.ndarray, other: np.ndarray) -> None:
    """Reduce ``other`` into ``acc`` in place: ``acc = op(acc, other)``.

    ``op`` must be a primitive op (not ``AVG`` or ``PREMUL_SUM``, which compose from ``SUM``).

    Example:
        >>> acc = np.array([1, 5]); combine(ReduceOp.MAX, acc, np.array([3, 2])); acc
        array([3, 5])
    """
    ufunc = _UFUNCS.get(op)
    if ufunc is None:
        raise InvalidArgument(f"reduce op {op.value!r} is composed above the backend, not combined")
    # On bool, numpy's add/multiply are logical or/and: what sum/prod mean for bool.
    ufunc(acc, other, out=acc)
