"""Rank 0 signals itself (SIGUSR1) while it waits in a collective for rank 1."""

import os
import signal
import threading
import time

import numpy as np

from meshcomm.group import ProcessGroup
from meshcomm.testing import run_ranks


def waits(world: ProcessGroup) -> None:
    world.all_reduce(np.ones(2))
    if world.rank == 0:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    else:
        time.sleep(2.0)
    world.all_reduce(np.ones(3))  # rank 0 is in flight here when the signal comes


if __name__ == "__main__":
    run_ranks(waits, 2, timeout=60)
