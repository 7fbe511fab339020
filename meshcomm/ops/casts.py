"""``pcast``: mark a value as varying or invariant along an axis, for gradients.

In JAX's ``shard_map`` every value is *invariant* along a mesh axis (one value, the same on
every rank: replicated weights, the result of ``psum``) or *varying* (one value per rank:
a shard, a rank's activations). The two kinds differ only in their gradients: the cotangent
of an invariant value is one value too, so a rank that uses an invariant input in a
per-rank computation must sum the cotangents of all ranks to get its gradient. JAX inserts
that cast itself; torch users call :func:`pcast` where it goes, as Megatron calls its
"copy to tensor-parallel region":

=======================  ==========================  ==================================
call                     forward                     backward
=======================  ==========================  ==================================
``to="varying"``         a copy (no communication)   ``psum`` of the cotangents
``to="invariant"``       a copy (no communication)   the cotangent ``/ n``
=======================  ==========================  ==================================

``to="invariant"`` is the converse for a varying value the caller knows to be equal on
every rank: it is ``pmean`` without the communication (and with pmean's gradient), so
``pcast(pcast(x, a, to="varying"), a, to="invariant")`` is the identity both ways.

Example:
    >>> import numpy as np
    >>> import meshcomm.world as world
    >>> from meshcomm.mesh import init_device_mesh
    >>> with init_device_mesh((1,), ("tp",)):  # a world of one here
    ...     w = pcast(np.ones(2), "tp", to="varying")
    >>> w
    array([1., 1.])
    >>> world.shutdown()
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from meshcomm.errors import InvalidArgument
from meshcomm.ops import _torch_stage, _transpose
from meshcomm.ops._autodiff import Call, apply, grad_kind
from meshcomm.ops._resolve import AxisName, resolve
from meshcomm.ops.pytree import Kernel, run

if TYPE_CHECKING:
    from meshcomm.mesh import DeviceMesh

__all__ = ["pcast"]

_COPY = Kernel()  # the base kernel's ``local`` copies a leaf; no group is ever asked for


def pcast(x: Any, axis_name: AxisName, *, to: str, mesh: DeviceMesh | None = None) -> Any:
    """Cast ``x`` to varying or invariant along ``axis_name`` (``jax.lax.pcast``).

    The values are copied unchanged; only the gradient differs (see the module's table).
    Call ``pcast(w, "tp", to="varying")`` where a replicated value (weights, activations
    copied to every tensor-parallel rank) enters a computation that differs per rank;
    its backward sums the per-rank gradients, as JAX's implicit cast does.

    Args:
        x: an array or a pytree of arrays, of any kind meshcomm takes.
        axis_name: a mesh dim name, or a tuple of names (an empty tuple: a plain copy).
        to: ``"varying"`` or ``"invariant"``.
        mesh: the mesh; default the ambient one.

    Returns:
        A copy of ``x`` (same kinds, dtypes, shapes and devices).

    Raises:
        InvalidArgument: ``to`` is neither, no mesh, or an unknown axis name.
        TypeError: an unsupported dtype.

    Example:
        >>> import numpy as np
        >>> from meshcomm.mesh import DeviceMesh
        >>> pcast(np.ones(1), "tp", to="fixed", mesh=DeviceMesh([0, 1], ("tp",)))
        Traceback (most recent call last):
        ...
        meshcomm.errors.InvalidArgument: pcast: to must be 'varying' or 'invariant', got 'fixed'
    """
    if type(x) is not np.ndarray and _torch_stage.tracing():
        return _torch_stage.call("pcast", x, axis_name, mesh, False, to=to)
    if to not in ("varying", "invariant"):
        raise InvalidArgument(f"pcast: to must be 'varying' or 'invariant', got {to!r}")
    axis = resolve(axis_name, mesh, "pcast")
    kind = grad_kind(x, axis.where)
    if kind is not None and axis.dims:
        forward = functools.partial(pcast, axis_name=axis_name, to=to, mesh=axis.mesh)
        if to == "varying":
            rule = _transpose.psum_t(axis_name, axis.mesh)
        else:
            rule = _transpose.scale_t(1.0 / axis.size)
        return apply(kind, Call(axis.where, forward, rule), x, False)
    return run(_COPY, x, axis.where, lambda: None, False)
