"""Array kinds at the ops boundary: torch tensors and jax arrays in, the same kind out.

The group layer moves numpy arrays (and cupy arrays, for a backend that takes them). Every
op of :mod:`meshcomm.ops` passes each leaf through :func:`unwrap`, which returns an array the
group can move plus a :class:`Rewrap` that turns a result back into the caller's kind, dtype
and device:

=====================  =============================  ====================================
leaf                   handed to the group            result
=====================  =============================  ====================================
numpy array, scalar    as is                          numpy array
torch CPU tensor       ``t.numpy()`` (shared memory)  ``torch.from_numpy`` (shared memory)
torch CUDA tensor      cupy via DLPack (no copy),     ``torch.from_dlpack`` on the same
                       else a host copy               device (else a host-to-device copy)
jax array, one device  ``np.asarray`` (no copy on     CPU: ``jnp.asarray`` (small) or DLPack
                       CPU), cupy via DLPack on GPU   (from 64 KiB); GPU: DLPack, on the
                                                      same device
cupy array             as is                          cupy array
=====================  =============================  ====================================

Which row a leaf takes is decided in :mod:`meshcomm.group.routes` (its kind, and whether a
GPU leaf goes as a cupy view); this module makes the conversions. torch ``bfloat16`` goes
through an ``int16`` view re-typed as ``ml_dtypes.bfloat16`` both ways (numpy has no
bfloat16 of its own). A tensor with its conjugate or negative bit set is resolved first (one
copy), as ``Tensor.numpy`` requires. torch and jax are never imported
here: a tensor can only arrive if the caller imported its library.

Example:
    >>> import numpy as np
    >>> arr, back = unwrap(np.arange(3), "psum")
    >>> back is None
    True
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from meshcomm.group import routes
from meshcomm.group.routes import is_jax_tracer

__all__ = [
    "Rewrap",
    "is_jax_tracer",
    "numpy_of_tensor",
    "tensor_of_numpy",
    "torch_tensor_type",
    "unwrap",
]

#: Turns a result (numpy or cupy array) back into the caller's kind and device.
Rewrap = Callable[[Any], Any]

_BF16 = np.dtype(ml_dtypes.bfloat16)


def torch_tensor_type() -> Any:
    """``torch.Tensor`` if torch was imported, else None (torch is never imported here)."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.Tensor


_TORCH_KINDS = frozenset({"torch", "torch-cuda", "torch-other"})
_JAX_KINDS = frozenset({"jax", "jax-gpu", "jax-tracer"})


def unwrap(x: Any, where: str) -> tuple[Any, Rewrap | None]:
    """Return ``(array, rewrap)``: what the group moves, and how to give a result back.

    ``rewrap`` is None for numpy arrays, scalars and cupy arrays (their results are
    already of the right kind).

    Raises:
        TypeError: a torch dtype numpy cannot view (float8, complex32, ...), a jax tracer
            (the ops stage jit's before they get here; vmap's and shard_map's they
            cannot take), or a jax array spread over several devices.
    """
    if type(x) is np.ndarray:
        return x, None
    kind = routes.kind_of(x)
    if kind == "other":  # scalars and lists: numpy converts them
        return x, None
    if kind in _TORCH_KINDS:
        return _unwrap_torch(x, kind, where)
    if kind in _JAX_KINDS:
        return _unwrap_jax(x, kind, where)
    return x, None


# -- torch ---------------------------------------------------------------------------------
def numpy_of_tensor(x: Any) -> np.ndarray | None:
    """``x.numpy()`` (shared memory) for a plain CPU tensor, else None: the ops' fast paths.

    Plain: exactly ``torch.Tensor`` (no subclass), on the CPU, strided, of a dtype numpy has
    (not bfloat16), no conjugate or negative bit, and not needing a gradient
    (``requires_grad`` off, or grad mode off). ``Tensor.numpy`` checks all but the first
    two itself and raises otherwise; that costs a raise, so bfloat16, common and never
    taken, is refused first. Give the result back with :func:`tensor_of_numpy`.

    Example:
        >>> numpy_of_tensor(np.zeros(1)) is None
        True
    """
    torch = sys.modules.get("torch")
    if torch is None or type(x) is not torch.Tensor or x.dtype is torch.bfloat16:
        return None
    try:
        return x.numpy()
    except (TypeError, RuntimeError):
        return None


def tensor_of_numpy(result: np.ndarray) -> Any:
    """``torch.from_numpy(result)``: the way back from :func:`numpy_of_tensor`."""
    return sys.modules["torch"].from_numpy(result)


