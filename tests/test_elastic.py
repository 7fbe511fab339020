"""meshcomm.elastic: a data-parallel run that loses ranks to SIGKILL shrinks and goes on.

Real processes under ``meshrun --elastic`` on the tcp backend: ranks SIGKILL themselves
mid-training, the survivors shrink the mesh (a whole 'dp' replica leaves with its dead
member), go back to the last step every survivor committed and go on. The final
parameters must equal a float64 replay of the same sequence of replica sets (1e-12): no
step lost, none applied twice. Nothing may be left behind in /dev/shm.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshcomm.elastic.membership import agree
from meshcomm.errors import InvalidArgument, LeftTheMesh
from meshcomm.store import HashStore

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "elastic_train.py"
sys.path.insert(0, str(SCRIPT.parent))
from elastic_train import DIM, RATE, sample  # noqa: E402
from test_nccl import GPU_SKIP  # noqa: E402


def _shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("mcshm")}


def _left_running() -> list[str]:
    """Processes still running the training script (none may outlive meshrun)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(SCRIPT) in line and "pytest" not in line:
            found.append(f"{pid}: {line}")
    return found


def _run(
    ranks: int, shape: str, steps: int, kills: list[str], ms: int = 0, flags: tuple[str, ...] = ()
) -> tuple[int, dict[int, Any], str]:
    env = dict(os.environ, MESHCOMM_TIMEOUT="10", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    command = [sys.executable, "-m", "meshcomm.run", "--elastic", *flags, "--nproc-per-node",
               str(ranks), str(SCRIPT), shape, str(steps), str(ms), *kills]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(REPO), start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"meshrun --elastic ran past 120 s:\n{err[-3000:]}")
    return proc.returncode, lines_of(out), err


def lines_of(out: str) -> dict[int, Any]:
    """Each rank's JSON line from meshrun's output (its ``[rankN] `` label dropped)."""
    lines: dict[int, Any] = {}
    for line in out.splitlines():
        body = line.split("] ", 1)[1] if line.startswith("[rank") else line
        if body.startswith("{"):
            record = json.loads(body)
            lines[record["rank"]] = record
    return lines


def _replay(history: list[list[Any]], tp: int) -> np.ndarray:
    """The parameters of a run whose step ``s`` ran on ``members`` (first-world ranks)."""
    w = np.zeros(DIM)
    for expected, (s, members) in enumerate(history):
        assert s == expected, history  # every step once, in order
        replicas = len(members) // tp
        grads = [w - sample(s, r) for r in range(replicas)]
        w = w - RATE * np.sum(grads, axis=0) / replicas
    return w


def _check(lines: dict[int, Any], survivors: list[int], left: list[int], steps: int, tp: int,
           shape: list[int]) -> None:  # fmt: skip
    assert sorted(r for r, v in lines.items() if v.get("left")) == sorted(left), lines
    done = {r: v for r, v in lines.items() if "w" in v}
    assert sorted(done) == sorted(survivors), lines
    first = done[survivors[0]]
    assert len(first["history"]) == steps, first
    reference = _replay(first["history"], tp)
    for r, v in done.items():
        assert v["history"] == first["history"], (r, v["history"], first["history"])
        assert v["shape"] == shape, v
        np.testing.assert_allclose(v["w"], reference, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("ranks", "shape", "kills", "survivors", "left", "final"),
    [
        (4, "4", ["2:5"], [0, 1, 3], [], [3]),
        (8, "4x2", ["5:4"], [0, 1, 2, 3, 6, 7], [4], [3, 2]),
        (4, "4", ["1:3", "3:7"], [0, 2], [], [2]),  # two failures in a row
    ],
    ids=["dp4-one-kill", "dp4xtp2-replica-leaves", "dp4-two-kills"],
)
def test_sigkilled_ranks_shrink_the_mesh_and_the_run_matches_the_replay(
    ranks: int, shape: str, kills: list[str], survivors: list[int], left: list[int],
    final: list[int],
) -> None:  # fmt: skip
    before = _shm()
    steps = 10
    rc, lines, err = _run(ranks, shape, steps, kills)
    assert rc == 0, err[-3000:]
    tp = int(shape.split("x")[1]) if "x" in shape else 1
    _check(lines, survivors, left, steps, tp, final)
    for arg in kills:
        victim = int(arg.split(":")[0])
        assert f"rank {victim} (pid" in err and "go on without it (--elastic)" in err, err
    assert _shm() <= before, _shm() - before
    assert _left_running() == []


