"""Ranks on simulated hosts (tests/test_hosts.py): one JSON line per rank on stdout.

``conformance``: meshcomm's conformance suite (every collective against numpy) on the
world. ``check``: psum along each axis of a (hosts, ranks per host) mesh, the host names seen, and
each peer's channel (shm on the same host, tcp across). ``loop``: psums until one fails,
then the error.
"""

import json
import os
import socket
import sys
import time

import numpy as np

import meshcomm
from meshcomm import ops
from meshcomm.errors import CommError


def main(mode: str) -> None:
    world = meshcomm.init()
    if mode == "conformance":
        from meshcomm.testing import run_conformance

        failures = run_conformance(world, quick=True)
        print("RESULT " + json.dumps({"rank": world.rank, "failures": failures}), flush=True)
        meshcomm.shutdown()
        return
    n_local = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = meshcomm.init_device_mesh((world.size // n_local, n_local), ("host", "local"))
    out: dict = {"rank": world.rank, "hostname": socket.gethostname()}
    if mode == "check":
        x = np.float64(world.rank)
        out["local"] = float(ops.psum(x, "local", mesh=mesh))
        out["host"] = float(ops.psum(x, "host", mesh=mesh))
        out["all"] = float(ops.psum(np.ones(1 << 16), ("host", "local"), mesh=mesh)[0])
        out["channels"] = {str(k): v for k, v in world._comm.transport.channels.items()}
    else:
        started = time.monotonic()
        try:
            for _ in range(100_000):
                ops.psum(np.ones(1024), ("host", "local"), mesh=mesh)
                time.sleep(0.01)
            out["error"] = None
        except CommError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["rank_named"] = getattr(exc, "rank", None)
        out["seconds"] = time.monotonic() - started
    print("RESULT " + json.dumps(out), flush=True)
    if mode == "check":
        meshcomm.shutdown()
    elif out["error"] is not None:
        # The node's other ranks time out on their own clock; leaving at once would let meshrun
        # stop them (SIGTERM) before they report what they saw.
        time.sleep(float(os.environ.get("MESHCOMM_TIMEOUT", "3")) + 2.0)
        sys.exit(1)  # as a training script would: meshrun then stops the node, non-zero


if __name__ == "__main__":
    main(sys.argv[1])
