"""Hang verdicts: when a collective times out, say which ranks are behind and where.

A timeout alone says "no progress for 30 s in exchange"; the user's question is *which rank,
and where in my code*. When a synchronous collective of a group times out, the rank writes
what it was waiting in (operation, sequence number, call site) to the job's store, reads what
the other members wrote within a short grace period, and the error says, in the user's
words::

    ranks [0, 1] waited in all_reduce #3 on group 'world' (called at train.py:41); rank 2
    never reached it (no report within 2 s: it is computing, sleeping, stuck in another
    group's collective, or gone)

Nothing is written unless a collective timed out; a store that cannot be reached gives no
verdict (the timeout stands).

Example:
    >>> from meshcomm.store import HashStore
    >>> store = HashStore(timeout=5)
    >>> text = report(store, "g", (0,), 0, "all_reduce", 3, "train.py:41", grace=0.1)
    >>> "rank 0 waited in all_reduce #3" in text
    True
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from meshcomm.errors import MeshCommError
from meshcomm.store.base import Store

__all__ = ["call_site", "grace_seconds", "report"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_PREFIX = "meshcomm/verdict/"
# Reports are small; anything longer from the store is not ours and is ignored.
_MAX_REPORT = 4096


def call_site() -> str:
    """``file:line`` of the innermost caller outside meshcomm ("?" if there is none).

    Example:
        >>> call_site().startswith("<doctest")
        True
    """
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def grace_seconds(timeout: float) -> float:
    """How long a timed-out rank waits for the others' reports: a tenth of the timeout,
    between 0.2 and 2 s (ranks time out within about that much of each other)."""
    return min(2.0, max(0.2, timeout / 10))


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {list(ranks)}"


def _read(store: Store, key: str) -> dict[str, Any] | None:
    try:
        if not store.check([key]):
            return None
        raw = store.get(key)
    except (MeshCommError, OSError):
        return None
    if len(raw) > _MAX_REPORT:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def report(
    store: Store,
    group: str,
    members: Sequence[int],
    me: int,
    op: str,
    seq: int,
    site: str,
    grace: float,
) -> str:
    """Publish this rank's wait, gather the others', and describe who is behind.

    Args:
        store: the job's store.
        group: the group's name, the same on every member (it keys the reports).
        members: the group's global ranks.
        me: this rank's global rank.
        op: the collective that timed out; ``seq`` its sequence number in the group.
        site: where the user called it (:func:`call_site`).
        grace: seconds to wait for the other members' reports.

    Returns:
        One or two sentences for the error message ("" when the store cannot be used).
    """
    base = f"{_PREFIX}{group}/"
    mine = json.dumps({"op": op, "seq": seq, "site": site}).encode()
    try:
        store.set(f"{base}{seq}/{me}", mine)
    except (MeshCommError, OSError):
        return ""
    deadline = time.monotonic() + grace
    waiting: dict[int, dict[str, Any]] = {}
    while True:
        for rank in members:
            if rank not in waiting:
                got = _read(store, f"{base}{seq}/{rank}")
                if got is not None:
                    waiting[rank] = got
        if len(waiting) == len(members) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    here = sorted(waiting)
    sites = sorted({str(w.get("site", "?")) for w in waiting.values()})
    where = sites[0] if len(sites) == 1 else ", ".join(sites)
    text = f"{_ranks(here)} waited in {op} #{seq} on group {group!r} (called at {where})"
    absent = [r for r in members if r not in waiting]
    if not absent:
        return text + "; every member reached it, so the data itself did not move in time"
    return (
        f"{text}; {_ranks(absent)} never reached it (no report within {grace:g} s: computing, "
        "sleeping, in another group's collective, or gone)"
    )
