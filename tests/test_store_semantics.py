"""One semantics suite for every store, run in threads and in separate processes.

Each kit makes clients of one shared store: ``kit.new()`` returns another client (a new TCP
connection, a new FileStore on the same file, the same HashStore). The process suite runs the
same checks in spawned processes for every store that can cross a process boundary (HashStore
lives in one process by definition, so it is only in the thread suite).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from meshcomm.errors import InvalidArgument, StoreError, StoreTimeout
from meshcomm.store import (
    MAX_KEY_BYTES,
    FileStore,
    HashStore,
    PrefixStore,
    Store,
    StoreServer,
    TCPStore,
)

TIMEOUT = 5.0
SHORT = 0.2
# A StoreTimeout must come within its timeout plus this.
SLACK = 0.5


class Kit:
    """Clients of one shared store; closes them all at the end."""

    def __init__(self, new: Callable[[], Store], spec: tuple[Any, ...] | None) -> None:
        self._new = new
        self.spec = spec  # how a spawned process opens the same store; None: in-process only
        self.opened: list[Store] = []

    def new(self) -> Store:
        store = self._new()
        self.opened.append(store)
        return store

    def close(self) -> None:
        for store in reversed(self.opened):
            store.close()


def _hash_kit(tmp_path: Path) -> tuple[Kit, list[Any]]:
    base = HashStore(timeout=TIMEOUT)
    return Kit(lambda: base, None), []


def _tcp_master_kit(tmp_path: Path) -> tuple[Kit, list[Any]]:
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
    kit = Kit(lambda: TCPStore("127.0.0.1", master.port, timeout=TIMEOUT), ("tcp", master.port))
    return kit, [master]


def _tcp_server_kit(tmp_path: Path) -> tuple[Kit, list[Any]]:
    server = StoreServer("127.0.0.1", 0).start()
    kit = Kit(lambda: TCPStore("127.0.0.1", server.port, timeout=TIMEOUT), ("tcp", server.port))
    return kit, [server]


def _file_kit(tmp_path: Path) -> tuple[Kit, list[Any]]:
    path = str(tmp_path / "store")
    return Kit(lambda: FileStore(path, timeout=TIMEOUT), ("file", path)), []


def _prefix_kit(inner: Callable[[Path], tuple[Kit, list[Any]]]) -> Callable[..., Any]:
    def make(tmp_path: Path) -> tuple[Kit, list[Any]]:
        kit, owned = inner(tmp_path)
        spec = None if kit.spec is None else ("prefix", "job", kit.spec)
        prefixed = Kit(lambda: PrefixStore("job", kit.new()), spec)
        return prefixed, [*owned, kit]

    return make


KITS = {
    "hash": _hash_kit,
    "tcp-master": _tcp_master_kit,
    "tcp-server": _tcp_server_kit,
    "file": _file_kit,
    "prefix-hash": _prefix_kit(_hash_kit),
    "prefix-tcp": _prefix_kit(_tcp_server_kit),
    "prefix-file": _prefix_kit(_file_kit),
}


@pytest.fixture(params=sorted(KITS))
def kit(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Kit]:
    made, owned = KITS[request.param](tmp_path)
    try:
        yield made
    finally:
        made.close()
        for thing in reversed(owned):
            thing.close()


def _later(seconds: float, action: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# --- the suite, in threads -------------------------------------------------------------------


def test_set_get_bytes_and_str(kit: Kit) -> None:
    a, b = kit.new(), kit.new()
    a.set("k", b"\x00\xff binary")
    assert b.get("k") == b"\x00\xff binary"
    a.set("k", "héllo")  # replaces, str is UTF-8 encoded
    assert b.get("k") == "héllo".encode()
    a.set("empty", b"")
    assert b.get("empty") == b""
    a.set("mv", memoryview(b"view"))
    assert b.get("mv") == b"view"


def test_get_blocks_until_another_client_sets(kit: Kit) -> None:
    a, b = kit.new(), kit.new()
    setter = _later(0.1, lambda: a.set("late", b"here"))
    assert b.get("late") == b"here"
    setter.join(TIMEOUT)


def test_get_missing_times_out_then_store_still_works(kit: Kit) -> None:
    store = kit.new()
    store.set_timeout(SHORT)
    assert store.timeout == pytest.approx(SHORT)
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match="nothere"):
        store.get("nothere")
    assert time.monotonic() - start < SHORT + SLACK
    store.set("after", b"1")
    assert store.get("after") == b"1"
    with pytest.raises(StoreTimeout, match="nothere"):
        store.multi_get(["after", "nothere"])
    assert store.add("n", 1) == 1


def test_timeouts_accept_timedelta(kit: Kit) -> None:
    store = kit.new()
    store.set_timeout(timedelta(milliseconds=250))
    assert store.timeout == pytest.approx(0.25)
    start = time.monotonic()
    with pytest.raises(StoreTimeout, match=r"x', .*y'"):
        store.wait(["x", "y"], timedelta(milliseconds=200))
    assert time.monotonic() - start < 0.2 + SLACK
    with pytest.raises(InvalidArgument):
        store.set_timeout(timedelta(seconds=-1))
    with pytest.raises(InvalidArgument):
        store.wait(["x"], 0)


def test_add(kit: Kit) -> None:
    a, b = kit.new(), kit.new()
    assert a.add("c", 5) == 5
    assert b.add("c", -2) == 3
    assert a.add("c", 0) == 3
    assert b.get("c") == b"3"
    a.set("manual", "41")
    assert b.add("manual", 1) == 42
    a.set("text", b"not a number")
    with pytest.raises(StoreError, match="text"):
        b.add("text", 1)
    assert a.get("text") == b"not a number"
    with pytest.raises(StoreError):
        a.add("c", 2**63 - 1)  # 3 + (2**63 - 1) leaves int64
    assert a.get("c") == b"3"


def test_compare_set(kit: Kit) -> None:
    a, b = kit.new(), kit.new()
    # Missing key, empty expected: set to desired.
    assert a.compare_set("k", b"", b"first") == b"first"
    assert b.get("k") == b"first"
    # Match: swap, return desired.
    assert b.compare_set("k", "first", "second") == b"second"
    # Mismatch: unchanged, return current.
    assert a.compare_set("k", b"wrong", b"third") == b"second"
    assert b.get("k") == b"second"
    # Missing key, non-empty expected: stays missing, returns expected (torch semantics).
    assert a.compare_set("m", b"exp", b"des") == b"exp"
    assert not b.check(["m"])


def test_wait_and_check(kit: Kit) -> None:
    a, b = kit.new(), kit.new()
    assert a.check([]) is True
    a.wait([])
    assert a.check(["w1"]) is False
    a.set("w1", b"")
    assert b.check(["w1"]) is True
    assert b.check(["w1", "w2"]) is False
    b.wait(["w1"], SHORT)  # present: returns at once
    setter = _later(0.1, lambda: a.multi_set(["w2", "w3"], [b"2", b"3"]))
    b.wait(["w1", "w2", "w3"])
    setter.join(TIMEOUT)
    assert b.check(["w1", "w2", "w3"])


def test_delete_and_num_keys(kit: Kit) -> None:
    a, b = kit.new(), kit.new()
    base = a.num_keys()
    a.set("d1", b"1")
    a.add("d2", 1)
    assert b.num_keys() == base + 2
    assert b.delete_key("d1") is True
    assert b.delete_key("d1") is False
    assert a.num_keys() == base + 1
    assert not a.check(["d1"])
    a.set_timeout(SHORT)
    with pytest.raises(StoreTimeout, match="d1"):
        a.get("d1")


def test_multi_set_and_multi_get(kit: Kit) -> None:
    a, b = kit.new(), kit.new()
    a.multi_set(["m1", "m2", "m3"], [b"1", "2", b""])
    assert b.multi_get(["m3", "m1", "m2"]) == [b"", b"1", b"2"]
    assert b.multi_get([]) == []
    setter = _later(0.1, lambda: a.set("m4", b"4"))
    assert b.multi_get(["m1", "m4"]) == [b"1", b"4"]
    setter.join(TIMEOUT)
    with pytest.raises(InvalidArgument, match="2 keys but 1 values"):
        a.multi_set(["x", "y"], [b"1"])


def test_append(kit: Kit) -> None:
    a, b = kit.new(), kit.new()
    a.append("log", b"a")
    b.append("log", "b")
    a.append("log", b"")
    assert a.get("log") == b"ab"
    setter = _later(0.1, lambda: b.append("fresh", b"x"))
    assert a.get("fresh") == b"x"
    setter.join(TIMEOUT)


def test_invalid_arguments_raise_before_io(kit: Kit) -> None:
    store = kit.new()
    with pytest.raises(InvalidArgument):
        store.set(3, b"v")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        store.set("", b"v")
    with pytest.raises(InvalidArgument, match=str(MAX_KEY_BYTES)):
        store.get("k" * (MAX_KEY_BYTES + 1))
    with pytest.raises(InvalidArgument):
        store.set("k", 5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="sequence"):
        store.wait("abc")
    with pytest.raises(InvalidArgument, match="sequence"):
        store.check("abc")
    with pytest.raises(TypeError):
        store.add("k", "1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        store.add("k", True)
    with pytest.raises(InvalidArgument):
        store.add("k", 2**63)
    store.set("still", b"works")
    assert store.get("still") == b"works"


def test_concurrent_adds_from_many_threads(kit: Kit) -> None:
    threads, rounds = 16, 25
    clients = [kit.new() for _ in range(threads)]
    shared = kit.new()
    results: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def work(store: Store) -> None:
        try:
            for _ in range(rounds):
                value = store.add("total", 1)
                shared.add("shared", 1)  # one client used by every thread at once
                with lock:
                    results.append(value)
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=work, args=(c,)) for c in clients]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(30)
    assert not errors
    # Every add saw a distinct counter value: the adds were atomic.
    assert sorted(results) == list(range(1, threads * rounds + 1))
    assert shared.get("shared") == str(threads * rounds).encode()


def test_compare_set_race_has_one_winner(kit: Kit) -> None:
    threads = 12
    clients = [kit.new() for _ in range(threads)]
    barrier = threading.Barrier(threads)
    results: list[bytes] = [b""] * threads

    def work(i: int) -> None:
        barrier.wait(TIMEOUT)
        results[i] = clients[i].compare_set("leader", b"", f"t{i}".encode())

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(30)
    assert len(set(results)) == 1
    assert results[0] in {f"t{i}".encode() for i in range(threads)}


def test_close_is_idempotent(kit: Kit) -> None:
    store = kit.new()
    store.set("k", b"v")
    store.close()
    store.close()


# --- the suite, in processes -----------------------------------------------------------------


def open_spec(spec: tuple[Any, ...]) -> Store:
    """Open the store a spec names (in a spawned process)."""
    kind = spec[0]
    if kind == "tcp":
        return TCPStore("127.0.0.1", spec[1], timeout=TIMEOUT)
    if kind == "file":
        return FileStore(spec[1], timeout=TIMEOUT)
    return PrefixStore(spec[1], open_spec(spec[2]))


def scenario(spec: tuple[Any, ...], rank: int, size: int) -> dict[str, Any]:
    """What one process does: every operation, checked against the other processes."""
    store = open_spec(spec)
    try:
        out: dict[str, Any] = {"pid": os.getpid()}
        store.add("arrived", 1)
        store.set(f"rank/{rank}", f"value {rank}")
        store.append("log", f"{rank};")
        store.wait([f"rank/{r}" for r in range(size)])
        out["values"] = store.multi_get([f"rank/{r}" for r in range(size)])
        out["leader"] = store.compare_set("leader", b"", f"p{rank}".encode())
        out["counter"] = [store.add("counter", 1) for _ in range(20)]
        # A barrier: everyone's appends and adds are in before anyone reads the totals.
        if store.add("done", 1) == size:
            store.set("all-done", b"1")
        store.get("all-done")
        out["log"] = store.get("log")
        out["arrived"] = int(store.get("arrived"))
        out["check"] = store.check([f"rank/{r}" for r in range(size)])
        store.set_timeout(SHORT)
        start = time.monotonic()
        try:
            store.get(f"never/{rank}")
        except StoreTimeout:
            out["timeout_s"] = time.monotonic() - start
        store.set(f"after/{rank}", b"ok")
        out["after"] = store.get(f"after/{rank}")
        return out
    finally:
        store.close()


PROCESSES = 4


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcessPoolExecutor]:
    """Spawned worker processes, shared by the process tests (spawning is the slow part)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(PROCESSES, mp_context=context) as executor:
        yield executor


@pytest.mark.parametrize("name", ["tcp-server", "file", "prefix-tcp", "prefix-file"])
def test_semantics_across_processes(name: str, tmp_path: Path, pool: ProcessPoolExecutor) -> None:
    made, owned = KITS[name](tmp_path)
    size = PROCESSES
    try:
        assert made.spec is not None
        futures = [pool.submit(scenario, made.spec, r, size) for r in range(size)]
        results = [f.result(timeout=60) for f in futures]
        expected = [f"value {r}".encode() for r in range(size)]
        assert len({res["pid"] for res in results}) == size  # really in separate processes
        assert all(res["values"] == expected for res in results)
        assert len({res["leader"] for res in results}) == 1
        counters = sorted(v for res in results for v in res["counter"])
        assert counters == list(range(1, 20 * size + 1))
        log = results[0]["log"].decode().split(";")[:-1]
        assert sorted(log) == [str(r) for r in range(size)]
        assert all(res["arrived"] == size and res["check"] for res in results)
        assert all(res["timeout_s"] < SHORT + SLACK for res in results)
        assert all(res["after"] == b"ok" for res in results)
    finally:
        made.close()
        for thing in reversed(owned):
            thing.close()
