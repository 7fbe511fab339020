"""Collectives inside ``jax.jit``: each op call becomes one ordered host callback.

Under ``jax.jit`` tracing an op sees abstract values. :func:`stage` turns the call into a
``jax.custom_vjp`` node (the backward rule of :mod:`meshcomm.ops._transpose`, as eager
code has) whose forward is ``io_callback(..., ordered=True)``: at run time the host
function runs the eager op on numpy views of the inputs. Result shapes and dtypes come
from :func:`out_specs`, with the eager op's checks, at trace time (no I/O), so argument
errors are raised while tracing, on every rank alike.

Ordering: the ordered callbacks of one program thread one effect token, so they run in
program order, and every rank traces the same program (backward passes included, which
JAX transposes deterministically). Successive programs chain the same token. The one gap
is between a program and eager code: a program whose inputs are not ready yet is dispatched
asynchronously and runs its callbacks later, on another thread. So once anything was
staged, every op first waits for the programs dispatched before it (:func:`settle`; a
dictionary look-up when none is pending), except inside a callback.

Example:
    >>> import numpy as np
    >>> import jax
    >>> from meshcomm import ops, world
    >>> from meshcomm.mesh import init_device_mesh
    >>> mesh = init_device_mesh((1,), ("x",))  # a world of one here
    >>> f = jax.jit(lambda v: ops.all_gather(v * 2, "x", tiled=True, mesh=mesh))
    >>> f(np.arange(3.0))
    Array([0., 2., 4.], dtype=float32)
    >>> jax.effects_barrier(); world.shutdown()
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import numpy as np

from meshcomm.errors import InvalidArgument
from meshcomm.group.arrays import check_dtype
from meshcomm.group.routes import is_jax_tracer
from meshcomm.ops import _resolve
from meshcomm.ops._checks import axis_arg, block_shape
from meshcomm.ops.pytree import tree_flatten, tree_unflatten
from meshcomm.reduction import ReduceOp, check_op_dtype

__all__ = ["StagedCall", "out_specs", "settle", "stage"]

_local = threading.local()


class StagedCall(Protocol):
    """What staging reads of an op call (:class:`meshcomm.ops._autodiff.Call`, whose module
    imports this one: the call is typed here by what it offers, not by its class)."""

    @property
    def where(self) -> str:
        """The op, axis and rank, for errors (its first word names the op)."""
        ...

    @property
    def op(self) -> str:
        """The op's name (``psum``)."""
        ...

    @property
    def forward(self) -> Callable[[Any], Any]:
        """The op with its arguments bound, on a pytree."""
        ...

    @property
    def transpose(self) -> Callable[[list[Any], list[Any], list[Any]], list[Any]]:
        """The backward rule: (cotangents, primal inputs, primal outputs) -> gradients."""
        ...

    @property
    def needs_primals(self) -> bool:
        """Whether ``transpose`` reads the primal inputs and outputs."""
        ...


def out_specs(call: StagedCall, leaves: list[Any]) -> list[Any]:
    """The ``jax.ShapeDtypeStruct`` of each leaf's result, checked as the eager op checks.

    Args:
        call: the op call (its op name, ``where`` and the keywords of ``forward``).
        leaves: the inputs, anything with ``shape`` and ``dtype``.

    Raises:
        InvalidArgument: an axis out of range, a shape that does not split over the axis,
            a 0-d input where an axis is needed, a misplaced ``factor``.
        TypeError: an unsupported dtype, or one the op does not take.
    """
    import jax

    kw: dict[str, Any] = getattr(call.forward, "keywords", {})
    where, op = call.where, call.op
    size = _resolve.resolve(kw["axis_name"], kw["mesh"], op).size
    specs = []
    for leaf in leaves:
        shape, dtype = tuple(leaf.shape), check_dtype(leaf.dtype, where)
        if "op" in kw:
            dtype = _reduced_dtype(where, dtype, kw)
        elif op == "all_gather":
            shape = _gathered(where, shape, kw["axis"], kw["tiled"], size)
        elif op == "psum_scatter":
            if dtype == np.bool_:
                raise TypeError(
                    f"{where}: psum_scatter does not sum bool (as jax.lax.psum_scatter); use "
                    "x.astype(np.int32)"
                )
            _need_axis(where, shape, "scatter")
            ax = axis_arg(where, kw["scatter_dimension"], len(shape), "scatter_dimension")
            shape = block_shape(where, shape, ax, size, kw["tiled"], "scatter_dimension")
        elif op == "all_to_all":
            shape = _exchanged(where, shape, kw, size)
        specs.append(jax.ShapeDtypeStruct(shape, dtype))
    return specs


def _need_axis(where: str, shape: tuple[int, ...], verb: str) -> None:
    if not shape:
        raise InvalidArgument(f"{where}: x needs at least one axis to {verb}, got a 0-d array")


