"""Where is this rank? ``kill -USR1 <pid>`` prints its groups' last collectives and stacks.

``meshcomm.init()`` installs a ``SIGUSR1`` handler (unless the program has one of its own)
that writes to stderr, for every group of the world: the last collectives of its ledger (what
is in flight and for how long, and the line that called it), then the Python stack of every
thread. A rank blocked in a collective answers within its poll interval (the engine's waits
return to Python at least every few hundred milliseconds).

Under ``meshrun`` (``MESHCOMM_REPORT_DIR`` names a directory of meshrun's), the rank instead
writes its head (:mod:`meshcomm.diagnostics.position`: its groups' last and current collectives, its
innermost user frames) to ``DIR/rank<N>.json`` for meshrun to gather into one screen, and
announces at ``init`` that it answers (``DIR/rank<N>.ready``, holding its pid): meshrun
signals only ranks that do, since ``SIGUSR1`` kills a process without a handler. A rank
whose collective times out also leaves ``DIR/timeout`` (first one wins), which makes
meshrun gather the same report once.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> g = ProcessGroup(SelfCommunicator())
    >>> _ = g.all_reduce(1.0)
    >>> print(describe(g, last=1).splitlines()[1].split(" done")[0])
      all_reduce #1 float64 ()
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from meshcomm.diagnostics import position as _heads

if TYPE_CHECKING:
    from meshcomm.diagnostics.group_view import GroupView

__all__ = ["REPORT_DIR_ENV", "TIMEOUT_FILE", "describe", "install", "timed_out", "uninstall"]

#: Set by meshrun: the directory where ranks leave their reports for it.
REPORT_DIR_ENV = "MESHCOMM_REPORT_DIR"
#: The file a rank whose collective timed out leaves in that directory.
TIMEOUT_FILE = "timeout"
_MAX_TIMEOUT_TEXT = 4096

_installed: Any = None
_groups = _heads.groups_of


def _write_atomic(path: str, data: bytes) -> None:
    """Write ``path`` whole or not at all (meshrun must never read half a report)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def timed_out(text: str) -> None:
    """Tell meshrun (if it started this rank) that a collective timed out here, once per
    job: it then gathers every rank's report. Never raises."""
    folder = os.environ.get(REPORT_DIR_ENV)
    if not folder:
        return
    with contextlib.suppress(OSError):
        fd = os.open(os.path.join(folder, TIMEOUT_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode(errors="replace")[:_MAX_TIMEOUT_TEXT])


def describe(world: GroupView, last: int = 3) -> str:
    """The last ``last`` collectives of ``world`` and of every group made from it."""
    lines = []
    for group in _groups(world):
        if group.closed:
            continue
        me = group.ranks[group.rank]
        records = group.ledger()[-last:]
        lines.append(f"rank {me}, group {group.name!r} (size {group.size}):")
        if not records:
            lines.append("  no collective yet")
        for r in records:
            shape = "" if r["shape"] is None else r["shape"]
            verb = "in flight for" if r["state"] == "in flight" else f"{r['state']} in"
            lines.append(
                f"  {r['op']} #{r['seq']} {r['dtype'] or ''} {shape} {verb} "
                f"{r['seconds']:.3f} s at {r['site']}"
            )
    return "\n".join(lines)


def install(world: GroupView) -> bool:
    """Install the ``SIGUSR1`` report for ``world``; False if not possible (another handler,
    not the main thread, no SIGUSR1 on this platform)."""
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None or threading.current_thread() is not threading.main_thread():
        return False
    folder = os.environ.get(REPORT_DIR_ENV)
    ours = (signal.SIG_DFL, None, signal.SIG_IGN) if folder else (signal.SIG_DFL, None)
    if signal.getsignal(usr1) not in ours:
        return False  # the program's own handler wins

    me = world.ranks[world.rank]

    def report(_signum: int, frame: FrameType | None) -> None:
        if folder:  # meshrun gathers every rank's head into one screen
            with contextlib.suppress(OSError):
                head = _heads.collect(world, me, frame)
                _write_atomic(os.path.join(folder, f"rank{me}.json"), _heads.encode(head))
            return
        text: Any = describe(world) if not world.closed else "the world is closed"
        sys.stderr.write(f"--- meshcomm: where this rank is (SIGUSR1) ---\n{text}\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    global _installed
    signal.signal(usr1, report)
    report.rank = me  # type: ignore[attr-defined]
    _installed = report
    if folder:
        with contextlib.suppress(OSError):
            _write_atomic(os.path.join(folder, f"rank{me}.ready"), str(os.getpid()).encode())
    return True


def uninstall() -> None:
    """Put back the default ``SIGUSR1`` action if :func:`install` set the report (under
    meshrun: ignore it, and withdraw the ready file)."""
    global _installed
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None or _installed is None:
        return
    folder = os.environ.get(REPORT_DIR_ENV)
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(usr1) is _installed
    ):
        # Under meshrun, ignored rather than the default (which kills): meshrun may have
        # read this rank's ready file just before it is removed.
        signal.signal(usr1, signal.SIG_IGN if folder else signal.SIG_DFL)
    if folder:
        with contextlib.suppress(OSError):
            me = _installed.rank
            os.unlink(os.path.join(folder, f"rank{me}.ready"))
    _installed = None
