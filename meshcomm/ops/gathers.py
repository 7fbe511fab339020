"""Gathers and scatters by axis name: ``all_gather``, ``psum_scatter``, ``all_to_all``.

Semantics and shapes are those of ``jax.lax``; index ``i`` along the gathered (or
scattered) axis belongs to the rank at axis index ``i`` (row-major over a tuple of axes)::

    all_gather(x, "tp")            psum_scatter(x, "tp")          all_to_all(x, "tp", 0, 0)
    rank i holds a_i               rank i holds [b_i0..b_i3]      rank i holds [c_i0..c_i3]
    every rank gets [a0 a1 a2 a3]  rank j gets b_0j+...+b_3j      rank j gets [c_0j..c_3j]

Example:
    >>> import numpy as np
    >>> import meshcomm.world as world
    >>> from meshcomm.mesh import init_device_mesh
    >>> mesh = init_device_mesh((1,), ("x",))  # a world of one here
    >>> all_gather(np.arange(3), "x", mesh=mesh).shape, all_gather(np.arange(3), "x",
    ...     tiled=True, mesh=mesh).shape
    ((1, 3), (3,))
    >>> world.shutdown()
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from meshcomm.errors import InvalidArgument
from meshcomm.group.arrays import SUPPORTED_DTYPES, rank_blocks_fit
from meshcomm.ops import _torch_stage, _transpose
from meshcomm.ops._autodiff import Call, apply, grad_kind
from meshcomm.ops._calls import Collectives
from meshcomm.ops._checks import axis_arg, block_shape, to_blocks, unstack
from meshcomm.ops._native import numpy_of_tensor, tensor_of_numpy
from meshcomm.ops._resolve import AxisName, resolve
from meshcomm.ops.pytree import Kernel, array_namespace, run

if TYPE_CHECKING:
    from meshcomm.mesh import DeviceMesh

__all__ = ["all_gather", "all_to_all", "psum_scatter"]

# The fast paths below: a synchronous call with one numpy array (or a plain CPU tensor's
# numpy view, ``_native.numpy_of_tensor``, given back with ``torch.from_numpy``) of a
# supported native-order dtype, at axis 0, whose shape fits, needs none of the kernels'
# work (the checks would pass, finish is the identity) and goes straight to the group,
# whose cached runner for the signature takes it.
# Anything else, errors included, goes through the kernel and its messages.
_AS_IS = frozenset(SUPPORTED_DTYPES)
_SUMMABLE = _AS_IS - {np.dtype(np.bool_)}  # psum_scatter refuses bool, as JAX does


def _fast(x: Any, async_op: bool, dtypes: frozenset[np.dtype], *axes: Any) -> bool:
    """Whether a call may take the fast path: synchronous, one numpy array of one of
    ``dtypes``, every axis argument the int 0."""
    if async_op or type(x) is not np.ndarray or x.dtype not in dtypes:
        return False
    for a in axes:  # noqa: SIM110 - a loop costs less than all(<generator>), on every call
        if type(a) is not int or a != 0:
            return False
    return True


class _Gather(Kernel):
    def __init__(self, axis: Any, tiled: bool, size: int) -> None:
        self.axis, self.tiled, self.size = axis, bool(tiled), size

    def check(self, arr: Any, where: str) -> tuple[Any, Any]:
        if self.tiled and arr.ndim == 0:
            raise InvalidArgument(
                f"{where}: tiled=True concatenates along an existing axis, got a 0-d array"
            )
        positions = arr.ndim if self.tiled else arr.ndim + 1
        return arr, (arr.shape, axis_arg(where, self.axis, positions, "axis"))

    def unpacked(self, group: Collectives, arr: Any, meta: Any, async_op: bool) -> Any:
        return group.all_gather(arr, axis=meta[1], tiled=self.tiled, async_op=async_op)

    def call(self, group: Collectives, buf: Any, async_op: bool) -> Any:
        return group.all_gather(buf.reshape(-1), axis=0, tiled=False, async_op=async_op)

    def unpack(self, result: Any, cols: slice, meta: Any) -> Any:
        xp = array_namespace(result)
        flat = xp.ascontiguousarray(result[:, cols]).reshape(-1)
        return unstack(xp, flat, meta[0], meta[1], self.size, self.tiled)

    def arg_words(self, metas: list[Any]) -> tuple[tuple[str, str], ...]:
        return (("axis", _word([m[1] for m in metas])), ("tiled", repr(self.tiled)))


class _Scatter(Kernel):
    def __init__(self, dim: Any, tiled: bool, size: int) -> None:
        self.dim, self.tiled, self.size = dim, bool(tiled), size

    def check(self, arr: Any, where: str) -> tuple[Any, Any]:
        if arr.dtype == np.bool_:
            raise TypeError(
                f"{where}: psum_scatter does not sum bool (as jax.lax.psum_scatter); use "
                "x.astype(np.int32)"
            )
        if arr.ndim == 0:
            raise InvalidArgument(f"{where}: x needs at least one axis to scatter, got a 0-d array")
        ax = axis_arg(where, self.dim, arr.ndim, "scatter_dimension")
        block = block_shape(where, arr.shape, ax, self.size, self.tiled, "scatter_dimension")
        return arr, (ax, block)

    def unpacked(self, group: Collectives, arr: Any, meta: Any, async_op: bool) -> Any:
        return group.reduce_scatter(arr, "sum", axis=meta[0], tiled=self.tiled, async_op=async_op)

    def pack(self, arr: Any, meta: Any) -> Any:
        return to_blocks(array_namespace(arr), arr, meta[0], self.size, self.tiled)

    def call(self, group: Collectives, buf: Any, async_op: bool) -> Any:
        return group.reduce_scatter(buf, "sum", axis=0, tiled=False, async_op=async_op)

    def unpack(self, result: Any, cols: slice, meta: Any) -> Any:
        return result[cols].reshape(meta[1])

    def arg_words(self, metas: list[Any]) -> tuple[tuple[str, str], ...]:
        return (("scatter_dimension", _word([m[0] for m in metas])), ("tiled", repr(self.tiled)))


class _AllToAll(Kernel):
    def __init__(self, split: Any, concat: Any, tiled: bool, size: int) -> None:
        self.split, self.concat, self.tiled, self.size = split, concat, bool(tiled), size

    def check(self, arr: Any, where: str) -> tuple[Any, Any]:
        if arr.ndim == 0:
            raise InvalidArgument(f"{where}: x needs at least one axis to split, got a 0-d array")
        split = axis_arg(where, self.split, arr.ndim, "split_axis")
        concat = axis_arg(where, self.concat, arr.ndim, "concat_axis")
        block = block_shape(where, arr.shape, split, self.size, self.tiled, "split_axis")
        return arr, (split, concat, block)

    def unpacked(self, group: Collectives, arr: Any, meta: Any, async_op: bool) -> Any:
        return group.all_to_all(
            arr, split_axis=meta[0], concat_axis=meta[1], tiled=self.tiled, async_op=async_op
        )

    def pack(self, arr: Any, meta: Any) -> Any:
        return to_blocks(array_namespace(arr), arr, meta[0], self.size, self.tiled)

    def call(self, group: Collectives, buf: Any, async_op: bool) -> Any:
        return group.all_to_all(buf, split_axis=0, concat_axis=0, tiled=False, async_op=async_op)

    def unpack(self, result: Any, cols: slice, meta: Any) -> Any:
        xp = array_namespace(result)
        flat = xp.ascontiguousarray(result[:, cols]).reshape(-1)
        return unstack(xp, flat, meta[2], meta[1], self.size, self.tiled)

    def arg_words(self, metas: list[Any]) -> tuple[tuple[str, str], ...]:
        return (
            ("split_axis", _word([m[0] for m in metas])),
            ("concat_axis", _word([m[1] for m in metas])),
            ("tiled", repr(self.tiled)),
        )


def _word(axes: list[int]) -> str:
    """The axes the leaves' checks resolved: one, or each leaf's where they differ."""
    return str(axes[0]) if len(set(axes)) == 1 else str(axes)


def all_gather(
    x: Any,
    axis_name: AxisName,
    *,
    axis: int = 0,
    tiled: bool = False,
    mesh: DeviceMesh | None = None,
    async_op: bool = False,
) -> Any:
    """Gather ``x`` from every rank along ``axis_name`` (``jax.lax.all_gather``).

    ::

        axis "tp" of size 4, rank i holds a_i (shape s):
        tiled=False: every rank gets stack([a0, a1, a2, a3], axis)  (shape s with 4 inserted)
        tiled=True:  every rank gets concatenate([a0, ..., a3], axis)  (s[axis] * 4)

    Args:
        x: an array or a pytree of arrays; same shapes and dtypes on every rank.
        axis_name: a mesh dim name, or a tuple of names (rank order: row-major over them).
        axis: not tiled: where the new axis goes (``-(x.ndim+1)..x.ndim``); tiled: the
            existing axis the pieces are concatenated along.
        tiled: concatenate instead of stacking.
        mesh: the mesh; default the ambient one.
        async_op: return a :class:`~meshcomm.work.Work`.

    Returns:
        A new array (pytree): entry ``i`` along ``axis`` is axis index ``i``'s ``x``.

    Raises:
        InvalidArgument: ``axis`` out of range, tiled with a 0-d ``x``, no mesh, unknown axis.
        TypeError: an unsupported dtype, a non-int ``axis``.
        CommError: communication failed.

    Example:
        >>> import numpy as np
        >>> import meshcomm.world as world
        >>> from meshcomm.mesh import init_device_mesh
        >>> mesh = init_device_mesh((1,), ("x",))
        >>> all_gather(np.ones((2, 3)), "x", axis=-1, mesh=mesh).shape
        (2, 3, 1)
        >>> world.shutdown()
    """
    if type(x) is not np.ndarray and _torch_stage.tracing():
        return _torch_stage.call("all_gather", x, axis_name, mesh, async_op, axis=axis, tiled=tiled)
    ax = resolve(axis_name, mesh, "all_gather")
    arr: Any = x if type(x) is np.ndarray else numpy_of_tensor(x)  # a plain CPU tensor's view
    kind = None if arr is not None else grad_kind(x, ax.where)
    if kind is not None:
        forward = functools.partial(all_gather, axis_name=axis_name, axis=axis, tiled=tiled,
                                    mesh=ax.mesh)  # fmt: skip
        rule = _transpose.all_gather_t(axis_name, ax.mesh, axis, tiled)
        return apply(kind, Call(ax.where, forward, rule), x, async_op)
    if _fast(arr, async_op, _AS_IS, axis) and (arr.ndim or not tiled):
        group = ax.group()
        if group is not None:
            out = ax.noted_group(group).all_gather(arr, 0, tiled)
            return out if arr is x else tensor_of_numpy(out)
    return run(_Gather(axis, tiled, ax.size), x, ax.where, ax.noted, async_op)


def psum_scatter(
    x: Any,
    axis_name: AxisName,
    *,
    scatter_dimension: int = 0,
    tiled: bool = False,
    mesh: DeviceMesh | None = None,
    async_op: bool = False,
) -> Any:
    """Sum ``x`` along ``axis_name`` and keep only this rank's block (``jax.lax.psum_scatter``).

    ``psum_scatter(x, a)`` equals ``psum(x, a)[axis_index(a)]`` (not tiled), at a fraction
    of the traffic; ``all_gather(psum_scatter(x, a, tiled=True), a, tiled=True)`` equals
    ``psum(x, a)``::

        axis of size 4, rank i holds [b_i0, b_i1, b_i2, b_i3] along scatter_dimension:
        rank j gets b_0j + b_1j + b_2j + b_3j

    Args:
        x: an array or a pytree of arrays; same shapes and dtypes on every rank.
        axis_name: a mesh dim name, or a tuple of names.
        scatter_dimension: the axis of ``x`` cut into blocks.
        tiled: not tiled: ``x.shape[scatter_dimension]`` must equal the axis size and
            that dimension is removed; tiled: it must be divisible by the axis size and
            shrinks by it.
        mesh: the mesh; default the ambient one.
        async_op: return a Work.

    Returns:
        A new array (pytree): this rank's block of the sum.

    Raises:
        InvalidArgument: the scatter dimension does not match (or divide by) the axis size
            (the message states both), out of range, a 0-d ``x``, no mesh, unknown axis.
        TypeError: bool (as in JAX) or an unsupported dtype.
        CommError: communication failed.

    Example:
        >>> import numpy as np
        >>> import meshcomm.world as world
        >>> from meshcomm.mesh import init_device_mesh
        >>> mesh = init_device_mesh((1,), ("x",))
        >>> psum_scatter(np.arange(4).reshape(2, 2), "x", scatter_dimension=1, tiled=True,
        ...              mesh=mesh)
        array([[0, 1],
               [2, 3]])
        >>> psum_scatter(np.arange(4), "x", mesh=mesh)
        Traceback (most recent call last):
        ...
        meshcomm.errors.InvalidArgument: psum_scatter over 'x' (size 1) on rank 0: with \
