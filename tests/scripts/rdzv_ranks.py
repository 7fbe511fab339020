"""Run meshcomm ranks as real processes for the rendezvous and init tests.

As a script (one rank): ``python rdzv_ranks.py CONFIG_JSON``; the rank joins the world with
``meshcomm.world.init`` (or ``meshcomm.rendezvous.rendezvous``), optionally exchanges a value
through the store, and writes its outcome as JSON to ``config["out"]`` (``{rank}`` in the path
is replaced by the rank from the environment under mpiexec).

As a module (the test side): :func:`launch` starts several ranks and collects their outcomes,
killing them all if any outlives the deadline, so a test can never hang.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parents[2]
# Variables of every launcher detect_launch reads; stripped so an outer launcher (a CI job
# under srun, say) cannot leak into a test's world.
_LAUNCHER_PREFIXES = ("MESHCOMM_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "HYDRA_")
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def is_launcher_var(key: str) -> bool:
    """Return True for a variable some launcher sets (and detect_launch may read)."""
    return key in _LAUNCHER_VARS or key.startswith(_LAUNCHER_PREFIXES)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return ``os.environ`` without launcher variables, plus ``extra``."""
    env = {key: value for key, value in os.environ.items() if not is_launcher_var(key)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def launch(
    ranks: Sequence[tuple[Mapping[str, str], Mapping[str, Any]]],
    tmp: Path,
    deadline_s: float,
) -> list[dict[str, Any]]:
    """Start one process per ``(env, config)`` and return each one's outcome, in order.

    Every process is killed once ``deadline_s`` has passed; the test then fails naming the
    processes still running (a hang is a failure, never a stuck test run).
    """
    stems = [tmp / f"proc{i}" for i in range(len(ranks))]
    commands = [
        ([sys.executable, str(SCRIPT), json.dumps(dict(cfg, out=str(stem) + ".json"))], env)
        for stem, (env, cfg) in zip(stems, ranks, strict=True)
    ]
    _supervise(commands, stems, deadline_s)
    return [_read(stem) for stem in stems]


def launch_mpi(
    mpiexec: str,
    n: int,
    env: Mapping[str, str],
    config: Mapping[str, Any],
    tmp: Path,
    deadline_s: float,
) -> list[dict[str, Any]]:
    """Run ``mpiexec -n N`` over the worker; return the outcomes in rank order."""
    cfg = dict(config, out=str(tmp / "rank{rank}.json"))
    command = [mpiexec, "-n", str(n), sys.executable, str(SCRIPT), json.dumps(cfg)]
    _supervise([(command, env)], [tmp / "mpiexec"], deadline_s)
    return [_read(tmp / f"rank{r}", log=tmp / "mpiexec.err") for r in range(n)]


def launch_meshrun(
    nproc: int, env: Mapping[str, str], config: Mapping[str, Any], tmp: Path, deadline_s: float
) -> list[dict[str, Any]]:
    """Run ``meshrun --nproc-per-node N`` over the worker; return the outcomes in rank order."""
    cfg = dict(config, out=str(tmp / "rank{rank}.json"))
    command = [sys.executable, "-m", "meshcomm.run", "--nproc-per-node", str(nproc)]
    command += [str(SCRIPT), json.dumps(cfg)]
    _supervise([(command, env)], [tmp / "meshrun"], deadline_s)
    return [_read(tmp / f"rank{r}", log=tmp / "meshrun.err") for r in range(nproc)]


def _supervise(
    commands: list[tuple[list[str], Mapping[str, str]]], stems: list[Path], deadline_s: float
) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    end = time.monotonic() + deadline_s
    try:
        for (command, env), stem in zip(commands, stems, strict=True):
            with open(stem.with_suffix(".err"), "wb") as log:
                # A session of its own lets a hang be killed with every child (mpiexec's ranks).
                procs.append(
                    subprocess.Popen(
                        command,
                        env=dict(env),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        for proc in procs:
            try:
                proc.wait(timeout=max(end - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                stuck = [i for i, p in enumerate(procs) if p.poll() is None]
                logs = "\n".join(f"--- {stems[i].name}:\n{_tail(stems[i])}" for i in stuck)
                raise AssertionError(
                    f"processes {stuck} still ran after {deadline_s} s (a hang)\n{logs}"
                ) from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def _tail(stem: Path) -> str:
    log = stem.with_suffix(".err")
    return log.read_text(errors="replace")[-3000:] if log.exists() else "(no output)"


def _read(stem: Path, log: Path | None = None) -> dict[str, Any]:
    path = stem.with_suffix(".json")
    if not path.exists():
        raise AssertionError(f"{path.name} was not written; output:\n{_tail(log or stem)}")
    result: dict[str, Any] = json.loads(path.read_text())
    return result


# -- the rank side ----------------------------------------------------------------------------


def _run(config: dict[str, Any]) -> dict[str, Any]:
    from meshcomm import world
    from meshcomm.rendezvous import rendezvous

    for name in config.get("block_modules", []):
        # A None entry makes `import name` raise ImportError: the interpreter's own mechanism.
        sys.modules[name] = None  # type: ignore[assignment]
    kwargs = config.get("kwargs", {})
    if config.get("api", "init") == "init":
        group = world.init(**kwargs)
        info = world.get_world_info()
        store, rank, size = group.store, group.rank, group.size
        closer = world.shutdown
        extra = {
            "backend": group.backend,
            "ranks": list(group.ranks),
            "store": None if store is None else type(store).__name__,
        }
        if config.get("try_collective"):
            import numpy as np

            try:
                group.all_reduce(np.ones(3))
                extra["collective"] = "ok"
            except Exception as exc:
                extra["collective"] = f"{type(exc).__name__}: {exc}"
    else:
        info = rendezvous(**kwargs)
        store, rank, size, closer, extra = info.store, info.rank, info.world_size, info.close, {}
    values = {}
    if config.get("exchange", True):
        store.set(f"value/{rank}", f"hello from rank {rank} pid {os.getpid()}")
        values = {str(r): store.get(f"value/{r}").decode() for r in range(size)}
    if config.get("late_store_use"):
        # Still using the store after the others (rank 0 among them) called shutdown.
        time.sleep(config["late_store_use"])
        store.set(f"late/{rank}", "x")
        values["late"] = store.get(f"late/{rank}").decode()
    closer()
    return {
        "ok": True,
        "rank": rank,
        "size": size,
        "launcher": info.launcher,
        "local_rank": info.local_rank,
        "local_world_size": info.local_world_size,
        "address": info.address,
        "hosts_server": info.hosts_server,
        "values": values,
        **extra,
    }


def main() -> None:
    config = json.loads(sys.argv[1])
    start = time.monotonic()
    try:
        result = _run(config)
    except Exception as exc:
        result = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    result["elapsed"] = time.monotonic() - start
    launcher_rank = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
    rank = next((os.environ[v] for v in launcher_rank if v in os.environ), "x")
    out = Path(config["out"].replace("{rank}", rank))
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(out)


if __name__ == "__main__":
    main()
