"""Run a standalone store server: ``python -m meshcomm.store --host 127.0.0.1 --port 29500``.

Prints ``meshcomm store listening on HOST:PORT`` once bound (port 0 picks a free port) and
serves until SIGINT or SIGTERM, then exits 0.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from meshcomm.errors import MeshCommError
from meshcomm.store.server import DEFAULT_BACKLOG, MEMORY_ENV, StoreServer

__all__ = ["main"]


def _raise_fd_limit() -> None:
    # Each client costs one descriptor; the soft limit (often 1024) is the first wall.
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass  # not permitted or not POSIX: keep the limit we have


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, serve until a stop signal, return the exit status.

    Returns:
        0 after a clean stop, 1 if the server could not start.
    """
    parser = argparse.ArgumentParser(
        prog="python -m meshcomm.store", description="Run a meshcomm TCPStore server."
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    parser.add_argument("--backlog", type=int, default=DEFAULT_BACKLOG, help="listen backlog")
    parser.add_argument(
        "--memory-limit",
        default=None,
        metavar="BYTES",
        help=f"total memory budget (bytes, or with K/M/G); default ${MEMORY_ENV}, else 256M",
    )
    args = parser.parse_args(argv)
    _raise_fd_limit()
    try:
        server = StoreServer(
            args.host, args.port, backlog=args.backlog, memory_limit=args.memory_limit
        )
    except MeshCommError as exc:
        print(f"meshcomm store: {exc}", file=sys.stderr)
        return 1

    def _stop(signum: int, frame: FrameType | None) -> None:
        server.stop()

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    print(f"meshcomm store listening on {server.address}", flush=True)
    server.serve_forever()
    print("meshcomm store stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
