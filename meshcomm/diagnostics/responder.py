"""The responder: a daemon thread per rank that says where the rank is when asked.

A rank that timed out in a collective wants to know where the others are, including the
ones that are *not* in a collective (computing, sleeping, in another group's collective).
Those cannot answer from the collective path, so every rank with a store runs one small
daemon thread with a store connection of its own, blocked in a store ``wait`` on its next
request key. An asker (:func:`ask`, from :mod:`meshcomm.store.mailbox`, where the keys are)
numbers its request with a store counter and sets the key; the responder answers with the
rank's head (:mod:`meshcomm.diagnostics.position`) under the same number and deletes the
request. Nothing runs per collective: the thread sleeps in the store
until someone asks, and wakes every few seconds only to notice shutdown.

A request may also ask for one record of one group's ledger (:func:`ask_call`): a rank that
saw a peer's call differ from its own (a mismatch) names the peer's call with it.

Keys (under the world's store prefix)::

    meshcomm/ask/<rank>          request counter
    meshcomm/ask/<rank>/<n>      request n ("?", "call\n<group>\n<seq>", or "stop" from
                                 the rank itself)
    meshcomm/head/<rank>/<n>     answer n (JSON, at most heads.MAX_BYTES)

Only stores that can hold a second blocking client get a responder: ``TCPStore`` (a second
connection to the same server, same secret) and the in-process ``HashStore``; with other
stores a rank does not answer and the verdict says it did not (the collective timeout stands).

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> from meshcomm.store import HashStore
    >>> store = HashStore(timeout=5)
    >>> g = ProcessGroup(SelfCommunicator(), store=store)
    >>> r = Responder.start(g, store, 0)
    >>> n = ask(store, 0)
    >>> answer(store, 0, n, wait=5)["rank"]
    0
    >>> r.stop(store)
    >>> g.close()
"""

from __future__ import annotations

import contextlib
import json
import threading
from typing import TYPE_CHECKING, Any

from meshcomm.diagnostics import position as _heads
from meshcomm.errors import MeshCommError, StoreTimeout
from meshcomm.store.base import Store
from meshcomm.store.mailbox import answer_key, ask, ask_key
from meshcomm.store.memory import HashStore
from meshcomm.store.prefix import PrefixStore
from meshcomm.store.tcp import TCPStore

if TYPE_CHECKING:
    from meshcomm.diagnostics.group_view import GroupView

__all__ = ["Responder", "answer", "ask", "ask_call"]

# The responder's store wait: how often it looks at its stop flag when nobody asks.
_IDLE_WAIT = 5.0
_TORCH_IDLE_WAIT = 24 * 3600.0


def answer(store: Store, rank: int, n: int, wait: float = 0.0) -> dict[str, Any] | None:
    """The answer to request ``n`` of ``rank`` (a parsed head), waiting up to ``wait``
    seconds; None if there is none (yet), or it is not a head."""
    key = answer_key(rank, n)
    try:
        if wait > 0:
            store.wait([key], wait)
        elif not store.check([key]):
            return None
        raw = store.get(key)
    except (MeshCommError, OSError):
        return None
    with contextlib.suppress(MeshCommError, OSError):
        store.delete_key(key)  # read once: the store does not grow with requests
    return _heads.parse(raw)


def ask_call(store: Store, rank: int, group: str, seq: int, wait: float) -> dict[str, Any] | None:
    """``rank``'s ledger record of call ``seq`` of its group named ``group`` (as
    :meth:`~meshcomm.diagnostics.ledger.Ledger.records` gives one, ``shape`` a list), waiting up to
    ``wait`` seconds; None if it does not answer in time or has no such record."""
    try:
        n = ask(store, rank, f"call\n{group}\n{int(seq)}".encode())
        key = answer_key(rank, n)
        store.wait([key], wait)
        raw = store.get(key)
        with contextlib.suppress(MeshCommError, OSError):
            store.delete_key(key)
    except (MeshCommError, OSError):
        return None
    if len(raw) > _heads.MAX_BYTES:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    record = value.get("record") if isinstance(value, dict) else None
    if not isinstance(record, dict) or not isinstance(record.get("name"), str):
        return None
    # Each field checked: these words go into every rank's error message.
    shape = record.get("shape")
    if not (isinstance(shape, list) and all(type(d) is int for d in shape[:64])):
        shape = None
    return {
        "name": record["name"][:_MAX_TEXT],
        "dtype": _short(record.get("dtype")),
        "shape": None if shape is None else shape[:64],
        "reduce": _short(record.get("reduce")),
        "root": record.get("root") if type(record.get("root")) is int else None,
        "device": record.get("device") is True,
        "args": _args(record.get("args")),
        "over": _short(record.get("over")),
        "tree": _short(record.get("tree")),
        "site": _short(record.get("site")) or "?",
    }


def _args(value: Any) -> dict[str, str]:
    """A record's ``args`` (names to words), bounded: at most 8, each name and word cut."""
    if not isinstance(value, dict):
        return {}
    return {
        k[:_MAX_TEXT]: v[:_MAX_TEXT]
        for k, v in list(value.items())[:8]
        if isinstance(k, str) and isinstance(v, str)
    }


