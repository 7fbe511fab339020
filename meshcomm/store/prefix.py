"""PrefixStore: a view of another store with every key under ``prefix/``."""

from __future__ import annotations

from collections.abc import Sequence

from meshcomm.common.timeout import Timeout
from meshcomm.errors import InvalidArgument
from meshcomm.store.base import Store, Value, encode_key, encode_keys

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Wrap ``store`` so that key ``k`` becomes ``prefix + "/" + k`` (as in torch).

    The timeout is the wrapped store's. ``num_keys`` counts every key of the wrapped store,
    as torch's does. ``close`` leaves the wrapped store open: whoever made it closes it.

    Args:
        prefix: the namespace; a non-empty str.
        store: the store to wrap (another PrefixStore nests the prefixes).

    Example:
        >>> from meshcomm.store import HashStore
        >>> base = HashStore(timeout=5)
        >>> job = PrefixStore("job1", base)
        >>> job.set("rank0", "ready")
        >>> base.get("job1/rank0")
        b'ready'
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise InvalidArgument(f"PrefixStore prefix must be a non-empty str, got {prefix!r}")
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore wraps a meshcomm Store, got {type(store).__name__}")
        # No super().__init__: the timeout lives in the wrapped store.
        self._prefix = prefix + "/"
        self._store = store

    @property
    def prefix(self) -> str:
        """The prefix, without the trailing slash."""
        return self._prefix[:-1]

    @property
    def underlying_store(self) -> Store:
        """The wrapped store."""
        return self._store

    @property
    def timeout(self) -> float:
        """The wrapped store's timeout in seconds."""
        return self._store.timeout

    def set_timeout(self, timeout: Timeout) -> None:
        """Set the wrapped store's timeout."""
        self._store.set_timeout(timeout)

    def _key(self, key: str) -> str:
        encode_key(key)  # reject a bad key under its own name, not the prefixed one
        return self._prefix + key

    def _keys(self, keys: Sequence[str]) -> list[str]:
        encode_keys(keys)
        return [self._prefix + key for key in keys]

    def set(self, key: str, value: Value) -> None:
        self._store.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self._store.get(self._key(key))

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._key(key), amount)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return self._store.compare_set(self._key(key), expected, desired)

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        self._store.wait(self._keys(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self._store.check(self._keys(keys))

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self._store.num_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._store.multi_get(self._keys(keys))

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        self._store.multi_set(self._keys(keys), values)

    def append(self, key: str, value: Value) -> None:
        self._store.append(self._key(key), value)

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self._store!r})"
