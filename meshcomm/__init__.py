"""meshcomm: JAX-style functional collectives over device meshes.

Start a job with ``meshrun --nproc-per-node N script.py`` (or torchrun, mpiexec, srun), then
in the script build a mesh and call collectives by axis name.

Public names are imported on first use (PEP 562), so ``import meshcomm`` stays cheap in
every rank of a launch: a rank pays only for the layers it touches.

Example:
    >>> import numpy as np
    >>> import meshcomm
    >>> from meshcomm import ops
    >>> mesh = meshcomm.init_device_mesh((1,), mesh_dim_names=("dp",))
    >>> with mesh:
    ...     ops.psum(np.arange(3), "dp").tolist()
    [0, 1, 2]
    >>> meshcomm.shutdown()
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from meshcomm.common.version import VERSION as __version__
from meshcomm.errors import (
    CommError,
    CommTimeout,
    InvalidArgument,
    MeshCommError,
    MismatchError,
    PeerError,
    ProcessExitedException,
    ProcessRaisedException,
    ProtocolError,
    RendezvousError,
    SpawnError,
    SpawnTimeout,
    StoreError,
    StoreTimeout,
)

# Eager on purpose: ``spawn`` and ``info`` share their names with their modules, and a lazy
# binding would be replaced by the module the first time anything imports that module.
from meshcomm.info import info
from meshcomm.spawn import SpawnContext  # binds meshcomm.spawn: the module, callable as spawn()

if TYPE_CHECKING:
    from meshcomm import c10d, distributed, ops
    from meshcomm.group import ProcessGroup, Work, new_group
    from meshcomm.mesh import DeviceMesh, current_mesh, init_device_mesh
    from meshcomm.reduction import ReduceOp
    from meshcomm.store import FileStore, HashStore, PrefixStore, Store, TCPStore
    from meshcomm.world import get_world, get_world_info, init, is_initialized, shutdown


# name -> module that defines it; resolved by __getattr__ on first access.
_LAZY = {
    "c10d": "meshcomm.c10d",
    "ops": "meshcomm.ops",
    "distributed": "meshcomm.distributed",
    "DeviceMesh": "meshcomm.mesh",
    "current_mesh": "meshcomm.mesh",
    "init_device_mesh": "meshcomm.mesh",
    "ProcessGroup": "meshcomm.group",
    "Work": "meshcomm.group",
    "new_group": "meshcomm.group",
    "ReduceOp": "meshcomm.reduction",
    "Store": "meshcomm.store",
    "TCPStore": "meshcomm.store",
    "FileStore": "meshcomm.store",
    "HashStore": "meshcomm.store",
    "PrefixStore": "meshcomm.store",
    "get_world": "meshcomm.world",
    "get_world_info": "meshcomm.world",
    "init": "meshcomm.world",
    "is_initialized": "meshcomm.world",
    "shutdown": "meshcomm.world",
}

_SUBMODULES = frozenset({"ops", "distributed", "c10d"})

__all__ = [
    "CommError",
    "CommTimeout",
    "DeviceMesh",
    "FileStore",
    "HashStore",
    "InvalidArgument",
    "MeshCommError",
    "MismatchError",
    "PeerError",
    "PrefixStore",
    "ProcessExitedException",
    "ProcessGroup",
    "ProcessRaisedException",
    "ProtocolError",
    "ReduceOp",
    "RendezvousError",
    "SpawnContext",
    "SpawnError",
    "SpawnTimeout",
    "Store",
    "StoreError",
    "StoreTimeout",
    "TCPStore",
    "Work",
    "__version__",
    "c10d",
    "current_mesh",
    "distributed",
    "get_world",
    "get_world_info",
    "info",
    "init",
    "init_device_mesh",
    "is_initialized",
    "new_group",
    "ops",
    "shutdown",
    "spawn",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'meshcomm' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if name in _SUBMODULES else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# torch already imported (and meshcomm not installed with its entry point, say on PYTHONPATH):
# register the "meshcomm" process-group backend now, cheaply; torch's autoload does it otherwise.
if "torch.distributed" in sys.modules:
    from meshcomm.common.torch_autoload import register as _register_torch_backend

    _register_torch_backend()
