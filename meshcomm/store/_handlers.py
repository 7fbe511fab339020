"""The store server's answers: every request checked against the memory budget, applied to
the key-value state, and answered in its connection's output; blocking requests parked.

A request that would take the store over its budget is answered with an ERROR naming the
budget and the sizes; nothing else is disturbed. :meth:`RequestHandler.admit` judges a large
frame from its header, before its body is buffered.

Example:
    >>> import socket
    >>> from meshcomm.store import wire
    >>> from meshcomm.store._budget import MemoryBudget
    >>> from meshcomm.store._conn import Conn
    >>> from meshcomm.store._waiters import Waiters
    >>> from meshcomm.store.memory import KVState
    >>> budget, state = MemoryBudget(2**20), KVState()
    >>> handler = RequestHandler(state, budget, Waiters(budget), "test", lambda conn: None)
    >>> a, b = socket.socketpair()
    >>> conn = Conn(a, "peer")
    >>> handler.handle(conn, 1, wire.OP_SET, (b"k", b"v"))
    >>> state.data, budget.stored, bytes(conn.out) == wire.ok(1)
    ({b'k': b'v'}, 130, True)
    >>> a.close(); b.close()
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from meshcomm.errors import StoreError
from meshcomm.store import wire
from meshcomm.store._budget import ENTRY_OVERHEAD, MEMORY_ENV, MemoryBudget
from meshcomm.store._conn import Conn, Waiter
from meshcomm.store._waiters import Waiters
from meshcomm.store.memory import KVState

__all__ = ["RequestHandler"]

_log = logging.getLogger("meshcomm.store")

# Parked (blocking) requests one connection may hold; a well-behaved client has one.
_MAX_PARKED = 256
_WRITES = frozenset(
    (wire.OP_SET, wire.OP_ADD, wire.OP_COMPARE_SET, wire.OP_MULTI_SET, wire.OP_APPEND)
)


class RequestHandler:
    """Answers the requests of one server's connections.

    Args:
        state: the key-value state.
        budget: the server's memory budget.
        waiters: the server's parked requests.
        address: the server's ``host:port``, for its log lines.
        flush: sends what a connection's output holds (the server's; it may drop the
            connection).
    """

    def __init__(
        self,
        state: KVState,
        budget: MemoryBudget,
        waiters: Waiters,
        address: str,
        flush: Callable[[Conn], None],
    ) -> None:
        self._state = state
        self._budget = budget
        self._waiters = waiters
        self._address = address
        self._flush = flush

    def handle(self, conn: Conn, rid: int, op: int, args: tuple[Any, ...]) -> None:
        """Answer (or park) one decoded request of ``conn``; the caller sends the output."""
        state = self._state
        out = conn.out
        if op == wire.OP_GET:
            timeout, key = args
            value = state.data.get(key)
            if value is None:
                self._park(conn, rid, op, [key], timeout)
            else:
                self._answer(conn, rid, op, [key])
        elif op in _WRITES:
            self._write(conn, rid, op, args)
        elif op in (wire.OP_WAIT, wire.OP_MULTI_GET):
            timeout, keys = args
            if state.missing(keys):
                self._park(conn, rid, op, keys, timeout)
            else:
                self._answer(conn, rid, op, keys)
        elif op == wire.OP_CHECK:
            conn.proto.frame(out, wire.ok_bool(rid, not state.missing(args[0])))
        elif op == wire.OP_DELETE:
            before = self._entry(args[0])
            conn.proto.frame(out, wire.ok_bool(rid, state.delete(args[0])))
            self._budget.stored -= before
        elif op == wire.OP_NUM_KEYS:
            conn.proto.frame(out, wire.ok_int(rid, len(state.data)))
        else:  # OP_PING; the decoder admits no other opcode
            conn.proto.frame(out, wire.ok(rid))

    def _write(self, conn: Conn, rid: int, op: int, args: tuple[Any, ...]) -> None:
        """SET, ADD, COMPARE_SET, MULTI_SET, APPEND: refused if the result would not fit."""
        state = self._state
        if op == wire.OP_MULTI_SET:
            final = dict(zip(args[0], args[1], strict=True))  # a repeated key: the last wins
            keys = list(final)
            after = sum(len(k) + len(v) + ENTRY_OVERHEAD for k, v in final.items())
        else:
            keys = [args[0]]
            size = len(args[0]) + ENTRY_OVERHEAD
            if op == wire.OP_SET:
                after = size + len(args[1])
            elif op == wire.OP_APPEND:
                after = max(self._entry(args[0]), size) + len(args[1])
            elif op == wire.OP_ADD:
                after = size + 20  # the decimal digits of an int64
            else:  # COMPARE_SET: at most the desired value
                after = size + len(args[2])
        before = sum(self._entry(k) for k in keys)
        used = self._budget.used
        if after > before and used + after - before > self._budget.limit:
            conn.proto.frame(
                conn.out,
                wire.error(
                    rid,
                    f"{wire.OP_NAMES[op]} of key {keys[0][:64]!r} refused: {after - before} more "
                    f"bytes would take the store to {used + after - before} bytes, over its "
                    f"memory budget of {self._budget.limit} bytes ({self._budget.usage()}); "
                    f"raise it with memory_limit= or {MEMORY_ENV}",
                ),
            )
            return
        out = conn.out
        if op == wire.OP_SET:
            state.data[args[0]] = args[1]
            conn.proto.frame(out, wire.ok(rid))
        elif op == wire.OP_ADD:
            try:
                total = state.add(args[0], args[1])
            except StoreError as exc:
                conn.proto.frame(out, wire.error(rid, str(exc)))
                return
            conn.proto.frame(out, wire.ok_int(rid, total))
        elif op == wire.OP_COMPARE_SET:
            conn.proto.frame(out, wire.ok_value(rid, state.compare_set(*args)))
        elif op == wire.OP_MULTI_SET:
            state.multi_set(*args)
            conn.proto.frame(out, wire.ok(rid))
        else:
            state.append(args[0], args[1])
            conn.proto.frame(out, wire.ok(rid))
        self._budget.stored += sum(self._entry(k) for k in keys) - before
        if self._waiters:
            for key in keys:
                self._waiters.notify(key, self._state.missing, self._answer_parked)

    def _entry(self, key: bytes) -> int:
        """What ``key`` and its value cost against the budget (0 if missing)."""
        value = self._state.data.get(key)
        return 0 if value is None else len(key) + len(value) + ENTRY_OVERHEAD

    def admit(self, conn: Conn, rid: int, op: int, length: int) -> str | None:
        """Reserve room for a large frame from its header, or say why it is refused."""
        need = wire.HEADER_SIZE + length
        extra = max(0, need - conn.proto.buffered)
        used = self._budget.used
        if used + extra > self._budget.limit:
            _log.info(
                "store %s: refusing a %d-byte %s from %s: memory budget %d, in use %d",
                self._address,
                length,
                wire.OP_NAMES[op],
                conn.peer,
                self._budget.limit,
                used,
            )
            return (
                f"{wire.OP_NAMES[op]} request of {length} bytes refused: it would take the store "
                f"to {used + extra} bytes, over its memory budget of {self._budget.limit} bytes "
                f"({self._budget.usage()}); raise it with memory_limit= or {MEMORY_ENV}"
            )
        conn.reserved = need
        conn.recount(self._budget)
        return None

    def _answer(self, conn: Conn, rid: int, op: int, keys: Sequence[bytes]) -> None:
        """Reply OK to a GET / WAIT / MULTI_GET whose keys all exist (or ERROR if too big)."""
        data = self._state.data
        out = conn.out
        if op == wire.OP_WAIT:
            conn.proto.frame(out, wire.ok(rid))
            return
        if op == wire.OP_GET:
            value = data[keys[0]]
            size = len(value)
        else:
            values = [data[key] for key in keys]
            size = sum(len(v) + 4 for v in values) + 4
            if size > wire.MAX_BODY_BYTES:
                conn.proto.frame(
                    out,
                    wire.error(
                        rid,
                        f"multi_get of {len(keys)} keys totals {size} bytes, over the "
                        f"{wire.MAX_BODY_BYTES}-byte frame limit; get the keys one at a time",
                    ),
                )
                return
        used = self._budget.used
        if size > wire.ADMIT_THRESHOLD and used + size > self._budget.limit:
            conn.proto.frame(
                out,
                wire.error(
                    rid,
                    f"{wire.OP_NAMES[op]} reply of {size} bytes refused: it would take the store "
                    f"to {used + size} bytes, over its memory budget of {self._budget.limit} bytes "
                    f"({self._budget.usage()}); read earlier replies first, or raise the budget "
                    f"with memory_limit= or {MEMORY_ENV}",
                ),
            )
            return
        if op == wire.OP_GET:
            # Header and value appended apart: one copy of a large value, not two.
            conn.proto.frame(out, wire.ok_header(rid, size), value)
        else:
            conn.proto.frame(out, wire.ok_values(rid, values))
        conn.recount(self._budget)

    def _park(self, conn: Conn, rid: int, op: int, keys: list[bytes], timeout: float) -> None:
        """Park a request on missing keys, unless the connection or the budget is full."""
        if len(conn.parked) >= _MAX_PARKED:
            conn.proto.frame(
                conn.out,
                wire.error(
                    rid,
                    f"{wire.OP_NAMES[op]} refused: {_MAX_PARKED} blocking requests are already "
                    f"parked on this connection, the most one connection may park",
                ),
            )
            return
        missing = self._state.missing(keys)
        # The decoder clamped timeout into [0, FOREVER]; FOREVER means no deadline at all,
        # so no huge float ever reaches the heap or select().
        forever = timeout >= wire.FOREVER
        deadline = math.inf if forever else time.monotonic() + timeout
        waiter = Waiter(conn, rid, op, keys, missing[0], deadline)
        used = self._budget.used
        if used + waiter.cost > self._budget.limit:
            conn.proto.frame(
                conn.out,
                wire.error(
                    rid,
                    f"{wire.OP_NAMES[op]} of {len(keys)} keys refused: parking it costs "
                    f"{waiter.cost} bytes, which would take the store to {used + waiter.cost} "
                    f"bytes, over its memory budget of {self._budget.limit} bytes "
                    f"({self._budget.usage()})",
                ),
            )
            return
        self._waiters.park(waiter)

    def _answer_parked(self, waiter: Waiter) -> None:
        """Answer a parked request whose keys all exist now, and send the answer."""
        conn = waiter.conn
        self._answer(conn, waiter.rid, waiter.op, waiter.keys)
        self._flush(conn)

    def expire(self, now: float) -> None:
        """Answer TIMEOUT to every parked request whose deadline passed, naming its missing keys."""
        self._waiters.expire(now, self._timed_out)

    def _timed_out(self, waiter: Waiter) -> None:
        """Answer TIMEOUT to a withdrawn waiter, naming the keys still missing."""
        conn = waiter.conn
        conn.proto.frame(conn.out, wire.timed_out(waiter.rid, self._state.missing(waiter.keys)))
        self._flush(conn)
