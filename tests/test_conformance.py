"""The conformance suite on real multi-process worlds (tcp backend), and run_ranks itself.

One launch per world size runs the whole suite (spawning processes is the expensive part).
Functions the ranks run are module level: they travel to the spawned processes by name.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from meshcomm.errors import CommError
from meshcomm.group import ProcessGroup
from meshcomm.spawn import SpawnTimeout
from meshcomm.testing import run_conformance, run_ranks

try:
    import meshcomm.backends.tcp  # noqa: F401

    TCP_MISSING = ""
except ImportError as exc:  # pragma: no cover - only while the backend is being written
    TCP_MISSING = str(exc)

pytestmark = pytest.mark.skipif(
    bool(TCP_MISSING), reason=f"the tcp backend is not importable yet: {TCP_MISSING}"
)

TIMEOUT = 150.0


# -- functions the ranks run ------------------------------------------------------------------
def conformance(group: ProcessGroup, quick: bool) -> list[str]:
    return run_conformance(group, quick=quick)


def mismatched_shapes(group: ProcessGroup) -> str:
    x = np.ones(3 if group.rank == 1 else 2, np.float32)
    try:
        group.all_reduce(x)
    except CommError as exc:
        return str(exc)
    return "no error"


def mismatched_ops(group: ProcessGroup) -> str:
    try:
        if group.rank == 0:
            group.all_reduce(np.ones(2), "max")
        else:
            group.broadcast(np.ones(2), root=0)
    except CommError as exc:
        return str(exc)
    return "no error"


def peer_goes_away(group: ProcessGroup) -> list[str]:
    group.barrier()  # connect the ranks (tcp connects lazily)
    if group.rank == 1:
        return []  # run_ranks shuts this rank's world down: its connections close
    seen = []
    try:
        group.recv(1, tag=0)
    except CommError as exc:
        seen.append(f"first: {type(exc).__name__}: {exc}")
    start = time.monotonic()
    try:
        group.all_reduce(np.ones(2))
    except CommError as exc:
        seen.append(f"then ({time.monotonic() - start:.3f} s): {exc}")
    return seen


def fails_on_rank_one(group: ProcessGroup) -> None:
    if group.rank == 1:
        raise ValueError(f"rank {group.rank} refuses")
    # Wait without communicating: a barrier here would fail too once rank 1 is gone, and under
    # load that second failure could be reported first. spawn stops this rank when rank 1 fails.
    time.sleep(60)


def sleeps(group: ProcessGroup) -> None:
    time.sleep(120)


# -- the suite --------------------------------------------------------------------------------
CASES = [
    pytest.param(n, transport, id=f"{n}ranks-{transport or 'default'}")
    for n in (1, 2, 3, 4, 8)
    for transport in (None, "tcp")
    if not (n == 1 and transport)  # a world of one has no transport
]


@pytest.mark.parametrize(("nprocs", "transport"), CASES)
def test_conformance(nprocs: int, transport: str | None) -> None:
    env = {} if transport is None else {"MESHCOMM_TRANSPORT": transport}
    quick = transport is not None  # the full suite runs with the default transport
    results = run_ranks(conformance, nprocs, env=env, timeout=TIMEOUT, args=(quick,))
    failures = [line for per_rank in results for line in per_rank]
    assert not failures, "\n".join(failures[:40])


@pytest.mark.parametrize("nprocs", [2, 3, 4, 8])
def test_conformance_direct_path_at_every_size(nprocs: int) -> None:
    """The CMA collectives (meshcomm.backends.tcp.same_host.cma_collectives) for every size
    from 1 byte, so that every dtype, op, layout and group of the suite goes through them."""
    env = {"MESHCOMM_SHM_DIRECT_MIN": "1"}
    results = run_ranks(conformance, nprocs, env=env, timeout=TIMEOUT, args=(nprocs != 4,))
    failures = [line for per_rank in results for line in per_rank]
    assert not failures, "\n".join(failures[:40])


def test_conformance_with_debug_fingerprints() -> None:
    env = {"MESHCOMM_DEBUG": "DETAIL"}
    results = run_ranks(conformance, 3, env=env, timeout=TIMEOUT, args=(True,))
    failures = [line for per_rank in results for line in per_rank]
    assert not failures, "\n".join(failures[:40])


# -- debug mismatches, failures ---------------------------------------------------------------
def test_debug_detail_names_disagreeing_ranks_on_every_rank() -> None:
    results = run_ranks(mismatched_shapes, 3, env={"MESHCOMM_DEBUG": "DETAIL"}, timeout=TIMEOUT)
    for rank, message in enumerate(results):
        assert f"rank {rank} in group 'world'" in message
        assert "global ranks [0, 2] called all_reduce(seq=1, dtype=float32, shape=(2,)" in message
        assert "global ranks [1] called all_reduce(seq=1, dtype=float32, shape=(3,)" in message


def test_torch_debug_variable_is_honoured() -> None:
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    results = run_ranks(mismatched_ops, 2, env=env, timeout=TIMEOUT)
    for message in results:
        assert "global ranks [0] called all_reduce(" in message and "op=max" in message
        assert "global ranks [1] called broadcast(" in message and "root=0" in message


def test_world_fails_fast_after_a_peer_goes_away() -> None:
    results = run_ranks(peer_goes_away, 2, env={"MESHCOMM_TIMEOUT": "10"}, timeout=TIMEOUT)
    seen = results[0]
    assert len(seen) == 2, seen
    assert seen[0].startswith("first: ") and "rank 1" in seen[0]
    assert "failed earlier" in seen[1] and "the first failure was in recv" in seen[1]


def test_run_ranks_reraises_the_rank_exception_with_its_traceback() -> None:
    with pytest.raises(ValueError, match="rank 1 refuses") as info:
        run_ranks(fails_on_rank_one, 2, timeout=TIMEOUT)
    cause = str(info.value.__cause__)
    assert "raised on rank 1" in cause and "fails_on_rank_one" in cause


def test_run_ranks_never_hangs() -> None:
    start = time.monotonic()
    with pytest.raises(SpawnTimeout):
        run_ranks(sleeps, 2, timeout=4)
    assert time.monotonic() - start < 4 + 30  # timeout + generous slack for the stop


def test_testing_module_doctests() -> None:
    import doctest

    import meshcomm.testing

    result = doctest.testmod(meshcomm.testing)
    assert result.failed == 0 and result.attempted > 0
