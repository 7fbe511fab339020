"""A job whose ranks disagree on a broadcast (rank 1 passes int32): the root returns from
it, and stops at its next call on any group (tests/test_mismatch.py, under meshrun)."""

import numpy as np

import meshcomm

world = meshcomm.init()
other = world.subgroup(list(world.ranks), "other")
x = np.ones(4, np.float32)
world.broadcast(x.astype(np.int32) if world.rank == 1 else x, root=0)
print(f"rank {world.rank}: returned from the broadcast", flush=True)
other.barrier()  # a call on another group: the root stops here
print(f"rank {world.rank}: done", flush=True)
meshcomm.shutdown()
