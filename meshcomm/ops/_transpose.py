"""The backward rule of every op: its transpose, as JAX defines it under ``shard_map``.

=========================  ==================================================================
forward                    backward (of the cotangent ``ct``)
=========================  ==================================================================
``psum``                   ``ct`` (the result is invariant: its cotangent is one value,
                           cast to varying, whose own transpose is a psum)
``pmean``                  ``ct / n``
``all_reduce`` premul_sum  ``ct * factor``
``pmax``, ``pmin``         ``ct * (x == y) / psum(x == y)``: to the winning rank(s), ties
                           shared equally (as ``jnp.max`` shares them)
``all_gather``             ``psum_scatter`` at the same axis, same ``tiled``
``psum_scatter``           ``all_gather`` at the same axis, same ``tiled``
``all_to_all``             ``all_to_all`` with ``split_axis`` and ``concat_axis`` swapped
``ppermute``, ``pshuffle`` the inverse permutation
``pbroadcast``             ``psum(ct)`` on the source, zeros elsewhere
``pcast`` to varying       ``psum(ct)``
``pcast`` to invariant     ``ct / n``
=========================  ==================================================================

Each rule runs on the mesh and axis captured when the op ran forward (the backward pass
usually runs outside ``with mesh:``), by calling the public ops (which :mod:`meshcomm.ops`
hands over through :func:`use` once they are defined: their modules import this one), so
it is differentiable again (second-order gradients) except where it reads ``x == y``.
Where JAX casts an invariant cotangent to varying (the transposes of psum, pmean, pmax,
pbroadcast), a backward that builds a graph calls ``pcast(ct, to="varying")``, so its own
backward sums over the axis as JAX's does; a plain backward skips the copy.

Example:
    >>> inverse_pairs(((0, 1), (1, 2), (2, 0)))
    ((1, 0), (2, 1), (0, 2))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from meshcomm.ops._autodiff import Transpose

if TYPE_CHECKING:
    from meshcomm.mesh import DeviceMesh

__all__ = [
    "OPS",
    "PublicOps",
    "all_gather_t",
    "all_to_all_t",
    "identity_t",
    "inverse_pairs",
    "pbroadcast_t",
    "pextreme_t",
    "ppermute_t",
    "psum_scatter_t",
    "psum_t",
    "scale_t",
    "use",
]


class PublicOps:
    """The public ops the rules call, set by :func:`use`.

    Attributes:
        pcast, psum, all_gather, psum_scatter, all_to_all, ppermute: the ops of
            :mod:`meshcomm.ops` of those names.
    """

    pcast: Callable[..., Any]
    psum: Callable[..., Any]
    all_gather: Callable[..., Any]
    psum_scatter: Callable[..., Any]
    all_to_all: Callable[..., Any]
    ppermute: Callable[..., Any]


#: The ops the rules call; :mod:`meshcomm.ops` fills it on import, before any op can run.
OPS = PublicOps()


def use(**ops: Callable[..., Any]) -> None:
    """Hand the rules the public ops they call (see :class:`PublicOps`).

    Example:
        >>> import meshcomm.ops
        >>> OPS.psum is meshcomm.ops.psum
        True
    """
    for name, op in ops.items():
        if name not in PublicOps.__annotations__:
            raise TypeError(f"the backward rules call no op named {name!r}")
        setattr(OPS, name, op)


def inverse_pairs(pairs: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """``(source, destination)`` pairs turned around."""
    return tuple((d, s) for s, d in pairs)


def _zeroed(ct: Any) -> Any:
    """Zeros of ``ct``'s shape that stay in ``ct``'s autodiff graph.

    A rank's backward must run the same collectives as every other rank's, second order
    included: zeros cut off from the graph would skip them on this rank alone.
    """
    root = type(ct).__module__.partition(".")[0]
    if root == "torch":
        import torch

        return torch.where(torch.zeros((), dtype=torch.bool, device=ct.device), ct, 0)
    if root in ("jax", "jaxlib"):
        import jax.numpy as jnp

        return jnp.where(False, ct, 0)
    return np.zeros_like(ct)


def _cast_like(flags: Any, ct: Any) -> Any:
    """A boolean array as ``ct``'s dtype, in its library."""
    if type(flags).__module__.partition(".")[0] == "torch":
        return flags.to(ct.dtype)
    return flags.astype(ct.dtype)


def _vary(cts: list[Any], axis_name: Any, mesh: DeviceMesh) -> list[Any]:
    """The cotangents of an invariant result, cast to varying as JAX's transpose does.

    Only a backward that is itself differentiated (``create_graph=True``, or a jax
    backward under another grad) needs the cast, whose own backward is a psum; a plain
    backward passes the cotangents through without a copy.
    """
    from meshcomm.ops._autodiff import grad_kind

    if grad_kind(cts, "backward") is None:
        return cts
    return list(OPS.pcast(cts, axis_name, to="varying", mesh=mesh))


