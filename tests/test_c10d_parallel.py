"""torch's modern parallel stack on backend "meshcomm" gives the values it gives on gloo.

Real torchrun jobs on CPU, worlds 2 and 4. tests/scripts/c10d_parallel_run.py runs every
scenario in one launch per backend and world size and saves each rank's values; the tests
here compare backend "meshcomm" with backend "gloo":

- torch's ``DeviceMesh`` (1-D at world 2, ``(2, 2)`` ``("dp", "tp")`` at world 4) and DTensor
  ``distribute_tensor`` / ``redistribute`` across Shard(0), Shard(1), Replicate and Partial,
  even and uneven shards;
- ``parallelize_module`` with ColwiseParallel, RowwiseParallel and SequenceParallel on small
  MLPs (forward, backward, one SGD step), with the default ``src_data_rank`` (torch's
  ``mesh_scatter``) and with ``src_data_rank=None``;
- FSDP2 ``fully_shard`` Adam steps; at world 4 also HSDP (a 2-D mesh) and FSDP + TP; in
  float32 too, where FSDP2 reduces gradients with AVG, or PREMUL_SUM (which gloo refuses;
  checked against gloo's AVG with the learning rate scaled, to float32 rounding);
- more of it: Partial("avg"), a flattened 2-D mesh, TP over the whole world,
  ``loss_parallel``, FSDP2 without resharding after forward, with mixed precision, with
  gradient accumulation (``set_requires_gradient_sync``) and with explicit prefetching,
  composable DDP (``replicate``), an asynchronous redistribution;
- torch.distributed.pipelining, GPipe and 1F1B with one stage per rank;
- torch's state-dict helpers: a full state dict on rank 0 loaded into a meta-device FSDP2
  model (``broadcast_from_rank0``), full model and optimizer state dicts, ``dcp.async_save``;
- torch.distributed.checkpoint: an FSDP2 state dict and a DTensor saved and loaded back,
  and the checkpoint gloo saved loaded on meshcomm (also gloo's world-4 one at world 2).

Values are float64. They must be bit-equal to gloo's except where a sum runs over more than
two ranks (FSDP2's reduce-scatter of gradients at world 4: gloo and meshcomm add in different
orders), which must agree to 1e-12. The meshcomm job runs again under meshrun and gives
the same values. examples/torch_tp.py and examples/torch_fsdp2.py run with only the backend
string changed and train the same weights bit for bit.

Skipped, with the reason, when torch is not installed.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed (pip install meshcomm[torch]): the c10d backend needs it",
)

from tests.test_torchrun import ROOT, _clean_env, _free_port, _run  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "c10d_parallel_run.py"
EXAMPLES = ROOT / "examples"
TOL = 1e-12
# Keys whose values sum over more than two ranks at world 4 (FSDP2, TP and Partial over the
# flat mesh):
# equal to gloo's within TOL, not bit for bit.
SUMMED_OVER_4 = (
    "fsdp ",
    "dcp saved ",
    "dcp loaded ",
    "more partial avg",
    "more tpworld ",
    "more loss_parallel ",
    "more fsdp ",
    "more prefetch ",
    "more replicate ",
    "sd full ",
    "sd optim ",
    "sd async param ",
)
# The same for the float32 FSDP2 runs: float32 rounding.
F32_TOL = 1e-6

Record = dict[str, Any]


def _torchrun(nproc: int, script: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``script`` under a real torchrun on a free port; fail with its output if it fails."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    command += ["--master-port", str(_free_port()), str(script), *args]
    code, out = _run(command, _clean_env(env))
    assert code == 0, f"{script.name} {' '.join(args)} exited with {code}:\n{out[-6000:]}"
    return out


class Jobs:
    """One launch per (backend, world size), run on first use and kept for the module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple[str, int], dict[int, Record]] = {}
        self.failed: set[tuple[str, int]] = set()

    def records(self, backend: str, world: int) -> dict[int, Record]:
        """Every rank's record of ``backend`` at ``world`` (meshcomm also loads gloo's DCP)."""
        key = (backend, world)
        if key in self.failed:  # one launch per job, even when it failed
            pytest.fail(f"the {backend} job at world {world} failed (see the first test)")
        if key not in self.done:
            import torch

            other: list[str] = []
            if backend == "meshcomm":
                self.records("gloo", world)
                other = [str(self.root / f"gloo-{world}" / "ckpt")]
            out_dir = self.root / f"{backend}-{world}"
            out_dir.mkdir()
            self.failed.add(key)
            out = _torchrun(world, SCRIPT, backend, str(out_dir), *other)
            found = {
                r: torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)
            }
            assert all(rec["rank"] == r for r, rec in found.items()), out[-4000:]
            self.failed.discard(key)
            self.done[key] = found
        return self.done[key]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    return Jobs(tmp_path_factory.mktemp("c10d-parallel"))


