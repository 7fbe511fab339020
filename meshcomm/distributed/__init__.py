"""``meshcomm.distributed``: torch.distributed's in-place API over meshcomm's process groups.

Port a torch.distributed script by changing one import::

    import meshcomm.distributed as dist      # was: import torch.distributed as dist

Names, parameters, defaults and return values follow torch 2.13. Every in-place call
computes meshcomm's functional result (see :mod:`meshcomm.group`) and copies it into the
caller's tensors: numpy arrays, torch tensors (CPU in place through shared memory; CUDA
through cupy/DLPack) or cupy arrays, bfloat16 included. ``"gloo"`` is an alias of meshcomm's
``"tcp"`` backend. Launch with ``meshrun`` (torchrun's flags) or :func:`meshcomm.spawn`
(``torch.multiprocessing.spawn``'s). See ``docs/porting.md`` for what differs.

The object collectives (``*_object*``) unpickle what peers send, as torch's do: use them only
among trusted processes.

Example:
    >>> import numpy as np
    >>> import meshcomm.distributed as dist
    >>> dist.init_process_group("gloo", world_size=1, rank=0)
    >>> t = np.arange(3.0)
    >>> dist.all_reduce(t, op=dist.ReduceOp.MAX); t
    array([0., 1., 2.])
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from meshcomm.common.timeout import default_timeout
from meshcomm.distributed._alltoall import all_to_all, all_to_all_single
from meshcomm.distributed._backend import (
    Backend,
    get_default_backend_for_device,
    is_available,
    is_backend_available,
    is_gloo_available,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
    is_xccl_available,
)
from meshcomm.distributed._coalescing import _coalescing_manager
from meshcomm.distributed._collectives import (
    _all_gather_base,
    _reduce_scatter_base,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from meshcomm.distributed._debug import (
    DebugLevel,
    get_debug_level,
    set_debug_level,
    set_debug_level_from_env,
)
from meshcomm.distributed._errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    QueueEmptyError,
)
from meshcomm.distributed._groups import (
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    split_group,
)
from meshcomm.distributed._monitor import monitored_barrier
from meshcomm.distributed._objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from meshcomm.distributed._p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from meshcomm.distributed._pg import ProcessGroup
from meshcomm.distributed._reduce_op import (
    ReduceOp,
    _make_nccl_premul_sum,
    reduce_op,
    supports_complex,
)
from meshcomm.distributed._sampler import DistributedSampler
from meshcomm.distributed._state import (
    GroupMember,
    destroy_process_group,
    get_backend,
    get_backend_config,
    get_node_local_rank,
    get_pg_count,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    is_initialized,
)
from meshcomm.distributed._stores import FileStore, HashStore, PrefixStore, Store, TCPStore
from meshcomm.distributed._work import Future, Work

if TYPE_CHECKING:
    from meshcomm.distributed import device_mesh
    from meshcomm.distributed._ddp import DistributedDataParallel
    from meshcomm.distributed.device_mesh import DeviceMesh, init_device_mesh

#: The default timeout of a process group (``MESHCOMM_TIMEOUT`` or 300 s; torch: 30 min).
default_pg_timeout = timedelta(seconds=default_timeout())

# Imported on first use: DistributedDataParallel needs torch.
_LAZY = {
    "DistributedDataParallel": "meshcomm.distributed._ddp",
    "DeviceMesh": "meshcomm.distributed.device_mesh",
    "init_device_mesh": "meshcomm.distributed.device_mesh",
    "device_mesh": "meshcomm.distributed.device_mesh",
}

__all__ = [
    "Backend",
    "DebugLevel",
    "DeviceMesh",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistributedDataParallel",
    "DistributedSampler",
    "FileStore",
    "Future",
    "GroupMember",
    "HashStore",
    "P2POp",
    "PrefixStore",
    "ProcessGroup",
    "QueueEmptyError",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "_all_gather_base",
    "_coalescing_manager",
    "_make_nccl_premul_sum",
    "_reduce_scatter_base",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "default_pg_timeout",
    "destroy_process_group",
    "device_mesh",
    "gather",
    "gather_object",
    "get_backend",
    "get_backend_config",
    "get_debug_level",
    "get_default_backend_for_device",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_device_mesh",
    "init_process_group",
    "irecv",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_op",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "set_debug_level",
    "set_debug_level_from_env",
    "split_group",
    "supports_complex",
]


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'meshcomm.distributed' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if name == "device_mesh" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