def identity_t(axis_name: Any, mesh: DeviceMesh) -> Transpose:
    """The transpose of ``psum``: the cotangent as it is (cast to varying)."""
    return lambda cts, xs, ys: _vary(cts, axis_name, mesh)


def scale_t(factor: Any, axis_name: Any = (), mesh: DeviceMesh | None = None) -> Transpose:
    """The transpose of ``pmean`` (``1 / n``) and premul_sum (cast to varying), and of
    ``pcast`` to invariant (``1 / n``, no axis: it is a cast already)."""
    if isinstance(factor, np.generic) or (isinstance(factor, np.ndarray) and factor.ndim == 0):
        factor = factor.item()
    if mesh is None:
        return lambda cts, xs, ys: [c * factor for c in cts]
    return lambda cts, xs, ys: [c * factor for c in _vary(cts, axis_name, mesh)]


def psum_t(axis_name: Any, mesh: DeviceMesh) -> Transpose:
    """The transpose of ``pcast(to="varying")``: a psum of the cotangents."""
    return lambda cts, xs, ys: OPS.psum(cts, axis_name, mesh=mesh)


def pextreme_t(axis_name: Any, mesh: DeviceMesh) -> Transpose:
    """The transpose of ``pmax`` / ``pmin``: the cotangent to the winners, ties shared."""

    def rule(cts: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        won = [_cast_like(x == y, c) for c, x, y in zip(cts, xs, ys, strict=True)]
        winners = OPS.psum(won, axis_name, mesh=mesh)
        cts = _vary(cts, axis_name, mesh)
        return [c * w / k for c, w, k in zip(cts, won, winners, strict=True)]

    return rule


def _by_axes(
    cts: list[Any], axes_of: Callable[[Any], tuple[int, ...]], op: Callable[..., list[Any]]
) -> list[Any]:
    """Call ``op(leaves, *axes)`` once per distinct axes (leaves of one ndim share them)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, c in enumerate(cts):
        groups.setdefault(axes_of(c), []).append(i)
    out: list[Any] = [None] * len(cts)
    for axes, idx in groups.items():
        for i, v in zip(idx, op([cts[i] for i in idx], *axes), strict=True):
            out[i] = v
    return out


def all_gather_t(axis_name: Any, mesh: DeviceMesh, axis: int, tiled: bool) -> Transpose:
    """The transpose of ``all_gather``: ``psum_scatter`` at the gathered axis."""

    def rule(cts: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        return _by_axes(
            cts,
            lambda c: (axis % c.ndim,),
            lambda leaves, ax: OPS.psum_scatter(
                leaves, axis_name, scatter_dimension=ax, tiled=tiled, mesh=mesh
            ),
        )

    return rule


def psum_scatter_t(axis_name: Any, mesh: DeviceMesh, dim: int, tiled: bool) -> Transpose:
    """The transpose of ``psum_scatter``: ``all_gather`` at the scattered axis."""

    def rule(cts: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        ndim_in = (lambda c: c.ndim) if tiled else (lambda c: c.ndim + 1)
        return _by_axes(
            cts,
            lambda c: (dim % ndim_in(c),),
            lambda leaves, ax: OPS.all_gather(leaves, axis_name, axis=ax, tiled=tiled, mesh=mesh),
        )

    return rule


def all_to_all_t(
    axis_name: Any, mesh: DeviceMesh, split_axis: int, concat_axis: int, tiled: bool
) -> Transpose:
    """The transpose of ``all_to_all``: ``all_to_all`` with the two axes swapped."""

    def rule(cts: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        return _by_axes(
            cts,
            lambda c: (split_axis % c.ndim, concat_axis % c.ndim),
            lambda leaves, split, concat: OPS.all_to_all(
                leaves, axis_name, concat, split, tiled=tiled, mesh=mesh
            ),
        )

    return rule


def ppermute_t(axis_name: Any, mesh: DeviceMesh, pairs: tuple[tuple[int, int], ...]) -> Transpose:
    """The transpose of ``ppermute`` (and ``pshuffle``): the inverse permutation."""
    back = inverse_pairs(pairs)
    return lambda cts, xs, ys: OPS.ppermute(cts, axis_name, back, mesh=mesh)


def pbroadcast_t(axis_name: Any, mesh: DeviceMesh, source: int, index: int) -> Transpose:
    """The transpose of ``pbroadcast``: the sum of the cotangents, to the source only."""

    def rule(cts: list[Any], xs: list[Any], ys: list[Any]) -> list[Any]:
        total = _vary(OPS.psum(cts, axis_name, mesh=mesh), axis_name, mesh)
        return total if index == source else [_zeroed(t) for t in total]

    return rule