def _compare(
    jobs: Jobs,
    world: int,
    keep: Callable[[str], bool],
    scenarios: list[str],
    summed: tuple[str, ...] = SUMMED_OVER_4,
    tol: float = TOL,
) -> int:
    """Compare meshcomm's values with gloo's on every rank; return how many were compared.

    Bit for bit, except keys starting with one of ``summed`` at world 4: within ``tol``.
    """
    import torch

    gloo, ours = jobs.records("gloo", world), jobs.records("meshcomm", world)
    compared = 0
    for rank in range(world):
        theirs, mine = gloo[rank], ours[rank]
        assert (theirs["backend"], mine["backend"]) == ("gloo", "meshcomm")
        assert set(mine["mesh_groups"]) == {"MeshcommProcessGroup"}, mine["mesh_groups"]
        for name in scenarios:
            assert name not in theirs["errors"], f"gloo, rank {rank}:\n{theirs['errors'][name]}"
            assert name not in mine["errors"], f"meshcomm, rank {rank}:\n{mine['errors'][name]}"
        want = {k: v for k, v in theirs["values"].items() if keep(k)}
        got = {k: v for k, v in mine["values"].items() if keep(k) and not k.startswith("dcp other")}
        assert want, f"no values of {scenarios} recorded"
        assert sorted(got) == sorted(want)
        for key, expected in want.items():
            value = got[key]
            where = f"{key!r} on rank {rank} of {world}"
            assert value.dtype == expected.dtype and value.shape == expected.shape, where
            if world > 2 and key.startswith(summed):
                torch.testing.assert_close(value, expected, rtol=tol, atol=tol, msg=where)
            else:
                assert torch.equal(value, expected), f"{where}: not bit-equal to gloo's"
            compared += 1
    return compared


