"""Backend names as ``init`` takes them: one backend, or torch's ``device:backend`` pairs.

``"tcp"``, ``"mpi"`` and ``"self"`` name the host backend alone: device (cupy) arrays go
through host memory over it. ``"cpu:tcp,cuda:nccl"`` (torch's spelling, in either order)
names a host backend and a device backend: every group dispatches by where the array
lives. ``"nccl"`` alone means ``"cpu:tcp,cuda:nccl"``: host arrays still work, over tcp.
``"cuda_ipc"`` (``"cpu:tcp,cuda:cuda_ipc"``) names the device path of ranks that share a GPU
(:mod:`meshcomm.backends.cuda_ipc`).

Example:
    >>> parse_backend("cuda:nccl,cpu:tcp")
    ('tcp', 'nccl')
    >>> parse_backend("nccl"), parse_backend("mpi")
    (('tcp', 'nccl'), ('mpi', None))
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

from meshcomm.errors import InvalidArgument

__all__ = [
    "DEVICE_BACKENDS",
    "HOST_BACKENDS",
    "canonical",
    "gpu_per_local_rank",
    "matches",
    "parse_backend",
]

#: Backends that move host (numpy) arrays.
HOST_BACKENDS = ("tcp", "mpi", "self")
#: Backends that move device (cupy / CUDA) arrays.
DEVICE_BACKENDS = ("nccl", "cuda_ipc")


def parse_backend(spec: str) -> tuple[str, str | None]:
    """``(host backend, device backend or None)`` of a backend name or pair list.

    Raises:
        InvalidArgument: an unknown name, device or pairing, said with what is known.
    """
    text = spec.strip().lower()
    if ":" not in text:
        if text in DEVICE_BACKENDS:
            return "tcp", text
        if text in HOST_BACKENDS:
            return text, None
        raise InvalidArgument(_unknown(spec))
    pairs: dict[str, str] = {}
    for part in text.split(","):
        device, _, name = (p.strip() for p in part.partition(":"))
        if device not in ("cpu", "cuda") or device in pairs:
            raise InvalidArgument(
                f"backend {spec!r}: each part is 'cpu:<{'|'.join(HOST_BACKENDS)}>' or "
                f"'cuda:<{'|'.join(DEVICE_BACKENDS)}>', once each (got {part.strip()!r})"
            )
        known = HOST_BACKENDS if device == "cpu" else DEVICE_BACKENDS
        if name not in known:
            raise InvalidArgument(
                f"backend {spec!r}: {device} arrays go over one of {', '.join(known)}, not {name!r}"
            )
        pairs[device] = name
    return pairs.get("cpu", "tcp"), pairs.get("cuda")


def canonical(spec: str) -> str:
    """The name ``group.backend`` reports: the host backend alone, or the pair list.

    Example:
        >>> canonical("nccl"), canonical("tcp")
        ('cpu:tcp,cuda:nccl', 'tcp')
    """
    host, device = parse_backend(spec)
    return host if device is None else f"cpu:{host},cuda:{device}"


def matches(asked: str, running: str) -> bool:
    """Whether a world running ``running`` (a ``group.backend``) is what ``asked`` names.

    A world of one runs its host arrays on "self" whatever host backend was asked for, and
    a host backend asked alone is met by a world that also has a device backend (the
    default pairs one where each rank has a GPU: a mesh cannot take it away).

    Example:
        >>> matches("nccl", "cpu:self,cuda:nccl"), matches("tcp", "cpu:tcp,cuda:nccl")
        (True, True)
        >>> matches("nccl", "tcp"), matches("mpi", "cpu:tcp,cuda:nccl")
        (False, False)
    """
    host, device = parse_backend(asked)
    running_host, running_device = parse_backend(running)
    if device is not None and device != running_device:
        return False
    return running_host in (host, "self")


def _unknown(spec: str) -> str:
    names = ", ".join((*HOST_BACKENDS, *DEVICE_BACKENDS))
    return (
        f"unknown backend {spec!r}; known backends: {names}, or pairs such as 'cpu:tcp,cuda:nccl'"
    )


def gpu_per_local_rank(
    world_size: int,
    local_world_size: int | None,
    gpu_count: Callable[[], int] | None = None,
) -> bool:
    """Whether ``init`` without a backend name pairs tcp with nccl here: this host has an
    NVIDIA driver, cupy with NCCL is installed, and it sees a GPU for every rank on this host (the
    local world size known from the launcher; a world of one is one rank). Ranks sharing a
    GPU (NCCL refuses two ranks on one) and hosts whose rank count is unknown keep staging.

    Nothing is imported on a host without ``/dev/nvidiactl`` or without cupy; otherwise
    ``gpu_count`` (default: cupy's, which honours ``CUDA_VISIBLE_DEVICES``) is asked.

    Example:
        >>> gpu_per_local_rank(2, 2, gpu_count=lambda: 1)  # on a host with the driver
        False
    """
    local = local_world_size if local_world_size is not None else (1 if world_size == 1 else 0)
    if local < 1:
        return False
    if gpu_count is None:
        if not os.path.exists("/dev/nvidiactl") or importlib.util.find_spec("cupy") is None:
            return False
        gpu_count = _cupy_gpu_count
    try:
        return gpu_count() >= local
    except Exception:  # no driver or device after all: cupy's CUDA errors
        return False


def _cupy_gpu_count() -> int:
    """The GPUs cupy sees, or 0 where it cannot drive NCCL (the default must not fail)."""
    from meshcomm.backends.nccl import load

    try:
        cupy, _ = load()
    except ImportError:  # cupy without NCCL: staging it is
        return 0
    return int(cupy.cuda.runtime.getDeviceCount())
