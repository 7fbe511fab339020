"""A rank under ``meshrun --backend nccl``: ops.psum of a cupy array over NCCL; says where."""

import meshcomm
from meshcomm import ops


def main() -> None:
    """Join the world, psum a cupy array over a one-axis mesh, print the backend and GPU."""
    import cupy as cp

    group = meshcomm.init()
    with meshcomm.init_device_mesh((group.size,), ("tp",)):
        y = ops.psum(cp.ones(3, dtype=cp.float32), "tp")
    device = cp.cuda.Device().id
    print(f"rank {group.rank}: backend {group.backend}, GPU {device}, {type(y).__name__} {y}")
    meshcomm.shutdown()


if __name__ == "__main__":
    main()
