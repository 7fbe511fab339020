"""Groups progress independently: threads on different groups, async ops on several mesh
axes in different orders on different ranks, and a peer killed while two groups are busy.

Every group has a progress engine (and, on tcp, a transport) of its own, so nothing here
may deadlock: each case would hang (then time out) if one group's operation waited for
another's. Real processes, real sockets and shared memory (``meshcomm.testing.run_ranks``).
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
from meshcomm.errors import CommError, PeerError
from meshcomm.group import ProcessGroup
from meshcomm.store import StoreServer, TCPStore
from meshcomm.testing import run_ranks

pytestmark = pytest.mark.timeout(300)


def _axes(world: ProcessGroup, shape: tuple[int, ...]) -> list[ProcessGroup]:
    """The groups of each axis of a row-major mesh of ``shape`` over the world, this rank's."""
    coords = np.unravel_index(world.rank, shape)
    groups = []
    for axis in range(len(shape)):
        # Ranks that agree on every other coordinate share this axis's group.
        others = tuple(int(c) for d, c in enumerate(coords) if d != axis)
        color = int(np.ravel_multi_index(others, [s for d, s in enumerate(shape) if d != axis]))
        group = world.split(color)
        assert group is not None
        groups.append(group)
    return groups


def _loop(group: ProcessGroup, ops: int, seed: int, errors: list[str]) -> None:
    """``ops`` all_reduces with random pauses; every result checked against the oracle."""
    rng = random.Random(seed)
    members = np.array(group.ranks, np.int64)
    try:
        for i in range(ops):
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.002)
            x = np.array([world_rank(group) + i, 1], np.int64)
            got = group.all_reduce(x)
            want = [int(members.sum()) + i * group.size, group.size]
            if got.tolist() != want:
                errors.append(f"{group.name} op {i}: {got.tolist()} != {want}")
                return
    except BaseException as exc:  # reported, not swallowed: the test fails on any entry
        errors.append(f"{group.name}: {type(exc).__name__}: {exc}")


def world_rank(group: ProcessGroup) -> int:
    return group.ranks[group.rank]


