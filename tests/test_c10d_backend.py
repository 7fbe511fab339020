"""Backend "meshcomm" under torch.distributed's own API gives what backend "gloo" gives.

Real processes on CPU. tests/scripts/c10d_collectives.py runs every check in one launch per
backend and world size (2, 3 and 4; gloo's and meshcomm's launches run side by side) and
saves each rank's values; the tests here compare the two backends:

- every collective torch's classes call on a backend: all_reduce (each op gloo takes, three
  dtypes, a non-contiguous view, a zero-size tensor), all_reduce_coalesced, all_gather and
  ``all_gather_into_tensor`` (plain, coalesced by ``dist._coalescing_manager``),
  reduce_scatter and ``reduce_scatter_tensor``, all_to_all, ``all_to_all_single`` with and
  without splits, broadcast, reduce, gather, scatter, send/recv, a receive from any rank,
  isend/irecv and ``batch_isend_irecv``, barrier, ``new_group`` subsets that leave ranks
  out, async works and their futures;
- torch's functional collectives, eager and (meshcomm) under ``torch.compile(fullgraph=True)``;
- torch's own DistributedDataParallel (with and without a comm hook),
  ZeroRedundancyOptimizer and DistributedSampler's defaults;
- errors: a rank that dies, mismatched calls, features the backend refuses before any I/O;
- torch's backend autoload (no ``import meshcomm``), and the explicit import without it;
- the same job under meshrun, with ``init_process_group("meshcomm")`` alone and after
  ``meshcomm.init()`` (torch's default group adopts meshcomm's world).

Values are float64 and must be bit-equal to gloo's, except reductions over more than two
ranks (the order of the additions differs): within 1e-12. Known differences from gloo,
checked apart: gloo all-reduces and broadcasts a non-contiguous view wrongly (it writes the
result as if the view were contiguous; meshcomm's equals the call on a contiguous copy), and the
future of an async ``all_gather_into_tensor`` holds gloo's input but meshcomm's output (as
NCCL's).

Skipped, with the reason, when torch is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed (pip install meshcomm[torch]): the c10d backend needs it",
)

from jobs import ROOT, Job  # noqa: E402

from tests.test_torchrun import _clean_env, _free_port  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "c10d_collectives.py"
ERRORS = ROOT / "tests" / "scripts" / "c10d_errors.py"
# One launch (torch and numpy imported by every rank, inductor compiling) on 2 slow cores.
JOB_TIMEOUT = 150.0
TOL = 1e-12
# float32 reductions over more than two ranks: float32 rounding.
F32_TOL = 1e-6
# The group timeout of c10d_errors.py, and how late an error may come after it.
ERROR_TIMEOUT = 10.0
SLACK = 5.0

# Keys whose values are sums or products over every rank: bit-equal to gloo's at world 2,
# within TOL beyond (the order of the additions differs).
REDUCED = (
    "all_reduce sum",
    "all_reduce product",
    "all_reduce avg",
    "all_reduce strided",
    "all_reduce_coalesced",
    "coalescing_manager all_reduce",
    "coalescing_manager reduce_scatter",
    "reduce_scatter sum",
    "reduce_scatter product",
    "reduce_scatter avg",
    "reduce_scatter_tensor avg",
    "reduce_scatter_tensor sum",
    "reduce_scatter_tensor product",
    "reduce sum",
    "new_group",
    "async all_reduce",
    "funcol eager all_reduce",
    "funcol eager reduce_scatter",
    "funcol eager step",
    "funcol compiled",
    "ddp ",
)
# Checked apart from gloo (see the module docstring), or meshcomm's alone.
APART = (
    "all_reduce strided",
    "broadcast strided",
    "async all_gather_into_tensor future",
    "funcol compiled",
    "unsupported ",
)

Record = dict[str, Any]


def _torchrun(nproc: int, *args: str, env: dict[str, str] | None = None) -> Job:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    command += ["--master-port", str(_free_port()), str(SCRIPT), *args]
    return Job(command, _clean_env(env))


def _meshrun(nproc: int, *args: str, env: dict[str, str] | None = None) -> Job:
    command = [sys.executable, "-m", "meshcomm.run", "--nproc-per-node", str(nproc)]
    return Job([*command, str(SCRIPT), *args], _clean_env(env))


def _load(out_dir: Path, world: int, launch: Job) -> dict[int, Record]:
    """Every rank's record of a finished launch; fail with its output if it failed."""
    import torch

    code, out = launch.finish(JOB_TIMEOUT)
    assert code == 0, f"{launch.command} exited with {code}:\n{out[-6000:]}"
    found = {r: torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)}
    assert all(rec["rank"] == r for r, rec in found.items()), out[-4000:]
    return found


