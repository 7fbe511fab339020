"""torchrun interop: meshcomm.init() under a real torchrun, and the torch store adapter.

torchrun's elastic agent serves torch's own TCPStore on MASTER_PORT and tells the workers so
with ``TORCHELASTIC_USE_AGENT_STORE=True``; meshcomm must then join that store (through
``TorchStore``) instead of binding the port itself. The end-to-end tests run this file as
the worker script under ``python -m torch.distributed.run`` (see :func:`worker`).

Every test is skipped, with the reason, when torch is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
from jobs import ROOT, Job

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed (pip install meshcomm[torch]): torchrun interop needs it",
)

MARK = "MESHCOMM-TORCHRUN "
# A whole torchrun job (agent + workers importing torch and numpy) on a slow 2-core machine.
JOB_TIMEOUT = 120.0
# A StoreTimeout or RendezvousError must come within its timeout plus this.
SLACK = 10.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without any launcher's variables (an outer job must not leak in)."""
    prefixes = ("MESHCOMM_", "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL")
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in names and not k.startswith(prefixes)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["MESHCOMM_TIMEOUT"] = "60"
    return env | (extra or {})


def _run(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run a command in its own session; kill the whole session if it outlives the timeout."""
    return Job(command, env).finish(JOB_TIMEOUT)


def _records(out: str) -> dict[int, dict[str, Any]]:
    found = [json.loads(line[len(MARK) :]) for line in out.splitlines() if line.startswith(MARK)]
    return {record["rank"]: record for record in found}


def _torchrun(nproc: int, *launcher_args: str) -> dict[int, dict[str, Any]]:
    command = [sys.executable, "-m", "torch.distributed.run", *launcher_args]
    command += ["--nproc-per-node", str(nproc), __file__, str(nproc)]
    code, out = _run(command, _clean_env())
    assert code == 0, f"torchrun exited with {code}:\n{out[-6000:]}"
    records = _records(out)
    assert sorted(records) == list(range(nproc)), out[-6000:]
    return records


def _tcp_backend_importable() -> bool:
    try:
        import meshcomm.backends.tcp  # noqa: F401 - only whether it imports
    except ImportError:
        return False
    return True


def _check_job(records: dict[int, dict[str, Any]], n: int) -> None:
    skipped = "skipped: the tcp backend is not importable"
    all_reduce = "ok" if _tcp_backend_importable() else skipped
    for rank, record in records.items():
        assert (record["size"], record["launcher"], record["local_rank"]) == (n, "torchrun", rank)
        # The agent serves the store: no rank may host one, and every rank joined its port.
        assert record["store_host"] == "torchelastic"
        assert record["hosts_server"] is False
        assert record["address"] == f"tcp://{record['master']} (torchrun)"
        assert record["peer_value"] == f"hello from rank {(rank + 1) % n}"
        assert record["all_reduce"] == all_reduce


# -- real torchrun -----------------------------------------------------------------------


@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_standalone(nproc: int) -> None:
    _check_job(_torchrun(nproc, "--standalone"), nproc)


def test_torchrun_multi_node_style_static_rendezvous() -> None:
    # What a multi-node job passes, with one node: the agent binds --master-port itself.
    port = _free_port()
    args = ["--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1"]
    records = _torchrun(2, *args, "--master-port", str(port))
    _check_job(records, 2)
    assert {r["master"] for r in records.values()} == {f"127.0.0.1:{port}"}


def test_torchrun_c10d_rendezvous_backend() -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    args = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    _check_job(_torchrun(2, *args, "--rdzv-id", "meshcomm-test"), 2)


# -- the same environment without torchrun ------------------------------------------------


def _launch(rank_envs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Start one worker per environment (each runs :func:`worker`); return their records."""
    jobs = [
        Job([sys.executable, __file__, str(len(rank_envs))], _clean_env(env)) for env in rank_envs
    ]
    outs = []
    try:
        for job in jobs:
            outs.append(job.proc.communicate(timeout=JOB_TIMEOUT)[0])
    finally:
        for job in jobs:
            if job.proc.poll() is None:
                job.kill()
                job.proc.communicate(timeout=30)
    records = [_records(out) for out in outs]
    assert all(len(r) == 1 for r in records), "\n".join(o[-3000:] for o in outs)
    return [next(iter(r.values())) for r in records]


def _rank_env(rank: int, n: int, port: int, **extra: str) -> dict[str, str]:
    env = {"RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank)}
    env |= {"LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return env | extra


def test_agent_store_served_by_this_process() -> None:
    import torch.distributed as dist

    # The test plays torchrun's agent: a torch TCPStore on a free port, workers as clients.
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    flag = {"TORCHELASTIC_USE_AGENT_STORE": "true"}  # any case, as well as "1"
    records = _launch([_rank_env(r, 3, server.port, **flag) for r in range(3)])
    assert [(r["rank"], r["hosts_server"], r["store_host"]) for r in records] == [
        (r, False, "torchelastic") for r in range(3)
    ]
    # meshcomm's keys live under meshcomm/, apart from torch's.
    assert server.check(["meshcomm/rdzv/0.0/done"])
    assert server.get("meshcomm/world/0.0/peer/1") == b"hello from rank 1"


@pytest.mark.parametrize(
    "extra",
    [
        {},  # not under torchrun's agent: rank 0 hosts, as torch's env:// does then
        {"TORCHELASTIC_USE_AGENT_STORE": "False"},
        # An explicit meshcomm address wins over the inherited torch flag.
        {"TORCHELASTIC_USE_AGENT_STORE": "True", "MESHCOMM_MASTER_ADDR": "127.0.0.1"},
    ],
)
def test_rank0_hosts_without_the_agent_store(extra: dict[str, str]) -> None:
    port = _free_port()
    if "MESHCOMM_MASTER_ADDR" in extra:
        extra = extra | {"MESHCOMM_MASTER_PORT": str(port)}
    records = _launch([_rank_env(r, 2, port, **extra) for r in range(2)])
    assert [(r["hosts_server"], r["store_host"]) for r in records] == [
        (True, "rank0"),
        (False, "rank0"),
    ]
    assert [r["peer_value"] for r in records] == ["hello from rank 1", "hello from rank 0"]


def test_agent_store_unreachable_is_a_clear_error() -> None:
    from meshcomm import world
    from meshcomm.errors import RendezvousError

    port = _free_port()  # nothing listens there
    env = _rank_env(1, 2, port, TORCHELASTIC_USE_AGENT_STORE="1")
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        world.World().init(timeout=1.0, env=env)
    assert time.monotonic() - start < 1.0 + SLACK
    text = str(info.value)
    assert "rank 1" in text and f"127.0.0.1:{port}" in text and "torchrun's agent" in text


# -- the adapter against a real torch TCPStore ------------------------------------------------


@pytest.fixture
def torch_server() -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_adapter_semantics(torch_server: Any) -> None:
    from meshcomm.store import PrefixStore
    from meshcomm.store.torch_adapter import TorchStore

    store = TorchStore.connect("127.0.0.1", torch_server.port, timeout=timedelta(seconds=5))
    other = TorchStore.connect("localhost", torch_server.port, timeout=5)
    assert store.timeout == 5.0
    store.set("bin", b"\x00\xff")
    store.set("text", "héllo")
    assert other.get("bin") == b"\x00\xff" and other.get("text") == "héllo".encode()
    assert store.add("n", 5) == 5 and other.add("n", -7) == -2 and store.get("n") == b"-2"
    # compare_set: a missing key matches "" only; otherwise the current value comes back.
    assert store.compare_set("c", "", "v") == b"v"
    assert store.compare_set("missing", "x", "y") == b"x" and not store.check(["missing"])
    assert store.compare_set("c", "nope", "w") == b"v"
    assert store.compare_set("c", b"v", b"w") == b"w"
    assert store.check(["c", "n"]) and not store.check(["c", "zz"])
    store.multi_set(["m1", "m2"], [b"1", "2"])
    assert other.multi_get(["m1", "m2"]) == [b"1", b"2"]
    store.append("log", b"a")
    store.append("log", "b")
    assert other.get("log") == b"ab"
    assert store.delete_key("log") and not store.delete_key("log")
    assert store.num_keys() >= 6
    other.wait(["c", "n"], timeout=1)
    # A PrefixStore over it: the world view meshcomm hands to backends.
    view = PrefixStore("job", store)
    view.set("k", "v")
    assert other.get("job/k") == b"v"
    store.close()
    other.close()
    store.close()  # idempotent


def test_adapter_timeouts_name_the_keys(torch_server: Any) -> None:
    from meshcomm.errors import StoreTimeout
    from meshcomm.store.torch_adapter import TorchStore

    store = TorchStore.connect("127.0.0.1", torch_server.port, timeout=0.3)
    for call in (
        lambda: store.get("absent"),
        lambda: store.multi_get(["here", "absent"]),
        lambda: store.wait(["absent"], timeout=timedelta(milliseconds=300)),
    ):
        store.set("here", "1")
        start = time.monotonic()
        with pytest.raises(StoreTimeout, match="'absent'"):
            call()
        assert time.monotonic() - start < 0.3 + SLACK
    store.set_timeout(5)
    assert store.timeout == 5.0 and store.get("here") == b"1"  # still usable after timeouts


def test_adapter_validates_before_any_io(torch_server: Any) -> None:
    from meshcomm.errors import InvalidArgument, StoreError
    from meshcomm.store.torch_adapter import TorchStore

    store = TorchStore.connect("127.0.0.1", torch_server.port, timeout=5)
    with pytest.raises(InvalidArgument, match="store keys must be str"):
        store.set(3, "v")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="store values must be bytes or str"):
        store.set("k", 3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="signed 64-bit"):
        store.add("k", 2**63)
    with pytest.raises(InvalidArgument, match="2 keys but 1 values"):
        store.multi_set(["a", "b"], [b"1"])
    with pytest.raises(InvalidArgument, match="sequence of str"):
        store.check("ab")
    with pytest.raises(InvalidArgument, match=r"port must be an int in \[1, 65535\], got 0"):
        TorchStore.connect("127.0.0.1", 0)
    store.set("k", "v")  # nothing above reached the server: the connection is unharmed
    assert store.get("k") == b"v"
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.get("k")


def test_adapter_errors_become_store_errors() -> None:
    import torch.distributed as dist

    from meshcomm.errors import StoreError
    from meshcomm.store.torch_adapter import TorchStore

    start = time.monotonic()
    with pytest.raises(StoreError, match=r"no torch TCPStore answered at 127\.0\.0\.1:\d+"):
        TorchStore.connect("127.0.0.1", _free_port(), timeout=0.5)
    assert time.monotonic() - start < 0.5 + SLACK
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = TorchStore.connect("127.0.0.1", server.port, timeout=5)
    store.set("k", "v")
    del server  # the server thread stops with its last reference
    with pytest.raises(StoreError, match=r"torch store at 127\.0\.0\.1"):
        for _ in range(50):  # the first call may still find the socket's buffer open
            store.set("k", "v")
            time.sleep(0.05)


# -- the worker: this file, run by torchrun (or by the tests above) --------------------------


def worker(expected_size: int) -> int:
    """One rank: init, check, exchange through the store, all_reduce, shut down."""
    import numpy as np

    import meshcomm
    from meshcomm.world import get_world_info

    group = meshcomm.init()
    info = get_world_info()
    rank, size = group.rank, group.size
    if size != expected_size or rank != int(os.environ["RANK"]):
        print(f"rank {rank} of {size}: expected RANK={os.environ['RANK']} of {expected_size}")
        return 1
    store = group.store
    assert store is not None, "the world group always has the rendezvous store"
    store.set(f"peer/{rank}", f"hello from rank {rank}")
    peer_value = store.get(f"peer/{(rank + 1) % size}").decode()
    try:
        import meshcomm.backends.tcp  # being finished: skip only if it is absent
    except ImportError:
        all_reduce = "skipped: the tcp backend is not importable"
    else:
        total = group.all_reduce(np.full(4, rank + 1.0))
        want = size * (size + 1) / 2
        all_reduce = "ok" if np.all(total == want) else f"got {total.tolist()}, want {want}"
    from meshcomm.launch import detect_launch

    record = {
        "rank": rank,
        "size": size,
        "launcher": info.launcher,
        "local_rank": info.local_rank,
        "address": info.address,
        "hosts_server": info.hosts_server,
        "store_host": detect_launch(os.environ).store_host,
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        "peer_value": peer_value,
        "all_reduce": all_reduce,
    }
    meshcomm.shutdown()
    # One write of the whole line: ranks share torchrun's stdout pipe, and print() may write the
    # text and its newline separately (unbuffered), letting another rank's line land in between.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (MARK + json.dumps(record) + "\n").encode())
    return 0 if all_reduce.startswith(("ok", "skipped")) else 1


if __name__ == "__main__":
    sys.exit(worker(int(sys.argv[1])))
