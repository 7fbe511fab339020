"""Default mismatch checks: ranks that call different collectives raise on every rank, at once.

Real ranks over tcp (sockets, shared-memory rings, the board, the CMA collectives), worlds
2 and 4: for each kind of mismatch (dtype, shape, reduce op, root, kind of collective) one
rank calls something else than the others; every rank must raise
:class:`~meshcomm.errors.MismatchError` within 3 s, with the same words naming both calls,
their call sites and the group. A rooted collective has no barrier: a rank that only sends
may return before anyone compares, and raises at its next call (on any group of the world:
tests below). The mpi backend's checks are in tests/test_mpi.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pytest

from meshcomm.diagnostics import fingerprint as _fingerprint
from meshcomm.errors import CommError, MismatchError
from meshcomm.group import ProcessGroup
from meshcomm.group import lower as _lower
from meshcomm.reduction import ReduceOp
from meshcomm.testing import run_ranks

pytestmark = pytest.mark.timeout(120)

#: The kinds of mismatch, and what the odd rank and the others call (as the message says).
KINDS = {
    "dtype": ("all_reduce(int32[4], sum)", "all_reduce(float32[4], sum)"),
    "shape": ("all_reduce(float32[2], sum)", "all_reduce(float32[4], sum)"),
    "reduce_op": ("all_reduce(float32[4], max)", "all_reduce(float32[4], sum)"),
    "root": ("broadcast(float32[4], root=1)", "broadcast(float32[4], root=0)"),
    "collective": ("all_gather(float32[4])", "all_reduce(float32[4], sum)"),
    "device": ("all_reduce(float32[4], sum, on a GPU)", "all_reduce(float32[4], sum)"),
}
#: The kinds of rooted collectives, whose ranks may raise at their next call instead.
ROOTED = {"root"}
SOCKETS = {"MESHCOMM_TRANSPORT": "tcp"}
RINGS = {"MESHCOMM_SHM_BOARD_MAX": "0"}  # same host: rings (sub-groups never use the board)
DIRECT = {"MESHCOMM_SHM_DIRECT_MIN": "1"}  # every size takes the CMA collectives


def _line(text: str) -> int:
    """The line of this file that ends with ``# text``."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {text}"))


def _call(group: ProcessGroup, kind: str, odd: bool) -> None:
    x = np.ones(4, np.float32)
    if kind == "dtype":
        group.all_reduce(x.astype(np.int32) if odd else x)  # THE CALL
    elif kind == "shape":
        group.all_reduce(x[:2].copy() if odd else x)  # THE CALL
    elif kind == "reduce_op":
        group.all_reduce(x, "max" if odd else "sum")  # THE CALL
    elif kind == "root":
        group.broadcast(x, root=1 if odd else 0)  # THE CALL
    elif kind == "collective":
        group.all_gather(x) if odd else group.all_reduce(x)  # THE CALL
    else:
        # A GPU array and a host one: without a GPU, the device flag a cupy array sets in
        # ProcessGroup._issue (numpy as the "device" module: the result comes back as is).
        lowered = _lower.all_reduce(group._enter("all_reduce"), x, "sum", None)
        group._issue("all_reduce", lowered, False, np if odd else None)


def _each_kind(world: ProcessGroup, kinds: list[str]) -> dict[str, tuple[str, float, str, str]]:
    """For each kind, in a fresh group of every rank: one good call, then rank 1 calls the
    odd one, then (if nothing was raised) a good one. Returns, per kind, the error's type,
    seconds to raise, its words, and which call raised ("call" or "next")."""
    out = {}
    cma_verdicts = []
    for kind in kinds:
        group = world.subgroup(list(world.ranks), f"k-{kind}")
        x = np.ones(4, np.float32)
        group.all_reduce(x)  # a good call first: the CMA route is learned, channels open
        group.broadcast(x, root=0)
        start = time.monotonic()
        where = "call"
        try:
            _call(group, kind, world.rank == 1)
            where = "next"
            group.all_reduce(x)
        except Exception as exc:
            out[kind] = (type(exc).__name__, time.monotonic() - start, str(exc), where)
        else:
            out[kind] = ("no error", time.monotonic() - start, "", where)
        cma_verdicts.append(getattr(group._comm, "_cma", None) and group._comm._cma._verdict)
    out["cma"] = ("", 0.0, repr(cma_verdicts), "")
    return out


