"""The CUDA IPC device path's protocol on a CPU: numpy over shared memory stands in for cupy.

:class:`~meshcomm.backends.cuda_ipc.IpcCommunicator` runs one protocol over a memory
mechanism (windows, handles through the store, the per-call handshake over the host
communicator); here the mechanism is
:class:`~meshcomm.backends.cuda_ipc.SharedMemoryStandIn`, so every collective runs over real
processes at worlds 1, 2, 3, 4 and 8 and must equal a numpy oracle (every primitive op and
dtype for the reductions), the group's lowerings run over it as they would for cupy
(:class:`~meshcomm.group.device_lower.DeviceBuffers`), the cache of opened windows is
checked, a dead peer becomes a ``PeerError`` naming it, and arguments are refused before
any I/O. The same path on a GPU is tests/test_gpu_ipc.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from meshcomm.backends.cuda_ipc import IpcCommunicator, SharedMemoryStandIn
from meshcomm.backends.cuda_ipc.communicator import MIN_SLOT_BYTES
from meshcomm.backends.local import SelfCommunicator
from meshcomm.errors import CommError, InvalidArgument, MismatchError, SpawnError
from meshcomm.reduction import PRIMITIVE_OP_KINDS, ReduceOp, combine
from meshcomm.store import HashStore
from meshcomm.testing import run_ranks

DTYPES = (
    np.bool_, np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128, ml_dtypes.bfloat16,
)  # fmt: skip
OPS = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR,
       ReduceOp.BXOR)  # fmt: skip


def ipc_world(group: Any, name: str = "t") -> IpcCommunicator:
    """The stand-in device communicator of a world: a host communicator of its own."""
    host = group._comm.sub(list(range(group.size)))
    return IpcCommunicator(host, SharedMemoryStandIn(), group.store, f"test/ipc/{name}")


def _input(rank: int, n: int, dtype: Any, salt: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: small values (products of 8 ranks stay exact), any rank can
    make any other's."""
    rng = np.random.default_rng(1000 * rank + salt)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, n).astype(bool)
    values = rng.integers(1, 3, n) * rng.choice([-1, 1], n)
    if np.dtype(dtype).kind == "u":
        values = np.abs(values)
    if np.dtype(dtype).kind == "c":
        return (values + 1j * rng.integers(-2, 3, n)).astype(dtype)
    return values.astype(dtype)


def _oracle(op: ReduceOp, parts: list[np.ndarray]) -> np.ndarray:
    acc = parts[0].copy()
    for part in parts[1:]:
        combine(op, acc, part)
    return acc