class Jobs:
    """gloo's and meshcomm's launches per world size, side by side, run once on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[int, tuple[dict[int, Record], dict[int, Record]]] = {}
        self.failed: set[int] = set()

    def records(self, world: int) -> tuple[dict[int, Record], dict[int, Record]]:
        """(gloo's, meshcomm's) records of every rank at ``world``."""
        if world in self.failed:  # one launch per world, even when it failed
            pytest.fail(f"the jobs at world {world} failed (see the first test)")
        if world not in self.done:
            self.failed.add(world)
            # inductor compiles at world 2 only (it is the slowest part of a launch).
            env = {"C10D_COMPILE": "inductor" if world == 2 else "none"}
            dirs, launches = {}, {}
            for backend in ("gloo", "meshcomm"):
                dirs[backend] = self.root / f"{backend}-{world}"
                dirs[backend].mkdir()
                launches[backend] = _torchrun(world, backend, str(dirs[backend]), env=env)
            found = {b: _load(dirs[b], world, launches[b]) for b in ("gloo", "meshcomm")}
            self.failed.discard(world)
            self.done[world] = (found["gloo"], found["meshcomm"])
        return self.done[world]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    return Jobs(tmp_path_factory.mktemp("c10d-backend"))


def _compare(jobs: Jobs, world: int, prefixes: tuple[str, ...], at_least: int) -> int:
    """meshcomm's values of keys starting with ``prefixes`` against gloo's, on every rank."""
    import torch

    gloo, ours = jobs.records(world)
    compared = 0
    for rank in range(world):
        theirs, mine = gloo[rank], ours[rank]
        assert (theirs["backend"], mine["backend"]) == ("gloo", "meshcomm")
        assert mine["info"]["world_group"] == "MeshcommProcessGroup"
        for name, record in (("gloo", theirs), ("meshcomm", mine)):
            errors = {k: v for k, v in record["errors"].items() if k.startswith(prefixes)}
            assert not errors, f"{name}, rank {rank} of {world}:\n" + "\n".join(errors.values())
        want = {
            k: v
            for k, v in theirs["values"].items()
            if k.startswith(prefixes) and not k.startswith(APART)
        }
        got = {
            k: v
            for k, v in mine["values"].items()
            if k.startswith(prefixes) and not k.startswith(APART)
        }
        assert sorted(got) == sorted(want), f"rank {rank} of {world}"
        for key, expected in want.items():
            value = got[key]
            where = f"{key!r} on rank {rank} of {world}"
            assert value.dtype == expected.dtype and value.shape == expected.shape, where
            if world > 2 and key.startswith(REDUCED):
                tol = F32_TOL if value.dtype == torch.float32 else TOL
                torch.testing.assert_close(value, expected, rtol=tol, atol=tol, msg=where)
            else:
                assert torch.equal(value, expected), f"{where}: not bit-equal to gloo's"
            compared += 1
    assert compared >= at_least * world, f"only {compared} values compared at world {world}"
    return compared


WORLDS = [2, 3, pytest.param(4, marks=pytest.mark.slow)]
COLLECTIVES = (
    "all_",
    "coalescing_manager ",
    "reduce",
    "broadcast",
    "gather",
    "scatter",
    "send recv",
    "recv any",
    "isend",
    "batch_isend_irecv",
    "barrier",
    "new_group",
    "async ",
    "object ",
)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", WORLDS)
def test_every_collective_equals_gloo(jobs: Jobs, world: int) -> None:
    """Each collective and point-to-point call of torch.distributed, as gloo computes it."""
    import torch

    _compare(jobs, world, COLLECTIVES, at_least=50)
    gloo, ours = jobs.records(world)
    for rank, record in ours.items():
        values = record["values"]
        # A non-contiguous view is reduced (broadcast) in place, as a contiguous copy would be.
        assert torch.equal(values["all_reduce strided"], values["all_reduce strided reference"])
        assert torch.equal(values["broadcast strided"], values["broadcast strided reference"])
        # The future of an async all_gather_into_tensor holds the gathered output.
        assert torch.equal(
            values["async all_gather_into_tensor future"],
            values["async all_gather_into_tensor"][0],
        )
        # The receive from any rank said who sent what.
        if rank == 0:
            senders = values["recv any source"][:, 0].tolist()
            assert senders == [float(r) for r in range(1, world)]
            assert values["recv any source"][:, 1:].tolist() == [[s, s] for s in senders]
        # torch warned about its deprecated call; the backend added no warning of its own.
        warned = record["info"]["coalesced warnings"]
        assert not [w for w in warned if "meshcomm" in w], warned
    # gloo's strided all-reduce and broadcast are wrong (they write the result as if the view
    # were contiguous), so the reference is gloo's call on the contiguous copy.
    for rank in range(world):
        assert torch.equal(
            ours[rank]["values"]["broadcast strided"],
            gloo[rank]["values"]["broadcast strided reference"],
        )
        torch.testing.assert_close(
            ours[rank]["values"]["all_reduce strided"],
            gloo[rank]["values"]["all_reduce strided reference"],
            rtol=TOL,
            atol=TOL,
        )


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", WORLDS)
def test_functional_collectives_eager_and_compiled(jobs: Jobs, world: int) -> None:
    """torch's funcol on the meshcomm group; compiled with fullgraph=True, equal to eager."""
    import torch

    _compare(jobs, world, ("funcol ",), at_least=11)
    if world != 2:
        return
    gloo, ours = jobs.records(world)
    for rank in range(world):
        compiled = ours[rank]["values"]["funcol compiled"]
        expected = gloo[rank]["values"]["funcol eager step"]
        torch.testing.assert_close(compiled, expected, rtol=TOL, atol=TOL)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", WORLDS)
