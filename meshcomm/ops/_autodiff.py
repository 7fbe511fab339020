"""Gradients through the collectives: torch autograd and jax custom_vjp around any op call.

An op called on a pytree with a leaf that needs a gradient (a torch tensor with
``requires_grad`` while grad mode is on, or a jax tracer under ``jax.grad``) goes through
:func:`apply` with a :class:`Call`: the op with every argument bound (``forward``, run on
the leaves without gradient tracking) and its transpose (``transpose``, the rule of
:mod:`meshcomm.ops._transpose`, run on the cotangents by calling the public ops again, so
that a backward under ``create_graph=True`` is itself differentiable).

Only the leaves that need a gradient become inputs of the autograd node; the others ride
along in the same op call (one transfer per dtype, as always) and come back as plain
arrays. Every rank must pass the same leaves with gradients: the backward pass is a
collective too.

Example:
    >>> import numpy as np
    >>> grad_kind(np.zeros(2), "psum") is None
    True
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshcomm.errors import InvalidArgument
from meshcomm.ops._jax_jit import stage
from meshcomm.ops._native import is_jax_tracer, torch_tensor_type, tracer_message
from meshcomm.ops._tracers import stageable
from meshcomm.ops.pytree import tree_flatten, tree_leaves, tree_unflatten

__all__ = ["Call", "apply", "grad_kind"]

#: (cotangents, primal inputs, primal outputs) -> input cotangents; lists of the leaves
#: that need gradients, in tree order.
Transpose = Callable[[list[Any], list[Any], list[Any]], list[Any]]


def _leaf_grad_kind(leaf: Any, where: str) -> str | None:
    root = type(leaf).__module__.partition(".")[0]
    if root == "torch":
        tensor = torch_tensor_type()
        if tensor is not None and isinstance(leaf, tensor) and leaf.requires_grad:
            return "torch" if sys.modules["torch"].is_grad_enabled() else None
    elif root in ("jax", "jaxlib") and is_jax_tracer(leaf):
        # jax.grad / vjp trace with autodiff tracers (over concrete values, or over jit's
        # abstract ones: apply tells them apart); jit traces abstract values, staged as
        # ordered callbacks. vmap and shard_map values no collective can take.
        if type(leaf).__module__.endswith(".interpreters.ad"):
            return "jax"
        if stageable(leaf):
            return "jit"
        raise TypeError(tracer_message(where))
    return None


def grad_kind(x: Any, where: str) -> str | None:
    """``"torch"`` or ``"jax"`` if a leaf of ``x`` needs a gradient, ``"jit"`` if one is a
    value of ``jax.jit`` tracing (and none needs a gradient), else None.

    Raises:
        TypeError: a jax tracer from vmap / shard_map tracing; torch leaves needing
            gradients beside jax tracers in one call.

    Example:
        >>> grad_kind({"a": np.ones(1), "b": [2.0]}, "psum") is None
        True
    """
    if type(x) is np.ndarray:
        return None
    if not isinstance(x, (dict, list, tuple)):
        return _leaf_grad_kind(x, where)
    kinds = set()
    for leaf in tree_leaves(x):
        if type(leaf) is not np.ndarray:  # numpy leaves, the common case, need none
            kind = _leaf_grad_kind(leaf, where)
            if kind is not None:
                kinds.add(kind)
    if kinds == {"jax", "jit"}:
        return "jax"  # values jit traced beside those jax.grad differentiates: apply stages all
    if len(kinds) > 1:
        raise TypeError(f"{where}: torch tensors that require grad and jax tracers in one call")
    return kinds.pop() if kinds else None


@dataclass
class Call:
    """One op call to differentiate.

    Attributes:
        where: the op, axis and rank, for errors (its first word names the op).
        forward: the op with its arguments bound, on a pytree without gradient tracking.
        transpose: the backward rule (see ``Transpose``).
        needs_primals: whether ``transpose`` reads the primal inputs and outputs.
        results: every leaf's result, once :meth:`run` ran.
    """

    where: str
    forward: Callable[[Any], Any]
    transpose: Transpose
    needs_primals: bool = False
    results: list[Any] = field(default_factory=list)
    _leaves: list[Any] = field(default_factory=list)
    _slots: list[int] = field(default_factory=list)
    _treedef: Any = None

    @property
    def op(self) -> str:
        """The op's name (``psum``)."""
        return self.where.split(" ", 1)[0]

    def run(self, diff: tuple[Any, ...]) -> tuple[Any, ...]:
        """Run the op on the call's leaves with ``diff`` in the differentiable slots; keep
        every result in ``results`` and return those of the slots."""
        full = list(self._leaves)
        for slot, value in zip(self._slots, diff, strict=True):
            full[slot] = value
        self.results, _ = tree_flatten(self.forward(tree_unflatten(self._treedef, full)))
        return tuple(self.results[s] for s in self._slots)


