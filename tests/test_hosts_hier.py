"""Host-aware collectives across simulated hosts (tests/hosts.py): results against numpy at
sizes that take the hierarchy, and the bytes a psum (and, on 2 x 2, an all_gather and a
reduce_scatter) moves over host 0's link (its veth counters), on 2 hosts x 2 ranks and on 3
hosts of 2 + 1 + 1 ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hosts import Hosts, available

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "host_ranks.py"
PORT = 29512
SECRET = "hosts-hier-" + "7" * 32

pytestmark = [
    pytest.mark.skipif(available() is not None, reason=str(available())),
    pytest.mark.timeout(240),
]


def _run(placement: Sequence[int], mode: str) -> dict[int, dict[str, Any]]:
    """Start rank r on host ``placement[r]`` (torchrun's variables; a host's ranks in one set
    of namespaces, so they share memory), return every rank's row."""
    count = max(placement) + 1
    with Hosts(count) as hosts:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            MESHCOMM_SECRET=SECRET,
            MESHCOMM_TIMEOUT="30",
            WORLD_SIZE=str(len(placement)),
            MASTER_ADDR=hosts.addresses[0],
            MASTER_PORT=str(PORT),
        )
        procs: list[subprocess.Popen[str]] = []
        for host in range(count):
            local = [r for r, h in enumerate(placement) if h == host]
            envs = [
                {"RANK": str(r), "LOCAL_RANK": str(i), "LOCAL_WORLD_SIZE": str(len(local))}
                for i, r in enumerate(local)
            ]
            procs.append(hosts.run_all(host, [sys.executable, str(SCRIPT), mode], envs, env))
        outs = [p.communicate(timeout=200) for p in procs]
    rows: dict[int, dict[str, Any]] = {}
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
        for line in out.splitlines():
            _, marker, payload = line.partition("RESULT ")
            if marker:
                row = json.loads(payload)
                rows[row["rank"]] = row
    assert sorted(rows) == list(range(len(placement))), outs
    return rows


def test_two_hosts_of_two_ranks_run_hierarchically() -> None:
    rows = _run([0, 0, 1, 1], "hier-mesh")
    assert all(row["failures"] == [] for row in rows.values()), rows
    # A flat ring crosses the link with 3.0x the psum; the hierarchy with 2.0x (each host
    # sends and receives the buffer once), plus headers and acknowledgements.
    assert 1.9 < rows[0]["world_bytes"] <= 2.2, rows[0]
    # all_gather (of the 8 MiB result) and reduce_scatter (of the 8 MiB input): each host
    # sends the other host's half once and receives its own once: 1.0x (flat rings: 1.5x).
    assert rows[0]["gather_bytes"] <= 1.1, rows[0]
    assert rows[0]["scatter_bytes"] <= 1.1, rows[0]
    # The mesh axis inside each host never touches the link (a barrier's few bytes aside).
    assert rows[0]["local_bytes"] < 0.01, rows[0]


def test_three_uneven_hosts_two_one_one() -> None:
    rows = _run([0, 0, 1, 2], "hier")
    assert all(row["failures"] == [] for row in rows.values()), rows
    # Host 0's two ranks each own half the buffer across 3 hosts: 2 * 2/3 of it out and in
    # (2.67x; a flat ring: 3.0x).
    assert rows[0]["world_bytes"] <= 2.8, rows[0]
