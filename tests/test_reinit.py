"""Re-initialising on a fixed port: the faster rank must not join the previous world's store.

Issue 17: with rank 0 hosting the store at ``tcp://127.0.0.1:P``, a world of 2 re-made in a
loop failed 18 of 20 times, because the rank that left first reached the old store before its
host closed it. Two real processes, real sockets.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

SCRIPT = str(Path(__file__).parent / "scripts" / "reinit_loop.py")
LOOPS = 20


def test_reinit_on_a_fixed_port_twenty_of_twenty() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, SCRIPT, str(rank), str(port), str(LOOPS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [proc.communicate(timeout=150)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for rank, out in enumerate(outputs):
        assert f"ok {LOOPS} of {LOOPS}" in out, f"rank {rank}:\n{out[-4000:]}"