def apply(kind: str, call: Call, x: Any, async_op: bool) -> Any:
    """Run ``call`` on ``x`` as one differentiable node of ``kind``'s autodiff.

    ``kind`` ``"jit"``, or ``"jax"`` over values of ``jax.jit`` tracing: the call is staged
    into the program as an ordered host callback (:mod:`meshcomm.ops._jax_jit`).

    Raises:
        InvalidArgument: ``async_op=True`` (a Work cannot carry gradients, nor leave a
            compiled program; call it synchronously, or detach the inputs).
        TypeError: a jax tracer from vmap / shard_map tracing.
    """
    if async_op and kind == "jit":
        raise InvalidArgument(
            f"{call.where}: async_op=True inside jax.jit is not supported (a Work cannot be "
            "returned from a compiled program); call it synchronously"
        )
    if async_op:
        raise InvalidArgument(
            f"{call.where}: async_op=True with inputs that need gradients is not supported "
            "(the result would leave the autograd graph); call it synchronously, or detach "
            "the inputs"
        )
    if kind == "jit" or (kind == "jax" and any(stageable(v) for v in tree_flatten(x)[0])):
        return stage(call, x)
    call._leaves, call._treedef = tree_flatten(x)
    call._slots = [
        i for i, leaf in enumerate(call._leaves) if _leaf_grad_kind(leaf, call.where) == kind
    ]
    diff = tuple(call._leaves[i] for i in call._slots)
    outs = _torch_function(call.op).apply(call, *diff) if kind == "torch" else _jax(call, diff)
    full = list(call.results)
    for slot, value in zip(call._slots, outs, strict=True):
        full[slot] = value
    return tree_unflatten(call._treedef, full)


# -- torch ---------------------------------------------------------------------------------
_TORCH_FUNCTIONS: dict[str, Any] = {}


def _torch_function(op: str) -> Any:
    """The ``torch.autograd.Function`` of ``op`` (made once per op, when torch is in use),
    so that a graph shows ``PsumBackward``, ``AllGatherBackward``, ..."""
    found = _TORCH_FUNCTIONS.get(op)
    if found is not None:
        return found
    import torch

    class Collective(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, call: Call, *diff: Any) -> Any:
            outs = call.run(diff)
            ctx.call = call
            if call.needs_primals:
                ctx.save_for_backward(*diff, *outs)
            return outs

        @staticmethod
        def backward(ctx: Any, *cts: Any) -> Any:
            call: Call = ctx.call
            xs: list[Any] = []
            ys: list[Any] = []
            if call.needs_primals:
                saved = ctx.saved_tensors
                xs, ys = list(saved[: len(cts)]), list(saved[len(cts) :])
            return (None, *call.transpose(list(cts), xs, ys))

    name = "".join(part.capitalize() for part in op.split("_"))
    function = type(name, (Collective,), {"__qualname__": name})
    _TORCH_FUNCTIONS[op] = function
    return function


# -- jax -----------------------------------------------------------------------------------
def _jax(call: Call, diff: tuple[Any, ...]) -> Any:
    import jax

    def concrete(values: tuple[Any, ...]) -> tuple[Any, ...]:
        for v in values:
            if is_jax_tracer(v):
                raise TypeError(tracer_message(call.where))
        return values

    @jax.custom_vjp
    def node(*args: Any) -> Any:
        return call.run(concrete(args))

    def node_fwd(*args: Any) -> Any:
        outs = call.run(concrete(args))
        return outs, (args, outs) if call.needs_primals else None

    def node_bwd(res: Any, cts: Any) -> Any:
        xs, ys = ([], []) if res is None else (list(res[0]), list(res[1]))
        return tuple(call.transpose(list(cts), xs, ys))

    node.defvjp(node_fwd, node_bwd)
    return node(*diff)