@pytest.mark.parametrize(
    ("ranks", "shape", "victim", "unit"),
    [(4, "4", 2, [2]), (8, "4x2", 5, [4, 5])],
    ids=["dp4", "dp4xtp2"],
)
def test_a_replacement_rejoins_and_the_dp_axis_grows_back(
    ranks: int, shape: str, victim: int, unit: list[int]
) -> None:
    """meshrun --elastic --max-restarts 1 starts the killed rank again; it joins at a step
    boundary (with the rank of its unit that waited), receives the state from a live
    replica, and the run goes on at full size: every rank ends with the replay's values."""
    before = _shm()
    rc, lines, err = _run(ranks, shape, 40, [f"{victim}:3"], ms=30, flags=("--max-restarts", "1"))
    assert rc == 0, err[-3000:]
    assert f"started rank {victim} again" in err, err[-3000:]
    assert sorted(r for r, v in lines.items() if "w" in v) == list(range(ranks)), lines
    history = lines[0]["history"]
    sizes = [len(members) for _, members in history]
    assert sizes[0] == ranks and sizes[-1] == ranks, sizes
    assert min(sizes) == ranks - len(unit), sizes  # shrunk by the unit, then grown back
    reference = _replay(history, int(shape.split("x")[1]) if "x" in shape else 1)
    for r, v in lines.items():
        np.testing.assert_allclose(v["w"], reference, rtol=1e-12, atol=1e-12)
        if r not in unit:  # the unit's ranks were away for a while
            assert v["history"] == history, (r, v["history"])
    assert lines[victim]["joined"] == "1", lines[victim]
    assert all(lines[r]["growths"] == 1 for r in range(ranks)), lines
    assert _shm() <= before, _shm() - before
    assert _left_running() == []


def test_no_whole_unit_left_is_an_error_on_every_survivor() -> None:
    rc, lines, err = _run(2, "1x2", 4, ["1:2"])
    assert rc == 0, err[-3000:]
    assert "no 'dp' unit of the mesh" in lines[0]["no_mesh"], lines