def _unwrap_torch(t: Any, kind: str, where: str) -> tuple[Any, Rewrap]:
    import torch  # already imported by the caller: a tensor is in hand

    if t.requires_grad:
        t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if kind == "torch-other" and t.device.type == "meta":
        raise TypeError(
            f"{where}: a torch meta tensor has no values to communicate; pass a CPU or CUDA tensor"
        )
    if kind == "torch":
        if t.dtype is torch.bfloat16:
            return t.view(torch.int16).numpy().view(_BF16), _to_torch_cpu
        try:
            return t.numpy(), _to_torch_cpu
        except TypeError:
            raise TypeError(
                f"{where}: torch dtype {t.dtype} is not supported (supported: bool, int8..int64, "
                "uint8..uint64, float16/32/64, complex64/128, bfloat16)"
            ) from None
    device = t.device
    # Without cupy, or for bfloat16 (cupy has none), torch's own copies.
    cupy = routes.via_cupy(kind, t.dtype is torch.bfloat16)
    if cupy is not None:
        with cupy.cuda.Device(device.index):
            arr = cupy.from_dlpack(t)
        return arr, lambda r: _to_torch_device(r, device)
    host, _ = _unwrap_torch(t.cpu(), "torch", where)
    return host, lambda r: _to_torch_device(r, device)


def _to_torch_cpu(result: Any) -> Any:
    import torch

    if result.dtype == _BF16:
        return torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(result)


def _to_torch_device(result: Any, device: Any) -> Any:
    import torch

    if isinstance(result, np.ndarray):
        return _to_torch_cpu(result).to(device)
    return torch.from_dlpack(result)


# -- jax -----------------------------------------------------------------------------------
def _unwrap_jax(x: Any, kind: str, where: str) -> tuple[Any, Rewrap | None]:
    import jax  # already imported by the caller: a jax array is in hand

    if kind == "jax-tracer":
        from meshcomm.ops._tracers import stageable

        if stageable(x):  # only calls that move nothing get here (pcast over no axes)
            raise TypeError(
                f"{where}: this call moves nothing and is not staged into jax.jit; drop it "
                "there (it is a copy)"
            )
        raise TypeError(tracer_message(where))
    devices = x.sharding.device_set
    if len(devices) != 1:
        raise TypeError(
            f"{where}: a jax array spread over {len(devices)} devices; a meshcomm rank holds "
            "one device's shard (pass x.addressable_shards[i].data)"
        )
    (device,) = devices
    if kind == "jax":
        return np.asarray(x), lambda r: _to_jax_cpu(r, device)
    cupy = routes.via_cupy(kind, x.dtype == _BF16)
    arr = cupy.from_dlpack(x) if cupy is not None else np.asarray(x)
    return arr, lambda r: jax.device_put(
        jax.dlpack.from_dlpack(r) if not isinstance(r, np.ndarray) else r, device
    )


#: From this size, DLPack hands a numpy result to jax faster than jax's own conversions.
_JAX_DLPACK_MIN = 64 << 10


def _to_jax_cpu(result: np.ndarray, device: Any) -> Any:
    """A numpy result as a jax array on ``device`` (a CPU device), by the cheapest way.

    Measured at world 1: 8 B ``jnp.asarray`` 10 us vs ``jax.device_put`` 18 us; 1 MiB
    ``jax.dlpack.from_dlpack`` 34 us vs ``device_put`` 165 us. Each copies (jax arrays are
    immutable), so the result pool never sees its buffer aliased.
    """
    import jax
    import jax.numpy as jnp

    out = None
    if result.nbytes >= _JAX_DLPACK_MIN:
        try:
            out = jax.dlpack.from_dlpack(result)
        except (TypeError, ValueError, BufferError):  # bfloat16 and other dtypes DLPack lacks
            out = None
    if out is None:
        out = jnp.asarray(result)
    return out if out.device == device else jax.device_put(out, device)


def tracer_message(where: str) -> str:
    """The error for a jax tracer: why, and what to use instead.

    Example:
        >>> tracer_message("psum over 'tp' (size 2) on rank 0").split(":")[1]
        ' got a jax tracer of jax.vmap or jax.shard_map'
    """
    return (
        f"{where}: got a jax tracer of jax.vmap or jax.shard_map: meshcomm collectives move "
        "one rank's whole array between processes, so they cannot be batched by vmap nor "
        "run per device inside shard_map. They work eagerly, under jax.grad, and inside "
        "jax.jit (as ordered host callbacks); inside jax.shard_map over one process's "
        "devices, use jax.lax.psum and friends"
    )
