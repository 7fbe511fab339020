"""A rank that reports how it was started, to compare meshrun's start methods.

Usage: ``launch_main.py [ACTION]``. Prints one JSON line (``__main__`` globals, argv,
``sys.path[0]``, open descriptors, signal dispositions, standard streams, threads once
numpy is imported), then ends as
ACTION says: ``ok`` (default), ``exit3`` (``sys.exit(3)``), ``exit-text``
(``sys.exit("bye")``), ``interrupt`` (an unhandled KeyboardInterrupt), ``raise`` (an
unhandled ValueError), or ``finish`` (an atexit handler and a non-daemon thread that must
both run before the process ends).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time


def open_fds() -> list[int]:
    listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        return sorted(int(fd) for fd in os.listdir(listing) if int(fd) != listing)
    finally:
        os.close(listing)


def disposition(signum: int) -> str:
    handler = signal.getsignal(signum)
    if handler is signal.default_int_handler:
        return "default_int_handler"
    return str(handler)


def threads_after_numpy() -> int | None:
    import numpy  # noqa: F401 - its BLAS starts its thread pool on import

    if not sys.platform.startswith("linux"):
        return None
    return len(os.listdir("/proc/self/task"))


def report() -> None:
    main = sys.modules["__main__"]
    record = {
        "name": __name__,
        "main_is_this": main.__dict__ is globals(),
        "globals": sorted(k for k in globals() if k.startswith("__")),
        "file": globals().get("__file__"),
        "spec": getattr(globals().get("__spec__"), "name", None),
        "cached": globals().get("__cached__"),
        "argv": sys.argv,
        "path0": sys.path[0],
        "leads_group": os.getpgid(0) == os.getpid(),
        "fds": open_fds() if sys.platform.startswith("linux") else None,
        "stdin": sys.stdin.read(),
        "signals": [disposition(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)],
        "stdout": [sys.stdout.encoding, sys.stdout.line_buffering, sys.stdout.write_through],
        "stderr": [sys.stderr.encoding, sys.stderr.errors, sys.stderr.write_through],
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads_after_numpy": threads_after_numpy(),
    }
    print(json.dumps(record))


def finish() -> None:
    atexit.register(print, "atexit ran", flush=True)

    def late() -> None:
        time.sleep(0.3)
        print("thread done", flush=True)

    threading.Thread(target=late).start()


if __name__ == "__main__":
    report()
    action = sys.argv[1] if len(sys.argv) > 1 else "ok"
    if action == "exit3":
        sys.exit(3)
    if action == "exit-text":
        sys.exit("bye")
    if action == "interrupt":
        raise KeyboardInterrupt
    if action == "raise":
        raise ValueError("boom")
    if action == "finish":
        finish()
