"""Prefix every line this process writes to stdout and stderr, at the file-descriptor level.

Used by ``meshcomm.run_mpi`` when ``meshrun --backend mpi`` starts the ranks: ``mpiexec``
merges every rank's output into its own, so each rank labels its lines itself
(``[rank3] ...``), as meshrun does for the ranks it starts. Working on fds 1 and 2 (a pipe
each, drained by a thread) labels what C libraries and child processes write too, not only
Python's ``print``. Lines are written whole, so lines of different ranks do not mix.

Example:
    >>> import subprocess, sys
    >>> code = ("from meshcomm.launcher.line_prefix import LinePrefix\\n"
    ...         "p = LinePrefix(b'[x] '); p.start(); print('a'); print('b', flush=True); p.stop()")
    >>> subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).stdout
    b'[x] a\\n[x] b\\n'
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

__all__ = ["LinePrefix"]

# A line longer than this is written in pieces (each piece prefixed) rather than held.
_MAX_LINE = 64 * 1024


class LinePrefix:
    """Route fds 1 and 2 through pipes; a thread per pipe writes ``prefix + line`` onward.

    :meth:`start` once, :meth:`stop` before the process exits (it flushes and waits up to
    ``timeout`` seconds for the last lines). Both are idempotent.
    """

    def __init__(self, prefix: bytes, fds: tuple[int, ...] = (1, 2)) -> None:
        self._prefix = prefix
        self._fds = fds
        self._saved: dict[int, int] = {}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start prefixing; output written before this call is not prefixed."""
        if self._saved:
            return
        _flush_python_streams()
        for fd in self._fds:
            saved = os.dup(fd)
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            self._saved[fd] = saved
            thread = threading.Thread(
                target=self._pump, args=(read_end, saved), name=f"line-prefix-{fd}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 2.0) -> None:
        """Put the original fds back and forward what the pipes still hold."""
        if not self._saved:
            return
        _flush_python_streams()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # drops our write end of the pipe: its reader sees EOF
        for thread in self._threads:
            thread.join(timeout)
        for saved in self._saved.values():
            os.close(saved)
        self._saved.clear()
        self._threads.clear()

    def _pump(self, read_end: int, out: int) -> None:
        partial = b""
        try:
            while True:
                try:
                    data = os.read(read_end, 65536)
                except InterruptedError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    break
                lines = (partial + data).split(b"\n")
                partial = lines.pop()
                if len(partial) > _MAX_LINE:
                    lines.append(partial)
                    partial = b""
                if lines:
                    _write_all(out, b"".join(self._prefix + line + b"\n" for line in lines))
            if partial:
                _write_all(out, self._prefix + partial + b"\n")
        finally:
            os.close(read_end)


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            return  # the reader is gone (a closed terminal, `| head`): drop the output
        view = view[written:]