def _reduced_dtype(where: str, dtype: np.dtype, kw: dict[str, Any]) -> np.dtype:
    """The result dtype of a reduction, as ``reductions._Reduce.check`` makes it."""
    op: ReduceOp = kw["op"]
    if (op is ReduceOp.PREMUL_SUM) != (kw.get("factor") is not None):
        raise InvalidArgument(
            f"{where}: factor= goes with op 'premul_sum' and only there; got op "
            f"{op.value!r} and factor={kw.get('factor')!r}"
        )
    if kw.get("jax_bool") and dtype.kind == "b":
        dtype = np.dtype(np.int32)
    out = dtype
    if kw.get("mean") and dtype.kind in "biu":
        op, out = ReduceOp.SUM, np.dtype(np.float64 if dtype.itemsize == 8 else np.float32)
    try:
        check_op_dtype(op, dtype)
    except TypeError as exc:
        raise TypeError(f"{where}: {exc}") from None
    return out


def _gathered(where: str, shape: tuple[int, ...], axis: Any, tiled: bool, size: int) -> tuple:
    if tiled:
        if not shape:
            raise InvalidArgument(
                f"{where}: tiled=True concatenates along an existing axis, got a 0-d array"
            )
        ax = axis_arg(where, axis, len(shape), "axis")
        return (*shape[:ax], shape[ax] * size, *shape[ax + 1 :])
    ax = axis_arg(where, axis, len(shape) + 1, "axis")
    return (*shape[:ax], size, *shape[ax:])


def _exchanged(where: str, shape: tuple[int, ...], kw: dict[str, Any], size: int) -> tuple:
    _need_axis(where, shape, "split")
    split = axis_arg(where, kw["split_axis"], len(shape), "split_axis")
    concat = axis_arg(where, kw["concat_axis"], len(shape), "concat_axis")
    block = block_shape(where, shape, split, size, kw["tiled"], "split_axis")
    if kw["tiled"]:
        return (*block[:concat], size * block[concat], *block[concat + 1 :])
    return (*block[:concat], size, *block[concat:])


def stage(call: StagedCall, x: Any) -> Any:
    """Run ``call`` on the pytree ``x`` of traced values as a differentiable ordered callback.

    Every leaf is an input of one ``jax.custom_vjp`` node; the backward rule runs on the
    cotangents of the inexact traced leaves (the others get none). ``pcast`` moves nothing
    forward, so its node has no callback, only its backward.

    Raises:
        InvalidArgument, TypeError: as :func:`out_specs`.
    """
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    _arm()
    leaves, treedef = tree_flatten(x)
    args = [jnp.asarray(v) for v in leaves]
    specs = out_specs(call, args)
    slots = [
        i
        for i, (v, a) in enumerate(zip(leaves, args, strict=True))
        if is_jax_tracer(v) and jnp.issubdtype(a.dtype, jnp.inexact)
    ]

    def host(*arrays: Any) -> tuple[np.ndarray, ...]:
        tree = tree_unflatten(treedef, [np.asarray(a) for a in arrays])
        with _inside():
            outs, _ = tree_flatten(call.forward(tree))
        return tuple(np.asarray(o, s.dtype) for o, s in zip(outs, specs, strict=True))

    def forward(values: tuple[Any, ...]) -> tuple[Any, ...]:
        if call.op == "pcast":
            return values
        return tuple(io_callback(host, tuple(specs), *values, ordered=True))

    @jax.custom_vjp
    def node(*values: Any) -> tuple[Any, ...]:
        return forward(values)

    def node_fwd(*values: Any) -> tuple[tuple[Any, ...], Any]:
        outs = forward(values)
        if not call.needs_primals:
            return outs, None
        return outs, ([values[i] for i in slots], [outs[i] for i in slots])

    def node_bwd(res: Any, cts: tuple[Any, ...]) -> tuple[Any, ...]:
        xs, ys = ([], []) if res is None else res
        got = call.transpose([cts[i] for i in slots], xs, ys) if slots else []
        full: list[Any] = [None] * len(cts)
        for i, g in zip(slots, got, strict=True):
            full[i] = g
        return tuple(full)

    node.defvjp(node_fwd, node_bwd)
    return tree_unflatten(treedef, list(node(*args)))


@contextmanager
def _inside() -> Iterator[None]:
    """Mark this thread as running a callback: its ops must not wait for programs (their
    own program among them)."""
    _local.inside = True
    try:
        yield
    finally:
        _local.inside = False


def settle() -> None:
    """Wait until the jax programs this thread dispatched have run their callbacks.

    Called by every op once anything was staged, so that an eager op never overtakes
    the collectives of a program dispatched before it; a no-op inside a callback.
    """
    if getattr(_local, "inside", False):
        return
    tokens = _runtime_tokens()
    if tokens is None or tokens.current_tokens or tokens.output_runtime_tokens:
        import jax

        jax.effects_barrier()


def _runtime_tokens() -> Any:
    """jax's record of the programs with effects still running (None where jax lacks it:
    then :func:`settle` always waits, a few microseconds)."""
    try:
        from jax._src import dispatch
    except ImportError:
        return None
    found = getattr(dispatch, "runtime_tokens", None)
    has = hasattr(found, "current_tokens") and hasattr(found, "output_runtime_tokens")
    return found if has else None


def _arm() -> None:
    if _resolve._settle is None:
        _resolve._settle = settle
        # Registered after the world's own exit handler, so it runs first: pending
        # callbacks finish before the world is shut down.
        atexit.register(settle)
