"""Key-value stores with torch's constructors: ``TCPStore``, ``FileStore``, ``HashStore``,
``PrefixStore``.

Each is a meshcomm store (so it can be given to ``init_process_group(store=...)`` or to
meshcomm directly) whose constructor takes torch's parameters, and whose methods raise
:class:`~meshcomm.distributed.DistStoreError` (a ``RuntimeError``, as torch) on failure.
Differences: ``timeout`` is in seconds (a float) rather than a ``timedelta`` (``set_timeout``
accepts both); there are no queues (``queue_push``/``queue_pop``/``queue_len``) and no
``list_keys``.

Example:
    >>> store = HashStore()
    >>> store.set("key", "value"); store.get("key"), store.add("n", 2), store.has_extended_api()
    (b'value', 2, True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from meshcomm.distributed._errors import public
from meshcomm.store import FileStore as _FileStore
from meshcomm.store import HashStore as _HashStore
from meshcomm.store import PrefixStore as _PrefixStore
from meshcomm.store import TCPStore as _TCPStore
from meshcomm.store.base import Store

__all__ = ["FileStore", "HashStore", "PrefixStore", "Store", "TCPStore"]

_C = TypeVar("_C", bound=type)

# The Store methods whose meshcomm errors become DistStoreError.
_METHODS = (
    "set",
    "get",
    "add",
    "compare_set",
    "wait",
    "check",
    "delete_key",
    "num_keys",
    "multi_get",
    "multi_set",
    "append",
    "set_timeout",
)


def _torch_errors(cls: _C) -> _C:
    """Wrap the store methods of ``cls`` so meshcomm errors leave as ``DistStoreError``."""
    for name in _METHODS:
        method: Callable[..., Any] = getattr(cls, name)
        setattr(cls, name, functools.wraps(method)(public(method)))
    cls.has_extended_api = lambda self: True  # type: ignore[attr-defined]
    return cls


def _world_size(world_size: int | None) -> int | None:
    return None if world_size is None or world_size < 0 else world_size


@_torch_errors
class TCPStore(_TCPStore):
    """A TCP key-value store, as ``torch.distributed.TCPStore``.

    Args:
        host_name: the server's host.
        port: the server's port (0 on the master: pick a free one; read it from ``.port``).
        world_size: the number of store users the master waits for (None: don't count).
        is_master: run the server in this process.
        timeout: for connecting and for ``get``/``wait``.
        wait_for_workers: the master waits for ``world_size`` users before returning.
        multi_tenant: ignored (every meshcomm server is private to its store).
        master_listen_fd: must be None (meshcomm binds its own socket).
        use_libuv: ignored.

    Example:
        >>> master = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
        >>> master.set("k", b"v"); master.get("k")
        b'v'
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta = timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
    ) -> None:
        if master_listen_fd is not None:
            raise ValueError("master_listen_fd is not supported: meshcomm binds its own socket")
        public(_TCPStore.__init__)(
            self, host_name, port, _world_size(world_size), is_master, timeout, wait_for_workers
        )

    @property
    def libuvBackend(self) -> bool:
        """False: meshcomm's server is pure Python."""
        return False


@_torch_errors
class FileStore(_FileStore):
    """A store in one file shared by the processes, as ``torch.distributed.FileStore``.

    Args:
        file_name: the file's path.
        world_size: number of users (-1: not fixed).

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> store = FileStore(path, 1); store.set("k", "v"); store.get("k")
        b'v'
        >>> store.close()
    """

    def __init__(self, file_name: str, world_size: int = -1) -> None:
        public(_FileStore.__init__)(self, file_name, _world_size(world_size))


@_torch_errors
class HashStore(_HashStore):
    """An in-process store (threads share it), as ``torch.distributed.HashStore``."""

    def __init__(self) -> None:
        super().__init__()


@_torch_errors
class PrefixStore(_PrefixStore):
    """A view of ``store`` that puts ``prefix + "/"`` before every key.

    Args:
        prefix: the prefix.
        store: a meshcomm store, or a torch store (wrapped).

    Example:
        >>> base = HashStore()
        >>> PrefixStore("job", base).set("k", "v"); base.get("job/k")
        b'v'
    """

    def __init__(self, prefix: str, store: Any) -> None:
        if not isinstance(store, Store):
            from meshcomm.store.torch_adapter import TorchStore

            store = TorchStore(store)
        super().__init__(prefix, store)
