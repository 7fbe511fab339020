"""A rank for meshrun's failure tests: write a pid file, then sleep or fail on cue.

Usage: ``launch_worker.py PIDDIR MODE FAILING_RANK [--ignore-term] [--grandchild]``

MODE is ``sleep`` (every rank sleeps), ``raise``, ``sigkill`` or ``exit3``: the failing rank
waits until every rank has written its pid file (so the test knows all pids), then fails
that way; the others sleep. ``--ignore-term`` makes the other ranks ignore SIGTERM;
``--grandchild`` makes every rank start a sleeping child and write its pid too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SLEEP = 120.0
WAIT_FOR_PEERS = 30.0


def write_pid(path: Path, pid: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(pid))
    os.replace(tmp, path)  # the test never reads a half-written file


def main() -> None:
    piddir, mode, failing = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    flags = sys.argv[4:]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "--ignore-term" in flags and rank != failing:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--grandchild" in flags:
        child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({SLEEP})"])
        write_pid(piddir / f"child{rank}.pid", child.pid)
    write_pid(piddir / f"rank{rank}.pid", os.getpid())
    print(f"rank {rank} ready", flush=True)
    if rank == failing and mode != "sleep":
        deadline = time.monotonic() + WAIT_FOR_PEERS
        while len(list(piddir.glob("rank*.pid"))) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
        if mode == "raise":
            raise ValueError(f"boom from rank {rank}")
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "exit3":
            sys.exit(3)
    time.sleep(SLEEP)


if __name__ == "__main__":
    main()
