"""One client connection as the store server holds it: the socket, the protocol's state, the
unsent replies, the parked requests (:class:`Waiter`, indexed by the server in
:mod:`meshcomm.store._waiters`) and the bytes it counts against the memory budget.

Example:
    >>> import socket
    >>> a, b = socket.socketpair()
    >>> conn = Conn(a, "test peer")
    >>> conn.ready, conn.held, len(conn.out), conn.proto.in_handshake
    (False, 0, 0, True)
    >>> a.close(); b.close()
"""

from __future__ import annotations

import selectors
import socket
import time
from typing import TYPE_CHECKING

from meshcomm.store import wire
from meshcomm.store._budget import ENTRY_OVERHEAD, WAITER_OVERHEAD

if TYPE_CHECKING:
    from meshcomm.store._budget import MemoryBudget

__all__ = ["Conn", "Waiter"]


class Conn:
    """One client connection: socket, decoder, unsent replies, parked requests."""

    __slots__ = (
        "events",
        "flags",
        "held",
        "nonces",
        "out",
        "parked",
        "peer",
        "proto",
        "ready",
        "reserved",
        "since",
        "sock",
        "stalled",
    )

    def __init__(self, sock: socket.socket, peer: object) -> None:
        self.sock = sock
        self.peer = peer
        self.proto = wire.ServerConnection()
        # Bytes this connection counts against the budget (``out`` and input), and the size
        # of the large frame admitted and still arriving (counted whole from its header on).
        self.held = 0
        self.reserved = 0
        # The handshake: done (``ready``), when it began, the hello's flags, and the
        # (client, server) nonces while a proof is awaited.
        self.ready = False
        self.since = time.monotonic()
        self.flags = 0
        self.nonces = (b"", b"")
        self.out = bytearray()
        self.parked: set[Waiter] = set()
        self.events = selectors.EVENT_READ
        # Complete requests wait in ``proto`` because ``out`` is over the high-water mark;
        # the socket is not read until they are handled, so ``proto`` cannot grow.
        self.stalled = False

    def recount(self, budget: MemoryBudget) -> None:
        """Recount what this connection holds in ``budget``: unsent replies, and its input or
        admitted frame."""
        held = len(self.out) + max(self.proto.buffered, self.reserved)
        budget.io += held - self.held
        self.held = held


class Waiter:
    """A parked GET / WAIT / MULTI_GET, filed under one of its missing keys."""

    __slots__ = ("conn", "cost", "deadline", "done", "key", "keys", "op", "rid")

    def __init__(
        self, conn: Conn, rid: int, op: int, keys: list[bytes], key: bytes, deadline: float
    ) -> None:
        self.conn = conn
        self.rid = rid
        self.op = op
        self.keys = keys
        self.key = key
        self.deadline = deadline
        self.done = False
        self.cost = WAITER_OVERHEAD + sum(len(k) + ENTRY_OVERHEAD for k in keys)
