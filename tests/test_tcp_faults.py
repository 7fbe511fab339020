"""Faults over real processes: a rank killed (SIGKILL) or frozen (SIGSTOP) mid-collective.

Survivors must raise the right error naming the right rank within ``timeout + 2 s``, and
every later call must fail fast with the original reason. Every test runs over shared memory
(the default between same-host ranks) and over sockets (``MESHCOMM_TRANSPORT=tcp``), and no
shared-memory name of the job may be left in ``/dev/shm`` afterwards, killed rank included.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import signal
import threading
import time
import traceback
from typing import Any

import numpy as np
import pytest

from meshcomm.backends.tcp import TcpCommunicator
from meshcomm.backends.tcp.same_host import rings as shm
from meshcomm.errors import CommError
from meshcomm.reduction import ReduceOp
from meshcomm.store import StoreServer, TCPStore

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX signals")

TIMEOUT = 3.0
SLACK = 2.0
TRANSPORTS = ["auto", "tcp"]


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test over shared memory ("auto") and over sockets; spawned ranks inherit it."""
    monkeypatch.setenv("MESHCOMM_TRANSPORT", request.param)
    return str(request.param)


def _leftovers(token: str) -> list[str]:
    if not os.path.isdir(shm.SHM_DIR):
        return []
    return sorted(name for name in os.listdir(shm.SHM_DIR) if f".{token}." in name)


def _child(
    name: str,
    rank: int,
    size: int,
    port: int,
    out: Any,
    release: Any,
    args: tuple,
    linger: bool = True,
) -> None:
    store = TCPStore("127.0.0.1", port, timeout=30)
    comm = TcpCommunicator.create_world(rank, size, store, TIMEOUT)
    try:
        out.put((rank, "ok", globals()[name](comm, store, *args)))
    except BaseException as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    # Survivors keep their sockets open until every survivor has answered, so that one
    # survivor's exit is never what another one observes; without linger they leave at once,
    # as a job's ranks do, and the others may see that first.
    if linger:
        release.wait(60)
    comm.close()
    store.close()


