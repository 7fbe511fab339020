"""torch's own ``init_process_group`` under meshrun, alone and mixed with ``meshcomm.init()``.

meshrun hosts a meshcomm store, so ``MASTER_PORT`` cannot name it: torch's rank 0 would try to
serve a TCPStore on the same port (EADDRINUSE). ``MASTER_ADDR``/``MASTER_PORT`` are a port
node 0's meshrun keeps for torch's rank 0; meshcomm uses ``MESHCOMM_MASTER_ADDR``/``_PORT``.
The end-to-end tests are skipped, with the reason, when torch is not installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from meshcomm.launcher.torch_port import (
    PortReservation,
    TorchEndpointError,
    endpoint_key,
    fetch_endpoint,
    node0_address,
)
from meshcomm.run import child_environment, parse_args
from meshcomm.store import TCPStore

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed (pip install meshcomm[torch]): torch's init needs it",
)

# A whole job importing torch in every rank, on a slow 2-core machine.
RUN_TIMEOUT = 90.0

# torch's env:// init and one all-reduce, checked against 1 + 2 + ... + world.
TORCH_INIT = """\
import os
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)], dtype=torch.float64)
dist.all_reduce(t)
expected = world * (world + 1) / 2
if t.item() != expected:
    raise SystemExit(f"rank {rank}: all_reduce gave {t.item()}, expected {expected}")
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"torch rank {rank} of {world} sum {t.item():g} attempt {attempt} "
      f"port {os.environ['MASTER_PORT']}")
if attempt == "0" and rank == 1 and os.environ.get("FAIL_FIRST_ATTEMPT"):
    os._exit(3)
dist.barrier()
dist.destroy_process_group()
"""

# torch's init and meshcomm's in one program, in the order argv[1] names.
MIXED = """\
import sys
import numpy as np
import torch
import torch.distributed as dist
import meshcomm

def torch_sum():
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item()

def meshcomm_sum():
    group = meshcomm.init()
    return float(group.all_reduce(np.full(1, group.rank + 1.0))[0])

if sys.argv[1] == "torch-first":
    a = torch_sum()
    b = meshcomm_sum()
else:
    b = meshcomm_sum()
    a = torch_sum()
