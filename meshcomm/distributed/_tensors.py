"""Caller buffers: numpy arrays, torch tensors and cupy arrays seen as numpy, written in place.

The in-place API computes each result with meshcomm's functional collectives (numpy in,
numpy out) and copies it into the caller's buffer. :func:`as_buffer` wraps one caller
object as a :class:`Buffer`:

- numpy arrays are used as they are;
- CPU torch tensors are viewed as numpy through ``tensor.numpy()`` (shared memory, any
  strides, so no copy on the way in and one ``np.copyto`` into the view on the way out);
  ``bfloat16`` goes through an ``int16`` view re-typed as ``ml_dtypes.bfloat16``;
- CUDA torch tensors and cupy arrays go through cupy (DLPack for torch): one device-to-host
  copy for inputs, one host-to-device copy into the caller's memory for outputs (meshcomm's
  backends compute on host memory today). Without cupy, CUDA tensors use torch's own copies.

Each object's kind, and whether a GPU one runs over a group's device backend, is decided in
:mod:`meshcomm.group.routes`. torch and cupy are never imported here unless the caller
passed one of their objects.
Anything else is a ``TypeError`` that names the parameter and the type.

Example:
    >>> buf = as_buffer(np.zeros(3, np.float32), "tensor")
    >>> buf.write(np.arange(3, dtype=np.float32)); buf.obj
    array([0., 1., 2.], dtype=float32)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np

from meshcomm.group import routes
from meshcomm.group.arrays import SUPPORTED_DTYPES, plain_array

__all__ = [
    "Buffer",
    "as_buffer",
    "as_buffer_list",
    "dtype_text",
    "same_dtype",
]

_SUPPORTED = frozenset(SUPPORTED_DTYPES)
_BF16 = np.dtype(ml_dtypes.bfloat16)


def _describe(x: Any) -> str:
    cls = type(x)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


class Buffer:
    """One caller object (array or tensor) as seen by the in-place API.

    Attributes:
        obj: the caller's object.
        kind: ``"numpy"``, ``"torch"`` (CPU), ``"torch-cuda"`` or ``"cupy"``.
        shape: its shape.
        dtype: its numpy dtype (``bfloat16`` as ``ml_dtypes.bfloat16``).
        name: the parameter it was passed as, for messages.
    """

    def __init__(
        self,
        obj: Any,
        kind: str,
        shape: tuple[int, ...],
        dtype: np.dtype,
        name: str,
        view: np.ndarray | None,
    ) -> None:
        self.obj = obj
        self.kind = kind
        self.shape = shape
        self.dtype = dtype
        self.name = name
        self._view = view  # a numpy view of the caller's memory (host kinds only)

    @property
    def numel(self) -> int:
        """The number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def host(self) -> np.ndarray:
        """The values as a numpy array: a view of the caller's memory for host kinds, a copy
        for device kinds."""
        if self._view is not None:
            return self._view
        return _device_to_host(self)

    @property
    def in_place(self) -> np.ndarray | None:
        """The caller's memory as a writeable C-contiguous numpy view (native byte order),
        for a collective that writes its result there directly; None where it is not one."""
        v = self._view
        if v is None or not (v.flags.c_contiguous and v.flags.writeable and v.dtype.isnative):
            return None
        return v

    def device_view(self, group: Any) -> Any | None:
        """The caller's GPU memory as a cupy array, for ``group`` (a meshcomm group) to move
        over its device backend; None where the values go through host memory: a host
        kind, a group without a device backend, or bfloat16 (cupy has no such dtype)."""
        if not routes.stays_on_device(self.kind, self.dtype == _BF16, group.device_backend):
            return None
        return _cupy_view(self)

    def for_group(self, group: Any) -> Any:
        """What to hand ``group``: :meth:`device_view` where there is one, else :attr:`host`."""
        view = self.device_view(group)
        return self.host if view is None else view

    def write(self, values: Any) -> None:
        """Copy ``values`` (same number of elements and dtype; numpy or cupy) into the
        caller's object."""
        if self._view is not None:
            if not isinstance(values, np.ndarray):  # a device result into host memory
                values = values.get()
            np.copyto(self._view, values.reshape(self.shape))
        elif isinstance(values, np.ndarray):
            _host_to_device(self, values.reshape(self.shape))
        else:  # a device result, copied on the device (the caller's stream: device_stream)
            with device_stream(self):
                _cupy_view(self)[...] = values.reshape(self.shape)

    def check_writable(self) -> None:
        """Raise ValueError before any I/O if results cannot be written into the object."""
        if self._view is not None and not self._view.flags.writeable:
            raise ValueError(f"{self.name} is read-only; pass a writable array")
        if self.kind == "torch" and _stride_overlaps(self.obj):
            raise ValueError(
                f"{self.name} has overlapping memory (an expanded tensor, stride 0); "
                "pass a tensor that owns each element, e.g. tensor.contiguous()"
            )

    def __repr__(self) -> str:
        return f"<Buffer {self.name} {self.kind} {self.shape} {dtype_text(self.dtype)}>"


