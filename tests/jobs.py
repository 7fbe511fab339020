"""A job the tests start as a subprocess: in its own session, at the repository's root,
output captured; waited for within a bound, and killed (its whole session) when late.

Launched commands (torchrun, meshrun, a rank script) start processes of their own, so a
late job is killed by its session, not by its pid alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

__all__ = ["ROOT", "Job"]

ROOT = Path(__file__).resolve().parents[1]


class Job:
    """``command`` started now with ``env``, in its own session; :meth:`finish` waits."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.command = command
        self.proc = subprocess.Popen(
            command,
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def finish(self, timeout: float) -> tuple[int, str]:
        """Wait up to ``timeout`` seconds; return the exit code and the output.

        Raises:
            AssertionError: it still ran after ``timeout`` (its session is killed first).
        """
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, _ = self.proc.communicate(timeout=30)
            raise AssertionError(
                f"{self.command} still ran after {timeout} s:\n{out[-4000:]}"
            ) from None
        return self.proc.returncode, out

    def kill(self) -> None:
        """Kill the job's whole session (nothing to do once it is gone)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
