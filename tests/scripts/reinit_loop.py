"""Re-make a world of 2 in a loop, rank 0 hosting the store on one fixed port each time.

Usage: reinit_loop.py RANK PORT LOOPS. Prints "ok N of LOOPS" and each failure's message.
"""

from __future__ import annotations

import sys

import numpy as np

import meshcomm


def main() -> None:
    rank, port, loops = (int(arg) for arg in sys.argv[1:4])
    ok = 0
    for i in range(loops):
        try:
            group = meshcomm.init(
                init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=5
            )
            total = float(group.all_reduce(np.full(1, float(i + rank)))[0])
            if total == 2 * i + 1:
                ok += 1
            else:
                print(f"loop {i}: sum {total}, expected {2 * i + 1}", flush=True)
        except meshcomm.errors.MeshCommError as exc:
            print(f"loop {i}: {type(exc).__name__}: {exc}", flush=True)
        finally:
            meshcomm.shutdown()
    print(f"ok {ok} of {loops}", flush=True)


if __name__ == "__main__":
    main()
