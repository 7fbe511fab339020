"""FileStore: a store in one file shared by processes on a machine (or a shared filesystem).

The file is an append-only log. It starts with the 8-byte magic ``b"MCFSLOG1"``; then each
record is ``u8 kind | u32 key length | u32 value length | key | value`` (big-endian), kind
being SET, DELETE, APPEND, OPEN or CLOSE. Every store replays the log into a
:class:`~meshcomm.store.memory.KVState`, reading only what was appended since its last look.
Writers hold an exclusive ``flock`` on the file (a whole record, or a whole ``multi_set``
batch, goes out in one ``write``); readers hold a shared one, so nobody sees half a record.
``add`` and ``compare_set`` read, decide and append under one exclusive lock, so they are
atomic across processes. A blocking ``get`` polls with sleeps growing from 0.5 ms to 20 ms.

Cleanup follows torch: each store appends OPEN when made and CLOSE when closed; when a
CLOSE leaves no store open and at least ``world_size`` stores have closed, that last closer
deletes the file. Without ``world_size`` the file is never deleted. ``flock`` locks are per
open file, so two FileStores in one process exclude each other as two processes do; they
may not work on every network filesystem.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
from collections.abc import Iterator, Sequence

from meshcomm.common.timeout import Timeout, to_seconds
from meshcomm.errors import InvalidArgument, StoreError, StoreTimeout
from meshcomm.store.base import (
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    Store,
    Value,
    check_amount,
    encode_key,
    encode_keys,
    encode_value,
    show_keys,
)
from meshcomm.store.memory import KVState

__all__ = ["FILE_MAGIC", "FileStore"]

FILE_MAGIC = b"MCFSLOG1"
_RECORD = struct.Struct("!BII")
_SET, _DELETE, _APPEND, _OPEN, _CLOSE = 1, 2, 3, 4, 5
_POLL_FIRST = 0.0005
_POLL_MAX = 0.02


def _record(kind: int, key: bytes = b"", value: bytes = b"") -> bytes:
    return _RECORD.pack(kind, len(key), len(value)) + key + value


class FileStore(Store):
    """A store in a file, shared by every process that opens the same path.

    Args:
        path: the file; created if missing (its directory must exist).
        world_size: the number of stores (ranks) that will use the file; once that many
            have closed and none is open, the last one deletes the file. None keeps it.
        timeout: seconds (or ``timedelta``) that ``get``/``wait`` block; default
            :func:`~meshcomm.common.timeout.default_timeout`.

    Raises:
        StoreError: the file cannot be opened, or is not a FileStore log.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> a, b = FileStore(path, world_size=2, timeout=5), FileStore(path, world_size=2)
        >>> a.set("k", "v"); b.get("k")
        b'v'
        >>> a.close(); b.close(); os.path.exists(path)
        False
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        world_size: int | None = None,
        timeout: Timeout | None = None,
    ) -> None:
        super().__init__(timeout)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"FileStore path must be a str or path-like, got {path!r}")
        if world_size is not None and (
            not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1
        ):
            raise InvalidArgument(
                f"FileStore world_size must be a positive int or None, got {world_size!r}"
            )
        self._path = os.fspath(path)
        self._world_size = world_size
        self._mutex = threading.Lock()
        self._fd = -1
        self._reset_replay()
        self._open()

    @property
    def path(self) -> str:
        """The file this store lives in."""
        return self._path

    # --- the Store interface ---------------------------------------------------------------

    def set(self, key: str, value: Value) -> None:
        k, v = encode_key(key), encode_value(value)
        with self._exclusive():
            self._commit(_record(_SET, k, v))
            self._state.set(k, v)

    def get(self, key: str) -> bytes:
        k = encode_key(key)
        return self._poll([k], [key], self._timeout)[0]

    def add(self, key: str, amount: int) -> int:
        k, amount = encode_key(key), check_amount(amount)
        with self._exclusive():
            # KVState.add refuses a non-integer before changing anything; a failed commit
            # resets the replay, so the local state never runs ahead of the log.
            total = self._state.add(k, amount)
            self._commit(_record(_SET, k, str(total).encode()))
        return total

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        k, e, d = encode_key(key), encode_value(expected), encode_value(desired)
        with self._exclusive():
            old = self._state.get(k)
            if (old is None and not e) or (old is not None and old == e):
                self._commit(_record(_SET, k, d))
            return self._state.compare_set(k, e, d)

    def wait(self, keys: Sequence[str], timeout: Timeout | None = None) -> None:
        ks = encode_keys(keys)
        self._poll(ks, list(keys), to_seconds(timeout, self._timeout))

    def check(self, keys: Sequence[str]) -> bool:
        ks = encode_keys(keys)
        with self._shared():
            return not self._state.missing(ks)

    def delete_key(self, key: str) -> bool:
        k = encode_key(key)
        with self._exclusive():
            if self._state.get(k) is None:
                return False
            self._commit(_record(_DELETE, k))
            return self._state.delete(k)

    def num_keys(self) -> int:
        with self._shared():
            return len(self._state)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        ks = encode_keys(keys)
        return self._poll(ks, list(keys), self._timeout)

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        ks = encode_keys(keys)
        vs = [encode_value(v) for v in values]
        if len(ks) != len(vs):
            raise InvalidArgument(f"multi_set got {len(ks)} keys but {len(vs)} values")
        with self._exclusive():
            self._commit(b"".join(_record(_SET, k, v) for k, v in zip(ks, vs, strict=True)))
            self._state.multi_set(ks, vs)

    def append(self, key: str, value: Value) -> None:
        k, v = encode_key(key), encode_value(value)
        with self._exclusive():
            self._commit(_record(_APPEND, k, v))
            self._state.append(k, v)

    def close(self) -> None:
        """Record this store's departure; the last of ``world_size`` deletes the file."""
        with self._mutex:
            fd = self._fd
            if fd < 0:
                return
            try:
                self._flock(fd, fcntl.LOCK_EX)
                self._refresh()
                self._commit(_record(_CLOSE))
                self._closes += 1
                if (
                    self._world_size is not None
                    and self._opens - self._closes <= 0
                    and self._closes >= self._world_size
                ):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._path)
            finally:
                self._fd = -1
                os.close(fd)  # also releases the lock

    def __repr__(self) -> str:
        return f"FileStore({self._path!r}, world_size={self._world_size})"

    # --- the log ---------------------------------------------------------------------------

    def _reset_replay(self) -> None:
        self._state = KVState()
        self._offset = 0
        self._opens = 0
        self._closes = 0

    def _open(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        while True:
            try:
                fd = os.open(self._path, flags, 0o600)
            except OSError as exc:
                raise StoreError(f"cannot open FileStore {self._path!r}: {exc}") from exc
            try:
                self._flock(fd, fcntl.LOCK_EX)
                # The last user may have deleted the file between our open and our lock; then
                # this descriptor points at a dead file and a fresh one must be made.
                mine = os.fstat(fd)
                try:
                    named = os.stat(self._path)
                except FileNotFoundError:
                    named = None
                if named is None or (named.st_ino, named.st_dev) != (mine.st_ino, mine.st_dev):
                    os.close(fd)
                    continue
                if mine.st_size == 0:
                    os.write(fd, FILE_MAGIC)
                self._fd = fd
                self._refresh()
                self._commit(_record(_OPEN))
                self._opens += 1
                fcntl.flock(fd, fcntl.LOCK_UN)
                return
            except BaseException:
                self._fd = -1
                os.close(fd)
                raise

    def _flock(self, fd: int, kind: int) -> None:
        """Take ``kind`` on ``fd``; poll (timeout bounded) if another process holds it."""
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        deadline = time.monotonic() + self._timeout
        delay = 0.00005
        while True:
            time.sleep(delay)
            try:
                fcntl.flock(fd, kind | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StoreTimeout(
                        f"FileStore {self._path!r}: could not lock the file within "
                        f"{self._timeout:g} s (is a process holding it stopped?)"
                    ) from None
                delay = min(delay * 2, 0.005)

    @contextlib.contextmanager
    def _locked(self, kind: int) -> Iterator[None]:
        with self._mutex:
            if self._fd < 0:
                raise StoreError(f"FileStore {self._path!r} is closed")
            self._flock(self._fd, kind)
            try:
                self._refresh()
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _exclusive(self) -> contextlib.AbstractContextManager[None]:
        return self._locked(fcntl.LOCK_EX)

    def _shared(self) -> contextlib.AbstractContextManager[None]:
        return self._locked(fcntl.LOCK_SH)

    def _commit(self, data: bytes) -> None:
        """Append ``data`` (exclusive lock held, replay up to date) and move past it."""
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            # Whatever part went out, the log now says more than our replay: replay afresh.
            self._reset_replay()
            raise StoreError(f"FileStore {self._path!r}: write failed: {exc}") from exc
        self._offset += len(data)

    def _refresh(self) -> None:
        """Apply the records appended since the last look (a lock held)."""
        size = os.fstat(self._fd).st_size
        if size == self._offset:
            return
        data = os.pread(self._fd, size - self._offset, self._offset)
        pos = 0
        if self._offset == 0:
            if data[: len(FILE_MAGIC)] != FILE_MAGIC:
                raise StoreError(
                    f"{self._path!r} is not a meshcomm FileStore log (it starts with "
                    f"{data[:8]!r}, not {FILE_MAGIC!r})"
                )
            pos = len(FILE_MAGIC)
        store = self._state.data
        end = len(data)
        while pos < end:
            if pos + _RECORD.size > end:
                break
            kind, klen, vlen = _RECORD.unpack_from(data, pos)
            stop = pos + _RECORD.size + klen + vlen
            if klen > MAX_KEY_BYTES or vlen > MAX_VALUE_BYTES or stop > end:
                break
            key = data[pos + _RECORD.size : pos + _RECORD.size + klen]
            if kind == _SET:
                store[key] = data[stop - vlen : stop]
            elif kind == _APPEND:
                store[key] = store.get(key, b"") + data[stop - vlen : stop]
            elif kind == _DELETE:
                store.pop(key, None)
            elif kind == _OPEN:
                self._opens += 1
            elif kind == _CLOSE:
                self._closes += 1
            else:
                break
            pos = stop
        if pos != end:
            raise StoreError(
                f"FileStore {self._path!r} is corrupt at byte {self._offset + pos} "
                f"(a truncated or unknown record); delete the file to start afresh"
            )
        self._offset = size

    def _poll(self, ks: list[bytes], names: list[str], seconds: float) -> list[bytes]:
        """Return the values of ``ks`` once all exist, polling until ``seconds`` pass."""
        deadline = time.monotonic() + seconds
        delay = _POLL_FIRST
        while True:
            with self._shared():
                missing = self._state.missing(ks)
                if not missing:
                    data = self._state.data
                    return [data[k] for k in ks]
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreTimeout(
                    f"FileStore {self._path!r}: keys {show_keys(missing)} still missing after "
                    f"{seconds:g} s (waited for {len(names)} key(s))"
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, _POLL_MAX)
