"""The key-value store interface that bootstraps every backend.

Keys are ``str``; values are ``bytes`` (a ``str`` value is accepted and UTF-8 encoded).
Every blocking call (``get``, ``wait``) waits at most the store's timeout, then raises
:class:`~meshcomm.errors.StoreTimeout` naming the missing keys.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from meshcomm.common.timeout import Timeout, to_seconds
from meshcomm.errors import InvalidArgument

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "Store",
    "Value",
    "check_amount",
    "encode_key",
    "encode_keys",
    "encode_value",
    "show_keys",
]

#: Largest key, in UTF-8 bytes, any store accepts.
MAX_KEY_BYTES = 4096
#: Largest value, in bytes, any store accepts (64 MiB).
MAX_VALUE_BYTES = 64 * 1024 * 1024

Value = bytes | bytearray | memoryview | str


def encode_key(key: str) -> bytes:
    """Validate a key and return its UTF-8 bytes.

    Raises:
        InvalidArgument: the key is not a str, or is empty or longer than ``MAX_KEY_BYTES``.

    Example:
        >>> encode_key("rank/0")
        b'rank/0'
    """
    if not isinstance(key, str):
        raise InvalidArgument(f"store keys must be str, got {type(key).__name__} {key!r}")
    raw = key.encode()
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise InvalidArgument(
            f"store key must have 1 to {MAX_KEY_BYTES} UTF-8 bytes, got {len(raw)}: {key[:64]!r}"
        )
    return raw


def encode_keys(keys: Sequence[str]) -> list[bytes]:
    """Validate a sequence of keys and return their UTF-8 bytes.

    A lone ``str`` is refused rather than read as a sequence of one-letter keys.

    Raises:
        InvalidArgument: ``keys`` is a single str/bytes, or one of the keys is invalid.

    Example:
        >>> encode_keys(["a", "b"])
        [b'a', b'b']
    """
    if isinstance(keys, (str, bytes, bytearray)):
        raise InvalidArgument(f"keys must be a sequence of str such as a list, got {keys!r:.64}")
    return [encode_key(key) for key in keys]


def check_amount(amount: int) -> int:
    """Validate the amount of an ``add``: an int that fits a signed 64-bit counter.

    Raises:
        TypeError: ``amount`` is not an int.
        InvalidArgument: ``amount`` is outside the signed 64-bit range.

    Example:
        >>> check_amount(-3)
        -3
    """
    if not isinstance(amount, int) or isinstance(amount, bool):
        raise TypeError(f"store add amount must be an int, got {type(amount).__name__} {amount!r}")
    if not -(2**63) <= amount < 2**63:
        raise InvalidArgument(f"store add amount must fit in a signed 64-bit int, got {amount}")
    return amount


def show_keys(keys: Sequence[str] | Sequence[bytes], limit: int = 8) -> str:
    """Format keys for an error message, at most ``limit`` of them.

    Example:
        >>> show_keys(["a", "b"])
        "'a', 'b'"
    """
    shown = [k.decode(errors="replace") if isinstance(k, bytes) else k for k in keys[:limit]]
    text = ", ".join(repr(k) for k in shown)
    if len(keys) > limit:
        text += f" and {len(keys) - limit} more"
    return text


def encode_value(value: Value) -> bytes:
    """Return a value as bytes (a str is UTF-8 encoded).

    Raises:
        InvalidArgument: the value is not bytes-like or str, or exceeds ``MAX_VALUE_BYTES``.

    Example:
        >>> encode_value("héllo")
        b'h\\xc3\\xa9llo'
    """
    if isinstance(value, str):
        raw = value.encode()
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
    else:
        raise InvalidArgument(
            f"store values must be bytes or str, got {type(value).__name__} {value!r:.64}"
        )
    if len(raw) > MAX_VALUE_BYTES:
        raise InvalidArgument(
            f"store value must be at most {MAX_VALUE_BYTES} bytes, got {len(raw)}"
        )
    return raw


class Store(ABC):
    """A key-value store shared by every rank of a job.

    Subclasses: :class:`~meshcomm.store.TCPStore`, :class:`~meshcomm.store.FileStore`,
    :class:`~meshcomm.store.HashStore`, :class:`~meshcomm.store.PrefixStore`.

    Example:
        >>> from meshcomm.store import HashStore
        >>> store = HashStore()
        >>> store.set("answer", "42")
        >>> store.get("answer")
        b'42'
        >>> store.add("counter", 5)
        5
    """

    def __init__(self, timeout: Timeout | None = None) -> None:
        self._timeout = to_seconds(timeout)

    @property
    def timeout(self) -> float:
        """Seconds that ``get`` and ``wait`` block before raising ``StoreTimeout``."""
        return self._timeout

    def set_timeout(self, timeout: Timeout) -> None:
        """Set the timeout of ``get`` and ``wait`` (seconds or ``timedelta``)."""
        self._timeout = to_seconds(timeout)

    @abstractmethod
    def set(self, key: str, value: Value) -> None:
        """Set ``key`` to ``value``, replacing any previous value."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Return the value of ``key``, blocking until it exists (up to the timeout).

        Raises:
            StoreTimeout: the key did not appear within the timeout; names the key.
        """

    @abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer counter at ``key`` (created at 0).

        The counter is stored as its decimal ASCII text, so ``get`` returns e.g. ``b"5"``.

        Returns:
            The counter's new value.

        Raises:
            StoreError: ``key`` holds a value that is not a decimal integer, or the counter
                would leave the signed 64-bit range.
        """

    @abstractmethod
    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Atomically set ``key`` to ``desired`` if its value equals ``expected``.

        A missing key counts as matching an empty ``expected``. As in torch.distributed, a
        missing key with a non-empty ``expected`` is left missing and ``expected`` is returned.

        Returns:
            The value of ``key`` after the operation (``desired`` if it was swapped in).
        """

    @abstractmethod
    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        """Block until every key in ``keys`` exists.

        Raises:
            StoreTimeout: some keys were still missing after the timeout; names them.
        """

    @abstractmethod
    def check(self, keys: Sequence[str]) -> bool:
        """Return True if every key in ``keys`` exists, without blocking."""

    @abstractmethod
    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return True if it existed."""

    @abstractmethod
    def num_keys(self) -> int:
        """Return the number of keys in the store."""

    @abstractmethod
    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Return the values of ``keys``, blocking until all exist (up to the timeout)."""

    @abstractmethod
    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set each key to the matching value, atomically as a batch."""

    @abstractmethod
    def append(self, key: str, value: Value) -> None:
        """Append ``value`` to the bytes at ``key`` (created empty if missing)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most stores hold nothing
        """Release connections and files this store holds. Idempotent."""

    def stop_reconnecting(self) -> None:  # noqa: B027 - optional hook, as close
        """Make a lost connection final: later calls fail at once instead of reconnecting.

        A rank leaving its world calls this first, so that leaving never waits out the
        timeout on a store whose host is gone. Stores without a connection ignore it.
        """

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
