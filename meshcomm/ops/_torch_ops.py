"""The torch operators behind ``meshcomm.ops`` in compiled code (``torch.ops.meshcomm.*``).

One operator per op, each over a list of tensors (a pytree's leaves, so one call still
moves one buffer per dtype) and a group name (:mod:`meshcomm.ops._torch_names`):

==============================================================  ===========================
``psum``, ``pmean``, ``pmax``, ``pmin``, ``pprod``              ``(xs, group)``
``all_reduce``                                                  ``(xs, group, op, factor)``
``all_gather``                                                  ``(xs, group, axis, tiled)``
``psum_scatter``                                                ``(xs, group, dim, tiled)``
``all_to_all``                                                  ``(xs, group, split, concat,
                                                                tiled)``
``ppermute`` (``pshuffle`` too)                                 ``(xs, group, pairs)``, flat
``pbroadcast``                                                  ``(xs, group, source)``
``pcast``                                                       ``(xs, group, to)``
``start``, ``wait``                                             an async op, split in two
==============================================================  ===========================

Each has a fake (meta) implementation that gives the results' shapes, dtypes and devices
without I/O and checks the arguments as the eager op does (same messages), so a bad call
fails at trace time and never reaches a group. The real implementation calls the eager op.
The backward of each is its rule in :mod:`meshcomm.ops._transpose`, the table the eager
ops use: one set of rules for eager and compiled code.

``start`` issues any op asynchronously and returns a token and placeholders of the
results' shapes; ``wait`` takes them and returns the results. In a compiled graph the wait
is a node of its own, so the compiler can run independent work before it (torch's
``wait_tensor`` pattern).

Example:
    >>> import torch
    >>> install()
    >>> torch.ops.meshcomm.psum.default._schema.name
    'meshcomm::psum'
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshcomm.errors import InvalidArgument
from meshcomm.ops import _transpose
from meshcomm.ops._checks import axis_arg, block_shape
from meshcomm.ops._resolve import Axis, resolve
from meshcomm.ops._torch_names import lookup
from meshcomm.reduction import ReduceOp, check_op_dtype, parse_op

__all__ = ["install", "placeholders", "real_call"]

Tensors = list[Any]

_SCHEMAS: dict[str, str] = {
    "psum": "(Tensor[] xs, str group) -> Tensor[]",
    "pmean": "(Tensor[] xs, str group) -> Tensor[]",
    "pmax": "(Tensor[] xs, str group) -> Tensor[]",
    "pmin": "(Tensor[] xs, str group) -> Tensor[]",
    "pprod": "(Tensor[] xs, str group) -> Tensor[]",
    "all_reduce": "(Tensor[] xs, str group, str op, float? factor) -> Tensor[]",
    "all_gather": "(Tensor[] xs, str group, int axis, bool tiled) -> Tensor[]",
    "psum_scatter": "(Tensor[] xs, str group, int scatter_dimension, bool tiled) -> Tensor[]",
    "all_to_all": (
        "(Tensor[] xs, str group, int split_axis, int concat_axis, bool tiled) -> Tensor[]"
    ),
    "ppermute": "(Tensor[] xs, str group, int[] pairs) -> Tensor[]",
    "pbroadcast": "(Tensor[] xs, str group, int source) -> Tensor[]",
    "pcast": "(Tensor[] xs, str group, str to) -> Tensor[]",
}

_REDUCE_OPS = {
    "psum": ReduceOp.SUM,
    "pmean": ReduceOp.AVG,
    "pmax": ReduceOp.MAX,
    "pmin": ReduceOp.MIN,
    "pprod": ReduceOp.PROD,
}


def _axis(group: str, op: str) -> Axis:
    mesh, axis_name = lookup(group)
    return resolve(axis_name, mesh, op)


def _pairs(flat: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple((flat[i], flat[i + 1]) for i in range(0, len(flat), 2))


# -- the eager ops, on real tensors ----------------------------------------------------------
def real_call(op: str, xs: Tensors, group: str, args: tuple[Any, ...], async_op: bool) -> Any:
    """Run the eager op ``op`` on ``xs`` with the operator's arguments ``args``.

    Returns:
        The list of results, or a Work giving it (``async_op``).
    """
    from meshcomm import ops

    mesh, axis_name = lookup(group)
    # One leaf goes as itself: the ops' direct paths take single arrays (a list takes the
    # pytree path, 15 us more).
    single = len(xs) == 1 and not async_op
    leaves: Any = xs[0] if single else list(xs)
    common: dict[str, Any] = {"mesh": mesh, "async_op": async_op}
    out: Any = None
    if op in _REDUCE_OPS:
        out = getattr(ops, op)(leaves, axis_name, **common)
    elif op == "all_reduce":
        out = ops.all_reduce(leaves, axis_name, args[0], factor=args[1], **common)
    elif op == "all_gather":
        out = ops.all_gather(leaves, axis_name, axis=args[0], tiled=args[1], **common)
    elif op == "psum_scatter":
        out = ops.psum_scatter(
            leaves, axis_name, scatter_dimension=args[0], tiled=args[1], **common
        )
    elif op == "all_to_all":
        out = ops.all_to_all(leaves, axis_name, args[0], args[1], tiled=args[2], **common)
    elif op == "ppermute":
        out = ops.ppermute(leaves, axis_name, _pairs(args[0]), **common)
    elif op == "pbroadcast":
        out = ops.pbroadcast(leaves, axis_name, args[0], **common)
    elif op == "pcast":
        out = ops.pcast(leaves, axis_name, to=args[0], mesh=mesh)
    if out is not None:
        return [out] if single else out
    raise InvalidArgument(f"meshcomm: no operator {op!r}")


def _unaliased(xs: Tensors, outs: Tensors) -> Tensors:
    """``outs``, each copied if it is an input's memory (an operator's outputs must not
    alias its inputs; a size-1 axis may hand an input back)."""
    if len(xs) == 1:
        o = outs[0]
        return [o.clone()] if o.numel() and o.data_ptr() == xs[0].data_ptr() else outs
    held = {x.data_ptr() for x in xs}
    return [o.clone() if o.numel() and o.data_ptr() in held else o for o in outs]


# -- shapes and dtypes, without I/O ----------------------------------------------------------
def _numpy_dtype(dtype: Any) -> np.dtype:
    """numpy's dtype for a torch dtype (by name: fake tensors have no ``.numpy()``)."""
    import ml_dtypes

    name = str(dtype).removeprefix("torch.")
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        raise TypeError(f"torch dtype {dtype} is not supported") from None


