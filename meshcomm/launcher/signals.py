"""meshrun's signals: stop signals recorded for the supervision loop, and the report signal.

Example:
    >>> with catch_stop_signals() as (wakeup_fd, received, replaced):
    ...     received
    []
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from meshcomm.launcher.config import LaunchConfig
from meshcomm.launcher.torchrun_options import STOP_SIGNALS

__all__ = ["catch_stop_signals", "report_signal"]


@contextmanager
def catch_stop_signals(
    signals: Sequence[int] = STOP_SIGNALS,
) -> Iterator[tuple[int | None, list[int], dict[int, Any]]]:
    """Record ``signals`` (SIGINT/SIGTERM/SIGHUP) instead of dying; wake the loop by a pipe.

    Yields the pipe's read end (None outside the main thread, where Python allows no signal
    handlers; Ctrl-C then stops meshrun the default way and the ranks die with it), the
    list the handler appends signal numbers to, and the handlers it replaced (which forked
    ranks get back). A signal ignored when meshrun started (``nohup`` ignores SIGHUP, a
    shell's ``&`` SIGINT) stays ignored, as a shell leaves it: meshrun does not stop on it,
    and its ranks, forked or spawned, inherit it ignored.
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield None, received, {}
        return
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    os.set_blocking(wfd, False)

    def record(signum: int, _frame: Any) -> None:
        received.append(signum)

    old_wakeup = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    old_handlers: dict[int, Any] = {
        signum: signal.signal(signum, record)
        for signum in signals
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield rfd, received, old_handlers
    finally:
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(old_wakeup)
        os.close(rfd)
        os.close(wfd)


def report_signal(config: LaunchConfig) -> int | None:
    """The signal that asks meshrun where each rank is (``SIGUSR1``; it stops nothing).

    None when ``--signals-to-handle`` names ``SIGUSR1``: the user asked it to stop the job.

    Example:
        >>> from meshcomm.run import parse_args
        >>> report_signal(parse_args(["x.py"])) == signal.SIGUSR1
        True
        >>> report_signal(parse_args(["--signals-to-handle", "SIGTERM,SIGUSR1", "x.py"]))
    """
    return None if signal.SIGUSR1 in config.torchrun.stop_signals else signal.SIGUSR1
