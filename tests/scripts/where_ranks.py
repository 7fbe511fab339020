"""Ranks for meshrun's report (tests/test_where.py): each leaves a file once it is ready.

``stall``: rank 0 waits in all_reduce #2 while ranks 1 and 2 sleep (meshrun gets SIGUSR1,
then Ctrl-C). ``timeout``: the same with MESHCOMM_TIMEOUT=2, so rank 0's collective times
out and meshrun reports on its own.
"""

import os
import sys
import time

import numpy as np

import meshcomm


def nap() -> None:
    time.sleep(60)  # THE NAP


def main() -> None:
    world = meshcomm.init()
    world.all_reduce(np.ones(2))  # op #1
    open(os.path.join(os.environ["WHERE_TEST_DIR"], f"ready{world.rank}"), "w").close()
    if world.rank == 0:
        world.all_reduce(np.ones(2))  # THE WAIT
    else:
        nap()  # THE CALL OF NAP


if __name__ == "__main__":
    main()
    sys.exit(0)
