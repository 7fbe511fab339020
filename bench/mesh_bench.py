"""Mesh creation side by side: meshcomm vs torch (gloo), measured in the same run.

Three figures for ``docs/benchmarks.md``:

1. **init**: the time of ``init_device_mesh((2, 4))`` on 8 ranks (the world already
   joined; slowest rank), beside ``torch.distributed.device_mesh.init_device_mesh("cpu",
   (2, 4))`` with gloo; also world init, and the first collective along each axis.
2. **sockets**: the sockets each rank holds for a (2, 2, 2) mesh after joining the world,
   after making the mesh, and after one collective along each axis (both libraries).
3. **job**: the wall time of a whole 8-rank job under its launcher (launch, (2, 4) mesh,
   one psum per axis, exit): ``meshrun`` vs ``torchrun --standalone``; target ratio <= 0.15.
   ``meshrun --start-method spawn`` (a fresh interpreter per rank) is timed beside them.

Usage (torch is optional: without it only the meshcomm figures are printed)::

    python bench/mesh_bench.py                      # all three, 8 ranks, 5 repeats
    python bench/mesh_bench.py --repeat 3 --json docs/mesh_bench.json
    python bench/mesh_bench.py --only job

Each repeat runs meshcomm and torch back to back, alternating which goes first; the
tables report medians (and min..max). The rank-side code is this same file, started by the
launchers with a private ``_rank`` / ``_job`` first argument.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

NPROC = 8
INIT_SHAPE = (2, 4)
SOCKET_SHAPE = (2, 2, 2)
NAMES = {2: ("dp", "tp"), 3: ("pp", "dp", "tp")}
REPO = Path(__file__).resolve().parents[1]


def count_sockets() -> int:
    """Sockets this process holds (Linux: /proc/self/fd links to ``socket:[...]``)."""
    fd_dir = "/proc/self/fd"
    if not os.path.isdir(fd_dir):
        return -1
    count = 0
    for fd in os.listdir(fd_dir):
        try:
            if os.readlink(os.path.join(fd_dir, fd)).startswith("socket:"):
                count += 1
        except OSError:
            continue  # closed while we looked
    return count


# -- rank side ------------------------------------------------------------------------------
def rank_meshcomm(shape: tuple[int, ...], out_dir: str) -> None:
    from meshcomm import ops, world
    from meshcomm.mesh import init_device_mesh

    names = NAMES[len(shape)]
    record: dict[str, Any] = {"sockets_before": count_sockets()}
    t0 = time.perf_counter()
    group = world.init()
    t1 = time.perf_counter()
    record["sockets_world"] = count_sockets()
    group.barrier()  # every rank joined: time the mesh alone
    t2 = time.perf_counter()
    mesh = init_device_mesh(shape, names)
    t3 = time.perf_counter()
    record["sockets_mesh"] = count_sockets()
    for name in names:
        ops.psum(np.ones(1, np.float32), name, mesh=mesh)
    t4 = time.perf_counter()
    record["sockets_used"] = count_sockets()
    record.update(world_s=t1 - t0, mesh_s=t3 - t2, first_ops_s=t4 - t3, rank=group.rank)
    record["backend"] = group.backend
    Path(out_dir, f"rank{group.rank}.json").write_text(json.dumps(record))
    world.shutdown()


def rank_torch(shape: tuple[int, ...], out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    names = NAMES[len(shape)]
    record: dict[str, Any] = {"sockets_before": count_sockets()}
    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    t1 = time.perf_counter()
    record["sockets_world"] = count_sockets()
    dist.barrier()
    t2 = time.perf_counter()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    t3 = time.perf_counter()
    record["sockets_mesh"] = count_sockets()
    for name in names:
        dist.all_reduce(torch.ones(1), group=mesh.get_group(name))
    t4 = time.perf_counter()
    record["sockets_used"] = count_sockets()
    rank = dist.get_rank()
    record.update(world_s=t1 - t0, mesh_s=t3 - t2, first_ops_s=t4 - t3, rank=rank)
    record["backend"] = "gloo"
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def job_meshcomm() -> None:
    """The whole-job benchmark body: mesh, one psum per axis, exit."""
    from meshcomm import ops, world
    from meshcomm.mesh import init_device_mesh

    mesh = init_device_mesh(INIT_SHAPE, NAMES[2])
    for name in NAMES[2]:
        ops.psum(np.ones(4, np.float32), name, mesh=mesh)
    world.shutdown()


def job_torch() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", INIT_SHAPE, mesh_dim_names=NAMES[2])
    for name in NAMES[2]:
        dist.all_reduce(torch.ones(4), group=mesh.get_group(name))
    dist.destroy_process_group()


# -- driver ---------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")  # 8 ranks on a few cores: no thread pools
    return env


def _launch(lib: str, args: list[str], nproc: int, timeout: float) -> float:
    """Run this file under ``lib``'s launcher; return the wall time in seconds."""
    me = str(Path(__file__).resolve())
    if lib in ("meshcomm", "meshcomm-spawn"):
        method = "spawn" if lib == "meshcomm-spawn" else "fork"
        cmd = [
            sys.executable, "-m", "meshcomm.run", "--start-method", method,
            "--nproc-per-node", str(nproc), me, *args,
        ]  # fmt: skip
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), me, *args,
        ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"mesh_bench: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return wall


