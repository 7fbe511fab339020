"""A rank's mailbox in the job's store: numbered requests to one rank, and their answers.

Every rank with a store reads its mailbox in a daemon thread (the responder,
:mod:`meshcomm.diagnostics.responder`); anyone who has the store writes to it: a rank that
timed out asks where the others are, the tcp backend's alarm announces a mismatch
(:mod:`meshcomm.backends.tcp.alarm`). Only the keys live here, below both, so the backend
writes a request without importing the diagnostics that read it. Keys::

    meshcomm/ask/<rank>          request counter
    meshcomm/ask/<rank>/<n>      request n
    meshcomm/head/<rank>/<n>     answer n

Example:
    >>> from meshcomm.store import HashStore
    >>> store = HashStore(timeout=5)
    >>> n = ask(store, 3, b"?")
    >>> n, store.get(ask_key(3, n)), answer_key(3, n)
    (1, b'?', 'meshcomm/head/3/1')
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshcomm.store.base import Store

__all__ = ["answer_key", "ask", "ask_key"]

_PREFIX = "meshcomm/"


def ask_key(rank: int, n: int) -> str:
    """The key of request ``n`` to ``rank``."""
    return f"{_PREFIX}ask/{rank}/{n}"


def answer_key(rank: int, n: int) -> str:
    """The key of the answer to request ``n`` of ``rank``."""
    return f"{_PREFIX}head/{rank}/{n}"


def ask(store: Store, rank: int, what: bytes = b"?") -> int:
    """Send ``what`` to ``rank``'s mailbox; return the request's number (its answer's key is
    :func:`answer_key` of it)."""
    n = store.add(f"{_PREFIX}ask/{rank}", 1)
    store.set(ask_key(rank, n), what)
    return n
