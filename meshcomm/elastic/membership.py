"""Who is still alive: the survivors of a world agree on it through the job's store.

After a loss every survivor of round ``r`` (the world it lived in) writes that it is
alive, with the ranks it saw die. The first to add one to the round's counter decides: it
waits until every rank of the old world either said it is alive or was seen dead by
someone (or the deadline passes: a rank that says nothing by then is counted gone), and
publishes the members. Everyone else waits for that list. A rank missing from it (it said
it is alive after the decision) learns so and leaves. The store is the launcher's
(``meshrun`` serves it), so it outlives any rank.

Example:
    >>> from meshcomm.store import HashStore
    >>> store = HashStore(timeout=5)
    >>> agree(store, round_=1, me=0, old_size=1, seen_dead=(), seconds=1.0)
    (0,)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

from meshcomm.errors import CommTimeout, LeftTheMesh, StoreError
from meshcomm.store.base import Store

__all__ = ["agree"]

_PREFIX = "meshcomm/elastic"
# How often the decider looks at who has spoken (seconds).
_LOOK = 0.005


def _key(round_: int, what: str) -> str:
    return f"{_PREFIX}/{round_}/{what}"


def agree(
    store: Store,
    round_: int,
    me: int,
    old_size: int,
    seen_dead: Iterable[int],
    seconds: float,
) -> tuple[int, ...]:
    """Agree with the other survivors of round ``round_``'s world on who is alive.

    Args:
        store: the job's store (every rank's, and one that outlives them).
        round_: the number of this agreement (0 for the first world's loss, then 1, ...):
            every survivor counts the same.
        me: this rank in the world that failed.
        old_size: that world's size.
        seen_dead: ranks of that world this rank saw die (a ``PeerError``'s rank).
        seconds: how long a rank that says nothing is waited for.

    Returns:
        The ranks (of the old world) alive, ascending; ``me`` among them.

    Raises:
        LeftTheMesh: this rank spoke after the decision (the others went on without it).
        CommTimeout: the decision did not come (the deciding rank died while deciding).
    """
    dead = sorted({int(r) for r in seen_dead if 0 <= int(r) < old_size and int(r) != me})
    store.set(_key(round_, f"alive/{me}"), json.dumps(dead))
    members_key = _key(round_, "members")
    if store.add(_key(round_, "decider"), 1) == 1:
        store.set(members_key, json.dumps(_decide(store, round_, old_size, seconds)))
    try:
        store.wait([members_key], timeout=2 * seconds + 5.0)
        members: tuple[int, ...] = tuple(json.loads(store.get(members_key)))
    except StoreError as exc:
        raise CommTimeout(
            f"rank {me}: the survivors' list of round {round_} did not come within "
            f"{2 * seconds + 5.0:g} s (the rank deciding it may have died too): {exc}"
        ) from exc
    if me not in members:
        raise LeftTheMesh(
            f"rank {me}: the survivors of round {round_} went on without this rank (it spoke "
            f"after they agreed on {list(members)})"
        )
    return members


def _decide(store: Store, round_: int, old_size: int, seconds: float) -> list[int]:
    """Wait until every rank spoke or was seen dead, or the deadline; the ranks that spoke."""
    deadline = time.monotonic() + seconds
    keys = [_key(round_, f"alive/{r}") for r in range(old_size)]
    alive: list[int] = []
    while True:
        alive = [r for r, key in enumerate(keys) if store.check([key])]
        dead: set[int] = set()
        for raw in store.multi_get([keys[r] for r in alive]):
            dead.update(int(r) for r in json.loads(raw))
        if len(alive) + len(dead - set(alive)) >= old_size or time.monotonic() >= deadline:
            return alive
        time.sleep(_LOOK)