def _rank_records(lib: str, shape: tuple[int, ...], nproc: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="mesh-bench-") as out:
        _launch(lib, ["_rank", lib, ",".join(map(str, shape)), out], nproc, timeout=300)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(nproc)]


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt_ms(s: dict[str, float]) -> str:
    return f"{s['median'] * 1e3:8.1f} ms ({s['min'] * 1e3:.1f}..{s['max'] * 1e3:.1f})"


def bench_init(libs: list[str], repeat: int, nproc: int) -> dict[str, Any]:
    runs: dict[str, dict[str, list[float]]] = {
        lib: {"world_s": [], "mesh_s": [], "first_ops_s": []} for lib in libs
    }
    for i in range(repeat):
        order = libs if i % 2 == 0 else libs[::-1]
        for lib in order:
            records = _rank_records(lib, INIT_SHAPE, nproc)
            for key in runs[lib]:
                runs[lib][key].append(max(r[key] for r in records))  # slowest rank
    out = {lib: {k: _stats(v) for k, v in runs[lib].items()} for lib in libs}
    print(f"\ninit_device_mesh({INIT_SHAPE}) on {nproc} ranks, slowest rank, median of {repeat}:")
    print(f"  {'':10} {'world init':>26} {'mesh':>26} {'1st psum per axis':>26}")
    for lib in libs:
        s = out[lib]
        label = "meshcomm" if lib == "meshcomm" else "torch gloo"
        print(
            f"  {label:10} {_fmt_ms(s['world_s']):>26} {_fmt_ms(s['mesh_s']):>26} "
            f"{_fmt_ms(s['first_ops_s']):>26}"
        )
    if "torch" in out:
        ratio = out["meshcomm"]["mesh_s"]["median"] / out["torch"]["mesh_s"]["median"]
        print(f"  mesh creation: meshcomm / torch = {ratio:.3f}x")
        out["mesh_ratio"] = ratio
    return out


def bench_sockets(libs: list[str], nproc: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    print(f"\nsockets per rank for a {SOCKET_SHAPE} mesh on {nproc} ranks (max over ranks):")
    print(f"  {'':10} {'world':>6} {'+mesh':>6} {'+1st op per axis':>17}")
    for lib in libs:
        records = _rank_records(lib, SOCKET_SHAPE, nproc)
        stage = {
            k: max(r[k] - r["sockets_before"] for r in records)
            for k in ("sockets_world", "sockets_mesh", "sockets_used")
        }
        out[lib] = stage
        label = "meshcomm" if lib == "meshcomm" else "torch gloo"
        print(
            f"  {label:10} {stage['sockets_world']:>6} {stage['sockets_mesh']:>6} "
            f"{stage['sockets_used']:>17}"
        )
    return out


def bench_job(libs: list[str], repeat: int, nproc: int) -> dict[str, Any]:
    libs = [libs[0], "meshcomm-spawn", *libs[1:]]  # meshrun's old start method, for scale
    walls: dict[str, list[float]] = {lib: [] for lib in libs}
    for i in range(repeat):
        order = libs if i % 2 == 0 else libs[::-1]
        for lib in order:
            body = "torch" if lib == "torch" else "meshcomm"
            walls[lib].append(_launch(lib, ["_job", body], nproc, timeout=300))
    out: dict[str, Any] = {lib: _stats(w) for lib, w in walls.items()}
    print(f"\nwhole {nproc}-rank job ({INIT_SHAPE} mesh, one psum per axis), median of {repeat}:")
    labels = {"meshcomm": "meshrun", "meshcomm-spawn": "meshrun --start-method spawn"}
    for lib in libs:
        s = out[lib]
        label = labels.get(lib, "torchrun")
        print(f"  {label:28} {s['median']:7.2f} s ({s['min']:.2f}..{s['max']:.2f})")
    if "torch" in out:
        ratio = out["meshcomm"]["median"] / out["torch"]["median"]
        out["ratio"] = ratio
        out["spawn_ratio"] = out["meshcomm-spawn"]["median"] / out["torch"]["median"]
        print(f"  meshrun / torchrun = {ratio:.3f}x (target <= 0.15x)")
        print(f"  meshrun --start-method spawn / torchrun = {out['spawn_ratio']:.3f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["_rank"]:
        lib, shape, out = args[1], tuple(int(s) for s in args[2].split(",")), args[3]
        (rank_meshcomm if lib == "meshcomm" else rank_torch)(shape, out)
        return 0
    if args[:1] == ["_job"]:
        (job_meshcomm if args[1] == "meshcomm" else job_torch)()
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5, help="runs per figure (default 5)")
    p.add_argument("--nproc", type=int, default=NPROC, help="ranks (default 8)")
    p.add_argument("--only", choices=("init", "sockets", "job"), action="append")
    p.add_argument("--no-torch", action="store_true", help="meshcomm only")
    p.add_argument("--json", help="also write the figures to this file")
    opts = p.parse_args(args)
    libs = ["meshcomm"]
    if opts.no_torch:
        pass
    elif importlib.util.find_spec("torch") is None:
        print("mesh_bench: torch is not installed: meshcomm figures only", file=sys.stderr)
    else:
        libs.append("torch")
    only = set(opts.only or ("init", "sockets", "job"))
    results: dict[str, Any] = {"nproc": opts.nproc, "repeat": opts.repeat, "cpus": os.cpu_count()}
    if "torch" in libs:
        import torch

        results["torch"] = torch.__version__
    if "init" in only:
        results["init"] = bench_init(libs, opts.repeat, opts.nproc)
    if "sockets" in only:
        results["sockets"] = bench_sockets(libs, opts.nproc)
    if "job" in only:
        results["job"] = bench_job(libs, opts.repeat, opts.nproc)
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
