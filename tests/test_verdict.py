"""Hang verdicts: a collective that times out says which ranks are behind, and where."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest

import meshcomm
from meshcomm.backends.local import SelfCommunicator
from meshcomm.diagnostics import position as _heads
from meshcomm.diagnostics import responder as _responder
from meshcomm.errors import CommTimeout
from meshcomm.group import ProcessGroup
from meshcomm.store import HashStore
from meshcomm.testing import run_ranks

pytestmark = pytest.mark.timeout(120)
ENV = {"MESHCOMM_TIMEOUT": "2"}


def _sleeper_skips(world: ProcessGroup, direct: bool) -> str | None:
    """Rank 2 sleeps past the others' timeout; ranks 0 and 1 report what they saw."""
    x = np.ones(4, np.float32) if direct else {"a": np.ones(4)}  # a pytree: the general path
    world.all_reduce(np.ones(4, np.float32))  # op #1: everyone; the direct path is learned
    if world.rank == 2:
        time.sleep(3.5)  # past the timeout and the verdict: THE SLEEP
        return None
    try:
        world.all_reduce(x) if direct else world.all_gather(np.ones(2))  # THE CALL
    except CommTimeout as exc:
        # The verdict stands for the waiting path's frames: no chained internal traceback.
        assert exc.__cause__ is None and exc.__suppress_context__, repr(exc.__cause__)
        return str(exc)
    return "no timeout"


