"""Where is this rank? ``kill -USR1 <pid>`` prints its groups' last collectives and stacks.

``meshcomm.init()`` installs a ``SIGUSR1`` handler (unless the program has one of its own)
that writes to stderr, for every group of the world: the last collectives of its ledger (what
is in flight and for how long, and the line that called it), then the Python stack of every
thread. A rank blocked in a collective answers within its poll interval (the engine's waits
return to Python at least every few hundred milliseconds).

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> g = ProcessGroup(SelfCommunicator())
    >>> _ = g.all_reduce(1.0)
    >>> print(describe(g, last=1).splitlines()[1].split(" done")[0])
      all_reduce #1 float64 ()
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshcomm.group import ProcessGroup

__all__ = ["describe", "install", "uninstall"]

_installed: Any = None


def _groups(world: ProcessGroup) -> list[ProcessGroup]:
    out, todo = [], [world]
    while todo:
        group = todo.pop(0)
        out.append(group)
        todo.extend(group._kids)
    return out


def describe(world: ProcessGroup, last: int = 3) -> str:
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


def install(world: ProcessGroup) -> bool:
    """Install the ``SIGUSR1`` report for ``world``; False if not possible (another handler,
    not the main thread, no SIGUSR1 on this platform)."""
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None or threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(usr1) not in (signal.SIG_DFL, None):
        return False  # the program's own handler wins

    def report(_signum: int, _frame: FrameType | None) -> None:
        text: Any = describe(world) if not world.closed else "the world is closed"
        sys.stderr.write(f"--- meshcomm: where this rank is (SIGUSR1) ---\n{text}\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    global _installed
    signal.signal(usr1, report)
    _installed = report
    return True


def uninstall() -> None:
    """Put back the default ``SIGUSR1`` action if :func:`install` set the report."""
    global _installed
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None or _installed is None:
        return
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(usr1) is _installed
    ):
        signal.signal(usr1, signal.SIG_DFL)
    _installed = None