_MAX_TEXT = 200


def _short(value: Any) -> str | None:
    return value[:_MAX_TEXT] if isinstance(value, str) else None


#: The fields of a ledger record that a ``call`` answer holds (what the words use).
_ANSWERED = (
    "seq", "op", "name", "dtype", "shape", "reduce", "root", "device", "args", "over", "tree",
    "site",
)  # fmt: skip


def _call_answer(world: GroupView, request: bytes) -> bytes:
    """The answer to a ``call`` request: ``{"record": <record or null>}``."""
    found = None
    parts = request.decode(errors="replace").split("\n")
    if len(parts) == 3 and parts[2].isdigit():
        for group in _heads.groups_of(world):
            if group.name == parts[1]:
                found = group._book.find(int(parts[2]))
                break
    if found is not None:
        found = {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in found.items() if k in _ANSWERED
        }
        if not isinstance(found.get("root"), int | None):
            found["root"] = str(found["root"])
    return json.dumps({"record": found}).encode()


#: How a mismatch announced by the tcp backend's alarm starts (its ``ALARM_REQUEST``).
_ALARM = b"mismatch\n"


def _announced(request: bytes) -> tuple[str, str] | None:
    """The group and words of an announced mismatch (imported here: only the tcp backend
    announces, and a world may form without it)."""
    from meshcomm.backends.tcp.alarm import parse_request

    return parse_request(request)


def _own_connection(store: Store) -> tuple[Store, bool] | None:
    """A store the responder may block in without stalling the rank's own calls, and
    whether it is a new connection (the responder closes it); None if there is none."""
    if isinstance(store, PrefixStore):
        inner = _own_connection(store.underlying_store)
        return None if inner is None else (PrefixStore(store.prefix, inner[0]), inner[1])
    if isinstance(store, TCPStore):
        secret = store._secret or b""  # the rank's own: the server admits only the job
        return TCPStore(store.host, store.port, timeout=store.timeout, secret=secret), True
    if isinstance(store, HashStore):
        return store, False  # in-process and thread-safe: a wait blocks no other caller
    from meshcomm.store.torch_adapter import TorchStore  # imports no torch

    if isinstance(store, TorchStore):  # torchrun's store, or torch's (the "meshcomm" backend)
        return store.clone(), True
    return None


def _idle_wait(store: Store) -> float:
    """How long one idle wait lasts: torch's stores log a warning each time a wait times out,
    so on those the responder waits long (its stop request wakes it all the same)."""
    inner = store
    while isinstance(inner, PrefixStore):
        inner = inner.underlying_store
    from meshcomm.store.torch_adapter import TorchStore

    return _TORCH_IDLE_WAIT if isinstance(inner, TorchStore) else _IDLE_WAIT


class Responder:
    """The daemon thread of one rank (see the module docstring); :meth:`start` makes it."""

    def __init__(self, world: GroupView, store: Store, rank: int, owns: bool) -> None:
        self._world = world
        self._store = store
        self._owns = owns
        self._rank = rank
        self._stopping = False
        self._thread = threading.Thread(
            target=self._serve, name=f"meshcomm-responder-{rank}", daemon=True
        )

    @classmethod
    def start(cls, world: GroupView, store: Store, rank: int) -> Responder | None:
        """Start ``rank``'s responder over ``world`` with a connection of its own to
        ``store``; None when the store cannot give one (or cannot be reached)."""
        try:
            own = _own_connection(store)
        except (MeshCommError, OSError):
            return None
        if own is None:
            return None
        responder = cls(world, own[0], rank, own[1])
        responder._thread.start()
        return responder

    def _serve(self) -> None:
        store, rank, n = self._store, self._rank, 1
        idle = _idle_wait(store)
        try:
            while not self._stopping:
                key = ask_key(rank, n)
                try:
                    store.wait([key], idle)
                except StoreTimeout:
                    continue
                request = store.get(key)
                if request == b"stop" or self._stopping:
                    return
                if request.startswith(_ALARM) and (announced := _announced(request)):
                    # A mismatch announced (meshcomm.backends.tcp.alarm); nobody waits for
                    # an answer. The store admits only the job's ranks.
                    self._world._comm.notice_mismatch(*announced)
                elif request.startswith(b"call\n"):
                    store.set(answer_key(rank, n), _call_answer(self._world, request))
                else:
                    head = _heads.collect(self._world, rank)
                    store.set(answer_key(rank, n), _heads.encode(head))
                store.delete_key(key)
                n += 1
        except (MeshCommError, OSError):
            return  # the store is gone: the job is ending
        finally:
            if self._owns:
                with contextlib.suppress(MeshCommError, OSError):
                    store.close()

    def stop(self, store: Store, timeout: float = 2.0) -> None:
        """Stop the thread: wake it through ``store`` (the rank's own) and join it."""
        self._stopping = True
        with contextlib.suppress(MeshCommError, OSError):
            ask(store, self._rank, b"stop")
        self._thread.join(timeout)
