"""meshrun's report of where each rank is: signal the ranks, gather their heads, one screen.

``meshrun`` hands its ranks a report directory (``MESHCOMM_REPORT_DIR``). A rank that ran
``meshcomm.init()`` announces there that it answers ``SIGUSR1`` (``rank<N>.ready``, its pid)
and, when signalled, writes its head there (``rank<N>.json``: :mod:`meshcomm.diagnostics.position`;
the
handler is :mod:`meshcomm.diagnostics.signal_report`'s). A :class:`Gathering` signals every live
rank that
announced itself, waits for their files up to a deadline without blocking meshrun's loop
(:meth:`Gathering.poll`), and :meth:`Gathering.text` makes one line or two per rank::

    meshrun: where each rank is (SIGUSR1):
      rank 0: in all_reduce #2 on group 'world' for 3.2 s (called at train.py:20)
              last done: all_reduce #1 at train.py:15; at train.py:20 in step <- train.py:40 in main
      rank 1: not in a collective; none called for 3.1 s
              last done: all_reduce #1 at train.py:15; at train.py:25 in step <- train.py:40 in main

Example:
    >>> import tempfile
    >>> g = Gathering(tempfile.mkdtemp(), [(0, None)], "SIGUSR1", deadline=0.0)
    >>> g.poll()
    True
    >>> print(g.text())
    meshrun: where each rank is (SIGUSR1):
      rank 0: exited before the report
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

from meshcomm.diagnostics import position as _heads

__all__ = ["Gathering", "describe_rank"]

_MAX_READY = 32  # bytes of a ready file (a pid)


def _ready_pid(folder: str, rank: int) -> int | None:
    try:
        with open(os.path.join(folder, f"rank{rank}.ready"), "rb") as f:
            raw = f.read(_MAX_READY)
    except OSError:
        return None
    return int(raw) if raw.strip().isdigit() else None


def _read_head(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(_heads.MAX_BYTES + 1)
    except OSError:
        return None
    return _heads.parse(raw)


def describe_rank(rank: int, head: dict[str, Any]) -> list[str]:
    """One or two lines about ``rank`` from its ``head``."""
    busy = [g for g in head["groups"] if g["now"] is not None]
    parts = []
    for g in busy[:2]:
        now = g["now"]
        args = f" with {now['args']}" if now.get("args") else ""
        parts.append(
            f"in {now['name']} #{now['seq']} {g['label']} for {now.get('for', 0.0):.1f} s "
            f"(called at {now['site']}){args}"
        )
    if not parts:
        idle = head["idle"]
        parts.append(
            "not in a collective; "
            + ("none called yet" if idle is None else f"none called for {idle:.1f} s")
        )
    mine = busy[0] if busy else next((g for g in head["groups"] if g["done"]), None)
    more = []
    if mine is not None and mine["done"] is not None:
        done = mine["done"]
        more.append(f"last done: {done['name']} #{done['seq']} at {done['site']}")
    if head["stack"]:
        more.append("at " + " <- ".join(head["stack"]))
    lines = [f"rank {rank}: " + "; ".join(parts)]
    if more:
        lines.append(" " * len(f"rank {rank}: ") + "; ".join(more))
    return lines


class Gathering:
    """One report in progress: ranks signalled, files awaited until ``deadline`` seconds.

    Args:
        folder: the report directory the ranks were given.
        ranks: ``(rank, pid)`` of every rank of this node; pid None: it has exited.
        why: what asked for the report (``"SIGUSR1"``, ``"Ctrl-C"``, ...).
        deadline: seconds to wait for the ranks' files.
    """

    def __init__(
        self, folder: str, ranks: Sequence[tuple[int, int | None]], why: str, deadline: float
    ) -> None:
        self._folder = folder
        self._why = why
        self._until = time.monotonic() + deadline
        self._ranks = [r for r, _ in ranks]
        self._state: dict[int, str] = {}  # rank -> why it gives no report
        self._heads: dict[int, dict[str, Any]] = {}
        self._pending: list[int] = []
        for rank, pid in ranks:
            if pid is None:
                self._state[rank] = "exited before the report"
                continue
            ready = _ready_pid(folder, rank)
            if ready is None:
                self._state[rank] = "does not answer (meshcomm.init() not called yet, or a "
                self._state[rank] += "SIGUSR1 handler of its own)"
                continue
            path = self._path(rank)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a stale answer from an earlier report
            try:
                os.kill(ready, signal.SIGUSR1)
            except OSError:
                self._state[rank] = "exited before the report"
                continue
            self._pending.append(rank)

    def _path(self, rank: int) -> str:
        return os.path.join(self._folder, f"rank{rank}.json")

    def poll(self) -> bool:
        """Collect the files that arrived; True when every rank answered or time is up."""
        for rank in list(self._pending):
            head = _read_head(self._path(rank))
            if head is not None:
                self._heads[rank] = head
                self._pending.remove(rank)
        if not self._pending:
            return True
        if time.monotonic() < self._until:
            return False
        for rank in self._pending:
            self._state[rank] = "no report in time (busy outside Python, or stopped)"
        self._pending = []
        return True

    def text(self) -> str:
        """The report, one or two lines per rank."""
        lines = [f"meshrun: where each rank is ({self._why}):"]
        for rank in self._ranks:
            head = self._heads.get(rank)
            if head is None:
                lines.append(f"rank {rank}: {self._state.get(rank, 'no report')}")
            else:
                lines.extend(describe_rank(rank, head))
        return "\n  ".join(lines)