def _check(
    results: list[dict[str, tuple[str, float, str, str]]], kinds: list[str], label: str
) -> None:
    line = _line("THE CALL")
    for kind in kinds:
        odd, usual = KINDS[kind]
        words = {r[kind][2] for r in results}
        for rank, r in enumerate(results):
            name, seconds, text, where = r[kind]
            assert name == "MismatchError", f"{kind}: rank {rank}: {name}: {text}"
            assert seconds < 3.0, f"{kind}: rank {rank} raised after {seconds:.2f} s"
            assert where == "call" or kind in ROOTED, f"{kind}: rank {rank} raised only after"
        assert len(words) == 1, f"{kind}: the ranks raised different words: {words}"
        text = words.pop()
        assert "0x" not in text, text
        assert text.startswith(f"ranks disagree on the collective {label.format(kind=kind)}: "), (
            text
        )
        calls = dict(
            (int(m.group(1)), m.group(2))
            for m in re.finditer(r"rank (\d+) called (\S+\(.*?\)) at test_mismatch\.py:", text)
        )
        assert calls.get(1) == odd, f"{kind}: {text}"
        assert [c for r, c in calls.items() if r != 1] == [usual], f"{kind}: {text}"
        if kind != "device":  # (its _issue call is not where the ledger looks for a site)
            assert text.count(f"test_mismatch.py:{line + list(KINDS).index(kind) * 2}") == 2, text


def _run(nprocs: int, env: dict[str, str], kinds: list[str]) -> list[Any]:
    return run_ranks(_each_kind, nprocs, env={"MESHCOMM_TIMEOUT": "20", **env}, args=(kinds,))


@pytest.mark.parametrize(
    ("nprocs", "env"),
    [
        (2, SOCKETS),
        (4, RINGS),
        pytest.param(4, SOCKETS, marks=pytest.mark.slow),
        pytest.param(2, RINGS, marks=pytest.mark.slow),
    ],
    ids=["sockets-2", "rings-4", "sockets-4", "rings-2"],
)
def test_every_kind_raises_on_every_rank(nprocs: int, env: dict[str, str]) -> None:
    kinds = list(KINDS)
    results = _run(nprocs, env, kinds)
    _check(results, kinds, "on group 'k-{kind}'")