def _reduced_dtype(x: Any, op: ReduceOp, jax_rules: bool, where: str) -> Any:
    """The result dtype of a reduction of ``x`` (raises as the eager op does)."""
    import torch

    dtype = x.dtype
    if jax_rules and dtype is torch.bool:
        dtype = torch.int32  # psum and pmean count booleans as int32, as JAX does
    if jax_rules and op is ReduceOp.AVG and not (dtype.is_complex or dtype.is_floating_point):
        # pmean sums integers as integers, then divides as float32 (float64 for 64 bits)
        return torch.float64 if dtype.itemsize == 8 else torch.float32
    try:
        check_op_dtype(op, _numpy_dtype(dtype))
    except TypeError as exc:
        raise TypeError(f"{where}: {exc}") from None
    return dtype


def _fake(op: str, xs: Tensors, group: str, args: tuple[Any, ...]) -> Tensors:
    """Empty results of the right shapes and dtypes (real or fake, as ``xs`` are)."""
    ax = _axis(group, op)
    where, n = ax.where, ax.size
    outs = []
    for x in xs:
        shape, dtype = list(x.shape), x.dtype
        if op in _REDUCE_OPS or op == "all_reduce":
            rop = _REDUCE_OPS[op] if op in _REDUCE_OPS else parse_op(args[0])
            dtype = _reduced_dtype(x, rop, op in ("psum", "pmean"), where)
        elif op == "all_gather":
            axis, tiled = args
            if tiled and x.dim() == 0:
                raise InvalidArgument(
                    f"{where}: tiled=True concatenates along an existing axis, got a 0-d array"
                )
            a = axis_arg(where, axis, x.dim() if tiled else x.dim() + 1, "axis")
            if tiled:
                shape[a] = shape[a] * n
            else:
                shape.insert(a, n)
        elif op == "psum_scatter":
            dim, tiled = args
            if x.dim() == 0:
                raise InvalidArgument(
                    f"{where}: x needs at least one axis to scatter, got a 0-d array"
                )
            _reduced_dtype(x, ReduceOp.SUM, False, where)
            a = axis_arg(where, dim, x.dim(), "scatter_dimension")
            shape = list(block_shape(where, tuple(shape), a, n, tiled, "scatter_dimension"))
        elif op == "all_to_all":
            split, concat, tiled = args
            if x.dim() == 0:
                raise InvalidArgument(
                    f"{where}: x needs at least one axis to split, got a 0-d array"
                )
            s = axis_arg(where, split, x.dim(), "split_axis")
            c = axis_arg(where, concat, x.dim(), "concat_axis")
            shape = list(block_shape(where, tuple(shape), s, n, tiled, "split_axis"))
            if tiled:
                shape[c] = shape[c] * n
            else:
                shape.insert(c, n)
        outs.append(x.new_empty(shape, dtype=dtype))
    return outs