def threads_on_groups(world: ProcessGroup, shape: tuple[int, ...], ops: int) -> list[str]:
    """One thread per group, each looping all_reduces on it, with per-rank random jitter."""
    if len(shape) == 1:
        # Two groups with the same members: the same peers, on two independent engines.
        groups = [world.new_group(range(world.size)), world.new_group(range(world.size))]
    else:
        groups = _axes(world, shape)
    errors: list[str] = []
    threads = [
        threading.Thread(target=_loop, args=(g, ops, 1000 * world.rank + k, errors))
        for k, g in enumerate(groups)
        if g is not None
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    errors += [f"thread {t.name} still running" for t in threads if t.is_alive()]
    return errors


@pytest.mark.parametrize("size", [2, 3, 4])
def test_two_threads_on_two_groups_never_deadlock(size: int) -> None:
    assert run_ranks(threads_on_groups, size, args=((size,), 200), timeout=240) == [[]] * size


def test_threads_on_the_axes_of_a_2x2_mesh() -> None:
    assert run_ranks(threads_on_groups, 4, args=((2, 2), 200), timeout=240) == [[]] * 4


def test_three_axes_busy_at_once() -> None:
    assert run_ranks(threads_on_groups, 8, args=((2, 2, 2), 200), timeout=280) == [[]] * 8


def async_in_opposite_orders(world: ProcessGroup) -> list[Any]:
    """Even ranks issue dp then tp, odd ranks tp then dp, several times; then wait."""
    dp, tp = _axes(world, (2, 2))
    me = world.rank
    works = []
    for step in range(5):
        big = np.full(1 << 18, me + step, np.float32)
        small = np.array([me, step], np.int64)
        if me % 2 == 0:
            works.append((dp.all_reduce(big, async_op=True), tp.all_reduce(small, async_op=True)))
        else:
            pair = (tp.all_reduce(small, async_op=True), dp.all_reduce(big, async_op=True))
            works.append(pair[::-1])
    out = []
    for big_work, small_work in works:
        big = big_work.wait(timeout=60)
        out.append((float(big[0]), float(big[-1]), small_work.wait(timeout=60).tolist()))
    return out


def test_async_ops_on_two_axes_in_opposite_orders() -> None:
    results = run_ranks(async_in_opposite_orders, 4, timeout=120)
    for me, got in enumerate(results):
        dp_members = [me % 2, me % 2 + 2]
        tp_members = [2 * (me // 2), 2 * (me // 2) + 1]
        for step, (first, last, small) in enumerate(got):
            assert first == last == sum(r + step for r in dp_members)
            assert small == [sum(tp_members), 2 * step]


# -- a peer killed while two groups are in flight -------------------------------------------
_VICTIM = 3
_TIMEOUT = 10.0


def _busy_child(rank: int, size: int, port: int, out: Any) -> None:
    try:
        store = TCPStore("127.0.0.1", port, timeout=30)
        world = ProcessGroup(TcpCommunicator.create_world(rank, size, store, _TIMEOUT), store)
        groups = _axes(world, (2, 2))  # dp = {r % 2, r % 2 + 2}, tp = {2 (r // 2), +1}
        world.barrier()
        outcomes: dict[str, Any] = {}

        def loop(group: ProcessGroup) -> None:
            # A fixed count, so that the groups without the victim end together.
            x = np.ones(1 << 16, np.float32)
            try:
                for done in range(300):
                    if rank == _VICTIM and done == 50:
                        os.kill(os.getpid(), signal.SIGKILL)  # both its groups are busy
                    group.all_reduce(x)
                outcomes[group.name] = ("ok", group.ranks, 300)
            except CommError as exc:
                rank_named = exc.rank if isinstance(exc, PeerError) else None
                outcomes[group.name] = (type(exc).__name__, group.ranks, rank_named, str(exc))

        threads = [threading.Thread(target=loop, args=(g,)) for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        out.put((rank, "ok", sorted(outcomes.values(), key=lambda o: o[1])))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


def test_a_peer_killed_fails_its_groups_only() -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    size = 4
    with StoreServer("127.0.0.1", 0) as server:
        procs = [
            ctx.Process(target=_busy_child, args=(r, size, server.port, out)) for r in range(size)
        ]
        for p in procs:
            p.start()
        reports: dict[int, Any] = {}
        try:
            deadline = time.monotonic() + 90
            while len(reports) < size - 1:
                rank, status, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
                assert status == "ok", f"rank {rank}: {value}"
                reports[rank] = value
        except queue.Empty:
            pytest.fail(f"ranks {sorted({0, 1, 2} - set(reports))} never reported")
        finally:
            for p in procs:
                p.join(15)
                if p.is_alive():
                    p.kill()
    for rank, outcomes in reports.items():
        for outcome in outcomes:
            members = outcome[1]
            if _VICTIM in members:
                # Every group the dead peer belongs to fails, naming it.
                assert outcome[0] == "PeerError" and outcome[2] == _VICTIM, (rank, outcome)
            else:
                # The others keep working through the whole loop.
                assert outcome[0] == "ok" and outcome[2] > 0, (rank, outcome)


def group_links_authenticated(world: ProcessGroup) -> list[bool]:
    """Whether the world's transport and each axis group's are authenticated."""
    groups = [world, *_axes(world, (2, 2))]
    for g in groups:
        g.all_reduce(np.ones(3))  # connects every link of each transport
    return [g._comm.transport.authenticated for g in groups]  # type: ignore[attr-defined]


def test_group_transports_use_the_job_secret() -> None:
    # spawn (under run_ranks) makes a secret for the job: every group's links use it.
    assert run_ranks(group_links_authenticated, 4, timeout=60) == [[True] * 3] * 4


def rings_within_budget(world: ProcessGroup) -> dict[str, Any]:
    """The world's rings fit the budget, a group's do not (socket), and come back on close."""
    from meshcomm.backends.tcp.same_host import ring_budget as shm_budget

    x = np.arange(4.0)
    world.all_reduce(x)  # the world's rings: one per peer
    first = world.new_group(range(world.size))
    assert first is not None
    got = first.all_reduce(x)
    report = {
        "world": world._comm.transport.channels,  # type: ignore[attr-defined]
        "group": first._comm.transport.channels,  # type: ignore[attr-defined]
        "why": sorted(first._comm.transport.shm_fallbacks.values()),  # type: ignore[attr-defined]
        "right": got.tolist() == (x * world.size).tolist(),
    }
    first.close()
    world.close()  # every ring of this process is gone: the budget is whole again
    report["left"] = shm_budget.rings.in_use
    return report


def test_rings_stay_within_the_process_budget() -> None:
    ring = 64 << 10
    env = {"MESHCOMM_SHM_BYTES": str(ring), "MESHCOMM_SHM_BUDGET": str(2 * (ring + 4096))}
    for r, report in enumerate(run_ranks(rings_within_budget, 3, env=env, timeout=60)):
        peers = {p for p in range(3) if p != r}
        # Every peer this rank talked to: the world's over rings, the group's over sockets.
        assert report["world"] and set(report["world"]) <= peers, report
        assert set(report["world"].values()) == {"shm"}, report
        assert report["group"] and set(report["group"].values()) == {"tcp"}, report
        assert report["why"] and all("budget" in why for why in report["why"]), report
        assert report["right"] and report["left"] == 0, report


def test_a_bad_ring_budget_is_refused_before_any_io(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshcomm.errors import InvalidArgument
    from meshcomm.store import HashStore

    monkeypatch.setenv("MESHCOMM_SHM_BUDGET", "lots")
    store = HashStore(timeout=5)
    with pytest.raises(InvalidArgument, match="MESHCOMM_SHM_BUDGET must be a non-negative"):
        TcpCommunicator.create_world(0, 1, store, 5.0)
    assert store.num_keys() == 0
