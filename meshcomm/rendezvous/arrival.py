"""Waiting for the whole world at the rendezvous's arrival barrier, and naming who is missing:
rank 0 says every few seconds (``MESHCOMM_RDZV_REPORT``, default 10) which ranks, and on
which nodes, have not arrived, so a node started late or never is named while the others
wait, not only at the timeout.

Example:
    >>> span([2, 3, 4, 7])
    '2-4, 7'
    >>> from meshcomm.store import HashStore
    >>> store = HashStore()
    >>> store.set("ns/rank/1", "claimed")
    >>> missing_ranks(store, "ns", 3)
    [0, 2]
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from meshcomm.errors import StoreTimeout

if TYPE_CHECKING:
    from meshcomm.store.base import Store

__all__ = ["local_world_size_hint", "missing_ranks", "span", "wait_for_all"]

# One logger for every part of the rendezvous, by the name docs/security.md gives users.
_log = logging.getLogger("meshcomm.rendezvous")
# Rank 0 says who is missing this often while the world assembles.
_REPORT_EVERY = 10.0


def missing_ranks(store: Store, ns: str, world_size: int) -> list[int]:
    """The ranks that have not claimed their key under ``ns`` yet."""
    return [r for r in range(world_size) if not store.check([f"{ns}/rank/{r}"])]


def _report_every() -> float:
    """Seconds between rank 0's "still waiting" lines (``MESHCOMM_RDZV_REPORT``, default 10)."""
    raw = os.environ.get("MESHCOMM_RDZV_REPORT", "").strip()
    try:
        value = float(raw) if raw else _REPORT_EVERY
    except ValueError:
        value = _REPORT_EVERY
    return value if value > 0 else _REPORT_EVERY


def wait_for_all(
    store: Store, ns: str, rank: int, world_size: int, seconds: float, deadline: float
) -> None:
    """Wait for the arrival barrier; rank 0 says who is missing every few seconds, so a node
    started late or never is named while the others wait, not only at the timeout.

    Raises:
        StoreTimeout: the deadline passed.
    """
    every = _report_every()
    started = time.monotonic()
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait([f"{ns}/done"], timeout=max(min(left, every), 1e-3))
            return
        except StoreTimeout:
            if time.monotonic() >= deadline - 1e-3:
                raise
        if rank != 0:
            continue
        missing = missing_ranks(store, ns, world_size)
        if not missing:
            continue
        local = local_world_size_hint()
        nodes = sorted({r // local for r in missing}) if local else []
        where = f" (node(s) {nodes} with {local} ranks per node)" if nodes else ""
        _log.warning(
            "meshcomm: waiting for rank(s) %s%s: %d of %d arrived, %.0f s of %g s",
            span(missing),
            where,
            world_size - len(missing),
            world_size,
            time.monotonic() - started,
            seconds,
        )


def span(ranks: list[int]) -> str:
    """``[2, 3, 4, 7]`` -> ``"2-4, 7"``: readable at 512 ranks."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def local_world_size_hint() -> int:
    """Ranks per node from the launcher's ``LOCAL_WORLD_SIZE`` (0 when unknown)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else 0
