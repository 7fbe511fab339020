"""What users and a reliability probe found (issue 33, items 7 and 8), each on tcp and mpi.

The checks that run inside the ranks (``meshcomm-bench``'s oracle, ndarray subclasses into
collectives, mesh ranks outside the world) run once per backend and world size, 2 and 4:
tcp through :func:`meshcomm.testing.run_ranks`, mpi under a real ``mpiexec`` running this
file as a script (``mpiexec -n 4 python tests/test_probe_fixes.py``; each rank writes its
failures as JSON, as ``tests/test_mpi.py``'s cases do). Every check returns the list of what
went wrong, so a test names every failure at once.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers of the sibling tests
from test_mpi import SKIP as MPI_SKIP
from test_mpi import mpirun

HERE = Path(__file__).resolve()

BACKENDS = [
    "tcp",
    pytest.param(
        "mpi", marks=[pytest.mark.mpi, pytest.mark.skipif(bool(MPI_SKIP), reason=MPI_SKIP)]
    ),
]


def _matrix(values: Any) -> np.matrix:
    import warnings

    with warnings.catch_warnings():  # numpy discourages np.matrix; users still pass them
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        return np.matrix(values)


# == the checks (run inside the ranks) ========================================================
def bench_oracle(group: Any) -> list[str]:
    """meshcomm-bench's oracle: every reduce op's result counts as right, a wrong one as
    wrong (it used to check every op against a sum)."""
    from meshcomm.bench import _Case

    failures = []
    n = group.size
    for dtype in (np.float32, np.float16, np.int32):
        for redop in ("sum", "prod", "min", "max", "avg"):
            if redop == "avg" and np.dtype(dtype).kind == "i":
                continue  # the library refuses a mean of integers
            for op in ("all_reduce", "reduce_scatter", "reduce"):
                case = _Case(group, op, 16 * n, np.dtype(dtype), redop, n - 1)
                result = case.run()
                wrong = case.wrong(result)
                if wrong:
                    failures.append(f"{op} {redop} {np.dtype(dtype)}: {wrong} counted wrong")
                if result is not None:
                    off = np.asarray(result).copy()
                    off.flat[0] = 2 * off.flat[0] + 1  # beyond any rounding's reach
                    if case.wrong(off) != 1:
                        failures.append(f"{op} {redop} {np.dtype(dtype)}: one wrong value missed")
    return failures


def subclasses(group: Any) -> list[str]:
    """np.matrix passes as its values; a masked array is refused before any I/O, naming the
    rank, and the group works on; out= takes plain arrays only."""
    from meshcomm import ops
    from meshcomm.errors import InvalidArgument
    from meshcomm.mesh import DeviceMesh

    failures = []
    n, rank = group.size, group.rank
    mesh = DeviceMesh(np.arange(n), "x", group=group)
    m = _matrix(np.arange(4.0).reshape(1, 4))
    for name, call in [
        ("all_reduce", group.all_reduce),
        ("all_reduce async", lambda x: group.all_reduce(x, async_op=True).wait()),
        ("psum", lambda x: ops.psum(x, "x", mesh=mesh)),
    ]:
        got = call(m)
        if type(got) is not np.ndarray or not np.array_equal(got, n * np.asarray(m)):
            failures.append(f"{name}(matrix) gave {type(got).__name__} {got!r}")
    gathered = group.all_gather(m)
    if type(gathered) is not np.ndarray or gathered.shape != (n, 1, 4):
        failures.append(f"all_gather(matrix) gave {type(gathered).__name__} {gathered.shape}")

    for size in (4, 1 << 17):  # 2^17 once summed its masked slots silently
        masked = np.ma.masked_array(np.ones(size), mask=np.arange(size) % 2 == 0)
        for name, call in [
            ("all_reduce", group.all_reduce),
            ("all_reduce async", lambda x: group.all_reduce(x, async_op=True)),
            ("broadcast", lambda x: group.broadcast(x, 0)),
            ("all_gather", group.all_gather),
            ("psum", lambda x: ops.psum(x, "x", mesh=mesh)),
            ("send", lambda x: group.send(x, (rank + 1) % n)),
        ]:
            try:
                call(masked)
                failures.append(f"{name}(masked, {size}) was accepted")
            except TypeError as exc:
                if "masked arrays are not supported" not in str(exc) or f"rank {rank}" not in str(
                    exc
                ):
                    failures.append(f"{name}(masked): {exc}")
    for x, out in [(m, m), (np.ones(4), np.ma.masked_array(np.ones(4)))]:
        try:
            group.all_reduce(x, out=out)
            failures.append(f"all_reduce(out={type(out).__name__}) was accepted")
        except InvalidArgument as exc:
            if "out= takes plain numpy arrays" not in str(exc):
                failures.append(f"all_reduce(out={type(out).__name__}): {exc}")
    # Nothing above reached the wire: the group works on.
    total = group.all_reduce(np.ones(2))
    if not np.array_equal(total, np.full(2, n)):
        failures.append(f"the group after the refusals: {total}")
    return failures


def mesh_ranks(group: Any) -> list[str]:
    """A mesh naming a rank outside the world is refused when it is made, not when used."""
    from meshcomm.errors import InvalidArgument
    from meshcomm.mesh import DeviceMesh

    failures = []
    n = group.size
    grid = np.arange(n).reshape(-1, 2)
    grid[-1, -1] = 9
    for kwargs in ({}, {"group": group}):
        try:
            DeviceMesh(grid.tolist(), **kwargs)
            failures.append(f"DeviceMesh({grid.tolist()}, {kwargs}) was accepted")
        except InvalidArgument as exc:
            text = str(exc)
            if "holds ranks [9]" not in text or f"group 'world' of size {n}" not in text:
                failures.append(f"DeviceMesh({grid.tolist()}): {text}")
    good = DeviceMesh(np.arange(n).reshape(-1, 2), ("a", "b"))
    if good.get_group("b").size != 2:
        failures.append("a good mesh after the refusal has no group")
    return failures


CASES: dict[str, Callable[[Any], list[str]]] = {
    "bench_oracle": bench_oracle,
    "subclasses": subclasses,
    "mesh_ranks": mesh_ranks,
}


def every_case(group: Any) -> dict[str, list[str]]:
    """Every check on one world: its failures by name (one launch per backend and size)."""
    out: dict[str, list[str]] = {}
    for name, check in CASES.items():
        try:
            out[name] = check(group)
        except Exception as exc:  # one check's crash must not hide the others' results
            out[name] = [f"raised {type(exc).__name__}: {exc}"]
    return out


def _mpi_rank_main() -> None:
    import meshcomm

    group = meshcomm.init(backend="mpi", timeout=60)
    try:
        result = every_case(group)
    finally:
        meshcomm.shutdown()
    out = Path(os.environ["MESHCOMM_TEST_RESULTS"]) / f"rank{group.rank}.json"
    out.write_text(json.dumps(result))


@functools.cache
def _results(backend: str, nprocs: int) -> tuple[dict[str, list[str]], ...]:
    if backend == "tcp":
        from meshcomm.testing import run_ranks

        return tuple(run_ranks(every_case, nprocs, timeout=120))
    run = mpirun(nprocs, [], script=[str(HERE)], timeout=120)
    assert run.rc == 0 and len(run.results) == nprocs, run.tail()
    return tuple(run.results)


def _failures(name: str, backend: str, nprocs: int) -> list[str]:
    return [f"rank {r}: {f}" for r, res in enumerate(_results(backend, nprocs)) for f in res[name]]


# == the tests ===============================================================================
@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bench_checks_every_reduce_op_against_its_own_oracle(backend: str, nprocs: int) -> None:
    failures = _failures("bench_oracle", backend, nprocs)
    assert not failures, "\n".join(failures[:30])


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matrix_passes_as_values_and_masked_arrays_are_refused_before_io(
    backend: str, nprocs: int
) -> None:
    failures = _failures("subclasses", backend, nprocs)
    assert not failures, "\n".join(failures[:30])


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mesh_with_ranks_outside_the_world_is_refused_when_made(backend: str, nprocs: int) -> None:
    failures = _failures("mesh_ranks", backend, nprocs)
    assert not failures, "\n".join(failures[:30])


def test_in_place_layer_takes_matrix_values_and_refuses_masked_arrays() -> None:
    from meshcomm.distributed._tensors import as_buffer

    m = _matrix([[1.0, 2.0]])
    buf = as_buffer(m, "tensor")
    assert type(buf.host) is np.ndarray and buf.shape == (1, 2)
    buf.write(np.array([5.0, 6.0]))
    assert m.tolist() == [[5.0, 6.0]]  # written into the caller's own memory
    with pytest.raises(TypeError, match="tensor: masked arrays are not supported"):
        as_buffer(np.ma.masked_array([1.0, 2.0]), "tensor")


# -- shutting down after the store's host died -------------------------------------------------
_LEAVES = """
import sys, time, numpy as np, meshcomm
group = meshcomm.init(backend="tcp", timeout=10)
group.all_reduce(np.ones(2))
print("joined", flush=True)
sys.stdin.readline()  # the store's process is dead when this line comes
start = time.monotonic()
meshcomm.shutdown()
print(f"shutdown took {time.monotonic() - start:.3f}", flush=True)
"""


@pytest.mark.parametrize("nprocs", [2, 4])
def test_shutdown_never_waits_on_a_store_whose_host_died(tmp_path: Path, nprocs: int) -> None:
    """The store's process (here a standalone server, as meshrun's is) is killed while the
    ranks are joined: each rank's shutdown used to retry the store for the timeout, twice
    (20 s at timeout=10)."""
    import subprocess

    from test_mpi import clean_env

    script = tmp_path / "leaves.py"
    script.write_text(_LEAVES)
    env = clean_env({"MESHCOMM_SECRET": "probe-secret"})
    server = subprocess.Popen(
        [sys.executable, "-m", "meshcomm.store", "--port", "0"],
        stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    ranks: list[subprocess.Popen[str]] = []
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip().rsplit(":", 1)[1]
        for rank in range(nprocs):
            rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(nprocs))
            rank_env.update(MESHCOMM_MASTER_ADDR="127.0.0.1", MESHCOMM_MASTER_PORT=port)
            rank_env["MESHCOMM_STORE_HOSTED"] = "1"
            pipe = subprocess.PIPE
            command = [sys.executable, str(script)]
            ranks.append(
                subprocess.Popen(
                    command, stdin=pipe, stdout=pipe, stderr=pipe, text=True, env=rank_env
                )
            )
        for proc in ranks:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "joined", proc.communicate(timeout=30)
        server.kill()
        server.wait(10)
        outcomes = [proc.communicate("\n", timeout=60) for proc in ranks]
    finally:
        for proc in [server, *ranks]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for rank, (out, err) in enumerate(outcomes):
        assert ranks[rank].returncode == 0, f"rank {rank}: {out}\n{err[-2000:]}"
        seconds = float(out.split("shutdown took ")[1])
        assert seconds < 3.0, f"rank {rank}: shutdown took {seconds:.1f} s at timeout=10"


def test_a_leaving_store_client_does_not_reconnect() -> None:
    from meshcomm.errors import StoreError
    from meshcomm.store import StoreServer, TCPStore

    server = StoreServer("127.0.0.1", 0)
    server.start()
    client = TCPStore("127.0.0.1", server.port, timeout=30)
    client.set("k", b"v")
    server.close()
    client.stop_reconnecting()
    start = time.monotonic()
    with contextlib.suppress(StoreError):
        client.get("k")  # may be the call that finds the connection closed
    with pytest.raises(StoreError, match="this client is leaving: not reconnecting"):
        client.get("k")
    assert time.monotonic() - start < 2.0
    client.close()


# -- what a REJECT tells a stranger ------------------------------------------------------------
def _answer_to(address: str, hello: bytes) -> Any:
    import socket

    from meshcomm.backends.tcp import wire

    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(hello)
        decoder = wire.Decoder()
        while (event := decoder.next_event()) is wire.NEED_DATA:
            data = sock.recv(4096)
            assert data, "the rank closed without answering"
            decoder.receive_data(data)
    return event


@pytest.mark.parametrize("secret", [None, "probe-secret"])
@pytest.mark.parametrize("size", [2, 4])
def test_a_reject_tells_a_stranger_only_that_its_token_differs(
    size: int, secret: str | None
) -> None:
    from meshcomm.backends.tcp import wire
    from meshcomm.backends.tcp.transport import TOKEN_KEY, Transport
    from meshcomm.store import HashStore

    store = HashStore(timeout=10)
    transport = Transport.start(0, size, store, 10.0, secret=secret)
    try:
        token = bytes(store.get(TOKEN_KEY))
        stranger = bytes(range(wire.TOKEN_SIZE))
        hello = wire.encode_hello(wire.HELLO, rank=1, world_size=size, token=stranger)
        answer = _answer_to(transport.address, hello)
    finally:
        transport.close()
    assert answer.kind == wire.REJECT, answer
    assert answer.token == wire.NO_TOKEN, "a REJECT carried the job's token"
    assert token.hex() not in answer.reason, answer.reason
    assert "its job token differs from this job's" in answer.reason, answer.reason


# -- an impostor store ------------------------------------------------------------------------
@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_refusing_an_impostor_store_says_why_not_that_it_timed_out(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from meshcomm.errors import RendezvousError
    from meshcomm.rendezvous import rendezvous
    from meshcomm.store import StoreServer

    monkeypatch.setenv("MESHCOMM_SECRET", "the-job")

    def env(port: int, rank: int) -> dict[str, str]:
        return {"RANK": str(rank), "WORLD_SIZE": str(size), "MESHCOMM_STORE_HOSTED": "1",
                "MESHCOMM_MASTER_ADDR": "127.0.0.1", "MESHCOMM_MASTER_PORT": str(port)}  # fmt: skip

    with StoreServer("127.0.0.1", 0, secret="an-impostor") as server:
        start = time.monotonic()
        with pytest.raises(RendezvousError) as refused:
            rendezvous(env=env(server.port, size - 1), timeout=8)
        assert time.monotonic() - start < 3.0
    text = str(refused.value)
    assert f"rank {size - 1} cannot use the store at 127.0.0.1:{server.port}" in text, text
    assert "could not prove it knows this job's secret" in text, text
    assert "within 8 s" not in text, text
    # A store that never answers still says how long this rank waited.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(RendezvousError, match=r"could not reach the store at .* within 0.5 s"):
        rendezvous(env=env(port, 1), timeout=0.5)


if __name__ == "__main__":
    _mpi_rank_main()
