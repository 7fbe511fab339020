"""Time from a SIGKILL to the next completed step: ``meshrun --elastic`` against
``meshrun --max-restarts 1``, side by side, and the manager's cost per step.

    python bench/elastic_recovery.py --ranks 8 --repeats 3

Each run trains a small data-parallel loop (a psum of 8 float64 per step, ``--step-ms`` of
sleep standing in for the compute). The victim (the last rank) writes the wall clock just
before it SIGKILLs itself at step 20; every rank writes the wall clock of each completed
step. Recovery is the time from the kill to step 20 completed (the step the victim never
finished: the job's next new step). *elastic*: ``meshrun --elastic``, the survivors shrink
and run step 20 again without the victim. *restart*: ``meshrun --max-restarts 1``, the whole
job starts again and runs steps 0-20 again (a checkpoint of step 0). *steady*: the
median step time of the same loop with the manager (vote and commit per step) against a
plain loop of the same psum, in one job without a kill.

The child mode (``--child MODE DIR``) is what each rank runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main"]

_KILL_AT = 20
_STEPS = 40


def _child(mode: str, folder: Path, step_ms: float) -> None:
    import numpy as np

    from meshcomm import ops

    rank = int(os.environ["RANK"])
    size = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    stamps: list[float] = []
    log = folder / f"steps.{attempt}.{rank}"

    def step(mesh, state, i):  # type: ignore[no-untyped-def]
        if mode in ("elastic", "restart") and attempt == 0 and rank == size - 1 and i == _KILL_AT:
            (folder / "killed").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(step_ms / 1e3)
        grad = state["w"] - i
        return {"w": state["w"] - 0.1 * ops.psum(grad, "dp", mesh=mesh) / mesh.size("dp")}

    if mode in ("elastic", "steady-manager"):
        from meshcomm.elastic import ElasticMesh, Manager

        elastic = ElasticMesh((size,), ("dp",), timeout=5)

        class Timed(Manager):
            pass

        manager = Timed(elastic, {"w": np.zeros(8)})
        done = 0
        while manager.step < _STEPS:
            if manager.run(step, manager.step + 1) is None:
                return
            if manager.step > done:
                done = manager.step
                stamps.append(time.time())
                log.write_text(json.dumps(stamps))
        elastic.close()
        return
    import meshcomm

    meshcomm.init(timeout=5)
    mesh = meshcomm.init_device_mesh((size,), ("dp",))
    state = {"w": np.zeros(8)}
    for i in range(_STEPS):
        state = step(mesh, state, i)
        stamps.append(time.time())
        log.write_text(json.dumps(stamps))
    meshcomm.shutdown()


def _job(mode: str, ranks: int, step_ms: float) -> Path:
    folder = Path(tempfile.mkdtemp(prefix=f"elastic-{mode}-"))
    flags = {"restart": ["--max-restarts", "1"], "steady-plain": []}.get(mode, ["--elastic"])
    command = [sys.executable, "-m", "meshcomm.run", *flags, "--nproc-per-node", str(ranks),
               __file__, "--child", mode, str(folder), "--step-ms", str(step_ms)]  # fmt: skip
    env = dict(os.environ, MESHCOMM_TIMEOUT="5")
    subprocess.run(command, env=env, capture_output=True, timeout=300, check=False)
    return folder


def _recovery(folder: Path) -> tuple[float, float]:
    """Seconds from the kill to the first step completed after it (often the others' step
    before the kill, still finishing: not reported), and to step ``_KILL_AT`` completed (the
    step the victim never finished: the next new step of the job)."""
    killed = float((folder / "killed").read_text())
    after, back = [], []
    for path in folder.glob("steps.*"):
        stamps = json.loads(path.read_text())
        after += [t for t in stamps if t > killed]
        if len(stamps) > _KILL_AT and stamps[_KILL_AT] > killed:
            back.append(stamps[_KILL_AT])
    return min(after) - killed, min(back) - killed


def _step_time(folder: Path) -> float:
    stamps = json.loads((folder / "steps.0.0").read_text())
    return statistics.median(b - a for a, b in itertools.pairwise(stamps[5:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--child", nargs=2, metavar=("MODE", "DIR"))
    args = p.parse_args()
    if args.child:
        _child(args.child[0], Path(args.child[1]), args.step_ms)
        return
    rows: dict[str, list[float]] = {
        "elastic": [], "elastic-back": [], "restart": [], "restart-back": [], "manager": [],
        "plain": [],
    }  # fmt: skip
    for _ in range(args.repeats):
        for mode in ("elastic", "restart"):
            first, back = _recovery(_job(mode, args.ranks, args.step_ms))
            rows[mode].append(first)
            rows[f"{mode}-back"].append(back)
        rows["manager"].append(_step_time(_job("steady-manager", args.ranks, args.step_ms)))
        rows["plain"].append(_step_time(_job("steady-plain", args.ranks, args.step_ms)))
    print(f"world {args.ranks}, timeout 5 s, {args.step_ms:g} ms of compute per step, "
          f"medians of {args.repeats} (min..max)")  # fmt: skip
    rows_shown = (
        ("elastic-back", f"kill -> step {_KILL_AT} done, --elastic"),
        ("restart-back", f"kill -> step {_KILL_AT} done, --max-restarts 1"),
        ("manager", "step time, manager"),
        ("plain", "step time, plain loop"),
    )
    for name, what in rows_shown:
        v = rows[name]
        print(f"  {what:38s} {statistics.median(v) * 1e3:9.1f} ms  "
              f"({min(v) * 1e3:.1f}..{max(v) * 1e3:.1f})")  # fmt: skip
    ratio = statistics.median(rows["manager"]) / statistics.median(rows["plain"])
    print(f"  manager / plain step time: {ratio:.3f}")


if __name__ == "__main__":
    main()
