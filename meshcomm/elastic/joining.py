"""Who joins: ranks that wait to come (back) into the mesh, and the decision to let them in.

A rank that wants in (a replacement ``meshrun --elastic --max-restarts`` started for a lost
one, or a rank that left with its unit and waits for the unit to be whole again) appends its
first-world rank to the job's join log and adds one to the pending counter, then waits for
its admission. The mesh's ranks learn at a step boundary that someone waits (the pending
counter, read at most every ``look`` seconds, folded into the step's vote so that every rank
decides alike); then the current world's rank 0 admits every *whole* unit among those
waiting (all the unit's first-world ranks wait) and publishes the new members and shape, to
the members and to each admitted rank. When the members finish, rank 0 says so, and ranks
still waiting go home.

Example:
    >>> from meshcomm.store import HashStore
    >>> store = HashStore(timeout=5)
    >>> ask_to_join(store, 2)
    >>> pending(store)
    1
    >>> waiting(store)
    [2]
"""

from __future__ import annotations

import json
import time
from typing import Any

from meshcomm.errors import CommTimeout, LeftTheMesh
from meshcomm.store.base import Store

__all__ = ["admit", "announce_done", "ask_to_join", "pending", "wait_for_admission", "waiting"]

_PREFIX = "meshcomm/elastic"
_LOG = f"{_PREFIX}/joins"
_PENDING = f"{_PREFIX}/pending"
_DONE = f"{_PREFIX}/done"
_POLL = 0.01


def ask_to_join(store: Store, origin: int) -> None:
    """Say that first-world rank ``origin`` waits to join."""
    store.append(_LOG, f"{origin}\n")
    store.add(_PENDING, 1)


def pending(store: Store) -> int:
    """How many ranks wait to join (not admitted yet)."""
    return store.add(_PENDING, 0)


def waiting(store: Store) -> list[int]:
    """The first-world ranks that asked to join and were not admitted since."""
    if not store.check([_LOG]):
        return []
    asked: list[int] = []
    for word in store.get(_LOG).decode().split():
        origin = int(word)
        if origin not in asked:
            asked.append(origin)
    # A rank admitted once that asks again (it left with its unit later) deleted its old
    # admission before asking (wait_for_admission).
    return [o for o in asked if not store.check([_admit_key(o)])]


def _admit_key(origin: int) -> str:
    return f"{_PREFIX}/admit/{origin}"


def admit(
    store: Store, round_: int, origins: list[int], members: tuple[int, ...], shape: tuple[int, ...]
) -> None:
    """Let ``origins`` in: they form round ``round_``'s world with ``members`` (first-world
    ranks, ascending) on a mesh of ``shape``."""
    record = json.dumps(
        {"round": round_, "members": list(members), "shape": list(shape), "joined": origins}
    )
    for origin in origins:
        store.set(_admit_key(origin), record)
    if origins:
        store.add(_PENDING, -len(origins))


def announce_done(store: Store) -> None:
    """The members finished: ranks still waiting to join go home."""
    store.set(_DONE, b"1")


def wait_for_admission(store: Store, origin: int, seconds: float) -> dict[str, Any]:
    """Ask to join as ``origin`` and wait up to ``seconds`` for the admission.

    Returns:
        ``{"round": r, "members": [...], "shape": [...], "joined": [...]}``.

    Raises:
        LeftTheMesh: the members finished first (nobody is left to join).
        CommTimeout: no admission within ``seconds``.
    """
    key = _admit_key(origin)
    store.delete_key(key)
    ask_to_join(store, origin)
    deadline = time.monotonic() + seconds
    while True:
        if store.check([key]):
            record: dict[str, Any] = json.loads(store.get(key))
            return record
        if store.check([_DONE]):
            raise LeftTheMesh(f"rank {origin}: the mesh finished while this rank waited to join")
        if time.monotonic() >= deadline:
            raise CommTimeout(f"rank {origin}: not let into the mesh within {seconds:g} s")
        time.sleep(_POLL)