tiled=False, x.shape[scatter_dimension] must equal the axis size, but they are 4 and 1 \
(scatter_dimension=0, x.shape=(4,))
        >>> world.shutdown()
    """
    if type(x) is not np.ndarray and _torch_stage.tracing():
        return _torch_stage.call(
            "psum_scatter",
            x,
            axis_name,
            mesh,
            async_op,
            scatter_dimension=scatter_dimension,
            tiled=tiled,
        )
    ax = resolve(axis_name, mesh, "psum_scatter")
    arr: Any = x if type(x) is np.ndarray else numpy_of_tensor(x)  # a plain CPU tensor's view
    kind = None if arr is not None else grad_kind(x, ax.where)
    if kind is not None:
        forward = functools.partial(psum_scatter, axis_name=axis_name, tiled=tiled,
                                    scatter_dimension=scatter_dimension, mesh=ax.mesh)  # fmt: skip
        rule = _transpose.psum_scatter_t(axis_name, ax.mesh, scatter_dimension, tiled)
        return apply(kind, Call(ax.where, forward, rule), x, async_op)
    if _fast(arr, async_op, _SUMMABLE, scatter_dimension) and rank_blocks_fit(arr, ax.size, tiled):
        group = ax.group()
        if group is not None:
            out = ax.noted_group(group).reduce_scatter(arr, "sum", 0, tiled)
            return out if arr is x else tensor_of_numpy(out)
    return run(_Scatter(scatter_dimension, tiled, ax.size), x, ax.where, ax.noted, async_op)


def all_to_all(
    x: Any,
    axis_name: AxisName,
    split_axis: int,
    concat_axis: int,
    *,
    tiled: bool = False,
    mesh: DeviceMesh | None = None,
    async_op: bool = False,
) -> Any:
    """Send block ``j`` of ``x`` to axis index ``j``; put the received blocks together
    (``jax.lax.all_to_all``).

    ::

        axis of size 4, rank i holds [c_i0, c_i1, c_i2, c_i3] along split_axis:
        rank j gets [c_0j, c_1j, c_2j, c_3j] along concat_axis

    Args:
        x: an array or a pytree of arrays; same shapes and dtypes on every rank.
        axis_name: a mesh dim name, or a tuple of names.
        split_axis: the axis of ``x`` cut into axis-size blocks.
        concat_axis: where the received blocks go. Not tiled: ``x.shape[split_axis]`` must
            equal the axis size; that axis is removed and a new one (indexed by the source)
            is inserted at ``concat_axis`` (a position in the result). Tiled:
            ``x.shape[split_axis]`` must be divisible by the axis size; it shrinks by it and
            ``concat_axis`` grows by it.
        tiled: keep the rank (see above).
        mesh: the mesh; default the ambient one.
        async_op: return a Work.

    Returns:
        A new array (pytree); not tiled, of shape
        ``np.insert(np.delete(x.shape, split_axis), concat_axis, axis_size)``.

    Raises:
        InvalidArgument: ``x.shape[split_axis]`` does not match (or divide by) the axis size
            (the message states both), an axis out of range, no mesh, unknown axis.
        TypeError: an unsupported dtype.
        CommError: communication failed.

    Example:
        >>> import numpy as np
        >>> import meshcomm.world as world
        >>> from meshcomm.mesh import init_device_mesh
        >>> mesh = init_device_mesh((1,), ("x",))
        >>> all_to_all(np.arange(6).reshape(1, 6), "x", 0, 1, mesh=mesh).shape
        (6, 1)
        >>> world.shutdown()
    """
    if type(x) is not np.ndarray and _torch_stage.tracing():
        return _torch_stage.call(
            "all_to_all",
            x,
            axis_name,
            mesh,
            async_op,
            split_axis=split_axis,
            concat_axis=concat_axis,
            tiled=tiled,
        )
    ax = resolve(axis_name, mesh, "all_to_all")
    arr: Any = x if type(x) is np.ndarray else numpy_of_tensor(x)  # a plain CPU tensor's view
    kind = None if arr is not None else grad_kind(x, ax.where)
    if kind is not None:
        forward = functools.partial(all_to_all, axis_name=axis_name, split_axis=split_axis,
                                    concat_axis=concat_axis, tiled=tiled, mesh=ax.mesh)  # fmt: skip
        rule = _transpose.all_to_all_t(axis_name, ax.mesh, split_axis, concat_axis, tiled)
        return apply(kind, Call(ax.where, forward, rule), x, async_op)
    if _fast(arr, async_op, _AS_IS, split_axis, concat_axis) and rank_blocks_fit(
        arr, ax.size, tiled
    ):
        group = ax.group()
        if group is not None:
            out = ax.noted_group(group).all_to_all(arr, 0, 0, tiled)
            return out if arr is x else tensor_of_numpy(out)
    kernel = _AllToAll(split_axis, concat_axis, tiled, ax.size)
    return run(kernel, x, ax.where, ax.noted, async_op)