def dtype_text(dtype: np.dtype) -> str:
    """Readable dtype name (``bfloat16``, not ``V2``)."""
    return np.dtype(dtype).name


def _stride_overlaps(t: Any) -> bool:
    if t.is_contiguous():  # the common case, one C call
        return False
    return any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape, strict=True))


# torch dtype -> numpy dtype, or None for dtypes numpy cannot hold (float8, complex32, ...).
_TORCH_DTYPES: dict[Any, np.dtype | None] = {}


def _torch_numpy_dtype(t: Any, name: str) -> np.dtype:
    import torch

    key = t.dtype
    if key not in _TORCH_DTYPES:
        if key == torch.bfloat16:
            _TORCH_DTYPES[key] = _BF16
        else:
            try:
                dt: np.dtype | None = np.dtype(torch.empty((), dtype=key).numpy().dtype)
            except (TypeError, RuntimeError):
                dt = None
            _TORCH_DTYPES[key] = dt if dt in _SUPPORTED else None
    found = _TORCH_DTYPES[key]
    if found is None:
        raise TypeError(
            f"{name}: torch dtype {key} is not supported (supported: bool, int8..int64, "
            "uint8..uint64, float16/32/64, bfloat16, complex64/128)"
        )
    return found


def _torch_buffer(t: Any, kind: str, name: str) -> Buffer:
    import torch

    if t.layout != torch.strided:
        raise TypeError(
            f"{name}: only dense (strided) tensors are supported, got layout {t.layout}"
        )
    dt = _TORCH_DTYPES.get(t.dtype)
    if dt is None:  # not seen yet, or unsupported (which raises)
        dt = _torch_numpy_dtype(t, name)
    shape = tuple(t.shape)  # torch.Size holds ints
    if kind == "torch":
        base = t.detach() if t.requires_grad else t
        if base.is_conj() or base.is_neg():
            raise TypeError(
                f"{name} is a lazy conjugate/negative view; call .resolve_conj() / "
                ".resolve_neg() first"
            )
        try:
            view = base.view(torch.int16).numpy().view(_BF16) if dt == _BF16 else base.numpy()
        except RuntimeError as exc:  # a FakeTensor or FunctionalTensor: no values to read
            raise TypeError(
                f"{name}: a {type(t).__name__} holds no values to communicate (a tensor of "
                "torch's tracing); call the collective on a real tensor, outside the trace "
                f"(torch.compile breaks the graph at meshcomm's calls): {exc}"
            ) from None
        return Buffer(t, "torch", shape, dt, name, view)
    if kind == "torch-cuda":
        return Buffer(t, kind, shape, dt, name, None)
    raise TypeError(f"{name}: torch tensors on device {t.device} are not supported (cpu, cuda)")


