"""Routes: the one place that decides where an array given to meshcomm goes.

Every layer that takes a caller's array asks this module, and none decides on its own:

- **kind** (:func:`kind_of`): numpy, cupy, a torch tensor on the CPU, on CUDA or elsewhere,
  a jax array on the CPU or a GPU or a jax tracer, or anything else (scalars, lists: numpy
  converts them);
- **how a layer above hands it to a group** (:func:`via_cupy`, :func:`stays_on_device`): a
  GPU kind goes as a cupy view of its memory (DLPack) where cupy can hold it, else as a host
  copy; in a group with a device communicator, such a view runs there;
- **device** (:func:`device_module`): whether the array the group is handed lives on a GPU,
  and its array module (``cupy``; the group moves numpy and cupy arrays only);
- **device or host** (:func:`group_route`): a device array in a group with a device
  communicator (nccl) goes there (:class:`DeviceRoute`); anything else goes through host
  memory (:class:`HostRoute`), a device array staged through a host copy
  (:mod:`meshcomm.group.staging`);
- **the way back** (:func:`give_back`): a staged result is handed back as an array of the
  caller's module.

The torch and jax layers above (:mod:`meshcomm.ops`, :mod:`meshcomm.distributed`, the torch
backend) turn their tensors into numpy or cupy arrays by the kind named here, and hand those
to a group, which routes them here. torch and jax are never imported here (an array of theirs
can only arrive if the caller imported its library), cupy only by :func:`importable_cupy`,
for a torch or jax GPU array in hand.

Example:
    >>> import numpy as np
    >>> x = np.arange(3)
    >>> kind_of(x), device_module(x) is None
    ('numpy', True)
    >>> group_route(None, x) == HostRoute(x, None)
    True
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from meshcomm.backends.base import Communicator
from meshcomm.group import staging as _staging

__all__ = [
    "DEVICE_KINDS",
    "KINDS",
    "DeviceRoute",
    "HostRoute",
    "array_module",
    "arrival_route",
    "device_module",
    "device_route",
    "give_back",
    "group_route",
    "host_route",
    "importable_cupy",
    "is_jax_tracer",
    "kind_of",
    "stays_on_device",
    "torch_kind",
    "via_cupy",
]

#: Every kind :func:`kind_of` names.
KINDS = (
    "numpy",
    "cupy",
    "torch",
    "torch-cuda",
    "torch-other",
    "jax",
    "jax-gpu",
    "jax-tracer",
    "other",
)
_PLAIN_ROOTS = frozenset({"builtins", "numpy"})
#: The kinds whose memory is a GPU's that cupy can view (DLPack).
DEVICE_KINDS = frozenset({"cupy", "torch-cuda", "jax-gpu"})


class DeviceRoute(NamedTuple):
    """The call runs on the group's device communicator, over the caller's device memory.

    Attributes:
        comm: the group's device communicator.
        xp: the array's module (cupy).
    """

    comm: Communicator
    xp: ModuleType


class HostRoute(NamedTuple):
    """The call runs on the group's host communicator.

    Attributes:
        x: what the host path lowers: the array itself, or a host copy of a device array.
        back: the device module to hand the result back to (:func:`give_back`), or None
            where the result is given back as it is.
    """

    x: Any
    back: ModuleType | None


def _root(x: Any) -> str:
    return type(x).__module__.partition(".")[0]


def kind_of(x: Any) -> str:
    """The kind of array ``x`` is (one of :data:`KINDS`), read from its type, never importing
    a library.

    ``torch``, ``torch-cuda``, ``torch-other``: a ``torch.Tensor`` on the CPU, on a CUDA
    device, elsewhere (meta, mps, ...). ``jax``, ``jax-gpu``: a ``jax.Array`` on CPU devices
    or not; ``jax-tracer``: a value of jax's tracing (:func:`is_jax_tracer`), which holds no
    values on any device.

    Example:
        >>> kind_of(np.zeros(2)), kind_of(3.0), kind_of([1, 2])
        ('numpy', 'other', 'other')
    """
    if isinstance(x, np.ndarray):
        return "numpy"
    root = type(x).__module__.partition(".")[0]  # _root, inline: scalars come here often
    if root in _PLAIN_ROOTS:  # scalars, lists: the common leaves, named at once
        return "other"
    if root in ("jax", "jaxlib"):
        jax = sys.modules.get("jax")
        if jax is not None and isinstance(x, jax.Array):
            if is_jax_tracer(x):
                return "jax-tracer"
            cpu = all(d.platform == "cpu" for d in x.sharding.device_set)
            return "jax" if cpu else "jax-gpu"
        return "other"
    # torch's own tensors and subclasses defined anywhere (a library's, a user's).
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch_kind(x)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    return "other"


def torch_kind(t: Any) -> str:
    """The kind of torch tensor ``t``: ``torch`` (CPU), ``torch-cuda`` or ``torch-other``;
    :func:`kind_of` for a caller that knows it holds a tensor (the torch backend's
    small all-reduce, where every 100 ns shows).

    Example:
        >>> from types import SimpleNamespace
        >>> torch_kind(SimpleNamespace(is_cpu=False, is_cuda=True))
        'torch-cuda'
    """
    # is_cpu and is_cuda are bools; t.device builds an object per call.
    return "torch" if t.is_cpu else "torch-cuda" if t.is_cuda else "torch-other"


def is_jax_tracer(x: Any) -> bool:
    """Whether ``x`` is a jax tracer (a value inside jit, grad, vmap or shard_map tracing).

    Example:
        >>> is_jax_tracer(np.zeros(1))
        False
    """
    if _root(x) not in ("jax", "jaxlib"):
        return False
    core = sys.modules.get("jax.core")
    tracer = getattr(core, "Tracer", None)
    return tracer is not None and isinstance(x, tracer)


def importable_cupy() -> ModuleType | None:
    """cupy if it can be imported (imported now if it was not yet), else None: the GPU
    kinds of torch and jax go through it where it is.

    Example:
        >>> importable_cupy() is None or importable_cupy().__name__ == "cupy"
        True
    """
    found = sys.modules.get("cupy")
    if found is not None:
        return found
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def via_cupy(kind: str, bfloat16: bool = False) -> ModuleType | None:
    """cupy, where an array of ``kind`` is handed to a group as a cupy view of its memory;
    None where it goes as a host copy: a host kind, a ``bfloat16`` array (cupy has no such
    dtype), or cupy not importable.

    Example:
        >>> via_cupy("numpy") is None, via_cupy("torch-cuda", bfloat16=True) is None
        (True, True)
    """
    if kind not in DEVICE_KINDS or bfloat16:
        return None
    return importable_cupy()


def stays_on_device(kind: str, bfloat16: bool, device: object | None) -> bool:
    """Whether an array of ``kind`` runs on a group's device communicator (``device``, None
    where the group has none) as a cupy view of its memory, rather than through host memory
    (a host kind, or ``bfloat16``, which cupy has no dtype for).

    Example:
        >>> stays_on_device("cupy", False, None), stays_on_device("torch", False, object())
        (False, False)
    """
    return device is not None and kind in DEVICE_KINDS and not bfloat16


def device_module(x: Any) -> ModuleType | None:
    """The array module of a device array the group can move (``cupy``), or None for
    anything else (numpy, scalars, lists; torch and jax arrays, which the layers above turn
    into numpy or cupy first).

    Example:
        >>> device_module(np.zeros(2)) is None
        True
    """
    if _root(x) != "cupy":
        return None
    return sys.modules.get("cupy")


def array_module(x: Any) -> ModuleType | None:
    """The module of an array a group moves: ``numpy`` for a numpy array, else
    :func:`device_module`.

    Example:
        >>> array_module(np.zeros(1)) is np, array_module([1]) is None
        (True, True)
    """
    return np if isinstance(x, np.ndarray) else device_module(x)


def device_route(device: Communicator | None, x: Any) -> DeviceRoute | None:
    """The device route of ``x`` in a group whose device communicator is ``device``: there
    where ``x`` is a device array and the group has one, else None (the host route).

    Example:
        >>> device_route(None, np.zeros(2)) is None
        True
    """
    if device is None:
        return None
    xp = device_module(x)
    return None if xp is None else DeviceRoute(device, xp)


def arrival_route(device: Communicator | None, dtype: Any) -> DeviceRoute | None:
    """The route of a rank that passes None to a broadcast or scatter (off the root, told
    only the result's ``dtype``): every rank of one call must take the same route, and such
    a rank cannot see where the root's array lives. In a group with a device communicator
    it takes the device route for a dtype the device's module holds (bool, integers,
    floats, complex: a root's array of such a dtype is a device array in the programs such
    a group is made for), else the host route (bfloat16 and other numpy-only dtypes, which
    a root can hold only in host memory). A root whose array lives elsewhere makes the
    others pass an array of that kind instead of None.

    Example:
        >>> arrival_route(None, np.float32) is None
        True
    """
    if device is None or dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None  # the lowering names the bad dtype
    if dt.kind not in "biufc" or not dt.isnative:
        return None
    return DeviceRoute(device, importlib.import_module(device.array_module))


def host_route(x: Any) -> HostRoute:
    """The host route of ``x``: ``x`` itself with ``back`` None, unless ``x`` is a device
    array: then a host copy of it, made now (so the caller may overwrite ``x`` at once;
    :func:`meshcomm.group.staging.download`), and its module, to give the result back.

    Example:
        >>> host_route([1, 2])
        HostRoute(x=[1, 2], back=None)
    """
    if type(x) is np.ndarray:  # the hot path
        return HostRoute(x, None)
    xp = device_module(x)
    if xp is None:
        return HostRoute(x, None)
    return HostRoute(_staging.download(xp, x), xp)


def group_route(device: Communicator | None, x: Any) -> DeviceRoute | HostRoute:
    """Where a group whose device communicator is ``device`` runs a call on ``x``:
    :func:`device_route` where there is one, else :func:`host_route` (which copies a
    device array to host memory now).

    Example:
        >>> group_route(None, [2.5])
        HostRoute(x=[2.5], back=None)
    """
    if type(x) is np.ndarray:  # the hot path
        return HostRoute(x, None)
    found = device_route(device, x)
    return found if found is not None else host_route(x)


def give_back(back: ModuleType | None, result: Any) -> Any:
    """A host route's ``result`` (an array, or None off a root) in the caller's module:
    as it is where ``back`` is None, else an array of ``back`` (cupy) on the current device
    (:func:`meshcomm.group.staging.upload`).

    Example:
        >>> give_back(None, np.arange(2))
        array([0, 1])
        >>> give_back(np, None) is None
        True
    """
    if back is None or result is None:
        return result
    return _staging.upload(back, result)
