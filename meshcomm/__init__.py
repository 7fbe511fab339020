"""meshcomm: JAX-style functional collectives over device meshes.

Start a job with ``meshrun --nproc-per-node N script.py`` (or torchrun, mpiexec, srun), then
in the script:

Example:
    >>> import numpy as np
    >>> import meshcomm
    >>> world = meshcomm.init(world_size=1)
    >>> world.all_reduce(np.arange(3)).tolist()
    [0, 1, 2]
    >>> meshcomm.shutdown()
"""

from __future__ import annotations

from meshcomm.errors import (
    CommError,
    CommTimeout,
    InvalidArgument,
    MeshCommError,
    PeerError,
    ProtocolError,
    RendezvousError,
    StoreError,
    StoreTimeout,
)
from meshcomm.group import ProcessGroup, Work, new_group
from meshcomm.reduction import ReduceOp
from meshcomm.spawn import (
    ProcessExitedException,
    ProcessRaisedException,
    SpawnContext,
    SpawnError,
    SpawnTimeout,
    spawn,
)
from meshcomm.world import get_world, init, is_initialized, shutdown

__version__ = "0.1.0"

__all__ = [
    "CommError",
    "CommTimeout",
    "InvalidArgument",
    "MeshCommError",
    "PeerError",
    "ProcessExitedException",
    "ProcessGroup",
    "ProcessRaisedException",
    "ProtocolError",
    "ReduceOp",
    "RendezvousError",
    "SpawnContext",
    "SpawnError",
    "SpawnTimeout",
    "StoreError",
    "StoreTimeout",
    "Work",
    "__version__",
    "get_world",
    "init",
    "is_initialized",
    "new_group",
    "shutdown",
    "spawn",
]