def as_buffer(x: Any, name: str) -> Buffer:
    """Wrap a numpy array, torch tensor or cupy array as a :class:`Buffer`.

    Args:
        x: the caller's object.
        name: the parameter name, for error messages.

    Raises:
        TypeError: another kind of object, or an unsupported dtype; the message names the
            parameter, the type and the dtype.

    Example:
        >>> as_buffer([1, 2], "tensor")
        Traceback (most recent call last):
        ...
        TypeError: tensor must be a numpy array, a torch tensor or a cupy array, got list
    """
    kind = routes.kind_of(x)
    if kind == "numpy":
        view = plain_array(x, name)  # np.matrix as its values; a masked array is refused
        dt = x.dtype
        if dt.kind in "biufc" and not dt.isnative:
            dt = dt.newbyteorder("=")  # values are compared and copied by value, not bytes
        if dt not in _SUPPORTED:
            raise TypeError(f"{name}: numpy dtype {x.dtype} is not supported")
        return Buffer(x, "numpy", view.shape, dt, name, view)
    if kind in ("torch", "torch-cuda", "torch-other"):
        return _torch_buffer(x, kind, name)
    if kind == "cupy":
        dt = np.dtype(x.dtype)
        if dt not in _SUPPORTED:
            raise TypeError(f"{name}: cupy dtype {dt} is not supported")
        return Buffer(x, "cupy", tuple(x.shape), dt, name, None)
    raise TypeError(
        f"{name} must be a numpy array, a torch tensor or a cupy array, got {_describe(x)}"
    )


def as_buffer_list(xs: Any, name: str) -> list[Buffer]:
    """Wrap a list of arrays/tensors (torch requires a list; tuples are accepted too).

    Raises:
        TypeError: not a list or tuple, or an element of an unsupported kind.

    Example:
        >>> [b.shape for b in as_buffer_list([np.zeros(2), np.zeros(3)], "tensor_list")]
        [(2,), (3,)]
    """
    if not isinstance(xs, (list, tuple)):
        raise TypeError(
            f"Invalid function argument: {name} must be a list of tensors, got {_describe(xs)}"
        )
    return [as_buffer(x, f"{name}[{i}]") for i, x in enumerate(xs)]


def same_dtype(buffers: Sequence[Buffer]) -> None:
    """Raise ValueError if the buffers do not all have one dtype (as torch does).

    Example:
        >>> same_dtype([as_buffer(np.zeros(1, np.float32), "a"), as_buffer(np.zeros(1), "b")])
        Traceback (most recent call last):
        ...
        ValueError: Invalid usage of tensors with different dtypes: a is float32 but b is float64
    """
    if not buffers:
        return
    first = buffers[0]
    for b in buffers[1:]:
        if b.dtype != first.dtype:
            raise ValueError(
                f"Invalid usage of tensors with different dtypes: {first.name} is "
                f"{dtype_text(first.dtype)} but {b.name} is {dtype_text(b.dtype)}"
            )


# -- device kinds (need a GPU; exercised only where one is present) --------------------------


def device_stream(buf: Buffer) -> contextlib.AbstractContextManager[Any]:
    """Make torch's current CUDA stream cupy's too, for work on a torch tensor's memory
    (cupy's own stream otherwise), so that torch's later work sees the result in order."""
    if buf.kind != "torch-cuda":
        return contextlib.nullcontext()
    import cupy
    import torch

    return cupy.cuda.ExternalStream(torch.cuda.current_stream(buf.obj.device).cuda_stream)


def _cupy_view(buf: Buffer) -> Any:
    import cupy

    if buf.kind == "cupy":
        return buf.obj
    import torch

    t = buf.obj.detach()
    if buf.dtype == _BF16:
        t = t.view(torch.int16)
    return cupy.from_dlpack(t)


def _device_to_host(buf: Buffer) -> np.ndarray:
    if buf.kind == "torch-cuda" and routes.importable_cupy() is None:
        import torch

        t = buf.obj.detach()
        if buf.dtype == _BF16:
            return t.view(torch.int16).cpu().numpy().view(_BF16)
        return np.asarray(t.cpu().numpy())
    import cupy

    host = cupy.asnumpy(_cupy_view(buf))
    return host.view(_BF16) if buf.dtype == _BF16 else host


def _host_to_device(buf: Buffer, values: np.ndarray) -> None:
    if buf.dtype == _BF16:
        values = values.view(np.int16)
    if buf.kind == "torch-cuda" and routes.importable_cupy() is None:
        import torch

        t = buf.obj.detach()
        if buf.dtype == _BF16:
            t = t.view(torch.int16)
        t.copy_(torch.from_numpy(np.ascontiguousarray(values)))
        return
    import cupy

    _cupy_view(buf)[...] = cupy.asarray(values)