WORLDS = [2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_device_mesh_and_dtensor_redistribute(jobs: Jobs, world: int) -> None:
    """distribute_tensor, full_tensor and every redistribution, Partial included."""
    kinds = ("local ", "full ", "redistribute ", "partial ", "tp sub-mesh ", "uneven ")
    count = _compare(jobs, world, lambda k: k.startswith(kinds), ["dtensor"])
    assert count >= world * 25


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_parallelize_module_colwise_rowwise_sequence(jobs: Jobs, world: int) -> None:
    """Outputs, gradients and stepped weights of Colwise/Rowwise/SequenceParallel."""
    _compare(jobs, world, lambda k: k.startswith(("mlp src=0", "mlp src=None", "seq ")), ["tp"])
    values = jobs.records("meshcomm", world)[0]["values"]
    # Both src_data_rank paths (torch's mesh_scatter, and local init) ran and agree.
    for key in [k for k in values if k.startswith("mlp src=0 ")]:
        other = key.replace("mlp src=0 ", "mlp src=None ")
        assert (values[key] - values[other]).abs().max() == 0, key
    assert any(k.startswith("seq grad norm.") for k in values)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2_training_steps(jobs: Jobs, world: int) -> None:
    """FSDP2 ``fully_shard``: losses and full parameters after three Adam steps."""
    import torch

    _compare(jobs, world, lambda k: k.startswith("fsdp "), ["fsdp"])
    values = jobs.records("meshcomm", world)[0]["values"]
    # The steps changed the weights (the comparison is not of initial values only).
    initial = [k for k in values if k.startswith("fsdp param0 param ")]
    assert initial
    assert any(
        not torch.equal(values[k], values[k.replace("fsdp param0 param ", "fsdp param ")])
        for k in initial
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_fsdp2_float32_avg_and_premul_sum(jobs: Jobs, world: int) -> None:
    """float32 FSDP2 reduce-scatters with AVG, and with PREMUL_SUM (a divide factor).

    gloo refuses PREMUL_SUM; meshcomm's run must match gloo's AVG run with the learning rate
    scaled to the same update, within float32 rounding.
    """
    import torch

    keep = lambda k: k.startswith("fsdp32 ") and not k.startswith("fsdp32 premul")  # noqa: E731
    _compare(jobs, world, keep, ["fsdp32"], summed=("fsdp32 ",), tol=F32_TOL)
    gloo = jobs.records("gloo", world)
    for rank, record in jobs.records("meshcomm", world).items():
        premul = {k: v for k, v in record["values"].items() if k.startswith("fsdp32 premul ")}
        assert premul
        for key, value in premul.items():
            expected = gloo[rank]["values"][key.replace("premul", "sgd-avg")]
            torch.testing.assert_close(value, expected, rtol=F32_TOL, atol=F32_TOL, msg=key)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_more_of_the_stack(jobs: Jobs, world: int) -> None:
    """Partial("avg"), a flattened mesh, TP over the world, loss_parallel, FSDP2's options."""
    _compare(jobs, world, lambda k: k.startswith("more "), ["more"])
    values = jobs.records("meshcomm", world)[0]["values"]
    assert any(k.startswith("more loss_parallel grad ") for k in values)
    assert any(k.startswith("more fsdp grad ") for k in values)
    assert world == 2 or "more flattened S0 -> S1" in values
    assert "more async redistribute" in values
    assert any(k.startswith("more prefetch grad ") for k in values)
    assert any(k.startswith("more replicate grad ") for k in values)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_pipeline_schedules(jobs: Jobs, world: int) -> None:
    """torch.distributed.pipelining, GPipe and 1F1B: every stage's gradients, the losses."""
    _compare(jobs, world, lambda k: k.startswith("pp "), ["pipeline"])
    last = jobs.records("meshcomm", world)[world - 1]["values"]
    assert {"pp gpipe losses", "pp 1f1b losses"} <= set(last)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hsdp_and_fsdp_with_tp_at_world_4(jobs: Jobs) -> None:
    """2-D: HSDP over a (replicate, shard) mesh, and TP over 'tp' with FSDP2 over 'dp'."""
    _compare(jobs, 4, lambda k: k.startswith(("hsdp ", "fsdp+tp ")), ["hsdp", "fsdp+tp"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_distributed_checkpoint_round_trip(jobs: Jobs, world: int) -> None:
    """DCP: save and load a sharded state dict; load what gloo saved."""
    import torch

    _compare(jobs, world, lambda k: k.startswith("dcp ") and not k.startswith("dcp other"), ["dcp"])
    gloo = jobs.records("gloo", world)
    for rank, record in jobs.records("meshcomm", world).items():
        values = record["values"]
        saved = {k[len("dcp saved ") :]: v for k, v in values.items() if k.startswith("dcp saved ")}
        assert saved
        for name, value in saved.items():
            assert torch.equal(values[f"dcp loaded {name}"], value), f"{name}: not round-tripped"
            # gloo's checkpoint, loaded over meshcomm: gloo's saved values, bit for bit.
            expected = gloo[rank]["values"][f"dcp saved {name}"]
            assert torch.equal(values[f"dcp other {name}"], expected), f"{name} from gloo's"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
def test_state_dict_helpers_and_async_save(jobs: Jobs, world: int) -> None:
    """broadcast_from_rank0 onto a meta-device model, full state dicts, dcp.async_save."""
    _compare(jobs, world, lambda k: k.startswith("sd "), ["sd"])
    values = jobs.records("meshcomm", world)[0]["values"]
    assert any(k.startswith("sd optim ") for k in values)
    assert values["sd async meanwhile"].tolist() == [world * (world - 1) / 2] * 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dcp_reshards_gloo_world_4_checkpoint_onto_world_2(jobs: Jobs) -> None:
    """DCP on meshcomm at world 2 loads what gloo saved at world 4 (resharded on load)."""
    import torch

    saved = jobs.records("gloo", 4)[0]["values"]
    out_dir = jobs.root / "meshcomm-2-from-4"
    out_dir.mkdir()
    env = {"C10D_PARALLEL_ONLY": "dcp"}
    _torchrun(2, SCRIPT, "meshcomm", str(out_dir), str(jobs.root / "gloo-4" / "ckpt"), env=env)
    for rank in range(2):
        got = torch.load(out_dir / f"rank{rank}.pt", weights_only=False)
        assert not got["errors"], got["errors"]
        loaded = {k: v for k, v in got["values"].items() if k.startswith("dcp other ")}
        assert loaded
        for key, value in loaded.items():
            expected = saved[key.replace("dcp other ", "dcp saved ")]
            assert torch.equal(value, expected), f"{key!r} on rank {rank}"


@pytest.mark.timeout(300)
def test_the_same_job_under_meshrun(jobs: Jobs) -> None:
    """Every scenario under meshrun (its store, torch's env://) equals the torchrun job's."""
    import torch

    out_dir = jobs.root / "meshrun-2"
    out_dir.mkdir()
    gloo_ckpt = str(jobs.root / "gloo-2" / "ckpt")
    want = jobs.records("meshcomm", 2)
    command = [sys.executable, "-m", "meshcomm.run", "--nproc-per-node", "2"]
    command += [str(SCRIPT), "meshcomm", str(out_dir), gloo_ckpt]
    code, out = _run(command, _clean_env())
    assert code == 0, f"meshrun exited with {code}:\n{out[-6000:]}"
    for rank in range(2):
        got = torch.load(out_dir / f"rank{rank}.pt", weights_only=False)
        assert got["backend"] == "meshcomm" and not got["errors"], got["errors"]
        assert sorted(got["values"]) == sorted(want[rank]["values"])
        for key, value in got["values"].items():
            assert torch.equal(value, want[rank]["values"][key]), f"{key!r}, rank {rank}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", ["torch_tp.py", "torch_fsdp2.py"])
def test_example_runs_with_only_the_backend_changed(example: str, tmp_path: Path) -> None:
    """The examples train the same weights on "gloo" and on "meshcomm" (argv and env var)."""
    import torch

    results = {}
    for backend, args, chosen in [
        ("gloo", ["gloo"], {}),
        ("meshcomm", [], {"DIST_BACKEND": "meshcomm"}),
    ]:
        out = tmp_path / f"{backend}.pt"
        env = chosen | {"EXAMPLE_OUT": str(out), "EXAMPLE_STEPS": "4"}
        _torchrun(2, EXAMPLES / example, *args, env=env)
        results[backend] = torch.load(out, weights_only=False)
    assert results["gloo"]["backend"] == "gloo"
    assert results["meshcomm"]["backend"] == "meshcomm"
    assert results["meshcomm"]["losses"] == results["gloo"]["losses"]
    theirs, ours = results["gloo"]["weights"], results["meshcomm"]["weights"]
    assert sorted(ours) == sorted(theirs)
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), f"{example}: {name} differs from gloo's"
