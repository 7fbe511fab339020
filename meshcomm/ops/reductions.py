"""All-reduce by axis name: ``psum``, ``pmean``, ``pmax``, ``pmin``, ``pprod``, ``all_reduce``.

Every rank of each group along the axis gets the reduction of the group's inputs::

    psum(x, "tp") on a (2, 4) mesh, x = [rank]:

          tp=0 tp=1 tp=2 tp=3                 tp=0 tp=1 tp=2 tp=3
    dp=0 [ 0]  [ 1]  [ 2]  [ 3]   ──►   dp=0 [ 6]  [ 6]  [ 6]  [ 6]
    dp=1 [ 4]  [ 5]  [ 6]  [ 7]         dp=1 [22]  [22]  [22]  [22]

Example:
    >>> import numpy as np
    >>> import meshcomm.world as world
    >>> from meshcomm.mesh import init_device_mesh
    >>> mesh = init_device_mesh((1, 1), ("dp", "tp"))  # a world of one here
    >>> psum({"w": np.ones(2), "b": np.int32(3)}, ("dp", "tp"), mesh=mesh)
    {'w': array([1., 1.]), 'b': array(3, dtype=int32)}
    >>> world.shutdown()
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from meshcomm.errors import InvalidArgument
from meshcomm.group.arrays import SUPPORTED_DTYPES
from meshcomm.ops import _calls, _torch_stage, _transpose
from meshcomm.ops._autodiff import Call, apply, grad_kind
from meshcomm.ops._calls import Collectives
from meshcomm.ops._native import numpy_of_tensor, tensor_of_numpy
from meshcomm.ops._resolve import Axis, AxisName, resolve
from meshcomm.ops.pytree import Kernel, run
from meshcomm.reduction import OP_KINDS, ReduceOp, check_op_dtype, parse_op

if TYPE_CHECKING:
    from meshcomm.mesh import DeviceMesh

__all__ = ["all_reduce", "pmax", "pmean", "pmin", "pprod", "psum"]


class _Reduce(Kernel):
    """All-reduce each leaf with ``op``; ``psum``/``pmean`` follow JAX's dtype rules."""

    def __init__(
        self, op: ReduceOp, factor: Any, size: int, *, jax_bool: bool = False, mean: bool = False
    ) -> None:
        self.op, self.factor, self.size = op, factor, size
        self.jax_bool, self.mean = jax_bool, mean

    def check(self, arr: Any, where: str) -> tuple[Any, Any]:
        kind = arr.dtype.kind
        if self.jax_bool and kind == "b":
            arr = arr.astype(np.int32)  # as jax.lax.psum: booleans are summed as int32
            kind = "i"
        op = self.op
        if (op is ReduceOp.PREMUL_SUM) != (self.factor is not None):
            raise InvalidArgument(
                f"{where}: factor= goes with op 'premul_sum' and only there; got op "
                f"{op.value!r} and factor={self.factor!r}"
            )
        divide = None
        if self.mean and kind in "biu":
            # As JAX (with x64): sum as ints, then divide as float32, float64 for 64-bit ints.
            op, divide = ReduceOp.SUM, np.dtype(np.float64 if arr.itemsize == 8 else np.float32)
        if not _allowed(op, kind):
            try:
                check_op_dtype(op, arr.dtype)  # raises, with the reason
            except TypeError as exc:
                raise TypeError(f"{where}: {exc}") from None
        return arr, (arr.shape, op, divide)

    def needs_finish(self, meta: Any) -> bool:
        return meta[2] is not None

    def unpacked(self, group: Collectives, arr: Any, meta: Any, async_op: bool) -> Any:
        return group.all_reduce(arr, meta[1], factor=self.factor, async_op=async_op)

    def call(self, group: Collectives, buf: Any, async_op: bool) -> Any:
        # Leaves of one bucket share a dtype, hence the op (the meta's) of its first leaf.
        op = self._bucket_op(buf.dtype)
        return group.all_reduce(buf.reshape(-1), op, factor=self.factor, async_op=async_op)

    def _bucket_op(self, dtype: np.dtype) -> ReduceOp:
        if self.mean and np.dtype(dtype).kind in "biu":
            return ReduceOp.SUM
        return self.op

    def unpack(self, result: Any, cols: slice, meta: Any) -> Any:
        return result[cols].reshape(meta[0])

    def finish(self, out: Any, meta: Any) -> Any:
        if meta[2] is None:
            return out
        mean = out.astype(meta[2])
        mean /= meta[2].type(self.size)  # in place: a 0-d result stays an array
        return mean

    def local(self, arr: Any, meta: Any) -> Any:
        return self.finish(arr.copy(), meta)