def _freeze_or_die(store: Any, how: str) -> None:
    store.set("test/fault_at", repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    time.sleep(60)  # after SIGCONT: wait to be killed


def _failure(comm: TcpCommunicator, exc: CommError, started: float) -> dict[str, Any]:
    report = {
        "type": type(exc).__name__,
        "rank": getattr(exc, "rank", None),
        "message": str(exc),
        "at": time.time(),
        "elapsed": time.monotonic() - started,
        "connected": comm.transport.connected_peers,
        "channels": comm.transport.channels,
        "names_at_failure": _leftovers(comm.transport.job),
    }
    # Fail fast afterwards: this communicator, and making a group of the failed world.
    for attempt in (comm.barrier, lambda: comm.sub(list(range(comm.size)))):
        t0 = time.monotonic()
        try:
            attempt()
        except CommError as again:
            report.setdefault("again", []).append(
                (type(again).__name__, str(again), time.monotonic() - t0)
            )
    return report


def ring_until_failure(comm: TcpCommunicator, store: Any, victim: int, how: str) -> Any:
    """Ring exchanges (send right, receive left) until the victim kills or stops itself."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    send = np.full(64 << 10, comm.rank, np.uint8)
    recv = np.empty_like(send)
    for step in range(10_000):
        if comm.rank == victim and step == 20:
            _freeze_or_die(store, how)
        started = time.monotonic()
        try:
            comm.link.exchange([(right, send)], [(left, recv)])
        except CommError as exc:
            return _failure(comm, exc, started)
    return "never failed"


def _all_reduce_loop(
    comm: TcpCommunicator, store: Any, victim: int, how: str, count: int, fault_step: int
) -> Any:
    """float32 all_reduces of ``count`` elements until the victim dies at ``fault_step``."""
    buf = np.ones(count, np.float32)
    for step in range(10_000):
        if comm.rank == victim and step == fault_step:
            _freeze_or_die(store, how)
        started = time.monotonic()
        try:
            comm.all_reduce(buf, ReduceOp.SUM)
            assert buf[0] == buf[-1] == comm.size, buf
            buf[:] = 1
        except CommError as exc:
            return _failure(comm, exc, started)
    return "never failed"


def all_reduce_until_failure(comm: TcpCommunicator, store: Any, victim: int, how: str) -> Any:
    """Large all_reduces until the victim dies (over shared memory: the direct path, where
    ranks read each other's memory; over sockets: the ring)."""
    return _all_reduce_loop(comm, store, victim, how, 1 << 20, 3)


def small_all_reduce_until_failure(comm: TcpCommunicator, store: Any, victim: int, how: str) -> Any:
    """8-byte all_reduces until the victim dies (over shared memory: the board, where ranks
    wait on each other's sequence words; over sockets: recursive doubling)."""
    return _all_reduce_loop(comm, store, victim, how, 2, 50)


ALL_REDUCES = ["all_reduce_until_failure", "small_all_reduce_until_failure"]


def big_all_reduce_until_killed(
    comm: TcpCommunicator, store: Any, victim: int, how: str, delay: float
) -> Any:
    """64 MiB all_reduces; the victim is killed ``delay`` s into its second call, from a
    timer thread, so the kill lands inside a collective rather than between two."""
    buf = np.ones(16 << 20, np.float32)
    for step in range(10_000):
        if comm.rank == victim and step == 1:
            store.set("test/fault_at", repr(time.time() + delay))
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        started = time.monotonic()
        try:
            comm.all_reduce(buf, ReduceOp.SUM)
            assert buf[0] == buf[-1] == comm.size, buf
            buf[:] = 1
        except CommError as exc:
            return _failure(comm, exc, started)
    return "never failed"


def run_fault(
    name: str, size: int, victim: int, how: str, *extra: Any, linger: bool = True
) -> tuple[dict[int, Any], float]:
    """Run ``name`` on ``size`` ranks; return the survivors' reports and the fault's time.

    ``linger=False``: each survivor closes its world as soon as it has its report.
    Afterwards (every process gone) no shared-memory name of the job may be left.
    """
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    release = ctx.Event()
    with StoreServer("127.0.0.1", 0) as server:
        procs = [
            ctx.Process(
                target=_child,
                args=(name, r, size, server.port, out, release, (victim, how, *extra), linger),
            )
            for r in range(size)
        ]
        for p in procs:
            p.start()
        reports: dict[int, Any] = {}
        try:
            deadline = time.monotonic() + 60 + TIMEOUT
            while len(reports) < size - 1:
                rank, status, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
                assert status == "ok", f"rank {rank}: {value}"
                reports[rank] = value
            client = TCPStore("127.0.0.1", server.port, timeout=10)
            fault_at = float(client.get("test/fault_at"))
            token = client.get("meshcomm/tcp/token").hex()
            client.close()
        except queue.Empty:
            pytest.fail(f"survivors {sorted(set(range(size)) - {victim} - set(reports))} hung")
        finally:
            release.set()
            victim_proc = procs[victim]
            if victim_proc.pid is not None and victim_proc.is_alive():
                os.kill(victim_proc.pid, signal.SIGCONT)
                victim_proc.kill()
            for p in procs:
                p.join(15)
                if p.is_alive():
                    p.kill()
    assert _leftovers(token) == []
    return reports, fault_at


def check_channels(report: dict[str, Any], transport: str) -> None:
    kinds = set(report["channels"].values())
    assert kinds <= ({"shm"} if transport == "auto" else {"tcp"}), report["channels"]
    # Set-up was over before the fault: the names were gone even with the victim alive.
    assert report["names_at_failure"] == []


def check_fail_fast(report: dict[str, Any]) -> None:
    assert len(report["again"]) == 2
    for kind, message, seconds in report["again"]:
        assert kind == report["type"]
        assert "already failed" in message and report["message"] in message
        assert seconds < 0.5


def test_sigkill_mid_ring_reaches_every_survivor(transport: str) -> None:
    reports, died_at = run_fault("ring_until_failure", 4, victim=3, how="kill")
    assert sorted(reports) == [0, 1, 2]
    for rank, report in reports.items():
        assert report["type"] == "PeerError", (rank, report)
        assert report["rank"] == 3, (rank, report)
        assert report["at"] - died_at <= TIMEOUT + SLACK, (rank, report)
        check_fail_fast(report)
        check_channels(report, transport)
    # Rank 1 never talked to rank 3: it learned of the death from the abort record.
    assert 3 not in reports[1]["connected"]
    assert "another rank reported" in reports[1]["message"]
    assert "rank 3 died" in reports[1]["message"]


@pytest.mark.parametrize("loop", ALL_REDUCES)
def test_sigkill_mid_all_reduce(transport: str, loop: str) -> None:
    reports, died_at = run_fault(loop, 3, victim=1, how="kill")
    for rank, report in reports.items():
        assert (report["type"], report["rank"]) == ("PeerError", 1), (rank, report)
        assert report["at"] - died_at <= TIMEOUT + SLACK
        check_fail_fast(report)
        check_channels(report, transport)


@pytest.mark.parametrize("loop", ALL_REDUCES)
def test_sigstop_mid_all_reduce(transport: str, loop: str) -> None:
    reports, _ = run_fault(loop, 3, victim=2, how="stop")
    assert sorted(reports) == [0, 1]
    for rank, report in reports.items():
        assert report["type"] == "CommTimeout", (rank, report)
        assert TIMEOUT <= report["elapsed"] <= TIMEOUT + SLACK, (rank, report)
        if transport == "auto" and loop.startswith("small"):
            assert "board; still waiting for ranks [2]" in report["message"], report
        check_fail_fast(report)
        check_channels(report, transport)


def test_sigstop_makes_survivors_time_out(transport: str) -> None:
    reports, _ = run_fault("ring_until_failure", 3, victim=2, how="stop")
    assert sorted(reports) == [0, 1]
    for rank, report in reports.items():
        assert report["type"] == "CommTimeout", (rank, report)
        assert TIMEOUT <= report["elapsed"] <= TIMEOUT + SLACK, (rank, report)
        assert "no progress for 3 s" in report["message"]
        check_fail_fast(report)
        check_channels(report, transport)


def check_blames_victim(reports: dict[int, Any], victim: int) -> None:
    """Every survivor names the victim, whichever peer's departure it saw first."""
    for rank, report in reports.items():
        assert (report["type"], report["rank"]) == ("PeerError", victim), (rank, report)
        assert f"rank {victim} died" in report["message"], (rank, report)
        check_fail_fast(report)


def test_survivors_that_leave_are_not_blamed(transport: str) -> None:
    # Rank 1 never talks to rank 3: it sees rank 0 (or 2) leave after its own error first.
    reports, _ = run_fault("ring_until_failure", 4, 3, "kill", linger=False)
    assert sorted(reports) == [0, 1, 2]
    check_blames_victim(reports, 3)
    assert 3 not in reports[1]["connected"]
    message = reports[1]["message"]
    assert "left after that failure" in message or "another rank reported" in message, message


def _kill_mid_64mib(runs: int) -> None:
    rng = random.Random(17)
    for _ in range(runs):
        delay = rng.uniform(0.0, 0.3)
        reports, died_at = run_fault(
            "big_all_reduce_until_killed", 4, 3, "kill", delay, linger=False
        )
        assert sorted(reports) == [0, 1, 2], (delay, reports)
        check_blames_victim(reports, 3)
        for report in reports.values():
            assert report["at"] - died_at <= TIMEOUT + SLACK, report


def test_sigkill_mid_64mib_all_reduce_names_the_victim(transport: str) -> None:
    _kill_mid_64mib(2)


@pytest.mark.slow
def test_sigkill_mid_64mib_all_reduce_names_the_victim_10_runs(transport: str) -> None:
    """Issue 17: 4 of 30 survivor reports blamed a survivor that had left after its error."""
    _kill_mid_64mib(10)


def test_survivors_that_time_out_and_leave_are_not_called_dead(transport: str) -> None:
    reports, _ = run_fault("ring_until_failure", 4, 3, "stop", linger=False)
    assert sorted(reports) == [0, 1, 2]
    for rank, report in reports.items():
        message = report["message"]
        assert report["type"] in ("CommTimeout", "PeerError"), (rank, report)
        assert "died" not in message, (rank, report)
        if report["type"] == "PeerError":  # it saw another survivor leave first
            assert "left after its own error (CommTimeout" in message, (rank, report)
        check_fail_fast(report)


def _store_host_child(rank: int, size: int, ports: Any, out: Any) -> None:
    """Rank 0 hosts the store (as under a launcher that makes rank 0 the master) and dies."""
    if rank == 0:
        store = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
        ports.put(store.port)
        ports.put(store.port)
    else:
        store = TCPStore("127.0.0.1", ports.get(timeout=30), timeout=30)
    comm = TcpCommunicator.create_world(rank, size, store, TIMEOUT)
    try:
        out.put((rank, "ok", ring_until_failure(comm, store, 0, "kill")))
    except BaseException as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    comm.close()


def test_the_store_dying_with_a_rank_does_not_delay_the_report(transport: str) -> None:
    # Every store operation after the first failed one could wait out the store's 30 s
    # trying to reconnect: survivors must still report within the transport's bounds.
    ctx = multiprocessing.get_context("spawn")
    out, ports = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_store_host_child, args=(r, 3, ports, out)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        reports = {}
        for _ in range(2):
            rank, status, value = out.get(timeout=60)
            assert status == "ok", f"rank {rank}: {value}"
            reports[rank] = value
    finally:
        for p in procs:
            p.join(15)
            if p.is_alive():
                p.kill()
    assert sorted(reports) == [1, 2]
    for rank, report in reports.items():
        assert (report["type"], report["rank"]) == ("PeerError", 0), (rank, report)
        assert report["elapsed"] <= TIMEOUT + SLACK, (rank, report)
        check_fail_fast(report)
