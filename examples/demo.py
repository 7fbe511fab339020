"""A first look at meshcomm. Run it with ``make demo``, which runs::

    meshrun --nproc-per-node 8 examples/demo.py

``meshrun`` starts 8 processes (ranks) and hosts a key-value store for them. Each rank joins
the world with ``meshcomm.init()``, says who it is, and publishes a number in the store;
rank 0 reads every rank's number and prints the sum. ``python examples/demo.py`` works too:
a world of one.
"""

from __future__ import annotations

import os
import socket

import meshcomm


def main() -> None:
    # Rank, world size and the store's address come from meshrun's environment variables.
    group = meshcomm.init()
    try:
        local_rank = os.environ.get("LOCAL_RANK", "0")
        print(
            f"rank {group.rank} of {group.size}: local rank {local_rank}, "
            f"host {socket.gethostname()}, pid {os.getpid()}, backend {group.backend}"
        )

        # Every rank sees the same store: set a key here, read it anywhere.
        store = group.store
        store.set(f"demo/value/{group.rank}", str(group.rank))
        if group.rank == 0:
            # get() waits (up to the timeout) until the key exists.
            total = sum(int(store.get(f"demo/value/{r}")) for r in range(group.size))
            expected = group.size * (group.size - 1) // 2
            print(f"sum of ranks through the store: {total} (expected {expected})")
    finally:
        meshcomm.shutdown()


if __name__ == "__main__":
    main()
