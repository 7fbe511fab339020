"""Routes: the one place that decides where an array given to meshcomm goes.

Every layer that takes a caller's array asks this module, and none decides on its own:

- **kind** (:func:`kind_of`): numpy, cupy, a torch tensor on the CPU or on CUDA, a jax
  array on the CPU or a GPU, or anything else (scalars, lists: numpy converts them);
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
to a group, which routes them here. cupy, torch and jax are never imported here: an array of
theirs can only arrive if the caller imported its library.

Example:
    >>> import numpy as np
    >>> x = np.arange(3)
    >>> kind_of(x), device_module(x) is None
    ('numpy', True)
    >>> group_route(None, x) == HostRoute(x, None)
    True
"""

from __future__ import annotations

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
    "device_module",
    "device_route",
    "give_back",
    "group_route",
    "host_route",
    "kind_of",
]

#: Every kind :func:`kind_of` names.
KINDS = ("numpy", "cupy", "torch", "torch-cuda", "jax", "jax-gpu", "other")
#: The kinds whose memory is a GPU's.
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

    ``torch``/``torch-cuda``: an instance of ``torch.Tensor`` on the CPU or elsewhere
    (meta tensors and other devices are named ``torch-cuda`` here too: a device; the
    callers refuse them with their own words). ``jax``/``jax-gpu``: a ``jax.Array`` whose
    devices are CPUs or not (a tracer is ``jax``: it holds no values on any device).

    Example:
        >>> kind_of(np.zeros(2)), kind_of(3.0), kind_of([1, 2])
        ('numpy', 'other', 'other')
    """
    if isinstance(x, np.ndarray):
        return "numpy"
    root = _root(x)
    if root == "cupy":
        return "cupy"
    if root == "torch":
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(x, torch.Tensor):
            return "torch" if x.is_cpu else "torch-cuda"
    elif root in ("jax", "jaxlib"):
        jax = sys.modules.get("jax")
        if jax is not None and isinstance(x, jax.Array):
            sharding = getattr(x, "sharding", None)
            devices = getattr(sharding, "device_set", None) or ()
            return "jax-gpu" if any(d.platform != "cpu" for d in devices) else "jax"
    return "other"


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