def test_ddp_zero_and_sampler_equal_gloo(jobs: Jobs, world: int) -> None:
    """torch's DDP (plain, with allreduce_hook), ZeroRedundancyOptimizer, DistributedSampler."""
    import torch

    _compare(jobs, world, ("ddp ", "sampler "), at_least=4)
    _, ours = jobs.records(world)
    values = ours[0]["values"]
    # The steps trained: the three losses differ, and the runs agree across the hook.
    assert len(set(values["ddp default"][-3:].tolist())) == 3
    torch.testing.assert_close(
        values["ddp default"], values["ddp allreduce_hook"], rtol=TOL, atol=TOL
    )
    # The sampler's shards are disjoint and cover the data set (padded to a multiple).
    shards = [ours[r]["values"]["sampler defaults"].tolist() for r in range(world)]
    flat = sorted(i for shard in shards for i in shard)
    assert set(flat) == set(range(23)) and len(flat) == -(-23 // world) * world


@pytest.mark.timeout(400)
def test_unsupported_features_fail_before_any_io(jobs: Jobs) -> None:
    """A per-call timeout and two tensors per process: Unsupported naming the feature.

    Rank 0 alone made the calls; the all-reduce every rank made next still matched, so
    nothing went out.
    """
    _, ours = jobs.records(2)
    found = ours[0]["info"]["unsupported"]
    assert found["timeout"].startswith("Unsupported: a per-call timeout (7.0 s)"), found
    assert "give the timeout to init_process_group" in found["timeout"]
    assert found["two tensors"].startswith("Unsupported: allreduce: "), found
    assert "one tensor per process" in found["two tensors"] and "got 2" in found["two tensors"]
    assert found["two broadcast"].startswith("Unsupported: broadcast: "), found
    for rank in range(2):
        assert ours[rank]["values"]["unsupported then all_reduce"].tolist() == [3.0, 3.0]


def _rank_launches(nproc: int, mode: str, out_dir: Path) -> dict[int, Job]:
    """``c10d_errors.py`` started once per rank with torch's env:// variables."""
    port = str(_free_port())
    launches = {}
    for rank in range(nproc):
        env = {"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank)}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        command = [sys.executable, str(ERRORS), mode, str(out_dir)]
        launches[rank] = Job(command, _clean_env(env))
    return launches


def _findings(launches: dict[int, Job], out_dir: Path) -> dict[int, dict[str, Any]]:
    found = {}
    for rank, launch in launches.items():
        code, out = launch.finish(90)
        assert code == 0, f"rank {rank} exited with {code}:\n{out[-4000:]}"
        path = out_dir / f"rank{rank}.json"
        if path.exists():
            found[rank] = json.loads(path.read_text())
    return found


@pytest.mark.timeout(120)
def test_dead_peer_and_mismatched_calls_raise_torch_and_meshcomm_errors(tmp_path: Path) -> None:
    """A dead rank: DistNetworkError + PeerError naming it, within the group's timeout.

    Mismatched dtypes or shapes: DistBackendError + MismatchError naming both ranks and
    their calls (over torch's store too: the c10d backend starts the responders the ranks
    ask for each other's calls).
    """
    died, mismatched = tmp_path / "die", tmp_path / "mismatch"
    died.mkdir()
    mismatched.mkdir()
    death = _rank_launches(3, "die", died)
    mismatch = _rank_launches(2, "mismatch", mismatched)
    dead, found = _findings(death, died), _findings(mismatch, mismatched)

    assert sorted(dead) == [0, 2], "rank 1 died; ranks 0 and 2 report"
    for rank, record in dead.items():
        error = record["dead peer"]
        assert error["raised"], f"rank {rank}: the all-reduce with a dead peer returned"
        assert error["seconds"] < ERROR_TIMEOUT + SLACK, error
        assert error["DistError"] and error["DistNetworkError"], error
        assert error["PeerError"] and error["CommError"], error
        assert "rank 1" in error["message"] and "died" in error["message"], error

    assert sorted(found) == [0, 1]
    for rank, record in found.items():
        for case, error in record.items():
            where = f"{case} mismatch, rank {rank}: {error}"
            assert error["raised"], where
            assert error["seconds"] < ERROR_TIMEOUT + SLACK, where
            assert error["DistBackendError"] and error["MismatchError"], where
            assert error["CommError"] and not error["PeerError"], where
            message = error["message"]
            assert message.startswith("ranks disagree on the collective"), where
            assert "rank 0 called" in message and "rank 1 called" in message, where
            assert "all_reduce(" in message, where
        # The calls in words: the detecting rank's own always; the peer's when its responder
        # answers within meshcomm's ask wait (1 s), else "its record could not be read".
        dtype, shape = record["dtype"]["message"], record["shape"]["message"]
        assert "called all_reduce(float32[4], sum)" in dtype or "float64[4]" in dtype, dtype
        assert "called all_reduce(float32[3], sum)" in shape or "float32[5]" in shape, shape


_AUTOLOAD = """
import sys
import torch.distributed as dist
# torch's import ran the entry point, which registered the backend lazily: the backend's
# module is imported when torch first makes a "meshcomm" group.
assert "MESHCOMM" in dist.Backend._plugins, "the autoload entry point did not register"
assert "meshcomm.c10d" not in sys.modules, "the autoload imported the backend eagerly"
import torch
dist.init_process_group("meshcomm", store=dist.HashStore(), rank=0, world_size=1)
t = torch.arange(3.0)
dist.all_reduce(t)
assert t.tolist() == [0.0, 1.0, 2.0] and dist.get_backend() == "meshcomm"
assert "meshcomm.c10d" in sys.modules
print("autoload", type(dist.group.WORLD).__name__)
dist.destroy_process_group()
"""

_EXPLICIT = """
import sys
import torch.distributed as dist
assert "MESHCOMM" not in dist.Backend._plugins, "registered although autoload is off"
import meshcomm.c10d
import torch
dist.init_process_group("meshcomm", store=dist.HashStore(), rank=0, world_size=1)
t = torch.ones(2)
dist.all_reduce(t)
assert t.tolist() == [1.0, 1.0]
print("explicit", dist.get_backend())
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_backend_autoload_and_explicit_import() -> None:
    """torch's ``torch.backends`` entry point registers "meshcomm" without ``import meshcomm``.

    With ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, ``import meshcomm.c10d`` registers it.
    """
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="torch.backends")}
    assert any(v.startswith("meshcomm") for v in names.values()), names
    auto = Job([sys.executable, "-c", _AUTOLOAD], _clean_env())
    explicit = Job(
        [sys.executable, "-c", _EXPLICIT], _clean_env({"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    )
    for launch, words in ((auto, "autoload MeshcommProcessGroup"), (explicit, "explicit meshcomm")):
        code, out = launch.finish(90)
        assert code == 0 and words in out, out[-4000:]


@pytest.mark.timeout(400)
def test_under_meshrun_alone_and_after_meshcomm_init(jobs: Jobs, tmp_path: Path) -> None:
    """meshrun: init_process_group("meshcomm") gives the torchrun job's values bit for bit;
    after ``meshcomm.init()`` torch's default group is meshcomm's world itself."""
    import torch

    want = jobs.records(2)[1]
    launches, dirs = {}, {}
    for name, env in (("alone", {}), ("adopt", {"C10D_ADOPT": "1"})):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        env |= {"C10D_ONLY": "collectives,ddp"}
        launches[name] = _meshrun(2, "meshcomm", str(dirs[name]), env=env)
    for name, launch in launches.items():
        found = _load(dirs[name], 2, launch)
        for rank, record in found.items():
            assert record["backend"] == "meshcomm" and not record["errors"], record["errors"]
            assert record["info"].get("adopted", name == "alone"), f"{name}: not adopted"
            values = record["values"]
            assert len(values) > 50
            for key, value in values.items():
                assert torch.equal(value, want[rank]["values"][key]), f"{name}: {key!r}, {rank}"