def _equal(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


def check_collectives(comm: Any, xp: Any) -> list[str]:
    """Every collective of device communicator ``comm`` (arrays of ``xp``: numpy over the
    stand-in, cupy on a GPU) against the numpy oracle: every primitive op and dtype ``xp``
    holds for the reductions, every root. Returns the problems, in words."""
    n, me = comm.size, comm.rank
    problems: list[str] = []

    def dev(a: np.ndarray) -> Any:
        return a.copy() if xp is np else xp.asarray(a)

    def check(what: str, got: Any, want: Any) -> None:
        got = np.asarray(got) if xp is np else xp.asnumpy(got)
        if not _equal(got, np.asarray(want)):
            problems.append(f"rank {me}: {what}: got {got!r}, want {want!r}")

    k = 5  # elements per rank block
    for dtype in DTYPES if xp is np else DTYPES[:-1]:  # cupy has no bfloat16
        kind, name = np.dtype(dtype).kind, np.dtype(dtype).name
        for op in OPS:
            if (op, "V" if dtype is ml_dtypes.bfloat16 else kind) not in PRIMITIVE_OP_KINDS:
                continue
            parts = [_input(r, n * k, dtype, 7) for r in range(n)]
            want = _oracle(op, parts)
            buf = dev(parts[me])
            comm.all_reduce(buf, op)
            check(f"all_reduce {op.value} {name}", buf, want)
            out = xp.empty(n * k, dtype)
            comm.all_reduce_out(dev(parts[me]), out, op)
            check(f"all_reduce_out {op.value} {name}", out, want)
            recv = xp.empty(k, dtype)
            comm.reduce_scatter(dev(parts[me]), recv, op)
            check(f"reduce_scatter {op.value} {name}", recv, want[me * k : (me + 1) * k])
            for root in {0, n - 1}:
                buf = dev(parts[me])
                comm.reduce(buf, root, op)
                if me == root:
                    check(f"reduce root={root} {op.value} {name}", buf, want)
        parts = [_input(r, n * k, dtype, 11) for r in range(n)]
        recv = xp.empty(n * n * k, dtype)
        comm.all_gather(dev(parts[me]), recv)
        check(f"all_gather {name}", recv, np.concatenate(parts))
        recv = xp.empty(n * k, dtype)
        comm.all_to_all(dev(parts[me]), recv)
        want = np.concatenate([p[me * k : (me + 1) * k] for p in parts])
        check(f"all_to_all {name}", recv, want)
        for root in range(n):
            buf = dev(parts[me])
            comm.broadcast(buf, root)
            check(f"broadcast root={root} {name}", buf, parts[root])
            into = xp.empty(n * n * k, dtype) if me == root else None
            comm.gather(dev(parts[me]), into, root)
            if me == root:
                check(f"gather root={root} {name}", into, np.concatenate(parts))
            out = xp.empty(k, dtype)
            comm.scatter(dev(parts[me]) if me == root else None, out, root)
            check(f"scatter root={root} {name}", out, parts[root][me * k : (me + 1) * k])
    comm.barrier()
    # Point to point, staged through host memory: a ring.
    if n > 1:
        got = xp.empty(3)
        comm.permute(dev(np.full(3, float(me))), (me + 1) % n, got, (me - 1) % n)
        check("permute", got, np.full(3, float((me - 1) % n)))
    # Sizes around a slot and zero elements.
    for count in (0, 1, MIN_SLOT_BYTES // 8, MIN_SLOT_BYTES // 8 + 1, 3 * MIN_SLOT_BYTES):
        parts = [_input(r, count, np.float64, count) for r in range(n)]
        buf = dev(parts[me])
        comm.all_reduce(buf, ReduceOp.SUM)
        check(f"all_reduce of {count} float64", buf, _oracle(ReduceOp.SUM, parts))
    return problems


def _collectives(group: Any) -> list[str]:
    comm = ipc_world(group)
    try:
        return check_collectives(comm, np)
    finally:
        comm.close()


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_every_collective_equals_the_numpy_oracle(nprocs: int) -> None:
    for problems in run_ranks(_collectives, nprocs, timeout=300):
        assert problems == [], "\n".join(problems[:20])


def _cache(group: Any) -> dict[str, Any]:
    """The windows opened per call: once per peer and generation, never per call."""
    n = group.size
    comm = ipc_world(group, "cache")
    mem = comm._mem
    seen: dict[str, Any] = {}
    small = np.ones(16)
    for _ in range(5):
        comm.all_reduce(small, ReduceOp.SUM)
    seen["after 5 small"] = mem.opens
    big = np.ones(MIN_SLOT_BYTES)  # 8x a slot: every rank's window grows once
    for _ in range(3):
        comm.all_reduce(big, ReduceOp.SUM)
    seen["after 3 big"] = mem.opens
    seen["retired left"] = len(comm._retired)
    seen["generations"] = sorted({g for g, _ in comm.opened.values()})
    comm.all_reduce(small, ReduceOp.SUM)  # a smaller call keeps the larger window
    seen["after a small again"] = mem.opens
    seen["size"] = n
    comm.close()
    return seen


@pytest.mark.parametrize("nprocs", [2, 4])
def test_opened_windows_are_cached_and_reopened_only_when_a_peer_grows(nprocs: int) -> None:
    for seen in run_ranks(_cache, nprocs, timeout=120):
        peers = seen["size"] - 1
        assert seen["after 5 small"] == peers, seen
        assert seen["after 3 big"] == 2 * peers, seen
        assert seen["after a small again"] == 2 * peers, seen
        assert seen["retired left"] == 0, seen
        assert seen["generations"] == [2], seen


def _lowerings(group: Any) -> list[str]:
    """The group's lowerings over DeviceBuffers of the stand-in (what a group runs for cupy
    arrays with this device communicator) equal the group's host results."""
    from meshcomm.group import lower as _lower
    from meshcomm.group.arrays import ScratchPool
    from meshcomm.group.device_lower import DeviceBuffers
    from meshcomm.group.lower import Call

    n, me = group.size, group.rank
    comm = ipc_world(group, "lower")
    on = DeviceBuffers(comm, np)
    problems: list[str] = []

    def run(op: str, *args: Any) -> Any:
        body, _ = getattr(_lower, op)(Call(comm, ScratchPool(), f"{op}: rank {me}"), *args, on=on)
        return body()

    x = np.random.default_rng(me).integers(-4, 4, (n, 3, 2 * n)).astype(np.float32)
    cases = {
        "all_reduce avg": (run("all_reduce", x, "avg", None), group.all_reduce(x, "avg")),
        "all_reduce premul": (
            run("all_reduce", x, "premul_sum", 2.0),
            group.all_reduce(x, "premul_sum", factor=2.0),
        ),
        "all_gather axis 1": (run("all_gather", x, 1, False), group.all_gather(x, 1)),
        "reduce_scatter tiled 2": (
            run("reduce_scatter", x, "sum", 2, True, None),
            group.reduce_scatter(x, "sum", 2, True),
        ),
        "all_to_all 0 2": (run("all_to_all", x, 0, 2, False), group.all_to_all(x, 0, 2)),
        "broadcast": (run("broadcast", x, n - 1, None, None), group.broadcast(x, n - 1)),
        "gather": (run("gather", x, 0), group.gather(x, 0)),
        "scatter": (run("scatter", x, 0, None, None), group.scatter(x, 0)),
    }
    for what, (got, want) in cases.items():
        if want is None and got is None:
            continue
        if not _equal(np.asarray(got), np.asarray(want)):
            problems.append(f"rank {me}: {what} differs")
    comm.close()
    return problems


@pytest.mark.parametrize("nprocs", [2, 3])
def test_the_group_lowerings_over_the_stand_in_equal_the_host_path(nprocs: int) -> None:
    for problems in run_ranks(_lowerings, nprocs, timeout=120):
        assert problems == [], problems


STANDINS = str(Path(__file__).parent / "standins")


def _conformance_through_device_arrays(group: Any) -> list[str]:
    """The conformance suite with "cupy" inputs (tests/standins: numpy dressed as cupy, put
    first on this rank process's path) through a group whose device communicator is the
    stand-in: every rank of a call must take the same route, also where a rank passes None
    to a broadcast or scatter, and point to point keeps tags and any-source receives."""
    import sys

    sys.path.insert(0, STANDINS)
    from test_gpu import DeviceGroup

    from meshcomm.group import ProcessGroup
    from meshcomm.testing import run_conformance

    host = group._comm.sub(list(range(group.size)))
    device = ipc_world(group, "pg")
    device.array_module = "cupy"  # the group's device arrays: the stand-in's numpy in disguise
    pg = ProcessGroup(host, store=group.store, name="ipc", device=device)
    try:
        return run_conformance(DeviceGroup(pg), quick=True)  # type: ignore[arg-type]
    finally:
        pg.close()


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_the_conformance_suite_through_device_arrays_over_the_stand_in(nprocs: int) -> None:
    """The GPU run's conformance test (tests/test_gpu_ipc.py) found ranks taking different
    routes: a rank passing None took the host route while the root's cupy array took the
    device route. Here the same suite runs on a CPU."""
    for rank, failures in enumerate(
        run_ranks(_conformance_through_device_arrays, nprocs, timeout=180)
    ):
        assert failures == [], f"rank {rank}: " + "\n".join(failures[:20])


def _mismatch(group: Any) -> str:
    comm = ipc_world(group, "mismatch")
    size = 4 if group.rank == 0 else 8
    try:
        comm.all_reduce(np.ones(size), ReduceOp.SUM)
    except MismatchError as exc:
        return str(exc)
    finally:
        comm.close()
    return ""


def test_ranks_that_call_different_sizes_raise_naming_both() -> None:
    for said in run_ranks(_mismatch, 2, timeout=60):
        assert "32 bytes" in said and "64 bytes" in said, said
        assert "rank 0" in said and "rank 1" in said, said


VICTIM = 2


def _dead_peer(group: Any, folder: str) -> None:
    if group.rank != VICTIM:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # live to write the report
    comm = ipc_world(group, "dead")
    buf = np.ones(1024)
    comm.all_reduce(buf, ReduceOp.SUM)
    group.store.set(f"test/dead/{group.rank}", b"1")  # its first call is over here
    if group.rank == VICTIM:
        # Dies once every survivor has its first call's bytes (some may not have left the
        # victim when it returned), so the survivors fail in the second call.
        group.store.wait([f"test/dead/{r}" for r in range(group.size)])
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(buf, ReduceOp.SUM)
    except CommError as exc:
        report = {"type": type(exc).__name__, "rank": getattr(exc, "rank", None), "text": str(exc)}
        try:
            comm.all_reduce(buf, ReduceOp.SUM)
        except CommError as again:
            report["again"] = str(again)
        with open(os.path.join(folder, f"{group.rank}.json"), "w") as f:
            json.dump(report, f)
        raise


def test_a_dead_peer_is_a_peer_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises((SpawnError, CommError)):
        run_ranks(_dead_peer, 3, timeout=60, env={"MESHCOMM_TIMEOUT": "15"}, args=(str(tmp_path),))
    for rank in (0, 1):
        report = json.loads((tmp_path / f"{rank}.json").read_text())
        assert (report["type"], report["rank"]) == ("PeerError", VICTIM), report
        assert "failed earlier" in report["again"], report


def test_arguments_are_refused_before_any_io() -> None:
    comm = IpcCommunicator(SelfCommunicator(), SharedMemoryStandIn(), HashStore(), "args")
    x = np.zeros(4)
    with pytest.raises(InvalidArgument, match=r"rank 0: root must be a rank in \[0, 1\), got 3"):
        comm.broadcast(x, 3)
    with pytest.raises(
        InvalidArgument,
        match=r"rank 0: recv has 3 elements, all_gather needs 4 \(group size 1 x send's 4\)",
    ):
        comm.all_gather(x, np.zeros(3))
    with pytest.raises(InvalidArgument, match="send is float64 but recv is float32"):
        comm.all_reduce_out(x, np.zeros(4, np.float32), ReduceOp.SUM)
    with pytest.raises(InvalidArgument, match="must be C-contiguous"):
        comm.all_reduce(np.zeros((4, 4))[:, 0], ReduceOp.SUM)
    with pytest.raises(InvalidArgument, match="must be a numpy array"):
        comm.all_reduce([1.0, 2.0], ReduceOp.SUM)
    with pytest.raises(InvalidArgument, match="not 'avg'"):
        comm.all_reduce(x, ReduceOp.AVG)
    with pytest.raises(TypeError, match="bool or integer"):
        comm.all_reduce(x, ReduceOp.BXOR)
    with pytest.raises(InvalidArgument, match="dst must be a rank"):
        comm.send(x, 1, 0)
    with pytest.raises(InvalidArgument, match=r"ranks must be distinct ranks in \[0, 1\)"):
        comm.sub([1])
    assert comm._window is None and comm.opened == {}  # nothing was allocated or opened
    comm.close()
    with pytest.raises(CommError, match="closed"):
        comm.all_reduce(x, ReduceOp.SUM)


def test_a_world_of_one_runs_on_the_stand_in() -> None:
    comm = IpcCommunicator(SelfCommunicator(), SharedMemoryStandIn(), HashStore(), "one")
    x = np.arange(6, dtype=np.int32)
    comm.all_reduce(x, ReduceOp.MAX)
    recv = np.empty(6, np.int32)
    comm.all_to_all(x, recv)
    assert recv.tolist() == x.tolist()
    assert comm.sub([0]).size == 1
    comm.close()
    comm.close()  # idempotent


# == choosing the path (pure; no GPU needed) ===================================================
def _choose(**changes: Any) -> Any:
    from meshcomm.backends.cuda_ipc.selection import choose

    facts: dict[str, Any] = {
        "backend": "tcp",
        "named": False,
        "world_size": 4,
        "local_world_size": 4,
        "gpu_count": 1,
        "device_ids": [0, 0, 0, 0],
        "peer_access": [[True]],
        "cupy": True,
        "setting": None,
    }
    facts.update(changes)
    return choose(**facts)


@pytest.mark.parametrize(
    ("changes", "use", "reason"),
    [
        ({}, True, "4 ranks share 1 GPU on this host"),
        ({"setting": "auto"}, True, "4 ranks share 1 GPU"),
        ({"setting": "0"}, False, "MESHCOMM_CUDA_IPC=0"),
        ({"cupy": False}, False, "cupy is not installed"),
        ({"gpu_count": 0, "peer_access": []}, False, "cupy sees no GPU"),
        ({"backend": "mpi"}, False, "the host backend is mpi"),
        ({"named": True}, False, "a backend was named"),
        ({"named": True, "setting": "1"}, True, "4 ranks share"),
        ({"world_size": 1, "local_world_size": 1, "device_ids": [0]}, False, "a world of one"),
        ({"world_size": 8}, False, "the world spans hosts (8 ranks, 4 on this host)"),
        ({"local_world_size": None}, False, "the world spans hosts"),
        (
            {"gpu_count": 4, "device_ids": [0, 1, 2, 3], "peer_access": [[True] * 4] * 4},
            False,
            "a GPU for every rank: the default pairs tcp with nccl",
        ),
        (
            {
                "gpu_count": 4,
                "device_ids": [0, 1, 2, 3],
                "peer_access": [[True] * 4] * 4,
                "setting": "on",
            },
            True,
            "4 ranks share 4 GPUs",
        ),
        (
            {"gpu_count": 2, "device_ids": [0, 1, 0, 1], "peer_access": [[True, True]] * 2},
            True,
            "4 ranks share 2 GPUs",
        ),
        (
            {"gpu_count": 2, "device_ids": [0, 1, 0, 1], "peer_access": [[True, False]] * 2},
            False,
            "GPU 0 cannot read GPU 1's memory (no peer access)",
        ),
    ],
)
def test_the_choice_of_the_path(changes: dict[str, Any], use: bool, reason: str) -> None:
    choice = _choose(**changes)
    assert choice.use is use, choice
    assert reason in choice.reason, choice
    assert choice.forced is (changes.get("setting") in ("1", "on"))


def test_a_bad_setting_is_refused_naming_the_variable() -> None:
    with pytest.raises(InvalidArgument, match=r"MESHCOMM_CUDA_IPC='maybe': expected auto"):
        _choose(setting="maybe")


def _world_choice(group: Any) -> tuple[str, Any, str | None]:
    from meshcomm.backends.cuda_ipc.selection import last_choice

    choice = last_choice()
    return group.backend, group.device_backend, None if choice is None else choice.reason


def test_a_world_without_cupy_stages_and_says_why() -> None:
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed: tests/test_gpu_ipc.py checks the choice there")
    unnamed: Any = None  # init() without a backend: the default, where the path may be taken
    for backend, device, reason in run_ranks(_world_choice, 2, timeout=60, backend=unnamed):
        assert (backend, device) == ("tcp", None)
        assert reason == "cupy is not installed", reason
    for _, device, reason in run_ranks(_world_choice, 2, timeout=60, backend="tcp"):
        assert device is None
        assert reason is not None and reason.startswith("a backend was named"), reason


def test_asking_for_the_path_without_cupy_raises_why() -> None:
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("cupy is installed")
    with pytest.raises(
        InvalidArgument, match="the cuda_ipc path cannot run: cupy is not installed"
    ):
        run_ranks(_world_choice, 2, timeout=60, backend="cpu:tcp,cuda:cuda_ipc")
    with pytest.raises(InvalidArgument, match="cupy is not installed"):
        run_ranks(_world_choice, 2, timeout=60, env={"MESHCOMM_CUDA_IPC": "1"})


# == inside a process group: sub-groups and point to point ====================================
def _in_a_group(group: Any) -> list[str]:
    """A group whose device communicator is the stand-in: split makes sub-groups with device
    communicators of their own (host communicators of their members), which collect; point
    to point of the device path (headers on the host, payloads here) goes round a ring."""
    from meshcomm.group import ProcessGroup
    from meshcomm.group.arrays import ScratchPool
    from meshcomm.group.device_p2p import DeviceP2P
    from meshcomm.group.lower import Call

    n, me = group.size, group.rank
    host = group._comm.sub(list(range(n)))
    pg = ProcessGroup(host, store=group.store, name="ipc", device=ipc_world(group, "pg"))
    problems: list[str] = []
    if pg.backend != "cpu:tcp,cuda:cuda_ipc":
        problems.append(f"backend {pg.backend!r}")
    half = pg.split(color=me % 2)
    assert half is not None
    dev = half._device
    if not isinstance(dev, IpcCommunicator) or dev.size != len(half.ranks):
        problems.append(f"the split's device communicator is {dev!r}")
    else:
        x = np.full(3, float(me))
        dev.all_reduce(x, ReduceOp.SUM)
        want = float(sum(r for r in range(n) if r % 2 == me % 2))
        if x.tolist() != [want] * 3:
            problems.append(f"split all_reduce: {x.tolist()}, want {want}")
    p2p = DeviceP2P(pg._comm, pg._device, np)
    if n > 1:
        c = Call(pg._comm, ScratchPool(), f"p2p: rank {me}")
        send, _ = p2p.send(c, np.arange(4.0) + me, (me + 1) % n, 7, False)
        recv, _ = p2p.recv(c, (me - 1) % n, 7, None, False)
        if me % 2:
            got = recv()
            send()
        else:
            send()
            got = recv()
        if np.asarray(got).tolist() != (np.arange(4.0) + (me - 1) % n).tolist():
            problems.append(f"p2p ring: got {got}")
    half.close()
    pg.close()
    return problems


@pytest.mark.parametrize("nprocs", [2, 4])
def test_groups_split_their_device_communicator_and_send_through_it(nprocs: int) -> None:
    for problems in run_ranks(_in_a_group, nprocs, timeout=120):
        assert problems == [], problems


# == many calls in a row: the double buffering under skewed timing ============================
def _random_calls(group: Any, calls: int) -> list[str]:
    """``calls`` collectives drawn by one seed on every rank (kind, size across the slot
    boundaries, root), each rank pausing at random between them: a rank that runs ahead
    writes its next slots while slow peers still read, which the parity of the slots and
    the handshake must keep apart."""
    import random
    import time

    n, me = group.size, group.rank
    comm = ipc_world(group, "random")
    plan, pauses = random.Random(36), random.Random(me)
    problems: list[str] = []
    sizes = (1, 7, MIN_SLOT_BYTES // 8 - 1, MIN_SLOT_BYTES // 4, MIN_SLOT_BYTES)
    for call in range(calls):
        kind = plan.choice(("all_reduce", "all_gather", "broadcast", "reduce_scatter"))
        count, root = plan.choice(sizes) // 8 * 8 or 8, plan.randrange(n)
        parts = [np.full(count, float(call * 10 + r)) for r in range(n)]
        if pauses.random() < 0.3:
            time.sleep(pauses.uniform(0, 0.004))
        if kind == "all_reduce":
            got = parts[me].copy()
            comm.all_reduce(got, ReduceOp.SUM)
            want = _oracle(ReduceOp.SUM, parts)
        elif kind == "all_gather":
            got = np.empty(n * count)
            comm.all_gather(parts[me], got)
            want = np.concatenate(parts)
        elif kind == "broadcast":
            got = parts[me].copy()
            comm.broadcast(got, root)
            want = parts[root]
        else:
            got = np.empty(count // n if count >= n else 0)
            send = np.concatenate([parts[me]] * n)[: got.size * n]
            comm.reduce_scatter(send, got, ReduceOp.SUM)
            full = _oracle(ReduceOp.SUM, [np.concatenate([p] * n)[: got.size * n] for p in parts])
            want = full[me * got.size : (me + 1) * got.size]
        if not _equal(got, want):
            problems.append(f"rank {me}: call {call} {kind} of {count}: wrong values")
    comm.close()
    return problems


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_many_calls_with_skewed_ranks_never_read_a_reused_slot(nprocs: int) -> None:
    for problems in run_ranks(_random_calls, nprocs, timeout=180, args=(300,)):
        assert problems == [], problems[:10]


@pytest.mark.parametrize(
    ("world", "local", "gpus", "setting", "why"),
    [
        (4, 4, 1, None, "4 ranks share 1 GPU on this host, which NCCL refuses"),
        (4, 4, 2, "auto", "4 ranks share 2 GPUs on this host, which NCCL refuses"),
        (4, 4, 4, None, None),  # a GPU per rank: nccl
        (4, 4, 1, "0", None),  # asked to keep nccl (it refuses)
        (4, 2, 1, None, None),  # over hosts: nccl, and its own error
        (1, 1, 1, None, None),  # a world of one
        (2, 2, 0, None, None),  # no GPU: nccl's own error says so
    ],
)
def test_a_world_naming_nccl_on_shared_gpus_takes_the_ipc_path(
    world: int, local: int, gpus: int, setting: str | None, why: str | None
) -> None:
    from meshcomm.backends.cuda_ipc.selection import instead_of_nccl

    got = instead_of_nccl(world_size=world, local_world_size=local, gpu_count=gpus, setting=setting)
    assert got == why
