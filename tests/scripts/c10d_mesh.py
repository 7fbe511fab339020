"""One mesh for both, in one rank of a (2, 2) world: DTensor and meshcomm.ops on one mesh.

Run by tests/test_c10d_mesh.py under torchrun (or meshrun) with the mode as argv[1]:
``meshcomm-first`` builds meshcomm's mesh and hands torch ``mesh.to_torch()``;
``torch-first`` builds torch's DeviceMesh on backend "meshcomm" and gives meshcomm.ops
``from_torch_mesh(...)``. Each rank writes its JSON record to ``argv[2]/rank<N>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import meshcomm
from meshcomm import ops
from meshcomm.c10d import MeshcommProcessGroup, from_torch_mesh


def main(mode: str, out_dir: str) -> None:
    if mode == "meshcomm-first":
        mesh = meshcomm.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
        tmesh = mesh.to_torch()
    else:
        dist.init_process_group("meshcomm")
        from torch.distributed.device_mesh import init_device_mesh

        tmesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        mesh = from_torch_mesh(tmesh)
    default = dist.distributed_c10d._get_default_group()
    rank = dist.get_rank()
    x = torch.arange(16.0, dtype=torch.float64).reshape(4, 4)
    sharded = distribute_tensor(x, tmesh, [Shard(0), Shard(1)])
    full = sharded.redistribute(tmesh, [Replicate(), Replicate()]).to_local()
    partial = DTensor.from_local(
        torch.ones(2, 2, dtype=torch.float64), tmesh, [Partial(), Replicate()]
    )
    summed = partial.redistribute(tmesh, [Replicate(), Replicate()])
    with mesh:
        psum_tp = ops.psum(torch.tensor([float(rank)], dtype=torch.float64), "tp")
        gathered = ops.all_gather(sharded.to_local(), "tp", axis=1, tiled=True)
    record = {
        "rank": rank,
        "backend": dist.get_backend(),
        "same_world": isinstance(default, MeshcommProcessGroup)
        and default.mesh_group is meshcomm.get_world(),
        "same_tp_group": tmesh.get_group("tp").mesh_group is mesh.get_group("tp"),
        "full_ok": bool(torch.equal(full, x)),
        "partial": summed.to_local().tolist(),
        "psum_tp": psum_tp.tolist(),
        "tp_row": [int(r) for r in mesh.mesh[mesh.get_coordinate()[0]]],
        "gathered": gathered.tolist(),
        "expected_rows": x[
            2 * mesh.get_coordinate()[0] : 2 * mesh.get_coordinate()[0] + 2
        ].tolist(),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    meshcomm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