_ORDERED = (ReduceOp.MIN, ReduceOp.MAX)


#: Native-order dtypes a reduction takes as they are (bool, which psum and pmean sum as
#: int32, and byte-swapped or unsupported arrays go through the kernel, which converts them
#: or names them in its errors).
_REDUCIBLE = frozenset(SUPPORTED_DTYPES) - {np.dtype(np.bool_)}


def _allowed(op: ReduceOp, kind: str) -> bool:
    """A cheap pre-check of ``check_op_dtype`` (which formats names: slow on a hot path)."""
    return (op, kind) in OP_KINDS


def _reduce(
    name: str,
    x: Any,
    axis_name: AxisName,
    mesh: DeviceMesh | None,
    async_op: bool,
    op: ReduceOp,
    factor: Any = None,
    *,
    jax_bool: bool = False,
    mean: bool = False,
) -> Any:
    if type(x) is not np.ndarray and _torch_stage.tracing():
        return _torch_stage.call(
            name, x, axis_name, mesh, async_op, **_stage_params(name, op, factor)
        )
    axis = resolve(axis_name, mesh, name)
    arr = x if type(x) is np.ndarray else numpy_of_tensor(x)  # a plain CPU tensor: its view
    if arr is None:
        kind = grad_kind(x, axis.where)
        if kind is not None:
            forward = functools.partial(
                _reduce, name, axis_name=axis_name, mesh=axis.mesh, async_op=False, op=op,
                factor=factor, jax_bool=jax_bool, mean=mean,
            )  # fmt: skip
            call = Call(axis.where, forward, _rule_for(kind, axis, axis_name, op, factor))
            call.needs_primals = op in _ORDERED
            return apply(kind, call, x, async_op)
    if factor is None and not async_op and arr is not None:
        # The commonest call, one numpy array (or plain CPU tensor) and a plain op, needs
        # none of the kernel's work (no bool or int-mean casts, no finish): straight to the
        # group, whose cached runner takes it. Anything else, errors included, takes the kernel.
        kind = arr.dtype.kind
        if (
            arr.dtype in _REDUCIBLE
            and op is not ReduceOp.PREMUL_SUM
            and not (mean and kind in "iu")
            and _allowed(op, kind)
        ):
            group = axis.group()
            if group is not None:
                # The group's own plan route, under a key that adds the axes' words.
                out = _calls.all_reduce(group, arr, op, axis.note)
                return out if arr is x else tensor_of_numpy(out)
    if factor is None:
        # Kernels without a factor are stateless: one per (op, size, flavour), reused.
        key = (op, axis.size, jax_bool, mean)
        kernel = _KERNELS.get(key)
        if kernel is None:
            kernel = _Reduce(op, None, axis.size, jax_bool=jax_bool, mean=mean)
            if len(_KERNELS) < 256:
                _KERNELS[key] = kernel
    else:
        kernel = _Reduce(op, factor, axis.size, jax_bool=jax_bool, mean=mean)
    return run(kernel, x, axis.where, axis.noted, async_op)


_KERNELS: dict[tuple[ReduceOp, int, bool, bool], _Reduce] = {}


def _stage_params(name: str, op: ReduceOp, factor: Any) -> dict[str, Any]:
    """The operator arguments of a reduction in traced code (only all_reduce has any)."""
    return {"op": op.value, "factor": factor} if name == "all_reduce" else {}


def _rule_for(kind: str, axis: Axis, axis_name: AxisName, op: ReduceOp, factor: Any) -> Any:
    """The backward rule for a call of ``kind``: under ``jax.jit`` a call without a gradient
    (pprod, the bitwise ops) is staged too, so its missing rule raises only if a gradient is
    asked of it; torch and jax.grad calls need it now (they differentiate)."""
    try:
        return _reduce_transpose(axis, axis_name, op, factor)
    except InvalidArgument as exc:
        if kind != "jit":
            raise
        error = exc

    def missing(cts: Any, xs: Any, ys: Any) -> Any:
        raise error

    return missing


