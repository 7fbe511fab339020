"""Point-to-point patterns by axis name: ``ppermute``, ``pshuffle``, ``pbroadcast``.

Indices are axis indices (row-major over a tuple of axes), the same on every group along
the axis::

    ppermute(x, "tp", [(0, 1), (1, 2), (2, 3), (3, 0)])     a ring shift by one
      tp=0 ──► tp=1 ──► tp=2 ──► tp=3 ──┐
        ▲───────────────────────────────┘
    pbroadcast(x, "tp", source=2): every rank gets the x of tp=2

Example:
    >>> import numpy as np
    >>> import meshcomm.world as world
    >>> from meshcomm.mesh import init_device_mesh
    >>> mesh = init_device_mesh((1,), ("x",))  # a world of one here
    >>> ppermute(np.arange(2), "x", [(0, 0)], mesh=mesh), ppermute(np.arange(2), "x", [],
    ...     mesh=mesh)
    (array([0, 1]), array([0, 0]))
    >>> world.shutdown()
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from meshcomm.ops import _torch_stage, _transpose
from meshcomm.ops._autodiff import Call, apply, grad_kind
from meshcomm.ops._calls import Collectives
from meshcomm.ops._checks import index_arg
from meshcomm.ops._pairs import checked_pairs, shuffle_pairs
from meshcomm.ops._resolve import AxisName, resolve
from meshcomm.ops.pytree import Kernel, array_namespace, run

if TYPE_CHECKING:
    from meshcomm.mesh import DeviceMesh

__all__ = ["pbroadcast", "ppermute", "pshuffle"]


class _Permute(Kernel):
    def __init__(self, pairs: tuple[tuple[int, int], ...], index: int) -> None:
        self.pairs, self.index = pairs, index

    def check(self, arr: Any, where: str) -> tuple[Any, Any]:
        return arr, arr.shape

    def unpacked(self, group: Collectives, arr: Any, meta: Any, async_op: bool) -> Any:
        return group.permute(arr, self.pairs, async_op=async_op)

    def call(self, group: Collectives, buf: Any, async_op: bool) -> Any:
        return group.permute(buf.reshape(-1), self.pairs, async_op=async_op)

    def unpack(self, result: Any, cols: slice, meta: Any) -> Any:
        return result[cols].reshape(meta)

    def local(self, arr: Any, meta: Any) -> Any:
        if any(d == self.index for _, d in self.pairs):
            return arr.copy()
        return array_namespace(arr).zeros_like(arr)


class _Broadcast(Kernel):
    def __init__(self, source: int) -> None:
        self.source = source

    def check(self, arr: Any, where: str) -> tuple[Any, Any]:
        return arr, arr.shape

    def unpacked(self, group: Collectives, arr: Any, meta: Any, async_op: bool) -> Any:
        return group.broadcast(arr, root=self.source, async_op=async_op)

    def call(self, group: Collectives, buf: Any, async_op: bool) -> Any:
        return group.broadcast(buf.reshape(-1), root=self.source, async_op=async_op)

    def unpack(self, result: Any, cols: slice, meta: Any) -> Any:
        return result[cols].reshape(meta)


def ppermute(
    x: Any,
    axis_name: AxisName,
    perm: Sequence[tuple[int, int]],
    *,
    mesh: DeviceMesh | None = None,
    async_op: bool = False,
) -> Any:
    """Send ``x`` along ``(source, destination)`` pairs of axis indices (``jax.lax.ppermute``).

    Indices are :func:`~meshcomm.ops.axis_index` values, also along a tuple of axes given
    out of mesh order (``("tp", "dp")``), as ``all_gather`` orders them. (JAX's ppermute
    lowering numbers such a tuple in mesh order instead, unlike its own ``axis_index``; for
    tuples in mesh order the two agree.)

    Args:
        x: an array or a pytree of arrays; same shapes and dtypes on every rank.
        axis_name: a mesh dim name, or a tuple of names (indices row-major over them).
        perm: ``(source, destination)`` pairs of axis indices; no index twice as a source or
            twice as a destination. Every rank passes the same ``perm``.
        mesh: the mesh; default the ambient one.
        async_op: return a :class:`~meshcomm.work.Work`.

    Returns:
        A new array (pytree): the ``x`` of the index that sends here, or zeros where no
        pair has this index as its destination.

    Raises:
        InvalidArgument: an index out of range, a repeated source or destination, a
            malformed ``perm``, no mesh, unknown axis.
        TypeError: an unsupported dtype.
        CommError: communication failed.

    Example:
        >>> import numpy as np
        >>> import meshcomm.world as world
        >>> from meshcomm.mesh import init_device_mesh
        >>> mesh = init_device_mesh((1,), ("x",))
        >>> n = mesh.size("x")
        >>> ring = [(i, (i + 1) % n) for i in range(n)]  # each rank gets its left neighbour's
        >>> ppermute(np.float32(7), "x", ring, mesh=mesh)
        array(7., dtype=float32)
        >>> world.shutdown()
    """
    if type(x) is not np.ndarray and _torch_stage.tracing():
        return _torch_stage.call("ppermute", x, axis_name, mesh, async_op, perm=perm)
    axis = resolve(axis_name, mesh, "ppermute")
    pairs = checked_pairs(axis.where, perm, axis.size, "ppermute")
    kind = grad_kind(x, axis.where)
    if kind is not None:
        forward = functools.partial(ppermute, axis_name=axis_name, perm=pairs, mesh=axis.mesh)
        rule = _transpose.ppermute_t(axis_name, axis.mesh, pairs)
        return apply(kind, Call(axis.where, forward, rule), x, async_op)
    return run(_Permute(pairs, axis.index), x, axis.where, axis.noted, async_op)


def pshuffle(
    x: Any,
    axis_name: AxisName,
    perm: Sequence[int],
    *,
    mesh: DeviceMesh | None = None,
    async_op: bool = False,
) -> Any:
    """Permute ``x`` so that index ``i`` gets the ``x`` of index ``perm[i]`` (``jax.lax.pshuffle``).

    ``ppermute`` with the pairs ``(perm[i], i)``.

    Args:
        x: an array or a pytree of arrays.
        axis_name: a mesh dim name, or a tuple of names.
        perm: a permutation of ``range(axis_size)``: the source of each index.
        mesh: the mesh; default the ambient one.
        async_op: return a Work.

    Returns:
        A new array (pytree): the ``x`` of index ``perm[axis_index]``.

    Raises:
        InvalidArgument: ``perm`` is not a permutation of ``range(axis_size)``, no mesh,
            unknown axis.
        TypeError: an unsupported dtype.
        CommError: communication failed.

    Example:
        >>> import numpy as np
        >>> import meshcomm.world as world
        >>> from meshcomm.mesh import init_device_mesh
        >>> mesh = init_device_mesh((1,), ("x",))
        >>> pshuffle(np.arange(3), "x", [0], mesh=mesh)
        array([0, 1, 2])
        >>> world.shutdown()
    """
    if type(x) is not np.ndarray and _torch_stage.tracing():
        return _torch_stage.call("pshuffle", x, axis_name, mesh, async_op, perm=perm)
    axis = resolve(axis_name, mesh, "pshuffle")
    pairs = shuffle_pairs(axis.where, perm, axis.size)
    kind = grad_kind(x, axis.where)
    if kind is not None:
        forward = functools.partial(ppermute, axis_name=axis_name, perm=pairs, mesh=axis.mesh)
        rule = _transpose.ppermute_t(axis_name, axis.mesh, pairs)
        return apply(kind, Call(axis.where, forward, rule), x, async_op)
    return run(_Permute(pairs, axis.index), x, axis.where, axis.noted, async_op)


def pbroadcast(
    x: Any,
    axis_name: AxisName,
    source: int,
    *,
    mesh: DeviceMesh | None = None,
    async_op: bool = False,
) -> Any:
    """Give every rank along ``axis_name`` the ``x`` of axis index ``source``
    (``jax.lax.pbroadcast``).

    Args:
        x: an array or a pytree of arrays; the same shapes and dtypes on every rank (only
            the source's values matter).
        axis_name: a mesh dim name, or a tuple of names.
        source: the axis index whose ``x`` is copied.
        mesh: the mesh; default the ambient one.
        async_op: return a Work.

    Returns:
        A new array (pytree): the source's ``x``.

    Raises:
        InvalidArgument: ``source`` out of range, no mesh, unknown axis.
        TypeError: an unsupported dtype, a non-int ``source``.
        CommError: communication failed.

    Example:
        >>> import numpy as np
        >>> import meshcomm.world as world
        >>> from meshcomm.mesh import init_device_mesh
        >>> mesh = init_device_mesh((1,), ("x",))
        >>> pbroadcast({"step": np.int64(5)}, "x", source=0, mesh=mesh)
        {'step': array(5)}
        >>> world.shutdown()
    """
    if type(x) is not np.ndarray and _torch_stage.tracing():
        return _torch_stage.call("pbroadcast", x, axis_name, mesh, async_op, source=source)
    axis = resolve(axis_name, mesh, "pbroadcast")
    src = index_arg(axis.where, source, axis.size, "source")
    kind = grad_kind(x, axis.where)
    if kind is not None:
        forward = functools.partial(pbroadcast, axis_name=axis_name, source=src, mesh=axis.mesh)
        rule = _transpose.pbroadcast_t(axis_name, axis.mesh, src, axis.index)
        return apply(kind, Call(axis.where, forward, rule), x, async_op)
    return run(_Broadcast(src), x, axis.where, axis.noted, async_op)