def placeholders(op: str, xs: Tensors, group: str, args: tuple[Any, ...]) -> Tensors:
    """Uninitialised tensors of the results' shapes, dtypes and devices."""
    return _fake(op, xs, group, args)


# -- the backward: the transpose table -------------------------------------------------------
def _rule(op: str, group: str, args: tuple[Any, ...]) -> _transpose.Transpose:
    mesh, axis_name = lookup(group)
    ax = resolve(axis_name, mesh, op)
    if op == "all_reduce":
        rop = parse_op(args[0])
        op = {ReduceOp.SUM: "psum", ReduceOp.MAX: "pmax", ReduceOp.MIN: "pmin"}.get(rop, op)
        if rop is ReduceOp.AVG:
            op = "pmean"
        elif rop is ReduceOp.PREMUL_SUM:
            return _transpose.scale_t(args[1], axis_name, mesh)
    if op == "psum":
        return _transpose.identity_t(axis_name, mesh)
    if op == "pmean":
        return _transpose.scale_t(1.0 / ax.size, axis_name, mesh)
    if op in ("pmax", "pmin"):
        return _transpose.pextreme_t(axis_name, mesh)
    if op == "all_gather":
        return _transpose.all_gather_t(axis_name, mesh, args[0], args[1])
    if op == "psum_scatter":
        return _transpose.psum_scatter_t(axis_name, mesh, args[0], args[1])
    if op == "all_to_all":
        return _transpose.all_to_all_t(axis_name, mesh, args[0], args[1], args[2])
    if op == "ppermute":
        return _transpose.ppermute_t(axis_name, mesh, _pairs(args[0]))
    if op == "pbroadcast":
        return _transpose.pbroadcast_t(axis_name, mesh, args[0], ax.index)
    if op == "pcast":
        if args[0] == "varying":
            return _transpose.psum_t(axis_name, mesh)
        return _transpose.scale_t(1.0 / ax.size)
    raise InvalidArgument(
        f"{ax.where}: {op} has no gradient here (meshcomm differentiates sum, avg, "
        "premul_sum, max and min); detach the input or call it under torch.no_grad()"
    )


def _needs_primals(op: str, args: tuple[Any, ...]) -> bool:
    if op in ("pmax", "pmin"):
        return True
    return op == "all_reduce" and parse_op(args[0]) in (ReduceOp.MAX, ReduceOp.MIN)


