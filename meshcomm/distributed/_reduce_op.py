"""``ReduceOp`` with torch's names and values, the deprecated ``reduce_op``, and the mapping
onto meshcomm's :class:`~meshcomm.reduction.ReduceOp`.

As in torch, ``ReduceOp.SUM`` is a member of the ``ReduceOp.RedOpType`` enum, and a
``ReduceOp`` instance can carry the factor of ``PREMUL_SUM``
(:func:`_make_nccl_premul_sum`, torch's private spelling, kept for scripts that use it).

Example:
    >>> ReduceOp.SUM, ReduceOp.PRODUCT.value
    (<RedOpType.SUM: 0>, 2)
    >>> to_meshcomm(ReduceOp.AVG), to_meshcomm(_make_nccl_premul_sum(2.0))
    ((<ReduceOp.AVG: 'avg'>, None), (<ReduceOp.PREMUL_SUM: 'premul_sum'>, 2.0))
"""

from __future__ import annotations

import enum
import warnings
from typing import Any

from meshcomm.reduction import ReduceOp as _MeshOp
from meshcomm.reduction import parse_op

__all__ = ["ReduceOp", "_make_nccl_premul_sum", "reduce_op", "supports_complex", "to_meshcomm"]


class RedOpType(enum.IntEnum):
    """The reduce operations, numbered as in torch."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8

    def __str__(self) -> str:
        return f"RedOpType.{self.name}"  # as torch prints it (IntEnum would print the number)


_TO_MESH = {
    RedOpType.SUM: _MeshOp.SUM,
    RedOpType.AVG: _MeshOp.AVG,
    RedOpType.PRODUCT: _MeshOp.PROD,
    RedOpType.MIN: _MeshOp.MIN,
    RedOpType.MAX: _MeshOp.MAX,
    RedOpType.BAND: _MeshOp.BAND,
    RedOpType.BOR: _MeshOp.BOR,
    RedOpType.BXOR: _MeshOp.BXOR,
    RedOpType.PREMUL_SUM: _MeshOp.PREMUL_SUM,
}


class ReduceOp:
    """A reduce operation: ``ReduceOp.SUM``, ``AVG``, ``PRODUCT``, ``MIN``, ``MAX``, ``BAND``,
    ``BOR``, ``BXOR`` and ``PREMUL_SUM`` (with a factor).

    ``BAND``/``BOR``/``BXOR`` need integer or bool tensors; ``AVG`` and ``PREMUL_SUM`` need
    floating-point ones (meshcomm computes them on every backend, where torch's gloo does not).

    Args:
        op: a ``RedOpType`` member.
        factor: the scalar of ``PREMUL_SUM``.

    Example:
        >>> ReduceOp(ReduceOp.MAX) == ReduceOp.MAX
        True
    """

    RedOpType = RedOpType
    SUM = RedOpType.SUM
    AVG = RedOpType.AVG
    PRODUCT = RedOpType.PRODUCT
    MIN = RedOpType.MIN
    MAX = RedOpType.MAX
    BAND = RedOpType.BAND
    BOR = RedOpType.BOR
    BXOR = RedOpType.BXOR
    PREMUL_SUM = RedOpType.PREMUL_SUM

    def __init__(self, op: int = RedOpType.SUM, factor: Any = None) -> None:
        self.op = RedOpType(int(op))
        self.factor = factor

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReduceOp):
            return (self.op, self.factor) == (other.op, other.factor)
        if isinstance(other, RedOpType):
            return self.op == other and self.factor is None
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.op)

    def __repr__(self) -> str:
        extra = "" if self.factor is None else f", factor={self.factor!r}"
        return f"ReduceOp({self.op.name}{extra})"


def _make_nccl_premul_sum(factor: Any) -> ReduceOp:
    """Return a ``PREMUL_SUM`` op that multiplies by ``factor`` before summing.

    Example:
        >>> _make_nccl_premul_sum(0.5)
        ReduceOp(PREMUL_SUM, factor=0.5)
    """
    return ReduceOp(RedOpType.PREMUL_SUM, factor)


def to_meshcomm(op: Any) -> tuple[_MeshOp, Any]:
    """Return meshcomm's op and the premul factor (or None) for a torch-style ``op``.

    Accepts ``ReduceOp`` members and instances, torch's own ``ReduceOp`` values, meshcomm's
    ``ReduceOp`` and names such as ``"sum"``.

    Raises:
        TypeError: ``op`` is not a reduce op at all.
        ValueError: an unknown name, or ``PREMUL_SUM`` without a factor.

    Example:
        >>> to_meshcomm(ReduceOp.BXOR)
        (<ReduceOp.BXOR: 'bxor'>, None)
    """
    factor = None
    if isinstance(op, ReduceOp):
        op, factor = op.op, op.factor
    elif type(op).__name__ == "ReduceOp" and hasattr(op, "op"):  # torch's ReduceOp instance
        op = op.op
    if isinstance(op, RedOpType):
        mesh = _TO_MESH[op]
    elif isinstance(op, (str, _MeshOp)) or hasattr(op, "name"):
        mesh = parse_op(op)
    else:
        raise TypeError(f"op must be a ReduceOp, got {type(op).__name__} {op!r}")
    if mesh is _MeshOp.PREMUL_SUM and factor is None:
        raise ValueError("ReduceOp.PREMUL_SUM needs a factor: use _make_nccl_premul_sum(factor)")
    return mesh, factor


def supports_complex(reduceOp: Any) -> bool:
    """Return True if ``reduceOp`` is defined for complex tensors (not MIN/MAX/PRODUCT/bitwise).

    Example:
        >>> supports_complex(ReduceOp.SUM), supports_complex(ReduceOp.MAX)
        (True, False)
    """
    mesh, _ = to_meshcomm(reduceOp)
    return mesh not in (
        _MeshOp.MIN,
        _MeshOp.MAX,
        _MeshOp.PROD,
        _MeshOp.BAND,
        _MeshOp.BOR,
        _MeshOp.BXOR,
    )


class _DeprecatedReduceOp:
    """``reduce_op``: the deprecated enum-like object; every attribute access warns."""

    def __init__(self) -> None:
        for member in RedOpType:
            object.__setattr__(self, member.name, member)
        object.__setattr__(self, "__members__", RedOpType.__members__)

    def __getattribute__(self, key: str) -> Any:
        if key.startswith("_"):  # introspection (help, doctest, pickle) stays quiet
            return object.__getattribute__(self, key)
        warnings.warn(
            "`meshcomm.distributed.reduce_op` is deprecated (as in torch), please use "
            "`meshcomm.distributed.ReduceOp` instead",
            FutureWarning,
            stacklevel=2,
        )
        return object.__getattribute__(self, key)


#: Deprecated alias of :class:`ReduceOp`'s members (``reduce_op.SUM``); warns on use.
reduce_op = _DeprecatedReduceOp()
