"""Hang verdicts: a collective that times out says which ranks are behind, and where."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from meshcomm.errors import CommTimeout
from meshcomm.group import ProcessGroup
from meshcomm.testing import run_ranks

pytestmark = pytest.mark.timeout(120)


def _sleeper_skips(world: ProcessGroup, direct: bool) -> str | None:
    """Rank 2 sleeps past the others' timeout; ranks 0 and 1 report what they saw."""
    x = np.ones(4, np.float32) if direct else {"a": np.ones(4)}  # a pytree: the general path
    world.all_reduce(np.ones(4, np.float32))  # op #1: everyone; the direct path is learned
    if world.rank == 2:
        time.sleep(6)
        return None
    try:
        world.all_reduce(x) if direct else world.all_gather(np.ones(2))  # THE CALL
    except CommTimeout as exc:
        return str(exc)
    return "no timeout"


@pytest.mark.parametrize("direct", [True, False])
def test_a_sleeping_rank_is_named_with_the_call_site(direct: bool) -> None:
    env = {"MESHCOMM_TIMEOUT": "2"}
    results = run_ranks(_sleeper_skips, 3, env=env, args=(direct,), timeout=60)
    op = "all_reduce" if direct else "all_gather"
    for message in results[:2]:
        assert message is not None and "verdict:" in message, message
        assert f"ranks [0, 1] waited in {op} #2 on group 'world'" in message, message
        assert "(called at test_verdict.py:" in message, message
        assert "rank 2 never reached it" in message, message


def _all_wait_for_data(world: ProcessGroup) -> str:
    """Every rank reaches the collective: the verdict says the data did not move."""
    world.barrier()
    try:
        # A send nobody receives, then a collective: rank 0 waits in recv for rank 1's
        # message, which never comes; ranks 1 and 2 block in the all_gather without it.
        if world.rank == 0:
            world.recv(1, tag=5)
        world.all_gather(np.ones(2))
    except CommTimeout as exc:
        return str(exc)
    return "no timeout"


def test_only_collectives_get_a_verdict() -> None:
    results: list[Any] = run_ranks(_all_wait_for_data, 3, env={"MESHCOMM_TIMEOUT": "2"}, timeout=60)
    assert "verdict:" not in results[0], results[0]  # point to point: no sequence number
    for message in results[1:]:
        assert "ranks [1, 2] waited in all_gather #2" in message, message
        assert "rank 0 never reached it" in message, message
