"""meshcomm.elastic across simulated hosts: a host cut off mid-training (its link down: no
RST, no FIN) is found by the timeout, the survivors on the other host agree without it and
go on; the run equals the float64 replay of the replica sets it used."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hosts import Hosts, available
from test_elastic import SCRIPT, _replay, lines_of

REPO = Path(__file__).resolve().parents[1]
PORT = 29517
SECRET = "elastic-hosts-" + "7" * 32

pytestmark = [
    pytest.mark.skipif(available() is not None, reason=str(available())),
    pytest.mark.timeout(240),
]


def _node(hosts: Hosts, node: int, steps: int, ms: int) -> subprocess.Popen[str]:
    argv = [
        sys.executable, "-m", "meshcomm.run", "--elastic", "--nnodes", "2", "--node-rank",
        str(node), "--nproc-per-node", "2", "--master-addr", hosts.addresses[0],
        "--master-port", str(PORT), str(SCRIPT), "4", str(steps), str(ms),
    ]  # fmt: skip
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        MESHCOMM_SECRET=SECRET,
        MESHCOMM_TIMEOUT="3",
    )
    return hosts.run(node, argv, env)


def test_a_host_cut_off_leaves_and_the_others_go_on() -> None:
    with Hosts(2) as hosts:
        nodes = [_node(hosts, k, steps=400, ms=20) for k in range(2)]
        time.sleep(5)  # every rank is in its loop
        assert all(p.poll() is None for p in nodes), [p.communicate() for p in nodes]
        hosts.cut(1)
        out, err = nodes[0].communicate(timeout=120)
    assert nodes[0].returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    lines = lines_of(out)
    assert sorted(lines) == [0, 1], f"{out[-2000:]}\n{err[-3000:]}"
    history = lines[0]["history"]
    assert lines[1]["history"] == history
    sizes = [len(members) for _, members in history]
    assert sizes[0] == 4 and sizes[-1] == 2 and sorted(set(sizes)) == [2, 4], sizes
    assert lines[0]["recoveries"] == 1 and lines[0]["shape"] == [2], lines[0]
    reference = _replay(history, 1)
    for v in lines.values():
        np.testing.assert_allclose(v["w"], reference, rtol=1e-12, atol=1e-12)
