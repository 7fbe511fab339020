"""A rank that uses the store meshrun hosts: publish a value, read everyone's, print the sum.

Node 0's launcher closes the store once node 0's ranks exit, so those ranks wait until every
rank has finished with the store (torch-style jobs end with a barrier for the same reason).
"""

from __future__ import annotations

import os

from meshcomm.store import TCPStore


def main() -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # meshrun names its store in meshcomm's variables; MASTER_PORT is torch's rank 0's.
    addr, port = os.environ["MESHCOMM_MASTER_ADDR"], int(os.environ["MESHCOMM_MASTER_PORT"])
    store = TCPStore(addr, port, timeout=30)
    try:
        store.set(f"value/{rank}", str(10 * rank))
        total = sum(int(store.get(f"value/{r}")) for r in range(world_size))
        store.set(f"done/{rank}", "1")
        if os.environ["GROUP_RANK"] == "0":
            store.wait([f"done/{r}" for r in range(world_size)])
        print(f"sum {total}")
    finally:
        store.close()


if __name__ == "__main__":
    main()