print(f"mixed rank {dist.get_rank()} torch {a:g} meshcomm {b:g}")
dist.barrier()
dist.destroy_process_group()
meshcomm.shutdown()
"""


def meshrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "meshcomm.run", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=env,
    )


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def rank_lines(stdout: str, word: str) -> list[str]:
    return sorted(line for line in stdout.splitlines() if f"] {word} " in line)


# -- end to end --------------------------------------------------------------------------------


@needs_torch
@pytest.mark.parametrize(("world", "start_method"), [(2, "spawn"), (3, "fork")])
def test_torch_init_process_group_under_meshrun(
    tmp_path: Path, world: int, start_method: str
) -> None:
    job = script(tmp_path, "job.py", TORCH_INIT)
    result = meshrun("--nproc-per-node", str(world), "--start-method", start_method, job)
    assert result.returncode == 0, result.stderr
    total = world * (world + 1) // 2
    lines = rank_lines(result.stdout, "torch")
    assert [line.split(" port ")[0] for line in lines] == [
        f"[rank{r}] torch rank {r} of {world} sum {total} attempt 0" for r in range(world)
    ]
    assert "EADDRINUSE" not in result.stderr


@needs_torch
@pytest.mark.parametrize("order", ["torch-first", "meshcomm-first"])
def test_torch_and_meshcomm_init_in_one_program(tmp_path: Path, order: str) -> None:
    # meshcomm-first: torch's rank 0 serves nothing yet, so meshcomm cannot have used
    # MASTER_PORT; torch-first: meshcomm would fail on torch's store if it did.
    result = meshrun("--nproc-per-node", "2", script(tmp_path, "mixed.py", MIXED), order)
    assert result.returncode == 0, result.stderr
    assert rank_lines(result.stdout, "mixed") == [
        f"[rank{r}] mixed rank {r} torch 3 meshcomm 3" for r in range(2)
    ]


@needs_torch
def test_a_restarted_attempt_serves_torch_on_the_same_port(tmp_path: Path) -> None:
    # Attempt 0's rank 0 served torch's store on the port; attempt 1's rank 0 binds it again
    # while the old connections may sit in TIME_WAIT.
    env = dict(os.environ, FAIL_FIRST_ATTEMPT="1")
    job = script(tmp_path, "job.py", TORCH_INIT)
    result = meshrun("--nproc-per-node", "2", "--max-restarts", "1", job, env=env)
    assert result.returncode == 0, result.stderr
    lines = rank_lines(result.stdout, "torch")
    assert len(lines) == 4, result.stdout
    assert len({line.split(" port ")[1] for line in lines}) == 1, lines
    assert "[rank0] torch rank 0 of 2 sum 3 attempt 1" in (
        line.split(" port ")[0] for line in lines
    )


@needs_torch
@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_two_nodes_torch_and_meshcomm(tmp_path: Path, backend: str) -> None:
    job = script(tmp_path, "mixed.py", MIXED)
    env = dict(os.environ, MESHCOMM_SECRET="two nodes on one machine")
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for k in (0, 1):
        node_rank = () if backend == "c10d" else ("--node-rank", str(k))
        cmd = [sys.executable, "-m", "meshcomm.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
               "--rdzv-conf", "join_timeout=60", *node_rank, job, "torch-first"]  # fmt: skip
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))  # fmt: skip
    results = []
    try:
        for node in nodes:
            out, err = node.communicate(timeout=RUN_TIMEOUT)
            results.append((node.returncode, out, err))
    finally:
        for node in nodes:
            node.kill()
            node.wait(timeout=RUN_TIMEOUT)
    assert [code for code, _, _ in results] == [0, 0], results
    lines = sorted(line for _, out, _ in results for line in rank_lines(out, "mixed"))
    assert lines == [f"[rank{r}] mixed rank {r} torch 10 meshcomm 10" for r in range(4)]


# -- the ranks' environment and the endpoint's exchange ------------------------------------------


def test_meshcomm_and_torch_get_their_own_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    # meshrun inside a torchrun worker inherits the agent's flag; torch's rank 0 must serve.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MESHCOMM_MASTER_PORT", "1")  # a stale outer job's
    cfg = parse_args(["--nproc-per-node", "2", "x.py"])
    prepared = dataclasses.replace(cfg, torch_master_port=40001)
    env = child_environment(prepared, 1, 40000)
    assert (env["MESHCOMM_MASTER_ADDR"], env["MESHCOMM_MASTER_PORT"]) == ("127.0.0.1", "40000")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "40001")
    assert (env["MESHCOMM_STORE_HOSTED"], env["TORCHELASTIC_USE_AGENT_STORE"]) == ("1", "False")


def test_the_reserved_port_refuses_others_and_admits_torch() -> None:
    reservation = PortReservation()
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("0.0.0.0", reservation.port))  # no SO_REUSEADDR: refused
        if importlib.util.find_spec("torch") is not None:
            import torch.distributed as dist

            server = dist.TCPStore(
                "127.0.0.1", reservation.port, 1, True, timeout=timedelta(seconds=10)
            )
            server.set("k", "v")
            assert server.get("k") == b"v"
            del server
    finally:
        reservation.close()


def test_other_nodes_wait_for_node_0_and_name_the_key() -> None:
    cfg = parse_args(["--nnodes", "2", "--node-rank", "1", "--no-secret",
                      "--rdzv-conf", "join_timeout=1", "x.py"])  # fmt: skip
    server = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, timeout=5, secret="")
    try:
        local = dataclasses.replace(cfg, master_addr="127.0.0.1")
        with pytest.raises(TorchEndpointError, match=r"meshrun/torch-endpoint/none.*join_timeout"):
            fetch_endpoint(local, server.port)
        server.set(endpoint_key("none"), json.dumps({"addr": "10.0.0.7", "port": 40123}))
        assert fetch_endpoint(local, server.port) == ("10.0.0.7", 40123)
        server.set(endpoint_key("none"), "not json")
        with pytest.raises(TorchEndpointError, match="malformed"):
            fetch_endpoint(local, server.port)
    finally:
        server.close()


def test_node_0_address() -> None:
    cfg = parse_args(["--nnodes", "2", "--no-secret", "--master-addr", "127.0.0.1", "x.py"])
    assert node0_address(cfg, hosts_store=True) == "127.0.0.1"
    # Not hosting (c10d, another node owns the endpoint): the address on the route to it.
    assert node0_address(cfg, hosts_store=False) == "127.0.0.1"
    given = parse_args(["--nnodes", "2", "--no-secret", "--local-addr", "10.1.2.3", "x.py"])
    assert node0_address(given, hosts_store=False) == "10.1.2.3"
