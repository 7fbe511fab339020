"""``meshcomm.ops`` on torch tensors while torch traces: ``torch.compile``, ``make_fx``, export.

Every public op starts with ``if type(x) is not np.ndarray and tracing(): return call(...)``.
In eager code :func:`tracing` is False (one flag read, and a call once torch is imported)
and the op runs as always. While torch traces, the op becomes one call of its
``torch.ops.meshcomm`` operator (:mod:`meshcomm.ops._torch_ops`) instead:

- Dynamo sees :func:`call`'s small body, which hands the op to a function marked
  ``torch._dynamo.nonstrict_trace``: Dynamo puts that call in its graph without looking
  inside (no graph break, no fake tensors inside meshcomm), and AOTAutograd runs it, with
  fake tensors, to record the operator. That run resolves the mesh and axis (the ambient
  ``with mesh:`` one or ``mesh=``) into a group name the operator carries, and checks the
  arguments (bad ones raise here, before any I/O, with the eager op's messages).
- ``async_op=True`` gives a :class:`StagedWork`: the ``start`` operator now, the ``wait``
  operator at ``.wait()``, so the compiler can schedule work in between.

torch is never imported here: :func:`install` runs once torch is in ``sys.modules``.

Example:
    >>> tracing()  # eager code
    False
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from meshcomm.common.after_import import after_import
from meshcomm.errors import InvalidArgument
from meshcomm.ops._pairs import checked_pairs, shuffle_pairs
from meshcomm.ops._resolve import resolve
from meshcomm.ops._torch_names import group_name

__all__ = ["StagedWork", "arm", "call", "install", "tracing"]

#: ``torch.compiler.is_compiling`` or a torch dispatch mode is on (set by install()).
_CHECK: list[Callable[[], bool]] = []
#: The nonstrict-traced runners (set by install()): sync, start.
_RUN: list[Callable[..., Any]] = []

#: Ops that have a gradient (pprod and the bitwise all_reduce ops have none).
_NO_GRADIENT = ("prod", "band", "bor", "bxor")


def tracing() -> bool:
    """Whether torch is tracing now (compile, make_fx, export); False in eager code."""
    if not _CHECK:
        if "torch._dynamo" not in sys.modules:
            return False  # nothing that traces is loaded (and loading it costs 1.5 s)
        install()
    return _CHECK[0]()


def arm() -> None:
    """Install now if torch's compiler is loaded, else as soon as it is.

    Dynamo cannot trace the installation itself, so it must happen before Dynamo first
    meets an op; importing ``torch._dynamo`` (1.5 s) for code that never compiles would
    tax every torch user, so an import hook waits for whoever imports it first.
    """
    if not _CHECK:
        after_import("torch._dynamo", install)


def install() -> None:
    """Ready the operators and the tracing hooks (torch must be imported; once)."""
    if _CHECK:
        return
    import torch
    import torch.utils._pytree as pytree

    from meshcomm.mesh import DeviceMesh
    from meshcomm.ops import _torch_ops

    _torch_ops.install()
    if DeviceMesh not in pytree.SUPPORTED_NODES:
        pytree.register_constant(DeviceMesh)  # mesh= passes into nonstrict-traced calls
    is_compiling = torch.compiler.is_compiling
    dispatch_modes = torch._C._len_torch_dispatch_stack

    def check() -> bool:
        return is_compiling() or dispatch_modes() > 0

    _RUN.extend(
        [torch._dynamo.nonstrict_trace(_run_sync), torch._dynamo.nonstrict_trace(_run_start)]
    )
    _CHECK.append(check)


def call(op: str, x: Any, axis_name: Any, mesh: Any, async_op: bool, **params: Any) -> Any:
    """Run ``op`` on ``x`` as its torch operator (while torch traces).

    Returns:
        The op's result (a pytree of tensors), or a :class:`StagedWork` if ``async_op``.
    """
    # nonstrict_trace takes tensors, constants and containers of them, but not None
    given = {k: v for k, v in params.items() if v is not None}
    if mesh is not None:
        given["mesh"] = mesh
    if not async_op:
        return _RUN[0](op, x, axis_name, given)
    token, shapes = _RUN[1](op, x, axis_name, given)
    return StagedWork(token, shapes)


class StagedWork:
    """An op started in traced code; :meth:`wait` gives its result.

    Every rank must wait for every op it started (the result leaves the group then).
    """

    def __init__(self, token: Any, shapes: Any) -> None:
        self._token, self._shapes = token, shapes

    def wait(self, timeout: float | None = None) -> Any:
        """The op's result (a pytree of tensors). ``timeout`` is the group's own."""
        import torch
        import torch.utils._pytree as pytree

        leaves, spec = pytree.tree_flatten(self._shapes)
        return pytree.tree_unflatten(torch.ops.meshcomm.wait(self._token, leaves), spec)


def _lower(op: str, x: Any, axis_name: Any, params: dict[str, Any]) -> Any:
    """The operator, its arguments, the leaves and how to rebuild the tree."""
    import torch
    import torch.utils._pytree as pytree

    from meshcomm.ops._checks import index_arg

    mesh = params.pop("mesh", None)
    axis = resolve(axis_name, mesh, op)
    leaves, spec = pytree.tree_flatten(x)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{axis.where}: in traced code every leaf must be a torch tensor, got "
                f"{type(leaf).__name__}"
            )
    target, args = op, tuple(params.values())
    if op == "all_reduce":
        rop = params["op"]
        target, args = op, (str(getattr(rop, "value", rop)), params.get("factor"))
        if args[1] is not None:
            args = (args[0], float(args[1]))
    elif op == "ppermute":
        pairs = checked_pairs(axis.where, params["perm"], axis.size, "ppermute")
        args = (tuple(v for pair in pairs for v in pair),)
    elif op == "pshuffle":
        pairs = shuffle_pairs(axis.where, params["perm"], axis.size)
        target, args = "ppermute", (tuple(v for pair in pairs for v in pair),)
    elif op == "pbroadcast":
        args = (index_arg(axis.where, params["source"], axis.size, "source"),)
    elif op == "pcast" and params["to"] not in ("varying", "invariant"):
        raise InvalidArgument(f"pcast: to must be 'varying' or 'invariant', got {params['to']!r}")
    if torch.is_grad_enabled() and any(leaf.requires_grad for leaf in leaves):
        name = op if op != "all_reduce" else args[0]
        if op == "pprod" or name in _NO_GRADIENT:
            what = "pprod" if op == "pprod" else f"all_reduce with op {name!r}"
            raise InvalidArgument(
                f"{axis.where}: {what} has no gradient here (meshcomm differentiates sum, "
                "avg, premul_sum, max and min); detach the input or call it under "
                "torch.no_grad()"
            )
    return target, args, group_name(axis.mesh, axis_name), axis, leaves, spec


def _run_sync(op: str, x: Any, axis_name: Any, params: dict[str, Any]) -> Any:
    import torch
    import torch.utils._pytree as pytree

    target, args, group, _, leaves, spec = _lower(op, x, axis_name, dict(params))
    outs = getattr(torch.ops.meshcomm, target)(leaves, group, *args)
    return pytree.tree_unflatten(list(outs), spec)


def _run_start(op: str, x: Any, axis_name: Any, params: dict[str, Any]) -> Any:
    import torch
    import torch.utils._pytree as pytree

    target, args, group, axis, leaves, spec = _lower(op, x, axis_name, dict(params))
    if torch.is_grad_enabled() and any(leaf.requires_grad for leaf in leaves):
        raise InvalidArgument(
            f"{axis.where}: async_op=True with inputs that need gradients is not supported "
            "(the result would leave the autograd graph); call it synchronously, or detach "
            "the inputs"
        )
    token, *shapes = torch.ops.meshcomm.start(leaves, group, target, repr(args))
    return token, pytree.tree_unflatten(shapes, spec)
