"""``meshcomm.ops``: JAX-style functional collectives by mesh axis name.

Each op takes ``axis_name`` (a mesh dim name, or a tuple of names taken together,
row-major in the order given, as in JAX) and ``mesh=None`` (the ambient mesh of
``with mesh:`` when None). Each returns new arrays of the input's array type and never
modifies its input; pytrees (dicts, lists, tuples) are mapped leaf by leaf with one
transfer per dtype; ``async_op=True`` returns a :class:`~meshcomm.work.Work`. Arguments
and shapes are checked before any I/O.

=====================  ===============================================================
``psum``, ``pmean``,   all-reduce (``all_reduce(x, axis_name, op=...)`` for the bitwise
``pmax``, ``pmin``,    ops, ``avg`` and ``premul_sum``)
``pprod``
``all_gather``         gather along an axis (``tiled`` concatenates)
``psum_scatter``       sum, keep this rank's block (reduce-scatter)
``all_to_all``         block ``j`` to rank ``j``
``ppermute``           ``(source, destination)`` pairs; unreceived ranks get zeros
``pshuffle``           index ``i`` gets the ``x`` of ``perm[i]``
``pbroadcast``         everyone gets the ``x`` of ``source``
``pcast``              varying / invariant for gradients (a copy; see below)
``axis_index``         this rank's index along the axis (an int, no I/O)
``axis_size``          the axis' length (an int, no I/O)
=====================  ===============================================================

Array kinds: numpy and cupy arrays, torch tensors (CPU and CUDA) and jax arrays come back
as the kind, dtype and device they went in as, mixed kinds in one pytree included.

Gradients: on torch tensors that require grad, and under ``jax.grad`` on jax arrays, every
op is differentiable: its backward is the transposed collective, as JAX defines it under
``shard_map`` (``psum`` -> identity, ``all_gather`` -> ``psum_scatter``, ...; the table is
in ``docs/autograd.md``). ``pcast(x, axis, to="varying")`` is where a replicated value
enters a per-rank computation (its backward is a psum).

Groups: a single mesh axis uses the group :func:`~meshcomm.mesh.init_device_mesh` made. A
tuple of axes that is not the whole world needs its own group, made by one split the first
time that ordered tuple is used on the mesh: **that first call is collective over the whole
mesh** (every rank of the mesh makes it, as every rank does in SPMD code). To make it at a
time of your choosing, call ``mesh.get_group(("dp", "tp"))`` on every rank.

Example:
    >>> import numpy as np
    >>> import meshcomm.world as world
    >>> from meshcomm import ops
    >>> from meshcomm.mesh import init_device_mesh
    >>> with init_device_mesh((1, 1), ("dp", "tp")):  # a world of one here
    ...     grads = ops.pmean({"w": np.ones(3)}, ("dp", "tp"))
    ...     shard = ops.psum_scatter(np.ones((4, 2)), "tp", tiled=True)
    >>> grads["w"], shard.shape
    (array([1., 1., 1.]), (4, 2))
    >>> world.shutdown()
"""

from __future__ import annotations

from meshcomm.ops import _torch_stage, _transpose
from meshcomm.ops.casts import pcast
from meshcomm.ops.gathers import all_gather, all_to_all, psum_scatter
from meshcomm.ops.indexing import axis_index, axis_size
from meshcomm.ops.permutes import pbroadcast, ppermute, pshuffle
from meshcomm.ops.pytree import tree_flatten, tree_unflatten
from meshcomm.ops.reductions import all_reduce, pmax, pmean, pmin, pprod, psum

_torch_stage.arm()  # ready for torch.compile once torch's compiler is loaded
# The backward rules call these ops; their modules import the rules, so the ops are handed
# over from here rather than imported there.
_transpose.use(
    pcast=pcast,
    psum=psum,
    all_gather=all_gather,
    psum_scatter=psum_scatter,
    all_to_all=all_to_all,
    ppermute=ppermute,
)

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pbroadcast",
    "pcast",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "pprod",
    "pshuffle",
    "psum",
    "psum_scatter",
    "tree_flatten",
    "tree_unflatten",
]
