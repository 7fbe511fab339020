"""torch's backend autoload entry point: makes ``init_process_group("meshcomm")`` work
without ``import meshcomm``.

torch calls :func:`register` while ``import torch`` runs (the ``torch.backends`` entry point
group; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it off). It must stay cheap and must never
fail torch's import, so it registers a creator that imports :mod:`meshcomm.c10d` only when
torch first makes a ``"meshcomm"`` group, and swallows anything that goes wrong (the backend
is then registered by ``import meshcomm.c10d`` as usual).

Example:
    >>> register()
"""

from __future__ import annotations

from typing import Any

__all__ = ["register"]


def _create(options: Any, backend_options: Any = None) -> Any:
    from meshcomm.c10d import create_group

    return create_group(options, backend_options)


def register() -> None:
    """Register the ``"meshcomm"`` backend with torch, lazily; never raises."""
    try:
        import torch.distributed as dist

        if not dist.is_available() or "MESHCOMM" in dist.Backend._plugins:
            return
        dist.Backend.register_backend(
            "meshcomm", _create, extended_api=True, devices=["cpu", "cuda"]
        )
    except Exception:  # torch's import must not fail because of us
        return
