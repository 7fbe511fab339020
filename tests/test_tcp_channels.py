"""Channels chosen per peer: shared memory between same-host ranks, sockets otherwise.

Spawned ranks over real sockets and real shared memory. Per-rank environments pretend that
ranks live on different hosts (``MESHCOMM_HOST_KEY``), shrink the rings, turn single-copy
reads off, or make one rank's shared-memory set-up fail, and every case must still move the
right bytes. Nothing may be left in ``/dev/shm`` once the ranks are gone.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import numpy as np
import pytest
from spawned import run_spawned

from meshcomm.backends.tcp import TcpCommunicator, waiting
from meshcomm.backends.tcp.same_host import cma
from meshcomm.backends.tcp.same_host import rings as shm
from meshcomm.backends.tcp.transport import Transport, channel_kind
from meshcomm.errors import InvalidArgument
from meshcomm.reduction import ReduceOp
from meshcomm.store import HashStore, StoreServer, TCPStore

pytestmark = pytest.mark.skipif(not shm.shm_supported(), reason="no shared-memory fast path here")

TIMEOUT = 20.0


# -- harness: fn(comm, *args) on spawned ranks, each with its own environment ---------------


def _child(name: str, rank: int, size: int, port: int, env: dict[str, str], out: Any) -> None:
    os.environ.update(env)
    store = TCPStore("127.0.0.1", port, timeout=30)
    comm = TcpCommunicator.create_world(rank, size, store, TIMEOUT)
    try:
        out.put((rank, "ok", globals()[name](comm)))
    except BaseException as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        comm.close()
        store.close()


def run(name: str, envs: list[dict[str, str]]) -> tuple[list[Any], str]:
    """Run ``name`` on ``len(envs)`` ranks; return the results and the job's token (hex)."""
    size = len(envs)
    with StoreServer("127.0.0.1", 0) as server:
        port = server.port
        results = run_spawned(
            _child, size, lambda r, out: (name, r, size, port, envs[r], out), join=30
        )
        client = TCPStore("127.0.0.1", server.port, timeout=10)
        token = client.get("meshcomm/tcp/token").hex()
        client.close()
    errors = [f"rank {r}: {v}" for r, (s, v) in sorted(results.items()) if s != "ok"]
    assert not errors, "\n".join(errors)
    return [results[r][1] for r in range(size)], token


def leftovers(token: str) -> list[str]:
    return sorted(name for name in os.listdir(shm.SHM_DIR) if f".{token}." in name)


# -- rank functions ------------------------------------------------------------------------


def _ring(comm: TcpCommunicator, nbytes: int, steps: int = 3) -> bool:
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for step in range(steps):
        send = np.full(nbytes, (comm.rank * 7 + step) % 251, np.uint8)
        send[::4093] = np.arange(send[::4093].size, dtype=np.uint8)
        recv = np.empty(nbytes, np.uint8)
        comm.link.exchange([(right, send)], [(left, recv)])
        expect = np.full(nbytes, (left * 7 + step) % 251, np.uint8)
        expect[::4093] = np.arange(expect[::4093].size, dtype=np.uint8)
        if not np.array_equal(recv, expect):
            return False
    return True


def _all_pairs(comm: TcpCommunicator) -> bool:
    me = comm.rank
    for step, scale in enumerate((1, 1000, 50_000)):  # small, ring-sized, single-copy sized
        peers = [p for p in range(comm.size) if p != me]
        sends = [(p, np.full(scale * (me + 1) + p + step, me, np.int16)) for p in peers]
        recvs = [(p, np.empty(scale * (p + 1) + me + step, np.int16)) for p in peers]
        comm.link.exchange(sends, recvs)
        if not all((buf == p).all() for p, buf in recvs):
            return False
    return True


