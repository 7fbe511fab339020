"""TorchStore: a meshcomm :class:`~meshcomm.store.base.Store` over a torch.distributed store.

Under ``torchrun`` the elastic agent already serves torch's own TCPStore at
``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``): the port is taken and
speaks torch's protocol, not meshcomm's. :meth:`TorchStore.connect` joins it as a client
through torch itself (imported only then), so meshcomm's rendezvous runs on the agent's store.

Semantics are torch's, which meshcomm's stores copy: values are bytes in and out,
``compare_set`` on a missing key with a non-empty ``expected`` leaves it missing, ``add``
keeps a decimal counter. Torch errors become :class:`~meshcomm.errors.StoreError`, and a
``get``/``wait``/``multi_get`` that ran out of time becomes
:class:`~meshcomm.errors.StoreTimeout` naming the keys. One difference: torch's server drops
the connection of a client that ``add``s to a non-integer value, so that store is unusable
afterwards (every later call raises StoreError).

Example:
    >>> import torch.distributed as dist
    >>> server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    >>> store = TorchStore.connect("127.0.0.1", server.port, timeout=10)
    >>> store.set("k", "v")
    >>> store.get("k"), store.compare_set("k", "v", b"w"), store.add("n", 3)
    (b'v', b'w', 3)
    >>> store.close()
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from meshcomm.common.timeout import Timeout, to_seconds
from meshcomm.errors import InvalidArgument, StoreError, StoreTimeout
from meshcomm.store.base import (
    Store,
    Value,
    check_amount,
    encode_key,
    encode_keys,
    encode_value,
    show_keys,
)

__all__ = ["TorchStore"]

_T = TypeVar("_T")


def _delta(seconds: float) -> timedelta:
    # torch counts in whole milliseconds, and 0 ms would mean "no timeout" to a socket.
    return timedelta(milliseconds=max(1, math.ceil(seconds * 1000)))


class TorchStore(Store):
    """Wrap a ``torch.distributed.Store`` (a TCPStore client, usually) as a meshcomm Store.

    Args:
        store: the torch store.
        timeout: seconds or ``timedelta`` for ``get``/``wait``; None keeps the torch store's.
        address: where the store lives, for error messages.

    Example:
        >>> import torch.distributed as dist
        >>> store = TorchStore(dist.HashStore(), timeout=5)
        >>> store.multi_set(["a", "b"], [b"1", "2"])
        >>> store.multi_get(["a", "b"])
        [b'1', b'2']
    """

    def __init__(self, store: Any, timeout: Timeout | None = None, address: str = "") -> None:
        if timeout is None:
            timeout = store.timeout
        super().__init__(timeout)
        self._store: Any = store
        self._address = address or type(store).__name__
        store.set_timeout(_delta(self._timeout))

    @classmethod
    def connect(cls, host: str, port: int, timeout: Timeout | None = None) -> TorchStore:
        """Connect to the torch TCPStore served at ``host:port`` (retrying until the timeout).

        Args:
            host: the server's host name or address.
            port: the server's port.
            timeout: seconds or ``timedelta`` for connecting and for ``get``/``wait``.

        Raises:
            InvalidArgument: bad host, port or timeout (before any I/O).
            StoreError: torch is not installed, or no server answered within the timeout.
        """
        seconds = to_seconds(timeout)
        if not isinstance(host, str) or not host.strip():
            raise InvalidArgument(f"host must be a non-empty str, got {host!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise InvalidArgument(f"port must be an int in [1, 65535], got {port!r}")
        try:
            import torch.distributed as dist
        except ImportError as exc:
            raise StoreError(
                f"connecting to the torch TCPStore at {host}:{port} needs torch "
                f"(pip install meshcomm[torch]): {exc}"
            ) from exc
        if not dist.is_available():
            raise StoreError(f"this torch build has no torch.distributed (store {host}:{port})")
        try:
            store = dist.TCPStore(
                host_name=host,
                port=port,
                world_size=None,
                is_master=False,
                timeout=_delta(seconds),
                wait_for_workers=False,
            )
        except RuntimeError as exc:
            raise StoreError(
                f"no torch TCPStore answered at {host}:{port} within {seconds:g} s: {_text(exc)}"
            ) from exc
        return cls(store, seconds, address=f"{host}:{port}")

    @property
    def authenticated(self) -> bool:
        """Always False: torch's TCPStore has no authentication."""
        return False

    @property
    def torch_store(self) -> Any:
        """The wrapped torch store.

        Raises:
            StoreError: the store was closed.
        """
        if self._store is None:
            raise StoreError(f"the torch store at {self._address} is closed")
        return self._store

    def set_timeout(self, timeout: Timeout) -> None:
        super().set_timeout(timeout)
        self._call("set_timeout", lambda s: s.set_timeout(_delta(self._timeout)))

    def _call(
        self, what: str, op: Callable[[Any], _T], keys: Sequence[str] = (), wait: float = 0.0
    ) -> _T:
        """Run ``op`` on the torch store; map torch's errors (``wait``: seconds it may block)."""
        store = self.torch_store
        try:
            return op(store)
        except RuntimeError as exc:  # torch's DistError family derives from RuntimeError
            text = _text(exc)
            if wait and type(exc).__name__ == "DistStoreError" and "timeout" in text.lower():
                raise StoreTimeout(
                    f"torch store at {self._address}: keys {show_keys(list(keys))} still "
                    f"missing after {wait:g} s"
                ) from exc
            raise StoreError(f"torch store at {self._address}: {what} failed: {text}") from exc

    def set(self, key: str, value: Value) -> None:
        encode_key(key)
        raw = encode_value(value)
        self._call("set", lambda s: s.set(key, raw))

    def get(self, key: str) -> bytes:
        encode_key(key)
        return bytes(self._call("get", lambda s: s.get(key), [key], self._timeout))

    def add(self, key: str, amount: int) -> int:
        encode_key(key)
        amount = check_amount(amount)
        return int(self._call("add", lambda s: s.add(key, amount)))

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        encode_key(key)
        old, new = encode_value(expected), encode_value(desired)
        return bytes(self._call("compare_set", lambda s: s.compare_set(key, old, new)))

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        encode_keys(keys)
        names, seconds = list(keys), to_seconds(timeout, self._timeout)
        self._call("wait", lambda s: s.wait(names, _delta(seconds)), names, seconds)

    def check(self, keys: Sequence[str]) -> bool:
        encode_keys(keys)
        names = list(keys)
        return bool(self._call("check", lambda s: s.check(names)))

    def delete_key(self, key: str) -> bool:
        encode_key(key)
        return bool(self._call("delete_key", lambda s: s.delete_key(key)))

    def num_keys(self) -> int:
        return int(self._call("num_keys", lambda s: s.num_keys()))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        encode_keys(keys)
        names = list(keys)
        values = self._call("multi_get", lambda s: s.multi_get(names), names, self._timeout)
        return [bytes(v) for v in values]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        encode_keys(keys)
        raws = [encode_value(v) for v in values]
        if len(keys) != len(raws):
            raise InvalidArgument(f"multi_set got {len(keys)} keys but {len(raws)} values")
        names = list(keys)
        self._call("multi_set", lambda s: s.multi_set(names, raws))

    def append(self, key: str, value: Value) -> None:
        encode_key(key)
        raw = encode_value(value)
        self._call("append", lambda s: s.append(key, raw))

    def clone(self) -> TorchStore:
        """A second connection to the same store (torch's ``Store.clone``), for a thread that
        blocks in it.

        Raises:
            StoreError: this store is closed, or torch's store cannot be cloned (a
                ``HashStore`` can: the clone shares its keys).
        """
        if self._store is None:
            raise StoreError(f"{self._address}: the store is closed")
        try:
            copy = self._store.clone()
        except Exception as exc:  # torch raises RuntimeError for stores without clone()
            raise StoreError(f"{self._address}: cannot clone the store: {exc}") from exc
        return TorchStore(copy, timeout=self._timeout, address=self._address)

    def close(self) -> None:
        """Drop the torch store; torch closes its connection when the last reference goes."""
        self._store = None

    def __repr__(self) -> str:
        state = " closed" if self._store is None else ""
        return f"<TorchStore {self._address}{state}>"


def _text(exc: BaseException) -> str:
    # torch appends C++ frames to some messages; the first line carries the reason.
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]
