"""Which jax tracers an op can stage into a ``jax.jit`` program (:mod:`meshcomm.ops._jax_jit`).

A leaf module: the array routes (:mod:`meshcomm.ops._native`) and the autodiff dispatch
(:mod:`meshcomm.ops._autodiff`) ask it without importing the staging, which imports them.

Example:
    >>> import numpy as np
    >>> stageable(np.zeros(1))
    False
"""

from __future__ import annotations

from typing import Any

__all__ = ["stageable"]


def stageable(x: Any) -> bool:
    """Whether ``x`` is a jax tracer an op can stage: a jit (or lax control flow) tracer
    outside ``shard_map``, possibly under autodiff tracers.

    vmap's batch tracers and ``shard_map``'s per-device values are not: an ordered
    callback cannot be batched, and inside ``shard_map`` one process runs several devices'
    programs, which meshcomm's one-rank-per-process collectives cannot serve.

    Example:
        >>> stageable(0.5)
        False
    """
    while type(x).__module__.endswith(".interpreters.ad"):
        x = getattr(x, "primal", None)
    if not type(x).__module__.endswith(".interpreters.partial_eval"):
        return False
    import jax

    return not jax.sharding.get_abstract_mesh().manual_axes