def _collectives(comm: TcpCommunicator) -> bool:
    p, r = comm.size, comm.rank
    for n in (5, 300_000):  # recursive doubling and the ring (single-copy chunks)
        buf = np.arange(n, dtype=np.int64) + r
        comm.all_reduce(buf, ReduceOp.SUM)
        if not np.array_equal(buf, p * np.arange(n) + p * (p - 1) // 2):
            return False
    for root in range(p):
        b = np.full(200_000, r, np.float32)
        comm.broadcast(b, root)
        if not (b == root).all():
            return False
    got = np.empty(p * 70_000, np.int32)
    comm.all_gather(np.full(70_000, r, np.int32), got)
    return bool((got.reshape(p, -1) == np.arange(p)[:, None]).all())


def _unexpected_large(comm: TcpCommunicator) -> bool:
    # Rank 1 sends big payloads before rank 0 posts their receives: an address (RTS) that
    # arrives first must be read at once, so the sender's exchange can return. They go on a
    # communicator of their own (on the same transport), so that the barrier's frames
    # cannot match them.
    pair = comm.sub([0, 1], own_transport=False) if comm.rank < 2 else None
    ok = True
    if comm.rank == 1:
        assert pair is not None
        for i in range(3):
            pair.link.exchange([(0, np.full(1 << 20, i + 1, np.uint8))], [])
    comm.barrier()
    if comm.rank == 0:
        assert pair is not None
        bufs = [np.empty(1 << 20, np.uint8) for _ in range(3)]
        for buf in bufs:
            pair.link.exchange([], [(1, buf)])
        ok = all((buf == i + 1).all() for i, buf in enumerate(bufs))
    comm.barrier()
    if pair is not None:
        pair.close()
    return ok


def _report(comm: TcpCommunicator) -> dict[str, Any]:
    comm.barrier()
    t = comm.transport
    report = {
        "channels": t.channels,
        "fallbacks": t.shm_fallbacks,
        "single_copy": sorted(p for p, sp in t.shm_peers.items() if sp.cma),
        "names_during_run": leftovers(t.job),
    }
    comm.barrier()  # nobody closes (and says goodbye) before everyone has looked
    return report


def workout(comm: TcpCommunicator) -> dict[str, Any]:
    """Everything at once: pairs, rings of small and large messages, collectives."""
    ok = {
        "pairs": _all_pairs(comm),
        "ring_small": _ring(comm, 100, steps=50),
        "ring_large": _ring(comm, 6 << 20),
        "collectives": _collectives(comm),
        "unexpected": _unexpected_large(comm),
    }
    return {"ok": ok, **_report(comm)}


# -- tests -----------------------------------------------------------------------------------

ALL_OK = {"pairs": True, "ring_small": True, "ring_large": True, "collectives": True}


def cma_workout(comm: TcpCommunicator) -> dict[str, Any]:
    """Large collectives (several reduction pieces per block, counts the world size does not
    divide): right results, and whether the CMA collectives were agreed on."""
    n, me = comm.size, comm.rank
    ok: dict[str, bool] = {}
    for dtype, count in ((np.float64, 1_000_003), (np.int32, 3_000_001)):
        mine = ((np.arange(count) + me) % 11).astype(dtype)
        xs = [((np.arange(count) + r) % 11).astype(dtype) for r in range(n)]
        total = np.sum(xs, axis=0, dtype=dtype)
        buf = mine.copy()
        comm.all_reduce(buf, ReduceOp.SUM)  # in place
        out = np.empty_like(mine)
        comm.all_reduce_out(mine, out, ReduceOp.MAX)
        m = count // n
        part = np.empty(m, dtype)
        comm.reduce_scatter(mine[: m * n], part, ReduceOp.SUM)
        gathered = np.empty(n * m, dtype)
        comm.all_gather(mine[:m], gathered)
        root = n - 1
        bcast = np.empty_like(mine)
        comm.broadcast_out(mine if me == root else None, bcast, root)
        ok[np.dtype(dtype).name] = (
            np.array_equal(buf, total)
            and np.array_equal(out, np.maximum.reduce(xs))
            and np.array_equal(
                part, np.sum([x[: m * n] for x in xs], axis=0, dtype=dtype)[me * m : (me + 1) * m]
            )
            and np.array_equal(gathered, np.concatenate([x[:m] for x in xs]))
            and np.array_equal(bcast, xs[root])
            and np.array_equal(mine, xs[me])  # inputs untouched
        )
    return {"ok": ok, "cma": comm._cma._verdict}


def test_cma_collectives_between_same_host_ranks() -> None:
    results, token = run("cma_workout", [{}] * 3)
    for result in results:
        assert result == {"ok": {"float64": True, "int32": True}, "cma": True}, result
    assert leftovers(token) == []


@pytest.mark.parametrize(
    ("envs", "verdicts"),
    [
        # One pair could, the others not. A group spanning hosts runs these sizes host-aware
        # (past MESHCOMM_HIER_MIN), which never asks the CMA route: no verdict at all.
        ([{"MESHCOMM_HOST_KEY": h} for h in ("a", "a", "b")], {False, None}),
        ([{}, {}, {"MESHCOMM_SHM_CMA": "0"}], {False}),  # one rank cannot be read
    ],
    ids=["pretend-hosts", "one-rank-without-cma"],
)
def test_cma_route_is_agreed_by_every_rank_or_none(
    envs: list[dict[str, str]], verdicts: set[bool | None]
) -> None:
    results, _ = run("cma_workout", envs)
    assert len({r["cma"] for r in results}) == 1, results
    for result in results:
        assert result["ok"] == {"float64": True, "int32": True}, result
        assert result["cma"] in verdicts, result


def board_workout(comm: TcpCommunicator) -> dict[str, Any]:
    """Small all_reduces (the board where every pair is shared memory), in place and out of
    place, with a large send in flight across them: rank 0 sends before its all_reduce,
    rank 1 receives after it, so rank 1 must keep the rings moving while it waits on the
    board (else rank 0, blocked in its send, never arrives)."""
    n, me = comm.size, comm.rank
    ok: dict[str, bool] = {}
    for step in range(300):
        x = np.array([me + step, -me], np.int64)
        out = np.empty_like(x)
        comm.all_reduce_out(x, out, ReduceOp.MAX)
        buf = np.full(3, me + 1.5, np.float32)
        comm.all_reduce(buf, ReduceOp.SUM)
        good = out.tolist() == [n - 1 + step, 0] and x.tolist() == [me + step, -me]
        ok["small"] = ok.get("small", True) and good and buf.tolist() == [n * n / 2 + n] * 3
    # The largest size below the CMA collectives' threshold (whole slots), then past it.
    for count in (65_535, 65_536):
        wide = np.full(count, me + 1, np.float32)
        wide[-1] = -me
        comm.all_reduce(wide, ReduceOp.SUM)
        ok[f"wide_{count}"] = bool((wide[:-1] == n * (n + 1) / 2).all()) and wide[-1] == -(
            n * (n - 1) / 2
        )
    big = np.arange(6 << 20, dtype=np.uint8)
    flag = np.array([me], np.int32)
    if me == 0:
        comm.send(big, dst=1, tag=5)
    comm.all_reduce(flag, ReduceOp.SUM)
    if me == 1:
        got, _ = comm.recv(src=0, tag=5)
        ok["in_flight"] = bool(np.array_equal(got, big))
    ok["after"] = flag.tolist() == [n * (n - 1) // 2]
    return {"ok": ok, "board": comm._board}


@pytest.mark.parametrize(
    ("envs", "board"),
    [
        ([{}] * 3, True),
        ([{"MESHCOMM_SHM_CMA": "0", "MESHCOMM_SHM_BYTES": "65536"}] * 3, True),
        ([{"MESHCOMM_HOST_KEY": h} for h in ("a", "a", "b")], False),
        ([{"MESHCOMM_TRANSPORT": "tcp"}] * 3, False),
    ],
    ids=["default", "small-rings-no-cma", "pretend-hosts", "sockets"],
)
def test_small_all_reduces_take_the_board_only_where_every_rank_can(
    envs: list[dict[str, str]], board: bool
) -> None:
    results, token = run("board_workout", envs)
    for rank, result in enumerate(results):
        expect = {
            "small": True,
            "wide_65535": True,
            "wide_65536": True,
            "after": True,
            **({"in_flight": True} if rank == 1 else {}),
        }
        assert result == {"ok": expect, "board": board}, (rank, result)
    assert leftovers(token) == []


def _check_ok(result: dict[str, Any]) -> None:
    assert result["ok"] == {**ALL_OK, "unexpected": True}, result


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_same_host_peers_use_shared_memory_unless_told_not_to(transport: str) -> None:
    results, token = run("workout", [{"MESHCOMM_TRANSPORT": transport}] * 3)
    kind = "shm" if transport == "auto" else "tcp"
    for rank, result in enumerate(results):
        _check_ok(result)
        assert result["channels"] == {p: kind for p in range(3) if p != rank}
        assert result["fallbacks"] == {}
        assert result["names_during_run"] == []  # names live only while set-up is in flight
    assert leftovers(token) == []


def test_pretend_hosts_mix_shared_memory_and_sockets() -> None:
    # Ranks 0 and 1 on "host a", 2 and 3 on "host b": every rank waits on both kinds at once.
    envs = [{"MESHCOMM_HOST_KEY": host} for host in ("a", "a", "b", "b")]
    results, token = run("workout", envs)
    for rank, result in enumerate(results):
        _check_ok(result)
        mate = rank ^ 1
        assert result["channels"] == {
            p: "shm" if p == mate else "tcp" for p in range(4) if p != rank
        }
    assert leftovers(token) == []


def test_tiny_rings_without_single_copy_stream_everything() -> None:
    env = {"MESHCOMM_SHM_BYTES": "4096", "MESHCOMM_SHM_CMA": "0"}
    results, token = run("workout", [env] * 3)
    for result in results:
        _check_ok(result)
        assert set(result["channels"].values()) == {"shm"}
        assert result["single_copy"] == []
    assert leftovers(token) == []


def _siblings_may_read_each_other() -> bool:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as fh:
            return int(fh.read()) == 0  # 1 and up: only ancestors may read a process
    except OSError:
        return True


def test_single_copy_is_used_where_the_kernel_allows_it() -> None:
    results, _ = run("workout", [{}] * 2)
    for result in results:
        _check_ok(result)
    # Each pair probes process_vm_readv; where the kernel refuses, the rings carry it all.
    allowed = cma.cma_available() and _siblings_may_read_each_other()
    assert results[0]["single_copy"] == ([1] if allowed else [])
    assert results[1]["single_copy"] == ([0] if allowed else [])


def test_failed_set_up_falls_back_to_the_socket() -> None:
    # Rank 1 asks for a 64 GiB ring: /dev/shm cannot reserve it, so rank 1 makes no offer
    # and both ends of every pair with rank 1 use their socket.
    envs = [{}, {"MESHCOMM_SHM_BYTES": str(1 << 36)}, {}]
    results, token = run("workout", envs)
    for result in results:
        _check_ok(result)
    assert results[0]["channels"] == {1: "tcp", 2: "shm"}
    assert results[1]["channels"] == {0: "tcp", 2: "tcp"}
    assert "no offer" in results[0]["fallbacks"][1]
    assert leftovers(token) == []


def test_ranks_that_disagree_on_the_transport_use_sockets() -> None:
    envs = [{"MESHCOMM_TRANSPORT": "tcp"}, {}, {}]
    results, _ = run("workout", envs)
    for result in results:
        _check_ok(result)
    assert results[0]["channels"] == {1: "tcp", 2: "tcp"}
    assert results[1]["channels"] == {0: "tcp", 2: "shm"}


# -- in-process: knobs and the spin budget ----------------------------------------------------


def test_spin_budget_adapts_only_with_a_core_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHCOMM_SHM_SPIN_US", raising=False)
    cores = len(os.sched_getaffinity(0))
    fit, shared = waiting.spin_policy(1), waiting.spin_policy(cores + 1)
    assert (fit, shared) == (waiting.SPIN_FIT_US * 1e-6, waiting.SPIN_SHARED_US * 1e-6)
    spinner = waiting.Spinner(fit, shared=False)
    for _ in range(20):
        spinner.update(False, 0.0)  # polls that find nothing: the peer is not running
    assert spinner.budget == waiting.SPIN_MIN_US * 1e-6
    for _ in range(20):
        spinner.update(True, 0.0)
    assert spinner.budget == spinner.limit(0.0) <= fit
    fixed = waiting.Spinner(shared, shared=True)
    fixed.update(False, 0.0)
    assert fixed.budget == shared  # sharing cores: a poller yields, no need to shrink
    monkeypatch.setenv("MESHCOMM_SHM_SPIN_US", "0")
    assert waiting.spin_policy(1) == 0.0
    for bad in ("fast", "-1", "2e6"):
        monkeypatch.setenv("MESHCOMM_SHM_SPIN_US", bad)
        with pytest.raises(InvalidArgument, match="MESHCOMM_SHM_SPIN_US"):
            Transport.start(0, 1, HashStore(timeout=5), 5.0)


def test_channel_kind_follows_the_transport_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHCOMM_TRANSPORT", "tcp")
    assert channel_kind(same_host=True) == "tcp"
    monkeypatch.setenv("MESHCOMM_TRANSPORT", "auto")
    assert channel_kind(same_host=True) == "shm" and channel_kind(same_host=False) == "tcp"
    monkeypatch.setenv("MESHCOMM_SHM_CMA", "maybe")
    with pytest.raises(InvalidArgument, match="MESHCOMM_SHM_CMA"):
        cma.cma_enabled()
