"""In-memory key-value state, and HashStore, the in-process store built on it.

:class:`KVState` holds the semantics every store shares (torch.distributed's): the TCP
server and the FileStore replay apply their operations to one, so the rules for ``add`` on a
non-integer, ``compare_set`` on a missing key and so on are written once. It is not thread
safe; its owner serialises access (HashStore with a condition variable, the server by running
in one thread, FileStore under a file lock).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence

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

__all__ = ["HashStore", "KVState"]

_INT_RE = re.compile(rb"[+-]?[0-9]+\Z")
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def _show(key: bytes) -> str:
    return repr(key.decode(errors="replace"))


class KVState:
    """The key-value map and the operations on it; keys and values are bytes.

    Example:
        >>> state = KVState()
        >>> state.add(b"n", 2)
        2
        >>> state.compare_set(b"k", b"", b"v")
        b'v'
        >>> state.missing([b"k", b"x"])
        [b'x']
    """

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self.data)

    def set(self, key: bytes, value: bytes) -> None:
        """Set ``key`` to ``value``."""
        self.data[key] = value

    def get(self, key: bytes) -> bytes | None:
        """Return the value of ``key``, or None if it is missing."""
        return self.data.get(key)

    def add(self, key: bytes, amount: int) -> int:
        """Add ``amount`` to the decimal counter at ``key`` (missing counts as 0).

        Raises:
            StoreError: the key holds a non-integer, or the result leaves the int64 range.
        """
        old = self.data.get(key)
        if old is None:
            current = 0
        elif _INT_RE.match(old):
            current = int(old)
        else:
            raise StoreError(
                f"cannot add {amount} to store key {_show(key)}: it holds {old[:64]!r}, "
                f"not a decimal integer"
            )
        result = current + amount
        if not _INT64_MIN <= result <= _INT64_MAX:
            raise StoreError(
                f"cannot add {amount} to store key {_show(key)}: {current} + {amount} leaves "
                f"the signed 64-bit range"
            )
        self.data[key] = str(result).encode()
        return result

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        """Swap in ``desired`` if the value equals ``expected`` (missing equals b"").

        Returns:
            The value after the operation; ``expected`` for a missing key that stays missing.
        """
        old = self.data.get(key)
        if old is None:
            if expected:
                return expected
        elif old != expected:
            return old
        self.data[key] = desired
        return desired

    def missing(self, keys: Sequence[bytes]) -> list[bytes]:
        """Return the keys of ``keys`` that do not exist, in order."""
        data = self.data
        return [key for key in keys if key not in data]

    def delete(self, key: bytes) -> bool:
        """Delete ``key``; return True if it existed."""
        return self.data.pop(key, None) is not None

    def multi_set(self, keys: Sequence[bytes], values: Sequence[bytes]) -> None:
        """Set each key to the matching value."""
        self.data.update(zip(keys, values, strict=True))

    def append(self, key: bytes, value: bytes) -> None:
        """Append ``value`` to the bytes at ``key`` (created empty if missing)."""
        old = self.data.get(key)
        self.data[key] = value if old is None else old + value


class HashStore(Store):
    """A thread-safe store inside one process (tests, single-process jobs).

    Blocking ``get``/``wait`` sleep on a condition variable that every write notifies.

    Args:
        timeout: seconds (or ``timedelta``) that ``get``/``wait`` block; default
            :func:`~meshcomm.common.timeout.default_timeout`.

    Example:
        >>> store = HashStore(timeout=5)
        >>> store.set("k", b"v")
        >>> store.multi_get(["k"])
        [b'v']
        >>> store.compare_set("k", b"v", b"w")
        b'w'
    """

    def __init__(self, timeout: Timeout | None = None) -> None:
        super().__init__(timeout)
        self._state = KVState()
        self._cond = threading.Condition()

    def set(self, key: str, value: Value) -> None:
        k, v = encode_key(key), encode_value(value)
        with self._cond:
            self._state.set(k, v)
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        k = encode_key(key)
        with self._cond:
            self._wait_locked([k], [key], self._timeout)
            return self._state.data[k]

    def add(self, key: str, amount: int) -> int:
        k, amount = encode_key(key), check_amount(amount)
        with self._cond:
            result = self._state.add(k, amount)
            self._cond.notify_all()
        return result

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        k, e, d = encode_key(key), encode_value(expected), encode_value(desired)
        with self._cond:
            result = self._state.compare_set(k, e, d)
            self._cond.notify_all()
        return result

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        ks = encode_keys(keys)
        seconds = to_seconds(timeout, self._timeout)
        with self._cond:
            self._wait_locked(ks, list(keys), seconds)

    def check(self, keys: Sequence[str]) -> bool:
        ks = encode_keys(keys)
        with self._cond:
            return not self._state.missing(ks)

    def delete_key(self, key: str) -> bool:
        k = encode_key(key)
        with self._cond:
            return self._state.delete(k)

    def num_keys(self) -> int:
        with self._cond:
            return len(self._state)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        ks = encode_keys(keys)
        with self._cond:
            self._wait_locked(ks, list(keys), self._timeout)
            data = self._state.data
            return [data[k] for k in ks]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        ks = encode_keys(keys)
        vs = [encode_value(v) for v in values]
        if len(ks) != len(vs):
            raise InvalidArgument(f"multi_set got {len(ks)} keys but {len(vs)} values")
        with self._cond:
            self._state.multi_set(ks, vs)
            self._cond.notify_all()

    def append(self, key: str, value: Value) -> None:
        k, v = encode_key(key), encode_value(value)
        with self._cond:
            self._state.append(k, v)
            self._cond.notify_all()

    def _wait_locked(self, ks: list[bytes], names: Sequence[str], seconds: float) -> None:
        """Wait (condition held) until all ``ks`` exist, else raise StoreTimeout."""
        missing: Callable[[list[bytes]], list[bytes]] = self._state.missing
        if not missing(ks):
            return
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                absent = missing(ks)
                raise StoreTimeout(
                    f"HashStore: keys {show_keys(absent)} still missing after {seconds:g} s "
                    f"(waited for {len(names)} key(s))"
                )
            self._cond.wait(min(left, threading.TIMEOUT_MAX))
            if not missing(ks):
                return