def _reduce_transpose(axis: Axis, axis_name: AxisName, op: ReduceOp, factor: Any) -> Any:
    """The backward rule of an all-reduce with ``op`` (raises if it has none)."""
    if op is ReduceOp.SUM:
        return _transpose.identity_t(axis_name, axis.mesh)
    if op is ReduceOp.AVG:
        return _transpose.scale_t(1.0 / axis.size, axis_name, axis.mesh)
    if op is ReduceOp.PREMUL_SUM:
        return _transpose.scale_t(factor, axis_name, axis.mesh)
    if op in _ORDERED:
        return _transpose.pextreme_t(axis_name, axis.mesh)
    name = "pprod" if op is ReduceOp.PROD else f"all_reduce with op {op.value!r}"
    raise InvalidArgument(
        f"{axis.where}: {name} has no gradient here (meshcomm differentiates sum, avg, "
        "premul_sum, max and min); detach the input or call it under torch.no_grad()"
    )


def psum(
    x: Any, axis_name: AxisName, *, mesh: DeviceMesh | None = None, async_op: bool = False
) -> Any:
    """Sum ``x`` over the ranks along ``axis_name`` (``jax.lax.psum``).

    Args:
        x: an array or a pytree of arrays (dict, list, tuple); same shapes and dtypes on
            every rank of the group. Booleans are summed as int32, as in JAX.
        axis_name: a mesh dim name, or a tuple of names reduced over together.
        mesh: the mesh; default the ambient one (``with mesh:``).
        async_op: return a :class:`~meshcomm.work.Work` whose ``wait()`` gives the result.

    Returns:
        A new array (pytree) of ``x``'s shapes and dtypes holding the sum.

    Raises:
        InvalidArgument: no mesh, an unknown axis name, or this rank is not in the mesh.
        TypeError: an unsupported dtype.
        CommError: communication failed.

    Example:
        >>> import numpy as np
        >>> import meshcomm.world as world
        >>> from meshcomm.mesh import init_device_mesh
        >>> with init_device_mesh((1,), ("x",)):
        ...     psum(np.arange(3), "x")  # on a mesh of n ranks: n * arange(3)
        array([0, 1, 2])
        >>> world.shutdown()
    """
    return _reduce("psum", x, axis_name, mesh, async_op, ReduceOp.SUM, jax_bool=True)


def pmean(
    x: Any, axis_name: AxisName, *, mesh: DeviceMesh | None = None, async_op: bool = False
) -> Any:
    """Average ``x`` over the ranks along ``axis_name`` (``jax.lax.pmean``).

    Floats and complex numbers are summed and divided by the axis size in their own dtype.
    Integers and booleans are summed as integers, then divided as floats, as JAX does with
    x64 enabled: float32 for types of up to 32 bits, float64 for int64 and uint64.

    Args:
        x: an array or a pytree of arrays; same shapes and dtypes on every rank.
        axis_name: a mesh dim name, or a tuple of names.
        mesh: the mesh; default the ambient one.
        async_op: return a Work.

    Returns:
        A new array (pytree) holding the mean.

    Raises:
        InvalidArgument: no mesh, an unknown axis name.
        TypeError: an unsupported dtype.
        CommError: communication failed.

    Example:
        >>> import numpy as np
        >>> import meshcomm.world as world
        >>> from meshcomm.mesh import init_device_mesh
        >>> mesh = init_device_mesh((1,), ("x",))
        >>> pmean(np.array([1, 2]), "x", mesh=mesh), pmean(np.int32(3), "x", mesh=mesh)
        (array([1., 2.]), array(3., dtype=float32))
        >>> world.shutdown()
    """
    return _reduce("pmean", x, axis_name, mesh, async_op, ReduceOp.AVG, jax_bool=True, mean=True)


def pmax(
    x: Any, axis_name: AxisName, *, mesh: DeviceMesh | None = None, async_op: bool = False
) -> Any:
    """Elementwise maximum over the ranks along ``axis_name`` (``jax.lax.pmax``).

    Args:
        x: an array or a pytree of arrays (not complex).
        axis_name: a mesh dim name, or a tuple of names.
        mesh: the mesh; default the ambient one.
        async_op: return a Work.

    Returns:
        A new array (pytree) holding the maximum.

    Raises:
        InvalidArgument: no mesh, an unknown axis name.
        TypeError: complex or unsupported dtype.
        CommError: communication failed.

    Example:
        >>> import numpy as np
        >>> import meshcomm.world as world
        >>> from meshcomm.mesh import init_device_mesh
        >>> mesh = init_device_mesh((1,), ("x",))
        >>> pmax(np.array([3, -1]), "x", mesh=mesh)
        array([ 3, -1])
        >>> world.shutdown()
    """
    return _reduce("pmax", x, axis_name, mesh, async_op, ReduceOp.MAX)


