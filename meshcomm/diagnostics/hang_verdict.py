"""Hang verdicts: when a collective times out, say which ranks are behind and where.

A timeout alone says "no progress for 30 s in exchange"; the user's question is *which rank,
and where in my code*. When a collective of a group times out, the rank writes what it was
waiting in (operation, sequence number, call site) to the job's store, asks every other
member's responder (:mod:`meshcomm.diagnostics.responder`) where that rank is, reads the answers and
the others' own wait reports within a short grace period, and the error says, in the user's
words::

    rank 2 has not entered psum #3 over 'tp' (called at train.py:41 by ranks 0, 1, 3): it
    is alive but has not called a collective for 40.2 s; its last completed collective
    there was psum #2 at train.py:41

or that it is in another collective (which, where, for how long), or that it did not answer
at all (gone, or stuck where Python cannot run). Nothing is written unless a collective
timed out; a store that cannot be reached gives no verdict (the timeout stands).

Example:
    >>> from meshcomm.store import HashStore
    >>> store = HashStore(timeout=5)
    >>> text = report(store, "g", (0,), 0, "all_reduce", 3, "train.py:41", grace=0.1)
    >>> text.split(";")[0]
    "rank 0 waited in all_reduce #3 on group 'g' (called at train.py:41)"
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from meshcomm.diagnostics import responder as _responder
from meshcomm.errors import MeshCommError
from meshcomm.store.base import Store

__all__ = ["DISAGREE", "call_site", "grace_seconds", "is_mismatch", "report"]

#: How a verdict that found the ranks in different calls begins.
DISAGREE = "ranks disagree on the collective"

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # meshcomm/
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


def is_mismatch(text: str) -> bool:
    """Whether a verdict of :func:`report` found a mismatch rather than a hang.

    Example:
        >>> is_mismatch("ranks disagree on the collective on group 'world': ..."), is_mismatch("")
        (True, False)
    """
    return text.startswith(DISAGREE)


def _disagreement(waiting: dict[int, dict[str, Any]], seq: int, label: str) -> str:
    """The words of a mismatch among the ranks found in call ``seq``; "" if they agree
    (or their arguments are not known)."""
    calls: dict[tuple[str, str], list[int]] = {}
    for rank, w in sorted(waiting.items()):
        if not isinstance(w.get("args"), str) or w.get("seq") != seq:
            continue
        call = f"{str(w.get('op', '?'))[:200]}({w['args'][:200]})"
        calls.setdefault((call, str(w.get("site", "?"))[:200]), []).append(rank)
    if len({call for call, _ in calls}) < 2:
        return ""
    parts = [f"{_ranks(r)} called {c} at {site} (op #{seq})" for (c, site), r in calls.items()]
    return f"{DISAGREE} {label} (found when it timed out): {'; '.join(parts)}"


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


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


def _lag(head: dict[str, Any], group: str, seq: int) -> str:
    """What a rank that did not report waiting is doing, from its head."""
    mine = next((g for g in head["groups"] if g["name"] == group), None)
    if mine is not None and mine["seq"] >= seq and (mine["now"] or {}).get("seq") != seq:
        return f"it already completed #{seq} (its last call there was #{mine['seq']})"
    busy = [g for g in head["groups"] if g["now"] is not None]
    if busy:
        g = busy[0]
        now = g["now"]
        what = (
            f"it is in {now['name']} #{now['seq']} {g['label']} (called at {now['site']}) "
            f"for {now.get('for', 0.0):.1f} s"
        )
    elif head["idle"] is not None:
        what = f"it is alive but has not called a collective for {head['idle']:.1f} s"
    else:
        what = "it is alive but has not called a collective yet"
    if head["stack"]:
        what += f", at {head['stack'][0]}"
    done = None if mine is None else mine["done"]
    if done is not None:
        what += f"; its last completed collective there was {done['name']} #{done['seq']} at "
        what += done["site"]
    elif mine is None:
        what += "; it has not used that group yet"
    return what


def report(
    store: Store,
    group: str,
    members: Sequence[int],
    me: int,
    op: str,
    seq: int,
    site: str,
    grace: float,
    label: str | None = None,
    args: str | None = None,
) -> str:
    """Publish this rank's wait, ask the others where they are, and describe who is behind.

    Ranks found in the same call number with different arguments (``psum(int32[4], sum)``
    against ``psum(float32[4], sum)``: on mpi, a signature one rank has checked before
    against one another rank has not) are a mismatch, not a hang: the words then start with
    :data:`DISAGREE` and name every call (:func:`is_mismatch`).

    Args:
        store: the job's store.
        group: the group's name, the same on every member (it keys the reports).
        members: the group's global ranks.
        me: this rank's global rank.
        op: the collective that timed out, in the user's words; ``seq`` its sequence
            number in the group.
        site: where the user called it (:func:`call_site`).
        grace: seconds to wait for the other members' reports and answers.
        label: how to name the group (``"over 'tp'"``); default ``"on group '<group>'"``.
        args: the call's arguments in words (``float32[4], sum``,
            :func:`meshcomm.diagnostics.ledger.arguments`); None: not compared.

    Returns:
        One or more sentences for the error message ("" when the store cannot be used).
    """
    label = label or f"on group {group!r}"
    base = f"{_PREFIX}{group}/"
    me_waiting: dict[str, Any] = {"op": op, "seq": seq, "site": site, "args": args}
    mine = json.dumps(me_waiting).encode()
    try:
        store.set(f"{base}{seq}/{me}", mine)
        asked = {r: _responder.ask(store, r) for r in members if r != me}
    except (MeshCommError, OSError):
        return ""
    deadline = time.monotonic() + grace
    waiting: dict[int, dict[str, Any]] = {me: me_waiting}
    heads: dict[int, dict[str, Any]] = {}
    while True:
        for rank in members:
            if rank in waiting or rank in heads:
                continue
            got = _read(store, f"{base}{seq}/{rank}")
            if got is not None:
                waiting[rank] = got
                continue
            head = _responder.answer(store, rank, asked[rank])
            if head is None:
                continue
            flight = next((g["now"] for g in head["groups"] if g["name"] == group), None)
            if flight is not None and flight["seq"] == seq:
                # It waits too, maybe in another call of that number (a mismatch).
                waiting[rank] = {**flight, "op": flight["name"]}
            else:
                heads[rank] = head
        if len(waiting) + len(heads) == len(members) or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    disagreement = _disagreement(waiting, seq, label)
    if disagreement:
        return disagreement
    here = sorted(waiting)
    sites = sorted({str(w.get("site", "?"))[:200] for w in waiting.values()})
    where = ", ".join(sites)
    call = f"{op} #{seq} {label}"
    absent = [r for r in members if r not in waiting and r not in heads]
    if not heads and not absent:
        return (
            f"{_ranks(here)} waited in {call} (called at {where}); every member reached it, "
            "so the data itself did not move in time"
        )
    called = f"(called at {where} by {_ranks(here)})"
    parts = [
        f"rank {r} has not entered {call} {called}: {_lag(heads[r], group, seq)}" for r in heads
    ]
    if absent:
        parts.append(
            f"{_ranks(absent)} never reached {call} {called} and did not answer within "
            f"{grace:g} s: gone, or stuck where Python cannot run"
        )
    return "; ".join(parts[:1]) + "".join(f"\n  also: {p}" for p in parts[1:])