def _register_autograd(op: str, real: Callable[..., Tensors]) -> None:
    """The operator's Autograd kernel: its backward from the transpose table.

    Written by hand rather than with ``torch.library.register_autograd``, whose wrapper
    costs about 8 us on every call, gradients or not; here a call that needs no gradient
    on plain tensors (every call from a compiled graph: AOTAutograd differentiated the
    graph already) goes straight to the kernel, without re-entering the dispatcher.
    """
    import torch

    overload = getattr(torch.ops.meshcomm, op).default
    below = torch._C._AutoDispatchBelowAutograd
    modes = torch._C._len_torch_dispatch_stack
    tensor = torch.Tensor

    class Node(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, group: str, args: tuple[Any, ...], *xs: Any) -> Any:
            with below():
                outs = overload(list(xs), group, *args)
            ctx.group, ctx.args, ctx.count = group, args, len(xs)
            if _needs_primals(op, args):
                ctx.save_for_backward(*xs, *outs)
            return tuple(outs)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            xs: list[Any] = []
            ys: list[Any] = []
            if _needs_primals(op, ctx.args):
                saved = ctx.saved_tensors
                xs, ys = list(saved[: ctx.count]), list(saved[ctx.count :])
            cts = _rule(op, ctx.group, ctx.args)(list(grads), xs, ys)
            return (None, None, *cts)

    Node.__name__ = Node.__qualname__ = "Meshcomm" + op.title().replace("_", "")

    def kernel(xs: Tensors, group: str, *args: Any) -> Tensors:
        if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
            return list(Node.apply(group, args, *xs))
        if not modes() and all(type(x) is tensor for x in xs):
            return real(xs, group, *args)
        with below():
            return overload(xs, group, *args)

    _LIBRARY[0].impl(op, kernel, "Autograd")


# -- async: start and wait -------------------------------------------------------------------
_PENDING: dict[int, Any] = {}
_TOKENS = itertools.count(1)


def _start_real(xs: Tensors, group: str, op: str, args: str) -> Tensors:
    import torch

    parsed = ast.literal_eval(args)
    work = real_call(op, xs, group, parsed, async_op=True)
    token = next(_TOKENS)
    _PENDING[token] = work
    return [torch.tensor(token, dtype=torch.int64), *placeholders(op, xs, group, parsed)]


def _start_fake(xs: Tensors, group: str, op: str, args: str) -> Tensors:
    import torch

    token = torch.empty((), dtype=torch.int64, device="cpu")
    return [token, *placeholders(op, xs, group, ast.literal_eval(args))]


def _wait_real(token: Any, shapes: Tensors) -> Tensors:
    work = _PENDING.pop(int(token), None)
    if work is None:
        raise InvalidArgument(f"meshcomm wait: no operation in flight for token {int(token)}")
    return _unaliased(shapes, list(work.wait()))


def _wait_fake(token: Any, shapes: Tensors) -> Tensors:
    return [s.new_empty(s.shape) for s in shapes]


# -- registration ----------------------------------------------------------------------------
#: The library the operators live in (kept: dropping it would unregister them).
_LIBRARY: list[Any] = []


def _define(name: str, schema: str, real: Callable[..., Any], fake: Callable[..., Any]) -> None:
    # torch.library.custom_op would wrap each call in three more Python layers (40 us per
    # call, measured); a plain definition with a composite kernel costs the dispatcher's 4.
    import torch

    library = _LIBRARY[0]
    library.define(f"{name}{schema}")
    library.impl(name, real, "CompositeExplicitAutograd")
    torch.library.register_fake(f"meshcomm::{name}", fake, lib=library)


def install() -> None:
    """Define the ``meshcomm`` operators with torch (once; torch must be imported)."""
    if _LIBRARY:
        return
    import torch

    _LIBRARY.append(torch.library.Library("meshcomm", "DEF"))
    for op, schema in _SCHEMAS.items():

        def real(xs: Tensors, group: str, *args: Any, op: str = op) -> Tensors:
            return _unaliased(xs, real_call(op, xs, group, args, async_op=False))

        def fake(xs: Tensors, group: str, *args: Any, op: str = op) -> Tensors:
            return _fake(op, xs, group, args)

        _define(op, schema, real, fake)
        _register_autograd(op, real)
    _define("start", "(Tensor[] xs, str group, str op, str args) -> Tensor[]", _start_real,
            _start_fake)  # fmt: skip
    _define("wait", "(Tensor token, Tensor[] shapes) -> Tensor[]", _wait_real, _wait_fake)