def pmin(
    x: Any, axis_name: AxisName, *, mesh: DeviceMesh | None = None, async_op: bool = False
) -> Any:
    """Elementwise minimum over the ranks along ``axis_name`` (``jax.lax.pmin``).

    Args:
        x: an array or a pytree of arrays (not complex).
        axis_name: a mesh dim name, or a tuple of names.
        mesh: the mesh; default the ambient one.
        async_op: return a Work.

    Returns:
        A new array (pytree) holding the minimum.

    Raises:
        InvalidArgument: no mesh, an unknown axis name.
        TypeError: complex or unsupported dtype.
        CommError: communication failed.

    Example:
        >>> import numpy as np
        >>> import meshcomm.world as world
        >>> from meshcomm.mesh import init_device_mesh
        >>> mesh = init_device_mesh((1,), ("x",))
        >>> pmin(np.float32(2.5), "x", mesh=mesh)
        array(2.5, dtype=float32)
        >>> world.shutdown()
    """
    return _reduce("pmin", x, axis_name, mesh, async_op, ReduceOp.MIN)


def pprod(
    x: Any, axis_name: AxisName, *, mesh: DeviceMesh | None = None, async_op: bool = False
) -> Any:
    """Elementwise product over the ranks along ``axis_name``.

    JAX has no ``lax.pprod``; this is ``all_reduce(x, axis_name, op="prod")``.

    Args:
        x: an array or a pytree of arrays.
        axis_name: a mesh dim name, or a tuple of names.
        mesh: the mesh; default the ambient one.
        async_op: return a Work.

    Returns:
        A new array (pytree) holding the product.

    Raises:
        InvalidArgument: no mesh, an unknown axis name.
        TypeError: an unsupported dtype.
        CommError: communication failed.

    Example:
        >>> import numpy as np
        >>> import meshcomm.world as world
        >>> from meshcomm.mesh import init_device_mesh
        >>> mesh = init_device_mesh((1,), ("x",))
        >>> pprod(np.array([2, 3]), "x", mesh=mesh)
        array([2, 3])
        >>> world.shutdown()
    """
    return _reduce("pprod", x, axis_name, mesh, async_op, ReduceOp.PROD)


def all_reduce(
    x: Any,
    axis_name: AxisName,
    op: str | ReduceOp = "sum",
    *,
    factor: Any = None,
    mesh: DeviceMesh | None = None,
    async_op: bool = False,
) -> Any:
    """Reduce ``x`` over the ranks along ``axis_name`` with any reduce op.

    The ops of :meth:`meshcomm.group.ProcessGroup.all_reduce`, with its dtype rules (a
    boolean "sum" is a logical or here; use :func:`psum` for JAX's int32 count).

    Args:
        x: an array or a pytree of arrays.
        axis_name: a mesh dim name, or a tuple of names.
        op: "sum", "prod", "min", "max", "avg", "band", "bor", "bxor" or "premul_sum".
        factor: the scalar of "premul_sum" (only there).
        mesh: the mesh; default the ambient one.
        async_op: return a Work.

    Returns:
        A new array (pytree) of ``x``'s shapes and dtypes.

    Raises:
        InvalidArgument: unknown op, factor missing or misplaced, no mesh, unknown axis.
        TypeError: the op is undefined for a leaf's dtype (float "band", complex "max",
            integer "avg"), or an unsupported dtype.
        CommError: communication failed.

    Example:
        >>> import numpy as np
        >>> import meshcomm.world as world
        >>> from meshcomm.mesh import init_device_mesh
        >>> mesh = init_device_mesh((1,), ("x",))
        >>> all_reduce(np.array([0b1100], np.uint8), "x", op="bxor", mesh=mesh)
        array([12], dtype=uint8)
        >>> all_reduce(np.ones(2), "x", op="premul_sum", factor=0.5, mesh=mesh)
        array([0.5, 0.5])
        >>> world.shutdown()
    """
    rop = parse_op(op)
    return _reduce("all_reduce", x, axis_name, mesh, async_op, rop, factor)