def _line(text: str) -> int:
    """The line of this file that ends with ``# text``."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {text}"))


@pytest.mark.parametrize("direct", [True, False])
def test_a_sleeping_rank_is_alive_and_named_with_its_last_collective(direct: bool) -> None:
    results = run_ranks(_sleeper_skips, 3, env=ENV, args=(direct,), timeout=60)
    op = "all_reduce" if direct else "all_gather"
    call, sleep = _line("THE CALL"), _line("past the timeout and the verdict: THE SLEEP")
    for message in results[:2]:
        assert message is not None and "\n  timed out: rank " in message, message
        assert "0x" not in message, message  # the group by its name, never an id
        assert (
            f"rank 2 has not entered {op} #2 on group 'world' (called at test_verdict.py:{call} "
            "by ranks 0, 1): it is alive but has not called a collective for "
        ) in message, message
        assert f"at test_verdict.py:{sleep} in _sleeper_skips" in message, message
        assert "its last completed collective there was all_reduce #1 at test_verdict.py:" in (
            message
        )


def _other_axis(world: ProcessGroup) -> str | None:
    """A 2x2 mesh: rank 1 goes into a psum over 'dp' while rank 0 waits in one over 'tp'."""
    mesh = meshcomm.init_device_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    x = np.ones(2)
    meshcomm.ops.psum(x, "tp", mesh=mesh)  # op #1 over 'tp' on every rank
    meshcomm.ops.psum(x, "dp", mesh=mesh) if world.rank in (0, 2) else None  # dp #1 for 0, 2
    try:
        if world.rank == 0:
            meshcomm.ops.psum(x, "tp", mesh=mesh)  # TP TWO
        elif world.rank == 1:
            time.sleep(1)  # so that it is in the psum over 'dp' when rank 0 times out
            meshcomm.ops.psum(x, "dp", mesh=mesh)  # DP ONE (rank 3 never comes)
        else:
            time.sleep(4.5)  # rank 1's timeout (3 s) and verdict
    except CommTimeout as exc:
        return str(exc)
    return None


def test_a_rank_in_another_groups_collective_is_found_there() -> None:
    results = run_ranks(_other_axis, 4, env=ENV, timeout=60)
    message = results[0]
    assert message is not None, results
    tp2, dp1 = _line("TP TWO"), _line("DP ONE (rank 3 never comes)")
    assert (
        f"rank 1 has not entered psum #2 over 'tp' (called at test_verdict.py:{tp2} by rank 0): "
        f"it is in psum #1 over 'dp' (called at test_verdict.py:{dp1}) for "
    ) in message, message
    assert "its last completed collective there was psum #1 at test_verdict.py:" in message
    assert "no progress for 2 s in exchange over 'tp'" in message, message
    # Rank 1, waiting over 'dp', finds rank 3 asleep outside any collective.
    assert "rank 3 has not entered psum #1 over 'dp'" in results[1], results[1]
    assert "it is alive but has not called a collective for" in results[1], results[1]


def _stopped(world: ProcessGroup) -> str | None:
    """Rank 2 is stopped (SIGSTOP): it cannot answer; rank 0 wakes it after its verdict."""
    pids = world.all_gather(np.array(os.getpid()))  # op #1
    if world.rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    try:
        world.all_reduce(np.ones(2))  # op #2
    except CommTimeout as exc:
        return str(exc)
    finally:
        if world.rank == 0:
            time.sleep(0.5)  # rank 1's verdict too
            os.kill(int(pids[2]), signal.SIGCONT)
    return None


def test_a_rank_that_cannot_answer_is_called_gone() -> None:
    results = run_ranks(_stopped, 3, env=ENV, timeout=60)
    for message in results[:2]:
        assert (
            message is not None
            and ("rank 2 never reached all_reduce #2 on group 'world' (called at test_verdict.py:")
            in message
        ), message
        assert "did not answer within 0.2 s: gone, or stuck where Python cannot run" in message


def _async_waits(world: ProcessGroup) -> str | None:
    world.barrier()
    if world.rank == 1:
        time.sleep(3.5)
        return None
    work = world.all_reduce(np.ones(2), async_op=True)  # ASYNC
    try:
        work.wait()
    except CommTimeout as exc:
        try:
            work.wait()  # the same verdict again, without asking twice
        except CommTimeout as again:
            assert str(again) == str(exc)
        return str(exc)
    return None


def test_an_async_operation_gets_the_verdict_in_wait() -> None:
    message = run_ranks(_async_waits, 2, env=ENV, timeout=60)[0]
    assert message is not None, message
    assert (
        f"rank 1 has not entered all_reduce #2 on group 'world' (called at test_verdict.py:"
        f"{_line('ASYNC')} by rank 0): it is alive but has not called a collective for"
    ) in message, message


def _all_wait_for_data(world: ProcessGroup) -> str:
    """Rank 0 waits in a point-to-point receive; ranks 1 and 2 in a collective."""
    world.barrier()
    try:
        # A send nobody receives, then a collective: rank 0 waits in recv for rank 1's
        # message, which never comes; ranks 1 and 2 block in the all_gather without it.
        if world.rank == 0:
            world.recv(1, tag=5)  # THE RECV
        world.all_gather(np.ones(2))
    except CommTimeout as exc:
        time.sleep(1.5)  # alive, so that the others' verdicts can ask it
        return str(exc)
    return "no timeout"


def test_only_collectives_get_a_verdict() -> None:
    results: list[Any] = run_ranks(_all_wait_for_data, 3, env=ENV, timeout=60)
    assert "verdict:" not in results[0], results[0]  # point to point: no sequence number
    for message in results[1:]:
        assert "rank 0 has not entered all_gather #2 on group 'world'" in message, message
        assert "by ranks 1, 2): it is alive but has not called a collective for" in message
        assert "its last completed collective there was barrier #1" in message, message


def test_a_responder_answers_and_bounds_what_it_reads() -> None:
    store = HashStore(timeout=5)
    g = ProcessGroup(SelfCommunicator(), store=store)
    g.all_reduce(np.ones(2))
    r = _responder.Responder.start(g, store, 0)
    assert r is not None
    head = _responder.answer(store, 0, _responder.ask(store, 0), wait=5)
    assert head is not None and head["groups"][0]["done"]["name"] == "all_reduce"
    # The main thread waits in the store (threading.py): its innermost frames outside meshcomm
    assert any(f.startswith("test_verdict.py:") for f in head["stack"]), head
    r.stop(store)
    assert not r._thread.is_alive()
    g.close()
    # Hostile answers: too big, not JSON, wrong shapes: ignored or clamped, never trusted.
    assert _heads.parse(b"x" * (_heads.MAX_BYTES + 1)) is None
    assert _heads.parse(b"[1, 2]") is None
    odd = _heads.parse(b'{"groups": [1, {"seq": "9", "now": {"name": "' + b"a" * 999 + b'"}}]}')
    assert odd is not None and odd["groups"][0]["seq"] == 0
    assert len(odd["groups"][0]["now"]["name"]) == 200
