"""The device lowering's layouts at every world size, run on numpy over a real tcp world.

The lowering of :mod:`meshcomm.group.lower` on :class:`~meshcomm.group.device_lower.
DeviceBuffers` is what a group with a device backend (nccl) runs for cupy arrays. Its
layout work (rank-major blocks, stacking and concatenating at any axis, tiled
or not) is written with the array's own module, so here it runs with numpy over the tcp
world's communicator, at worlds 1-4 and 8, and every result must equal the group's own
numpy result for the same call (the path the conformance suite checks against numpy).
NCCL refuses two ranks on one GPU, so this is where multi-rank layouts are tested; the
device runs them with cupy over nccl at world 1 (tests/test_nccl_groups.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from meshcomm.group import device_lower as _device_lower
from meshcomm.group import lower as _lower
from meshcomm.group.arrays import ScratchPool
from meshcomm.group.device_lower import DeviceBuffers
from meshcomm.group.lower import Call, Lowered
from meshcomm.testing import run_ranks


def _on_device(op: str, c: Call, comm: Any, xp: Any, x: Any, *args: Any) -> Lowered:
    """The one lowering of ``op`` on :class:`DeviceBuffers` of ``comm`` and ``xp`` (what a
    group with a device backend runs for a device array)."""
    lowering: Any = getattr(_lower, op)
    return lowering(c, x, *args, on=DeviceBuffers(comm, xp))


def _compare(group: Any) -> list[str]:
    n, me = group.size, group.rank
    comm = group._comm  # the tcp world's communicator stands in for the device's
    problems: list[str] = []

    def check(what: str, lowered: Any, expected: Any) -> None:
        body, _ = lowered
        got = body()
        if expected is None:
            if got is not None:
                problems.append(f"rank {me}: {what}: expected None, got {got!r}")
            return
        if got.shape != expected.shape or got.dtype != expected.dtype:
            problems.append(
                f"rank {me}: {what}: got {got.dtype}{got.shape}, expected "
                f"{expected.dtype}{expected.shape}"
            )
        elif not np.array_equal(got, expected):
            problems.append(f"rank {me}: {what}: values differ")

    def call(op: str) -> Call:
        return Call(comm, ScratchPool(), f"{op}: rank {me}")

    rng = np.random.default_rng(7 + me)
    x = rng.integers(-5, 5, size=(n, 3, 2 * n)).astype(np.float64)
    flat, issuer = x.reshape(-1), group._issuer
    for op in ("sum", "max", "avg"):  # the planned all_reduce, through the issuer's route
        plan = _device_lower.plan_all_reduce(call("all_reduce"), comm, np, flat, op)
        expected = group.all_reduce(flat, op)
        for async_op in (False, True, False):  # first call checked, then the fast case
            seq = issuer.seq
            got = issuer.run_device_plan(plan, flat, async_op)
            got = got.wait(timeout=30) if async_op else got
            check(f"planned all_reduce {op} async={async_op}", (lambda g=got: g, None), expected)
            last = group.ledger()[-1]
            if issuer.seq != seq + 1 or (last["op"], last["device"]) != ("all_reduce", True):
                problems.append(f"rank {me}: planned all_reduce {op}: not one call in order")
    strided = x[:, ::-1, ::2]  # not contiguous
    for arr in (x, strided):
        for op in ("sum", "max", "avg"):
            check(
                f"all_reduce {op}",
                _on_device("all_reduce", call("all_reduce"), comm, np, arr, op, None),
                group.all_reduce(arr, op),
            )
        check(
            "all_reduce premul_sum",
            _on_device("all_reduce", call("all_reduce"), comm, np, arr, "premul_sum", 3.0),
            group.all_reduce(arr, "premul_sum", factor=3.0),
        )
        for axis in range(-arr.ndim - 1, arr.ndim + 1):
            check(
                f"all_gather axis={axis}",
                _on_device("all_gather", call("all_gather"), comm, np, arr, axis, False),
                group.all_gather(arr, axis),
            )
        for axis in range(arr.ndim):
            check(
                f"all_gather tiled axis={axis}",
                _on_device("all_gather", call("all_gather"), comm, np, arr, axis, True),
                group.all_gather(arr, axis, tiled=True),
            )
        for op in ("sum", "avg"):
            for axis, tiled in ((0, False), (0, True), (2, True)):
                what = f"reduce_scatter {op} axis={axis} tiled={tiled}"
                lowered = _on_device(
                    "reduce_scatter", call("reduce_scatter"), comm, np, arr, op, axis, tiled, None
                )
                check(what, lowered, group.reduce_scatter(arr, op, axis, tiled))
        for split, concat, tiled in ((0, 0, False), (0, 2, False), (0, 1, True), (2, 0, True)):
            what = f"all_to_all split={split} concat={concat} tiled={tiled}"
            lowered = _on_device(
                "all_to_all", call("all_to_all"), comm, np, arr, split, concat, tiled
            )
            check(what, lowered, group.all_to_all(arr, split, concat, tiled))
        for root in range(n):
            check(
                f"broadcast root={root}",
                _on_device("broadcast", call("broadcast"), comm, np, arr, root, None, None),
                group.broadcast(arr, root),
            )
            check(
                f"reduce root={root}",
                _on_device("reduce", call("reduce"), comm, np, arr, root, "sum", None),
                group.reduce(arr, root, "sum"),
            )
            check(
                f"gather root={root}",
                _on_device("gather", call("gather"), comm, np, arr, root),
                group.gather(arr, root),
            )
            check(
                f"scatter root={root}",
                _on_device("scatter", call("scatter"), comm, np, arr, root, None, None),
                group.scatter(arr, root),
            )
        shift = [(r, (r + 1) % n) for r in range(n)]
        partial = [(r, r + 1) for r in range(n - 1)]  # rank 0 receives from nobody: zeros
        for perm in (shift, partial):
            check(
                f"permute {perm}",
                _on_device("permute", call("permute"), comm, np, arr, perm),
                group.permute(arr, perm),
            )
    transposed = x[:, :, 0].T  # Fortran-ordered: the scaled copy must still be C-ordered
    check(
        "reduce premul_sum of a transposed array",
        _on_device("reduce", call("reduce"), comm, np, transposed, 0, "premul_sum", 2.0),
        group.reduce(transposed, 0, "premul_sum", factor=2.0),
    )
    scalar = np.float64(me + 1.5)
    check(
        "all_reduce of a 0-d array",
        _on_device("all_reduce", call("all_reduce"), comm, np, np.asarray(scalar), "sum", None),
        group.all_reduce(np.asarray(scalar)),
    )
    check(
        "all_gather of a 0-d array",
        _on_device("all_gather", call("all_gather"), comm, np, np.asarray(scalar), 0, False),
        group.all_gather(np.asarray(scalar)),
    )
    check(
        "reduce of a 0-d array",
        _on_device("reduce", call("reduce"), comm, np, np.asarray(scalar), 0, "sum", None),
        group.reduce(np.asarray(scalar), 0),
    )
    check(
        "broadcast of a 0-d array",
        _on_device("broadcast", call("broadcast"), comm, np, np.asarray(scalar), 0, None, None),
        group.broadcast(np.asarray(scalar), 0),
    )
    empty = np.zeros((n, 0), np.float32)
    check(
        "all_gather of zero elements",
        _on_device("all_gather", call("all_gather"), comm, np, empty, 0, True),
        group.all_gather(empty, 0, tiled=True),
    )
    return problems


def _compare_plans(group: Any) -> list[str]:
    """Every collective's device plan, made as a group makes it for a device array (numpy
    and the tcp world's communicator standing in for cupy and nccl) and run through the
    issuer, equals the group's host result; each call is one ledger entry marked device."""
    from meshcomm.group.collectives import COLLECTIVES

    n, me, comm, issuer = group.size, group.rank, group._comm, group._issuer
    problems: list[str] = []
    rng = np.random.default_rng(11 + me)
    x = rng.integers(-5, 5, size=(n, 3, 2 * n)).astype(np.float32)
    cases: list[tuple[str, Any, tuple[Any, ...], Any]] = []
    flat = x.reshape(-1)  # all_reduce's runner hands x over as it is: nccl takes any shape
    for op in ("sum", "max", "avg"):
        cases.append(("all_reduce", flat, (op, None), group.all_reduce(flat, op)))
    for axis in range(-x.ndim - 1, x.ndim + 1):
        cases.append(("all_gather", x, (axis, False), group.all_gather(x, axis)))
    for axis in range(x.ndim):
        cases.append(("all_gather", x, (axis, True), group.all_gather(x, axis, tiled=True)))
    for op in ("sum", "avg", "min"):
        for axis, tiled in ((0, False), (0, True), (2, True), (-1, True)):
            expected = group.reduce_scatter(x, op, axis, tiled)
            cases.append(("reduce_scatter", x, (op, axis, tiled, None), expected))
    for split, concat, tiled in ((0, 0, False), (0, 2, False), (0, 1, True), (2, 0, True)):
        expected = group.all_to_all(x, split, concat, tiled)
        cases.append(("all_to_all", x, (split, concat, tiled), expected))
    for root in range(n):
        cases.append(("broadcast", x, (root, None, None), group.broadcast(x, root)))
        cases.append(("reduce", x, (root, "avg", None), group.reduce(x, root, "avg")))
        cases.append(("gather", x, (root,), group.gather(x, root)))
        cases.append(("scatter", x, (root, None, None), group.scatter(x, root)))
    scalar = np.asarray(np.float64(me + 0.5))
    cases.append(("all_gather", scalar, (0, False), group.all_gather(scalar)))
    cases.append(("broadcast", scalar, (0, None, None), group.broadcast(scalar, 0)))
    for name, arr, args, expected in cases:
        coll = COLLECTIVES[name]
        key = coll.device_key(arr, *args)
        if key is None or key != coll.key(arr, *args):
            problems.append(f"rank {me}: {name}{args}: device key {key!r}")
            continue
        plan = issuer.plan(key, coll.device_plan, comm, np, arr, *args, cache=issuer.device_plans)
        for async_op in (False, True):
            seq = issuer.seq
            got = issuer.run_device_plan(plan, arr, async_op)
            got = got.wait(timeout=30) if async_op else got
            what = f"rank {me}: {name}{args} async={async_op}"
            if expected is None or got is None:
                if got is not expected:
                    problems.append(f"{what}: got {got!r}, expected {expected!r}")
            elif got.shape != expected.shape or got.dtype != expected.dtype:
                problems.append(
                    f"{what}: {got.dtype}{got.shape}, not {expected.dtype}{expected.shape}"
                )
            elif not np.array_equal(got, expected):
                problems.append(f"{what}: values differ")
            last = group.ledger()[-1]
            # Without a device backend (world > 1) the location of a broadcast or scatter is
            # nobody's to compare (issuing._LOCATION_FREE): the ledger books host calls.
            device = last["device"] or name in ("broadcast", "scatter")
            if issuer.seq != seq + 1 or (last["op"], device) != (name, True):
                problems.append(f"{what}: not one device call in order ({last})")
    strided = x[:, :, ::2]
    if COLLECTIVES["all_gather"].device_key(strided, 0, False) is not None:
        problems.append(f"rank {me}: a strided device array got a plan key (it is lowered)")
    return problems


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_every_device_plan_equals_the_host_path(nprocs: int) -> None:
    for problems in run_ranks(_compare_plans, nprocs, timeout=240):
        assert problems == [], "\n".join(problems[:20])


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_device_layouts_equal_the_host_path(nprocs: int) -> None:
    for problems in run_ranks(_compare, nprocs, timeout=240):
        assert problems == [], "\n".join(problems[:20])