@pytest.mark.parametrize("nprocs", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_kind_raises_on_the_cma_collectives(nprocs: int) -> None:
    kinds = list(KINDS)
    results = _run(nprocs, DIRECT, kinds)
    if "True" not in results[0]["cma"][2]:
        pytest.skip("process_vm_readv/writev refused here: no CMA collectives")
    _check(results, kinds, "on group 'k-{kind}'")


def _on_world(world: ProcessGroup, kind: str) -> tuple[str, float, str, bool]:
    """On the world (the board where ranks share a host): one good call, then rank 1's odd
    one. ``big``: rank 1 reduces 512 KiB, past the board, while the others use it."""
    x = np.ones(4, np.float32)
    world.all_reduce(x)
    board = bool(getattr(world._comm, "_board", False))
    start = time.monotonic()
    try:
        if kind == "big":
            world.all_reduce(np.ones(1 << 17, np.float32) if world.rank == 1 else x)
        elif kind == "large":  # 1 MiB: same-host frames go as RTS, read in place (CMA)
            y = np.ones(1 << 18, np.float32)
            world.all_reduce(y.astype(np.int32) if world.rank == 1 else y)
        else:
            _call(world, kind, world.rank == 1)
    except MismatchError as exc:
        return "MismatchError", time.monotonic() - start, str(exc), board
    except Exception as exc:
        return type(exc).__name__, time.monotonic() - start, str(exc), board
    return "no error", time.monotonic() - start, "", board


@pytest.mark.parametrize(
    ("nprocs", "kind"),
    [
        (2, "dtype"),
        (4, "reduce_op"),
        pytest.param(4, "big", marks=pytest.mark.slow),
        pytest.param(2, "large", marks=pytest.mark.slow),
    ],
)
def test_the_board_compares_stamps(nprocs: int, kind: str) -> None:
    """The board, a rank past it while the others use it (big), and frames read in place
    (large: the ring algorithms, not the CMA collectives)."""
    env = {"MESHCOMM_TIMEOUT": "20", "MESHCOMM_SHM_DIRECT_MIN": "0"}
    results = run_ranks(_on_world, nprocs, env=env, args=(kind,))
    if not results[0][3]:
        pytest.skip("no shared-memory board here")
    words = {r[2] for r in results}
    for rank, (name, seconds, text, _) in enumerate(results):
        assert name == "MismatchError", f"rank {rank}: {name}: {text}"
        assert seconds < 3.0, f"rank {rank} raised after {seconds:.2f} s"
    assert len(words) == 1, words
    text = words.pop()
    assert text.startswith("ranks disagree on the collective on group 'world': "), text
    odd = {
        "big": "all_reduce(float32[131072], sum)",
        "large": "all_reduce(int32[262144], sum)",
    }.get(kind) or KINDS[kind][0]
    assert f"rank 1 called {odd} at test_mismatch.py:" in text, text


def _psum_over_tp(world: ProcessGroup) -> str:
    import meshcomm

    x = np.ones(3, np.float32)
    try:
        # Inside the try from the start: the world alarm of ranks 2 and 3's mismatch may
        # reach ranks 0 and 1 before their first psum, which then raises the same words.
        mesh = meshcomm.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
        meshcomm.ops.psum(x, "tp", mesh=mesh)
        meshcomm.ops.psum(x.astype(np.float64) if world.rank == 3 else x, "tp", mesh=mesh)  # PSUM
        # Ranks 0 and 1 agree; the mismatch of ranks 2 and 3 stops them at a later call.
        world.barrier()
    except MismatchError as exc:
        return str(exc)
    return "no error"


def test_a_mesh_axis_is_named_and_the_call_by_its_ops_name() -> None:
    results = run_ranks(_psum_over_tp, 4, env={"MESHCOMM_TIMEOUT": "20"})
    line = _line("PSUM")
    assert len(set(results)) == 1, results  # ranks 0 and 1 (which agree) too, later
    for rank in (2, 3):  # the 'tp' group of ranks 2 and 3
        text = results[rank]
        assert text.startswith("ranks disagree on the collective over 'tp': "), text
        assert f"rank 3 called psum(float64[3], sum) at test_mismatch.py:{line}" in text, text
        assert f"rank 2 called psum(float32[3], sum) at test_mismatch.py:{line}" in text, text


def _off(world: ProcessGroup) -> tuple[bool, Any]:
    x = np.ones(4, np.float32)
    y = world.all_reduce(x if world.rank == 0 else x.astype(np.int32))
    return world._issuer._stamper is None, y.tolist()


def test_off_turns_the_checks_off() -> None:
    results = run_ranks(_off, 2, env={"MESHCOMM_DEBUG": "OFF"})
    assert all(off for off, _ in results)
    assert results[0][1] != [2.0] * 4  # float32 and int32 bytes summed as float32: garbage


# -- the fingerprint itself, no ranks ---------------------------------------------------------
def test_signatures_tell_every_kind_apart() -> None:
    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    calls = {
        "base": ("all_reduce", {"dtype": f32, "shape": (4,), "reduce": ReduceOp.SUM}, False),
        "dtype": ("all_reduce", {"dtype": i32, "shape": (4,), "reduce": ReduceOp.SUM}, False),
        "shape": ("all_reduce", {"dtype": f32, "shape": (2, 2), "reduce": ReduceOp.SUM}, False),
        "reduce": ("all_reduce", {"dtype": f32, "shape": (4,), "reduce": ReduceOp.MAX}, False),
        "op": ("reduce", {"dtype": f32, "shape": (4,), "reduce": ReduceOp.SUM, "root": 0}, False),
        "device": ("all_reduce", {"dtype": f32, "shape": (4,), "reduce": ReduceOp.SUM}, True),
        "tiled": ("all_gather", {"dtype": f32, "shape": (4,), "axis": 0, "tiled": True}, False),
        "untiled": ("all_gather", {"dtype": f32, "shape": (4,), "axis": 0, "tiled": False}, False),
    }
    sigs = {k: _fingerprint.signature_of(*v) for k, v in calls.items()}
    assert len(set(sigs.values())) == len(sigs), sigs
    assert all(0 <= s < 1 << 46 for s in sigs.values())
    stamp = _fingerprint.stamp(sigs["base"], 70001)
    assert 0 <= stamp < 1 << 62 and _fingerprint.stamp_seq(stamp, 70000) == 70001


def test_signatures_are_the_same_in_every_process() -> None:
    """``hash`` of a str is salted per process; signatures hash ints only."""
    code = (
        "import numpy as np; from meshcomm.diagnostics import fingerprint as f; "
        "from meshcomm.reduction import ReduceOp; "
        "print(f.signature_of('all_reduce', {'dtype': np.dtype('float32'), 'shape': (4, 2), "
        "'reduce': ReduceOp.SUM, 'args': ((0, 1),)}, True))"
    )
    seen = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        seen.add(out.stdout.strip())
    assert len(seen) == 1, seen


def test_a_gpu_array_is_described_and_stamped_apart_from_a_host_one() -> None:
    """Ranks passing a GPU array and a host array to one collective differ in their stamps;
    the words say which is on the GPU (needs no GPU: the fingerprint alone)."""
    fields = {"dtype": np.dtype(np.float32), "shape": (4,), "reduce": ReduceOp.SUM}
    gpu = _fingerprint.signature_of("all_reduce", fields, True)
    host = _fingerprint.signature_of("all_reduce", fields, False)
    assert gpu != host
    words = _fingerprint.describe_call("psum", np.dtype(np.float32), (4,), "sum", None, True)
    assert words == "psum(float32[4], sum, on a GPU)"


def test_abort_records_say_mismatch() -> None:
    # Imported here: the ranks import this module, and the tcp backend reads its knobs
    # (MESHCOMM_SHM_DIRECT_MIN) once, at its import, which must come after their env is set.
    from meshcomm.backends.tcp.abort import AbortRecord

    record = AbortRecord(None, "ranks disagree on the collective over 'tp': ...", mismatch=True)
    assert AbortRecord.decode(record.encode(), world_size=4) == record
    assert not AbortRecord.decode(AbortRecord(1, "died").encode(), world_size=4).mismatch


def test_the_ledger_records_reduce_op_root_and_device() -> None:
    """What the words of a mismatch are made of, on both paths (general and direct)."""
    from meshcomm.backends.local import SelfCommunicator

    g = ProcessGroup(SelfCommunicator())
    x = np.ones(3, np.float32)
    for _ in range(2):  # the second call of each takes the direct path
        g.all_reduce(x, "max")
        g.broadcast(x, root=0)
    g.all_gather(x)
    records = g.ledger()
    assert [(r["op"], r["reduce"], r["root"]) for r in records] == [
        ("all_reduce", "max", None),
        ("broadcast", None, 0),
        ("all_reduce", "max", None),
        ("broadcast", None, 0),
        ("all_gather", None, None),
    ]
    assert all(r["shape"] == (3,) and r["dtype"] == "float32" for r in records)
    assert not any(r["device"] for r in records)
    assert {r["group"] for r in records} == {"on group 'world'"}
    g.label = "over 'tp'"  # as a mesh names the group it made for its axis 'tp'
    assert g.ledger()[-1]["group"] == "over 'tp'"
    g.close()


def test_a_frame_nobody_waits_for_is_judged_by_its_call_number() -> None:
    """Matching's rule for stamped frames that arrive before their receive: a later call's
    is a peer that is ahead (kept); the same call number with another signature, or an
    earlier call's, is a mismatch."""
    from meshcomm.backends.tcp.matching import Matching
    from meshcomm.backends.tcp.waiting import Progress

    engine = Matching(0, Progress())
    engine.labels[7] = "over 'tp'"
    mine = _fingerprint.stamp(1234, 10)
    engine.stamped = (7, -2 - mine)

    def tag(sig: int, seq: int) -> int:
        return -2 - _fingerprint.stamp(sig, seq)

    engine.stray(7, 1, tag(1234, 10))  # the same call
    engine.stray(7, 1, tag(999, 11))  # a later call: the peer is ahead
    engine.stray(8, 1, tag(999, 10))  # another communicator's
    engine.stray(7, 1, -1)  # unstamped (MESHCOMM_DEBUG=OFF there)
    for sig, seq in ((999, 10), (1234, 9)):  # another signature; an earlier call
        with pytest.raises(MismatchError, match="rank 1 called a different collective over 'tp'"):
            engine.stray(7, 1, tag(sig, seq))


# == rooted collectives: no barrier; a rank that returned raises at its next call ==========
#: Rank 1's odd call of each rooted op (the others call it with float32[4] from rank 0).
ROOTED_ODD = {
    "broadcast": "broadcast(int32[4], root=0)",
    "reduce": "reduce(int32[4], sum, root=0)",
    "gather": "gather(float32[2], root=0)",
    "scatter": "scatter(float32[2], root=0)",
}


def _rooted_call(group: ProcessGroup, op: str, odd: bool) -> None:
    x = np.ones(4, np.float32)
    if op == "broadcast":
        group.broadcast(x.astype(np.int32) if odd else x, root=0)  # ROOTED broadcast
    elif op == "reduce":
        group.reduce(x.astype(np.int32) if odd else x, root=0)  # ROOTED reduce
    elif op == "gather":
        group.gather(x[:2].copy() if odd else x, root=0)  # ROOTED gather
    else:  # each rank's entry: 2 floats on rank 1, 4 elsewhere
        stacked = np.ones((group.size, 2 if odd else 4), np.float32)
        group.scatter(stacked, root=0)  # ROOTED scatter


def _rooted(world: ProcessGroup, ops: list[str]) -> dict[str, tuple[str, str, float]]:
    """Per op, in fresh groups: rank 1 calls it differently; a rank that returns then calls
    all_reduce on *another* group until it raises (at most 5 s). Returns, per op, where this
    rank raised ("call" or "next"), the words, and the seconds from the call."""
    out = {}
    for op in ops:
        group = world.subgroup(list(world.ranks), f"rooted-{op}")
        other = world.subgroup(list(world.ranks), f"other-{op}")
        x = np.ones(4, np.float32)
        group.all_reduce(x)
        other.all_reduce(x)
        start = time.monotonic()
        try:
            _rooted_call(group, op, world.rank == 1)
        except MismatchError as exc:
            out[op] = ("call", str(exc), time.monotonic() - start)
            continue
        out[op] = ("none", "", 0.0)
        while time.monotonic() - start < 5.0:
            try:
                other.all_reduce(x)
            except MismatchError as exc:
                out[op] = ("next", str(exc), time.monotonic() - start)
                break
    return out


@pytest.mark.parametrize("nprocs", [2, 4])
def test_a_rank_that_returned_from_a_rooted_call_raises_at_its_next_call_on_any_group(
    nprocs: int,
) -> None:
    """No barrier: the root of a broadcast (or the leaves of a reduce, gather, scatter) send
    and return; the rank that compares raises in the call and announces it, and every rank
    that returned raises the same words at its next call on another group."""
    ops = list(ROOTED_ODD)
    results = run_ranks(_rooted, nprocs, env={"MESHCOMM_TIMEOUT": "20"}, args=(ops,))
    for op in ops:
        seen = [r[op] for r in results]
        assert all(where in ("call", "next") for where, _, _ in seen), (op, seen)
        assert any(where == "call" for where, _, _ in seen), (op, seen)
        assert all(seconds < 4.0 for _, _, seconds in seen), (op, seen)
        words = {text for _, text, _ in seen}
        assert len(words) == 1, (op, words)
        text = words.pop()
        assert text.startswith(f"ranks disagree on the collective on group 'rooted-{op}': "), text
        assert f"rank 1 called {ROOTED_ODD[op]} at test_mismatch.py:" in text, text
        assert text.count(f"test_mismatch.py:{_line(f'ROOTED {op}')} ") == 2, text
    # The root of a broadcast, and a leaf of a reduce, returned before anyone compared.
    assert results[0]["broadcast"][0] == "next" or nprocs > 2, results[0]["broadcast"]
    assert results[1]["reduce"][0] == "next", results[1]["reduce"]


def _roots_each(world: ProcessGroup) -> tuple[str, str]:
    """Every rank takes itself for the broadcast's root (nobody receives a frame of it);
    then one more call on the group. Returns where this rank raised, and the words."""
    group = world.subgroup(list(world.ranks), "roots")
    x = np.ones(4, np.float32)
    group.all_reduce(x)
    try:
        group.broadcast(x, root=group.rank)  # EVERY ROOT
    except CommError as exc:  # DETAIL's check raises a CommError naming every call
        return "call", f"{type(exc).__name__}: {exc}"
    try:
        group.all_reduce(x)
    except CommError as exc:
        return "next", f"{type(exc).__name__}: {exc}"
    return "none", ""


@pytest.mark.parametrize("level", ["default", "DETAIL"])
def test_ranks_that_each_take_themselves_for_the_root(level: str) -> None:
    """By default nobody need compare in the call (each only sends): the frames left behind
    are compared at the group's next call, which raises on every rank naming the broadcast; with
    MESHCOMM_DEBUG=DETAIL every rank raises in the call itself."""
    env = {"MESHCOMM_TIMEOUT": "20", **({"MESHCOMM_DEBUG": "DETAIL"} if level == "DETAIL" else {})}
    results = run_ranks(_roots_each, 2, env=env)
    # By default a rank may also see the other's frame while still in its call.
    want = ("call",) if level == "DETAIL" else ("call", "next")
    assert all(where in want for where, _ in results), results
    text = results[0][1]
    if level == "DETAIL":
        assert "called broadcast(seq=2, dtype=float32, shape=(4,), root=0" in text, text
        assert "root=1" in text, text
    else:
        assert len({t for _, t in results}) == 1, results
        line = _line("EVERY ROOT")
        assert text.startswith("MismatchError: "), text
        assert f"rank 0 called broadcast(float32[4], root=0) at test_mismatch.py:{line}" in text
        assert f"rank 1 called broadcast(float32[4], root=1) at test_mismatch.py:{line}" in text


def test_under_meshrun_the_root_stops_at_its_next_call_and_the_job_fails() -> None:
    """The root returns from the broadcast (its next call, on another group, would raise the
    same words); the job stops: no rank prints "done", meshrun exits non-zero and shows the
    mismatch."""
    script = os.path.join(os.path.dirname(__file__), "scripts", "rooted_mismatch.py")
    run = subprocess.run(
        [sys.executable, "-m", "meshcomm.run", "--nproc-per-node", "2", script],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MESHCOMM_TIMEOUT": "20"},
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "done" not in run.stdout, out
    words = "ranks disagree on the collective on group 'world': rank 1 called broadcast(int32[4]"
    # meshrun stops the job at the first failure (the root raises too if it gets there
    # first) and its summary names the mismatch.
    assert re.search(rf"meshrun: rank \d .*its error.*\n.*MismatchError: {re.escape(words)}", out)
