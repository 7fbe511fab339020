"""FileStore specifics: cleanup after world_size closes, foreign and corrupt files, closing."""

from __future__ import annotations

import multiprocessing
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest

from meshcomm.errors import InvalidArgument, StoreError, StoreTimeout
from meshcomm.store import FileStore
from meshcomm.store.file import FILE_MAGIC

TIMEOUT = 5.0


def test_file_removed_after_world_size_stores_close(tmp_path: Path) -> None:
    path = tmp_path / "store"
    a = FileStore(path, world_size=2, timeout=TIMEOUT)
    b = FileStore(str(path), world_size=2, timeout=TIMEOUT)
    a.set("k", b"v")
    a.close()
    assert path.exists()  # b is still open
    assert b.get("k") == b"v"
    b.close()
    assert not path.exists()
    # The path is free for a fresh store that starts empty.
    c = FileStore(path, world_size=1, timeout=TIMEOUT)
    assert c.num_keys() == 0
    c.close()
    assert not path.exists()


def test_file_kept_until_world_size_have_closed(tmp_path: Path) -> None:
    path = tmp_path / "store"
    first = FileStore(path, world_size=3, timeout=TIMEOUT)
    first.close()  # none open, but only 1 of 3 closed: a late joiner must still find it
    assert path.exists()
    late = [FileStore(path, world_size=3, timeout=TIMEOUT) for _ in range(2)]
    late[0].close()
    assert path.exists()
    late[1].close()
    assert not path.exists()


def test_file_kept_without_world_size(tmp_path: Path) -> None:
    path = tmp_path / "store"
    store = FileStore(path, timeout=TIMEOUT)
    store.set("k", b"v")
    store.close()
    assert path.exists()
    again = FileStore(path, timeout=TIMEOUT)
    assert again.get("k") == b"v"  # the log is replayed
    again.close()


def _close_in_child(path: str) -> None:
    FileStore(path, world_size=2, timeout=TIMEOUT).close()


def test_cleanup_counts_stores_in_other_processes(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    mine = FileStore(path, world_size=2, timeout=TIMEOUT)
    child = multiprocessing.get_context("spawn").Process(target=_close_in_child, args=(path,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert os.path.exists(path)
    mine.close()
    assert not os.path.exists(path)


def test_foreign_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"some text that is not a store\n")
    with pytest.raises(StoreError, match="not a meshcomm FileStore"):
        FileStore(path, timeout=TIMEOUT)
    assert path.read_bytes() == b"some text that is not a store\n"


def test_corrupt_tail_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "store"
    store = FileStore(path, timeout=TIMEOUT)
    store.set("k", b"v")
    with open(path, "ab") as raw:
        raw.write(b"\x01\x00\x00")  # half a record header
    with pytest.raises(StoreError, match="corrupt"):
        FileStore(path, timeout=TIMEOUT)
    with pytest.raises(StoreError, match="corrupt"):
        store.get("k")
    with pytest.raises(StoreError, match="corrupt"):
        store.close()  # reports the corruption, and still releases the file
    store.close()


def test_timedelta_timeout(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store", timeout=timedelta(milliseconds=200))
    assert store.timeout == 0.2
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="'nothere'"):
        store.get("nothere")
    assert time.monotonic() - start < 0.2 + 0.5
    store.close()


def test_closed_store_raises(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store", timeout=TIMEOUT)
    store.close()
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.set("k", b"v")
    with pytest.raises(StoreError, match="closed"):
        store.get("k")


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        FileStore(tmp_path / "s", world_size=0)
    with pytest.raises(TypeError):
        FileStore(3)  # type: ignore[arg-type]
    with pytest.raises(StoreError, match="cannot open"):
        FileStore(tmp_path / "missing-dir" / "store")


def test_log_format_starts_with_magic(tmp_path: Path) -> None:
    path = tmp_path / "store"
    store = FileStore(path, timeout=TIMEOUT)
    store.add("n", 2)
    store.add("n", 3)
    assert path.read_bytes().startswith(FILE_MAGIC)
    assert FileStore(path, timeout=TIMEOUT).get("n") == b"5"
    store.close()