def test_the_survivors_agree_on_who_is_alive() -> None:
    """Three survivors of a world of five, one of them seeing rank 4 die: the decider waits
    for rank 3 (seen by nobody) until the deadline, and everyone gets the same list."""
    store = HashStore(timeout=10)
    got: dict[int, Any] = {}

    def rank(me: int) -> None:
        got[me] = agree(store, 0, me, 5, [4] if me == 0 else [], seconds=0.5)

    threads = [threading.Thread(target=rank, args=(me,)) for me in (0, 1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == {0: (0, 1, 2), 1: (0, 1, 2), 2: (0, 1, 2)}, got
    with pytest.raises(LeftTheMesh, match="rank 3: the survivors of round 0 went on"):
        agree(store, 0, 3, 5, [], seconds=0.5)  # too late


def test_a_shape_that_is_not_the_world_is_refused_before_any_io() -> None:
    from meshcomm.elastic import ElasticMesh

    store = HashStore(timeout=5)
    with pytest.raises(InvalidArgument, match="has 6 ranks, the world 4"):
        ElasticMesh((3, 2), ("dp", "tp"), store=store, rank=0, world_size=4)
    with pytest.raises(InvalidArgument, match="unit 'pp' is not one of the axes"):
        ElasticMesh((2, 2), ("dp", "tp"), unit="pp", store=store, rank=0, world_size=4)
    assert store.num_keys() == 0


def test_the_mpi_backend_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshcomm.elastic import ElasticMesh
    from meshcomm.run import parse_args

    monkeypatch.setenv("MESHCOMM_BACKEND", "mpi")
    with pytest.raises(InvalidArgument, match="no ULFM"):
        ElasticMesh((2,), ("dp",), store=HashStore(timeout=5), rank=0, world_size=2)
    with pytest.raises(SystemExit):
        parse_args(["--nproc-per-node", "2", "--elastic", "--backend", "mpi", "x.py"])


def test_a_call_on_the_old_mesh_says_it_was_re_formed() -> None:
    """A world of one shrinks by nobody (every rank spoke): the mesh is formed again, and a
    collective on the mesh from before raises, saying why and what to use."""
    from meshcomm import ops
    from meshcomm.elastic import ElasticMesh
    from meshcomm.errors import CommError

    elastic = ElasticMesh((1,), ("dp",), store=HashStore(timeout=5), rank=0, world_size=1)
    try:
        old = elastic.mesh
        assert ops.psum(np.ones(2), "dp", mesh=old).tolist() == [1.0, 1.0]
        elastic.shrink()
        assert elastic.rounds == 1 and elastic.shape == (1,)
        with pytest.raises(CommError, match="the mesh is being re-formed after a loss"):
            ops.psum(np.ones(2), "dp", mesh=old)
        assert ops.psum(np.ones(2), "dp", mesh=elastic.mesh).tolist() == [1.0, 1.0]
    finally:
        elastic.close()


@pytest.mark.parametrize(("shape", "axis", "waiting"), [("3", "", [1, 2]),
                         ("2x2", "", [1, 2, 3]), ("2x2", "dp", [2])])  # fmt: skip
def test_calls_in_flight_say_the_mesh_is_being_re_formed(
    shape: str, axis: str, waiting: list[int]
) -> None:
    """Rank 0 re-forms the mesh while the others wait for it in a psum (over the mesh, or
    over 'dp' alone: a group of its own, where only rank 2 waits for rank 0): their calls
    end with PeerClosed saying so (not a death), and every rank is in the new mesh."""
    ranks = int(np.prod([int(n) for n in shape.split("x")]))
    env = dict(os.environ, MESHCOMM_TIMEOUT="10", PYTHONPATH=str(REPO))
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    script = SCRIPT.parent / "elastic_inflight.py"
    command = [sys.executable, "-m", "meshcomm.run", "--elastic", "--nproc-per-node", str(ranks),
               str(script), shape, *([axis] if axis else [])]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=str(REPO),
                          timeout=90, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = lines_of(done.stdout)
    assert sorted(lines) == list(range(ranks)), done.stdout
    for rank, line in lines.items():
        assert line["shape"] == [int(n) for n in shape.split("x")], line
        assert line["psum"] == [float(ranks)] * 2, line
        if rank not in waiting:
            assert line["error"] is None, line
            continue
        kind, words = line["error"]
        assert kind == "PeerClosed", line
        said = "rank 0 left the world: the mesh is being re-formed after a loss (round 1)"
        assert said in words, words
    assert _left_running() == []


@pytest.mark.gpu
@pytest.mark.skipif(bool(GPU_SKIP), reason=GPU_SKIP or "ok")
def test_a_gpu_world_is_aborted_and_made_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nccl for GPU arrays (one GPU: a world of one): a shrink aborts the device
    communicator and makes a new one; psum of cupy arrays and a Manager over a cupy state
    work on the new world."""
    import cupy

    from meshcomm import ops
    from meshcomm.elastic import ElasticMesh, Manager

    monkeypatch.setenv("MESHCOMM_BACKEND", "cpu:tcp,cuda:nccl")
    elastic = ElasticMesh((1,), ("dp",), store=HashStore(timeout=30), rank=0, world_size=1)
    try:
        assert ops.psum(cupy.ones(4), "dp", mesh=elastic.mesh).tolist() == [1.0] * 4
        elastic.shrink()
        assert ops.psum(cupy.ones(4), "dp", mesh=elastic.mesh).tolist() == [1.0] * 4

        def step(mesh: Any, state: dict[str, Any], i: int) -> dict[str, Any]:
            return {"w": state["w"] + ops.psum(cupy.ones(4), "dp", mesh=mesh)}

        final = Manager(elastic, {"w": cupy.zeros(4)}).run(step, 3)
        assert final is not None and isinstance(final["w"], cupy.ndarray)
        assert final["w"].tolist() == [3.0] * 4
    finally:
        elastic.close()
