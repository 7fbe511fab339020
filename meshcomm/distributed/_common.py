"""What every in-place collective does around its meshcomm call: membership, argument checks
shared by several functions, and issuing the call synchronously or as a Work.

Example:
    >>> from meshcomm.distributed._tensors import as_buffer
    >>> same_count(2, [1, 2], "tensor_list")
    >>> counts_equal([as_buffer(np.zeros(3), "a")], 3, "tensor")
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from meshcomm.distributed._errors import DistTypeError
from meshcomm.distributed._pg import ProcessGroup
from meshcomm.distributed._reduce_op import supports_complex, to_meshcomm
from meshcomm.distributed._state import STATE, resolve, warn_not_in_group
from meshcomm.distributed._tensors import Buffer, device_stream
from meshcomm.distributed._work import Work
from meshcomm.group import routes
from meshcomm.reduction import ReduceOp as MeshOp
from meshcomm.reduction import check_op_dtype

__all__ = [
    "Issue",
    "Route",
    "counts_equal",
    "flat",
    "member",
    "reduce_op_for",
    "run",
    "same_count",
    "writable",
]

Issue = Callable[[bool], Any]


class Route:
    """Where one call's input values go: over the group's device backend where every input
    lives on the GPU and the group has one (cupy views of the caller's memory, worked on in
    torch's current stream), else through host memory (numpy). Each buffer's way is decided
    in :mod:`meshcomm.group.routes` (:meth:`Buffer.device_view`).

    Args:
        group: the meshcomm group.
        inputs: the buffers whose values the call sends (decides the route).

    Example:
        >>> from meshcomm.distributed._tensors import as_buffer
        >>> from meshcomm.group import ProcessGroup
        >>> from meshcomm.backends.local import SelfCommunicator
        >>> b = as_buffer(np.arange(4.0).reshape(2, 2), "tensor")
        >>> route = Route(ProcessGroup(SelfCommunicator()), [b])
        >>> route.on_device, route.flat(b)
        (False, array([0., 1., 2., 3.]))
    """

    def __init__(self, group: Any, inputs: Sequence[Buffer]) -> None:
        views = [b.device_view(group) for b in inputs]
        self.on_device = bool(views) and all(v is not None for v in views)
        self._views: dict[int, Any] = {id(b): v for b, v in zip(inputs, views, strict=True)}
        # Whose stream device work runs on (torch's current one for a torch tensor).
        self._lead = inputs[0] if self.on_device else None
        self.xp: ModuleType = np
        if self.on_device:
            self.xp = routes.device_module(views[0]) or np

    def flat(self, buf: Buffer) -> Any:
        """``buf``'s values, 1-D: its device view on the device route, else :func:`flat`."""
        if self.on_device:
            return self._views[id(buf)].reshape(-1)
        return flat(buf)

    def stream(self) -> contextlib.AbstractContextManager[Any]:
        """Where device work of this call runs: torch's current stream for torch tensors."""
        if self._lead is None:
            return contextlib.nullcontext()
        return device_stream(self._lead)


def run(
    label: str, issue: Issue, outputs: Any, finish: Callable[[Any], None], async_op: bool
) -> Any:
    """Issue one meshcomm operation; copy its result out with ``finish`` (now or on wait)."""
    if async_op:
        inner = issue(True)
        return Work(label, outputs, lambda results: finish(results[0])).attach([inner])
    finish(issue(False))
    return None


def member(group: Any, op: str) -> ProcessGroup | None:
    """Resolve ``group``; None (after torch's warning) if this rank is not a member.

    Issues deferred receives first, so they keep their place before this operation.
    """
    pg = resolve(group)
    if pg is None:
        warn_not_in_group(op)
        return None
    STATE.flush()
    return pg


def writable(*buffers: Buffer) -> None:
    """Raise ValueError (before any I/O) if a result cannot be written into a buffer."""
    for b in buffers:
        b.check_writable()


def flat(buf: Buffer) -> np.ndarray:
    """The buffer's values as a 1-D numpy array (a view where the layout allows)."""
    return buf.host.reshape(-1)


def same_count(size: int, buffers: Sequence[Any], name: str) -> None:
    """Raise ValueError unless there is one entry per rank of the group."""
    if len(buffers) != size:
        raise ValueError(
            f"{name} must hold one tensor per rank of the group ({size}), got {len(buffers)}"
        )


def counts_equal(buffers: Sequence[Buffer], n: int, ref: str) -> None:
    """Raise ValueError unless every buffer has ``n`` elements, as ``ref`` has."""
    for b in buffers:
        if b.numel != n:
            raise ValueError(f"{b.name} has {b.numel} elements but {ref} has {n}; they must match")


def reduce_op_for(op: Any, buf: Buffer, fname: str) -> tuple[MeshOp, Any]:
    """Return meshcomm's op and factor for ``op`` on ``buf``'s dtype, or raise as torch does
    (ValueError for complex tensors, DistTypeError for other dtypes)."""
    mop, factor = to_meshcomm(op)
    if buf.dtype.kind == "c" and not supports_complex(op):
        raise ValueError(f"{fname} does not support {op} on complex tensors")
    try:
        check_op_dtype(mop, buf.dtype)
    except TypeError as exc:
        raise DistTypeError(f"{fname}: {exc}") from None
    return mop, factor
