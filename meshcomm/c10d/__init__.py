"""meshcomm as a torch.distributed backend: torch's own parallel stack over meshcomm.

``import meshcomm.c10d`` (also done by torch's backend autoload when meshcomm is installed,
and by ``import meshcomm`` once torch is imported) registers the backend ``"meshcomm"``, so
torch's ``init_process_group("meshcomm")``, ``new_group``, DeviceMesh, DTensor, FSDP2, DDP,
ZeroRedundancyOptimizer and the functional collectives run unchanged over meshcomm's
transports. See docs/torch.md.

Example:
    >>> import torch, torch.distributed as dist
    >>> import meshcomm.c10d
    >>> dist.init_process_group("meshcomm", store=dist.HashStore(), rank=0, world_size=1)
    >>> t = torch.arange(3.0)
    >>> dist.all_reduce(t); t.tolist()
    [0.0, 1.0, 2.0]
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from meshcomm.c10d._backend import create_group, register, registered
from meshcomm.c10d._errors import as_torch_error
from meshcomm.c10d._mesh import from_torch_mesh, to_torch_mesh, torch_group
from meshcomm.c10d._process_group import BACKEND_NAME, MeshcommProcessGroup, Unsupported
from meshcomm.c10d._work import TorchWork

__all__ = [
    "BACKEND_NAME",
    "MeshcommProcessGroup",
    "TorchWork",
    "Unsupported",
    "as_torch_error",
    "create_group",
    "from_torch_mesh",
    "register",
    "registered",
    "to_torch_mesh",
    "torch_group",
]

register()
