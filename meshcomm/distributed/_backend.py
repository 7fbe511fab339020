"""Backend names: torch's ``Backend`` strings, availability checks, and the name mapping.

torch names backends ``gloo``, ``nccl``, ``mpi`` (and ``cpu:gloo,cuda:nccl`` style strings
that pick one per device type). meshcomm runs ``tcp`` (pure Python, the CPU backend),
``mpi`` and ``nccl``. ``gloo`` is an alias of ``tcp`` so torch scripts run unchanged. A
``nccl`` entry runs CUDA tensors over NCCL where cupy sees a GPU (host tensors over tcp);
without one, CUDA tensors are staged through host memory over the CPU entry's backend.

Example:
    >>> Backend("GLOO"), Backend.NCCL
    ('gloo', 'nccl')
    >>> meshcomm_backend("cpu:gloo,cuda:nccl")
    'tcp'
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = [
    "Backend",
    "get_default_backend_for_device",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "meshcomm_backend",
    "parse_backend_string",
]

# torch backend name -> meshcomm backend name.
_TO_MESHCOMM = {"gloo": "tcp", "tcp": "tcp", "mpi": "mpi", "nccl": "nccl"}


class Backend(str):
    """An enum-like str of backend names, as ``torch.distributed.Backend``.

    ``Backend(name)`` validates and lower-cases a name; the attributes are the known names.

    Example:
        >>> Backend("tcp") == Backend.TCP == "tcp"
        True
        >>> Backend("ucx")
        Traceback (most recent call last):
        ...
        ValueError: Invalid backend: 'ucx' (meshcomm knows gloo, tcp, mpi, nccl)
    """

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"
    XCCL = "xccl"
    TCP = "tcp"

    #: The backend torch uses by default for each device type.
    default_device_backend_map: dict[str, str] = {"cpu": "gloo", "cuda": "nccl"}  # noqa: RUF012
    backend_list: list[str] = ["undefined", "gloo", "nccl", "ucc", "mpi", "xccl", "tcp"]  # noqa: RUF012

    def __new__(cls, name: str) -> Backend:
        if not isinstance(name, str):
            raise ValueError(f"Backend constructor parameter must be string-ish, got {name!r}")
        value = name.lower()
        if value not in _TO_MESHCOMM and value != "undefined":
            raise ValueError(f"Invalid backend: {name!r} (meshcomm knows gloo, tcp, mpi, nccl)")
        return str.__new__(cls, value)


def parse_backend_string(backend: str) -> dict[str, str]:
    """Return ``{device_type: backend}`` for ``"gloo"`` or ``"cpu:gloo,cuda:nccl"``.

    Raises:
        ValueError: a malformed pair, a duplicate device, or an unknown backend name.

    Example:
        >>> parse_backend_string("cpu:gloo,cuda:nccl")
        {'cpu': 'gloo', 'cuda': 'nccl'}
        >>> parse_backend_string("nccl")
        {'cuda': 'nccl'}
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__} {backend!r}")
    text = backend.strip().lower()
    if ":" not in text:
        name = str(Backend(text))
        if name in ("gloo", "tcp", "mpi"):
            return {"cpu": name}
        return {"cuda": name}
    pairs: dict[str, str] = {}
    for part in text.split(","):
        pieces = part.split(":")
        if len(pieces) != 2 or not pieces[0].strip() or not pieces[1].strip():
            raise ValueError(
                f"Invalid device:backend pairing {part!r} in {backend!r}; expected "
                "'<device_type>:<backend>,<device_type>:<backend>'"
            )
        device, name = pieces[0].strip(), str(Backend(pieces[1].strip()))
        if device in pairs:
            raise ValueError(f"Duplicate device type {device!r} in backend string {backend!r}")
        pairs[device] = name
    return pairs


def meshcomm_backend(backend: str | None) -> str:
    """Return the meshcomm backend that runs the torch backend string ``backend``.

    None means meshcomm's default (``tcp``). A ``nccl`` entry (``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``) gives the pair ``"cpu:tcp,cuda:nccl"`` where cupy sees a GPU
    with NCCL, so CUDA tensors go over NCCL; elsewhere CUDA tensors are staged through host
    memory over the CPU entry's backend (``tcp`` if none), as torch scripts written for GPUs
    still run on a laptop.

    Example:
        >>> meshcomm_backend("gloo"), meshcomm_backend(None), meshcomm_backend("mpi")
        ('tcp', 'tcp', 'mpi')
    """
    if backend is None:
        return "tcp"
    pairs = parse_backend_string(backend)
    # The host arrays' backend: the cpu entry, else the one entry that is not nccl.
    cpu = pairs.get("cpu") or next((b for b in pairs.values() if b != "nccl"), "gloo")
    host = _TO_MESHCOMM[cpu]
    if pairs.get("cuda") == "nccl" and host == "tcp" and _nccl_usable():
        return "cpu:tcp,cuda:nccl"
    return host


def _nccl_usable() -> bool:
    """cupy imports, sees a GPU, and has NCCL (imports cupy: only asked for nccl)."""
    if not _module_exists("cupy"):
        return False
    try:
        from meshcomm.backends.nccl import load

        cupy, _ = load()
        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # no driver, no device, no NCCL: staged over tcp instead
        return False


def get_default_backend_for_device(device: Any) -> str:
    """Return torch's default backend name for a device (``"cpu"`` -> ``"gloo"``).

    Args:
        device: a device type string (``"cuda"``, ``"cuda:1"``) or a ``torch.device``.

    Raises:
        ValueError: no default backend for that device type.

    Example:
        >>> get_default_backend_for_device("cuda:0")
        'nccl'
    """
    kind = getattr(device, "type", device)
    if not isinstance(kind, str):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    name = Backend.default_device_backend_map.get(kind.split(":")[0].strip())
    if name is None:
        raise ValueError(f"Default backend not registered for device : {device}")
    return name


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def is_available() -> bool:
    """Return True: meshcomm.distributed is always available.

    Example:
        >>> is_available()
        True
    """
    return True


def is_gloo_available() -> bool:
    """Return True if the ``gloo`` alias (meshcomm's tcp backend) is available."""
    return _module_exists("meshcomm.backends.tcp")


def is_mpi_available() -> bool:
    """Return True if meshcomm's mpi backend and mpi4py are installed."""
    return _module_exists("meshcomm.backends.mpi") and _module_exists("mpi4py")


def is_nccl_available() -> bool:
    """Return True if meshcomm's nccl backend and cupy are installed."""
    return _module_exists("meshcomm.backends.nccl") and _module_exists("cupy")


def is_ucc_available() -> bool:
    """Return False: meshcomm has no UCC backend."""
    return False


def is_xccl_available() -> bool:
    """Return False: meshcomm has no XCCL backend."""
    return False


def is_backend_available(backend: str) -> bool:
    """Return True if the named backend (torch or meshcomm name) can be used.

    Example:
        >>> is_backend_available("gloo"), is_backend_available("ucc")
        (True, False)
    """
    checks = {
        "gloo": is_gloo_available,
        "tcp": is_gloo_available,
        "mpi": is_mpi_available,
        "nccl": is_nccl_available,
    }
    check = checks.get(str(backend).lower())
    return bool(check and check())


def is_torchelastic_launched() -> bool:
    """Return True if a torchrun-style launcher started this process.

    As torch, this checks ``TORCHELASTIC_RUN_ID``, which torchrun, ``meshrun`` and
    :func:`meshcomm.spawn` all set.
    """
    import os

    return os.getenv("TORCHELASTIC_RUN_ID") is not None
