"""Several hosts on one machine: network namespaces (tests/hosts.py), ranks started by
``meshrun --nnodes 2 --node-rank K --master-addr ADDR`` on each, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hosts import Hosts, available

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "host_ranks.py"
PORT = 29511
SECRET = "hosts-test-" + "5" * 32

pytestmark = [
    pytest.mark.skipif(available() is not None, reason=str(available())),
    pytest.mark.timeout(240),
]


def _node(
    hosts: Hosts, node: int, mode: str, timeout: float = 5.0, nproc: int = 2
) -> subprocess.Popen[str]:
    argv = [
        sys.executable, "-m", "meshcomm.run", "--nnodes", "2", "--node-rank", str(node),
        "--nproc-per-node", str(nproc), "--master-addr", hosts.addresses[0],
        "--master-port", str(PORT), str(SCRIPT), mode,
    ]  # fmt: skip
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        MESHCOMM_SECRET=SECRET,
        MESHCOMM_TIMEOUT=str(timeout),
    )
    return hosts.run(node, argv, env)


def _results(out: str) -> dict[int, dict[str, Any]]:
    found = {}
    for line in out.splitlines():
        _, marker, payload = line.partition("RESULT ")
        if marker:
            row = json.loads(payload)
            found[row["rank"]] = row
    return found


def test_two_hosts_of_two_ranks() -> None:
    with Hosts(2) as hosts:
        nodes = [_node(hosts, k, "check") for k in range(2)]
        outs = [p.communicate(timeout=120) for p in nodes]
        for p, (out, err) in zip(nodes, outs, strict=True):
            assert p.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    rows = {**_results(outs[0][0]), **_results(outs[1][0])}
    assert sorted(rows) == [0, 1, 2, 3], outs
    assert rows[0]["hostname"] == rows[1]["hostname"] != rows[2]["hostname"] == rows[3]["hostname"]
    for rank, row in rows.items():
        host = rank // 2
        assert row["local"] == sum(r for r in range(4) if r // 2 == host)
        assert row["host"] == sum(r for r in range(4) if r % 2 == rank % 2)
        assert row["all"] == 4.0
        for peer, kind in row["channels"].items():
            same = int(peer) // 2 == host
            assert kind == ("shm" if same else "tcp"), (rank, row["channels"])


def test_a_host_cut_off_is_named_by_the_others() -> None:
    with Hosts(2) as hosts:
        nodes = [_node(hosts, k, "loop", timeout=3.0) for k in range(2)]
        time.sleep(6)  # every rank is in its loop of psums
        assert all(p.poll() is None for p in nodes), [p.communicate() for p in nodes]
        cut = time.monotonic()
        hosts.cut(1)
        out, err = nodes[0].communicate(timeout=60)
        took = time.monotonic() - cut
    assert nodes[0].returncode != 0, out[-2000:]
    rows = _results(out)
    assert sorted(rows) == [0, 1], f"{out[-2000:]}\n{err[-3000:]}"
    for row in rows.values():
        assert row["error"] is not None
        assert "ranks 2, 3 never reached" in row["error"] or row["rank_named"] in (2, 3), row
    assert took < 3.0 + 2.0 + 10.0, took  # the timeout, the verdict's grace, meshrun's stop


def test_every_collective_across_two_hosts() -> None:
    with Hosts(2) as hosts:
        nodes = [_node(hosts, k, "conformance", timeout=30.0) for k in range(2)]
        outs = [p.communicate(timeout=200) for p in nodes]
    rows = {**_results(outs[0][0]), **_results(outs[1][0])}
    assert sorted(rows) == [0, 1, 2, 3], outs
    assert all(row["failures"] == [] for row in rows.values()), rows


def test_uneven_hosts_two_ranks_and_one() -> None:
    """Ranks started by hand with torchrun's variables: 2 on one host, 1 on the other."""
    with Hosts(2) as hosts:
        procs = []
        for rank, host in ((0, 0), (1, 0), (2, 1)):
            env = dict(os.environ)
            env.update(
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
                MESHCOMM_SECRET=SECRET,
                MESHCOMM_TIMEOUT="30",
                RANK=str(rank),
                WORLD_SIZE="3",
                LOCAL_RANK=str(rank if host == 0 else 0),
                LOCAL_WORLD_SIZE="2" if host == 0 else "1",
                MASTER_ADDR=hosts.addresses[0],
                MASTER_PORT=str(PORT),
            )
            procs.append(hosts.run(host, [sys.executable, str(SCRIPT), "conformance"], env))
        outs = [p.communicate(timeout=200) for p in procs]
    rows: dict[int, dict[str, Any]] = {}
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
        rows.update(_results(out))
    assert sorted(rows) == [0, 1, 2] and all(r["failures"] == [] for r in rows.values()), rows


def test_nodes_that_disagree_on_ranks_per_node_fail_fast() -> None:
    with Hosts(2) as hosts:
        started = time.monotonic()
        nodes = [_node(hosts, 0, "check", timeout=30.0), _node(hosts, 1, "check", 30.0, 1)]
        outs = [p.communicate(timeout=120) for p in nodes]
        took = time.monotonic() - started
    assert all(p.returncode != 0 for p in nodes), outs
    text = outs[0][0] + outs[0][1] + outs[1][0] + outs[1][1]
    assert "disagree on the world size" in text, text[-3000:]
    assert "2 vs 1 ranks per node" in text or "1 vs 2 ranks per node" in text, text[-3000:]
    assert took < 25, took  # well before the 30 s timeout
