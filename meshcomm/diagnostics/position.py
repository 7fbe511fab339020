"""Where a rank is: its ledger heads and its innermost user frames, as a small JSON value.

A *head* is what a rank can say about itself in a few hundred bytes: for every group of its
world, the last collective it completed and the one it is in now (from each group's ledger,
:mod:`meshcomm.diagnostics.ledger`), how long since it last called any collective, and the
innermost frames of *your* code on its main thread. Hang verdicts
(:mod:`meshcomm.diagnostics.hang_verdict`, through :mod:`meshcomm.diagnostics.responder`) and
meshrun's report (:mod:`meshcomm.diagnostics.signal_report`) are made from heads;
:func:`parse` bounds what it accepts, so a hostile or corrupt value costs nothing.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> g = ProcessGroup(SelfCommunicator())
    >>> _ = g.all_reduce(1.0)
    >>> h = parse(encode(collect(g, 0)))
    >>> h["rank"], h["groups"][0]["done"]["name"], h["groups"][0]["now"]
    (0, 'all_reduce', None)
    >>> g.close()
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshcomm.diagnostics.group_view import GroupView

__all__ = ["MAX_BYTES", "collect", "encode", "groups_of", "parse", "user_frames"]

#: The largest head accepted from the store or a file (a head is usually under 1 KiB).
MAX_BYTES = 16 * 1024
_MAX_GROUPS = 32  # groups described per rank (a mesh has a few)
_MAX_FRAMES = 3  # innermost user frames kept
_MAX_TEXT = 200  # characters per string field
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # meshcomm/
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


def groups_of(world: GroupView) -> list[GroupView]:
    """``world`` and every group made from it, parents first."""
    out, todo = [], [world]
    while todo:
        group = todo.pop(0)
        out.append(group)
        todo.extend(list(group._kids))
    return out


def user_frames(frame: FrameType | None, limit: int = _MAX_FRAMES) -> list[str]:
    """The innermost ``limit`` frames of ``frame``'s stack outside meshcomm and the
    standard library, innermost first, as ``"file.py:41 in step"``."""
    out: list[str] = []
    while frame is not None and len(out) < limit:
        code = frame.f_code
        name = code.co_filename
        library = name.startswith(_STDLIB) and "-packages" not in name
        if not (name.startswith(_PACKAGE) or library or name.startswith("<frozen")):
            out.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}")
        frame = frame.f_back
    return out


def collect(world: GroupView, rank: int, frame: FrameType | None = None) -> dict[str, Any]:
    """This rank's head: ``rank``, ``pid``, ``idle`` (seconds since its last collective
    call on any group, None if none yet), ``groups`` (``name``, ``label``, and the ledger's
    ``seq``, ``done``, ``now``) and ``stack`` (:func:`user_frames` of ``frame``, default
    the main thread's current frame). Safe to call from any thread."""
    if frame is None:
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
    now = time.monotonic()
    groups, last = [], None
    for group in groups_of(world)[:_MAX_GROUPS]:
        if group.closed:
            continue
        head = group._book.head()
        issued = head.pop("issued")
        if issued is not None and (last is None or issued > last):
            last = issued
        groups.append({"name": group.name, "label": group.label, **head})
    return {
        "rank": rank,
        "pid": os.getpid(),
        "idle": None if last is None else now - last,
        "groups": groups,
        "stack": user_frames(frame),
    }


def encode(head: dict[str, Any]) -> bytes:
    """``head`` as compact JSON bytes."""
    return json.dumps(head, separators=(",", ":")).encode()


def _text(value: Any) -> str:
    return str(value)[:_MAX_TEXT]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _call(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        return None
    seq = value.get("seq")
    out = {
        "name": _text(value.get("name", "?")),
        "seq": seq if isinstance(seq, int) and not isinstance(seq, bool) else -1,
        "site": _text(value.get("site", "?")),
    }
    if "for" in value:
        out["for"] = _number(value.get("for")) or 0.0
    if isinstance(value.get("args"), str):
        out["args"] = _text(value["args"])
    return out


def parse(raw: bytes) -> dict[str, Any] | None:
    """A head from bytes, every field checked and bounded; None if it is not one."""
    if len(raw) > MAX_BYTES:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("groups"), list):
        return None
    rank = value.get("rank")
    groups = []
    for g in value["groups"][:_MAX_GROUPS]:
        if not isinstance(g, dict):
            continue
        seq = g.get("seq")
        groups.append(
            {
                "name": _text(g.get("name", "?")),
                "label": _text(g.get("label", "")),
                "seq": seq if isinstance(seq, int) and not isinstance(seq, bool) else 0,
                "done": _call(g.get("done")),
                "now": _call(g.get("now")),
            }
        )
    stack = value.get("stack")
    return {
        "rank": rank if isinstance(rank, int) and not isinstance(rank, bool) else -1,
        "pid": _number(value.get("pid")),
        "idle": _number(value.get("idle")),
        "groups": groups,
        "stack": [_text(s) for s in stack[:_MAX_FRAMES]] if isinstance(stack, list) else [],
    }
