"""A rank of a world of 2 that waits while an attacker tries the store, then all_reduces.

Joins the world (meshrun-style environment), says "ready/RANK" in the world's store, waits
for "go", then all_reduces rank + 1 and prints "sum S" (3.0 when nothing was disturbed).
"""

from __future__ import annotations

import numpy as np

import meshcomm


def main() -> None:
    group = meshcomm.init(timeout=60)
    store = meshcomm.get_world_info().raw_store
    assert store is not None
    store.set(f"test/ready/{group.rank}", "1")
    store.wait(["test/go"])
    total = float(group.all_reduce(np.full(1, float(group.rank + 1)))[0])
    print(f"sum {total}", flush=True)
    meshcomm.shutdown()


if __name__ == "__main__":
    main()
