"""Key-value stores that bootstrap every backend (torch.distributed's Store semantics).

- :class:`TCPStore`: a server (in the master rank, or :class:`StoreServer` in a launcher)
  and its clients over TCP; for jobs across processes and hosts.
- :class:`FileStore`: one file shared by processes that see the same filesystem.
- :class:`HashStore`: in one process (threads, tests).
- :class:`PrefixStore`: a namespaced view of another store.

See ``docs/store.md`` for the wire protocol, limits and security notes.

Example:
    >>> from meshcomm.store import HashStore, PrefixStore
    >>> store = PrefixStore("job", HashStore(timeout=5))
    >>> store.add("arrived", 1)
    1
"""

from __future__ import annotations

from meshcomm.store.base import MAX_KEY_BYTES, MAX_VALUE_BYTES, Store
from meshcomm.store.file import FileStore
from meshcomm.store.memory import HashStore
from meshcomm.store.prefix import PrefixStore
from meshcomm.store.server import StoreServer
from meshcomm.store.tcp import TCPStore

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "Store",
    "StoreServer",
    "TCPStore",
]
