"""Where the ranks' output goes: meshrun's own streams, and each rank's pipe split into lines.

A :class:`Lines` reads one rank's pipe, prefixes each line (``[rank3] ``) for the console,
copies it to the rank's log files (:mod:`meshcomm.launcher.rank_logs`) and keeps the tail of stderr
for the failure summary; a :class:`Sink` is meshrun's stdout or stderr, where a closed
reader (``| head``) is not an error.

Example:
    >>> import io, os
    >>> from meshcomm.launcher.rank_logs import RunLogs, LogPlan
    >>> r, w = os.pipe()
    >>> _ = os.write(w, b"hello\\nworld"); os.close(w)
    >>> route = RunLogs(LogPlan(), "job").attempt(0, 1).route(0, 1)
    >>> lines = Lines(r, Sink(io.StringIO()), b"[rank0] ", None, route)
    >>> lines.read(), lines.read()
    (True, False)
    >>> os.close(r)
"""

from __future__ import annotations

import os
import sys
from collections import deque
from typing import IO

from meshcomm.launcher.rank_logs import Route

__all__ = ["Lines", "Sink"]

# A line longer than this is forwarded in pieces, so one rank cannot grow our memory.
_MAX_LINE = 64 * 1024


class Sink:
    """One of meshrun's own output streams; a closed reader (``| head``) is not an error."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._broken = False

    def write(self, data: bytes) -> None:
        """Write ``data`` now; after the reader went away, drop it."""
        if self._broken or not data:
            return
        try:
            self._stream.flush()
            buffer = getattr(self._stream, "buffer", None)
            if buffer is None:  # a text-only replacement (doctest, some notebooks)
                self._stream.write(data.decode(errors="replace"))
                self._stream.flush()
            else:
                buffer.write(data)
                buffer.flush()
        except (BrokenPipeError, ValueError):
            self._broken = True

    def say(self, text: str) -> None:
        """Write one line of meshrun's own: ``meshrun: text``."""
        self.write(f"meshrun: {text}\n".encode())


class Lines:
    """Split one rank's pipe into lines; prefix them for the console, copy them to log files."""

    def __init__(
        self, fd: int, sink: Sink, prefix: bytes, tail: deque[bytes] | None, route: Route
    ) -> None:
        self.fd = fd
        self._sink = sink
        self._prefix = prefix
        self._tail = tail
        self._route = route
        self._partial = b""

    def read(self) -> bool:
        """Forward what the pipe holds; return False at end of file."""
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            self.flush()
            return False
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > _MAX_LINE:
            lines.append(self._partial)
            self._partial = b""
        self._emit(lines)
        return True

    def flush(self) -> None:
        """Forward a last line that has no newline (at end of file, or when closing)."""
        if self._partial:
            self._emit([self._partial])
            self._partial = b""

    def _emit(self, lines: list[bytes]) -> None:
        if not lines:
            return
        if self._tail is not None:
            self._tail.extend(lines)
        problem = self._route.write(lines, self._prefix)
        if problem is not None:
            Sink(sys.stderr).say(problem)
        if self._route.console:
            self._sink.write(b"".join(self._prefix + line + b"\n" for line in lines))