def test_device_argument_errors_are_the_host_paths() -> None:
    from meshcomm.backends.local import SelfCommunicator
    from meshcomm.errors import InvalidArgument

    comm = SelfCommunicator()
    call = Call(comm, ScratchPool(), "all_gather: rank 0")
    with pytest.raises(InvalidArgument, match=r"all_gather: rank 0: .*axis"):
        _on_device("all_gather", call, comm, np, np.zeros(3), 5, False)
    with pytest.raises(InvalidArgument, match="tiled all_gather needs at least 1 axis"):
        _on_device("all_gather", call, comm, np, np.float32(1), 0, True)
    with pytest.raises(InvalidArgument, match="group size 1"):
        _on_device("scatter", call, comm, np, np.zeros(()), 0, None, None)


def _device_call_of_another_dtype(group: Any) -> list[str]:
    """Rank 0 reduces float32 where the others reduce float64, through the planned device
    route (the host communicator standing in for the device one): every rank must raise a
    MismatchError naming both calls, found by the first-call check over the host
    communicator (device calls carry no stamp)."""
    from meshcomm.errors import MismatchError

    comm, me = group._comm, group.rank
    x = np.ones(4, np.float32 if me == 0 else np.float64)
    plan = _device_lower.plan_all_reduce(
        Call(comm, ScratchPool(), f"rank {me}"), comm, np, x, "sum"
    )
    try:
        group._issuer.run_device_plan(plan, x, False)
    except MismatchError as exc:
        return [str(exc)]
    return []


@pytest.mark.parametrize("nprocs", [2, 3])
def test_a_device_call_that_differs_between_ranks_is_a_mismatch_naming_both(nprocs: int) -> None:
    for rank, said in enumerate(run_ranks(_device_call_of_another_dtype, nprocs, timeout=60)):
        assert len(said) == 1, f"rank {rank} raised no MismatchError"
        assert "float32" in said[0] and "float64" in said[0], said[0]
        assert "on a GPU" in said[0], said[0]


def test_a_kept_result_is_given_out_again_only_once_nothing_holds_it() -> None:
    """A device plan's small result is reused after the caller let it go, never while the
    caller (or a view of it) holds it; large results are always new."""
    from meshcomm.group.device_lower import results

    take = results(np, (4,), np.dtype(np.float32))
    first = take()
    first[:] = 1.0
    view = first[1:]
    last = id(first)
    del first
    second = take()  # the view still holds the first
    assert id(second) != last and view.base is not None and id(view.base) == last
    second[:] = 2.0
    assert view.tolist() == [1.0, 1.0, 1.0]
    kept = id(second)
    del view, second
    assert id(take()) == kept  # nothing holds the second now: the plan gives it out again
