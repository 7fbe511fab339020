"""torch's own DDP and FSDP2 on backend "meshcomm" against "gloo", and the c10d route's cost.

    python bench/torch_backend.py                     # world 4: DDP, FSDP2, then the 8 B route
    python bench/torch_backend.py --what ddp --repeats 7 --json out.json
    python bench/torch_backend.py --quick             # world 2, 1 step: a smoke run

Training steps (``ddp``, ``fsdp``): an MLP of ``--layers`` Linear(``--width``, ``--width``)
layers (4 x 1024: 4.2M float32 parameters), a batch of ``--batch`` rows per rank, SGD. Each
repeat launches one torchrun job per backend (``--world`` ranks, ``OMP_NUM_THREADS=1``),
alternating which backend goes first, so drift on a shared machine hits both alike. A job
runs ``--warmup`` untimed steps, then ``--steps`` timed ones; a step's time is the slowest
rank's, and each job reports its median step. The table gives the median over repeats of
those medians, and meshcomm's time over gloo's. DDP also times the same steps under
``no_sync()`` (no gradient traffic): the compute part of the step on this machine.

The c10d route (``overhead``): in one torchrun job per world of ``--overhead-worlds`` on
backend "meshcomm", loops of ``--iters`` 8-byte float32 all-reduces alternate, round by
round in rotated order, between ``dist.all_reduce(t)`` and the layers under it, down to
``pg.mesh_group.all_reduce(x)`` of a numpy array on the same meshcomm group: first the
blocking routes before any asynchronous call, then every route once the group's progress
thread runs (as in a training job). Prints rank 0's median microseconds per call over
``--rounds`` rounds and the difference to the group call, then what single pieces cost.
``--profile`` adds a cProfile of the ``dist.all_reduce`` loop (world 1).

Rank counts above the core count oversubscribe the machine (world 4 on 2 cores does);
quote ratios, not absolute times. ``--json PATH`` saves every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
BACKENDS = ("meshcomm", "gloo")
MARK = "TORCH_BACKEND_RESULT "


# -- the driver ----------------------------------------------------------------------------
def _bin(name: str) -> str:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(world: int, args: list[str], timeout: float) -> dict[str, Any]:
    """Run this file's worker under torchrun; return rank 0's result."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [
        _bin("torchrun"), "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
        "--master-port", str(_free_port()), str(HERE), "--worker", *args,
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, env=env, timeout=timeout
    )
    for line in proc.stdout.splitlines()[::-1]:
        if line.startswith(MARK):
            result: dict[str, Any] = json.loads(line[len(MARK) :])
            return result
    raise SystemExit(
        f"{' '.join(cmd)} failed (rc {proc.returncode}):\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )


def _train_table(what: str, runs: dict[str, list[dict[str, Any]]], world: int) -> dict[str, Any]:
    row: dict[str, Any] = {"world": world}
    for backend in BACKENDS:
        steps = [r["step_ms"] for r in runs[backend]]
        row[backend] = {"step_ms": statistics.median(steps), "repeats_ms": steps}
        if "nosync_ms" in runs[backend][0]:
            row[backend]["nosync_ms"] = statistics.median(r["nosync_ms"] for r in runs[backend])
    row["ratio"] = row["meshcomm"]["step_ms"] / row["gloo"]["step_ms"]
    row["ratio_per_repeat"] = [
        m["step_ms"] / g["step_ms"] for m, g in zip(runs["meshcomm"], runs["gloo"], strict=True)
    ]
    row["ratio_median_of_repeats"] = statistics.median(row["ratio_per_repeat"])
    first = runs["meshcomm"][0]
    row["params"], row["batch"] = first["params"], first["batch"]
    return row


def _print_train(what: str, row: dict[str, Any]) -> None:
    m, g = row["meshcomm"], row["gloo"]
    print(
        f"## {what}, world {row['world']}, {row['params'] / 1e6:.2f}M float32 parameters, "
        f"batch {row['batch']} per rank (ms per step, medians)"
    )
    nosync = "nosync_ms" in m
    head = f"{'backend':>9} | {'step ms':>9}"
    head += f" | {'no_sync ms':>10}" if nosync else ""
    head += " | per repeat"
    print(head)
    print("-" * len(head))
    for name, d in (("meshcomm", m), ("gloo", g)):
        line = f"{name:>9} | {d['step_ms']:>9.2f}"
        line += f" | {d['nosync_ms']:>10.2f}" if nosync else ""
        line += " | " + " ".join(f"{x:.1f}" for x in d["repeats_ms"])
        print(line)
    per = " ".join(f"{x:.3f}" for x in row["ratio_per_repeat"])
    print(
        f"meshcomm / gloo: {row['ratio']:.3f} (medians); per repeat {per}, their median "
        f"{row['ratio_median_of_repeats']:.3f}"
    )
    print()


def _print_overhead(world: int, res: dict[str, Any]) -> None:
    base = res["medians_us"]["mesh_group.all_reduce(x)"]
    idle = res.get("idle_medians_us", {})
    idle_base = idle.get("mesh_group.all_reduce(x)", float("nan"))
    print(f"## c10d route, all_reduce of 8 B float32, world {world} (us per call, rank 0)")
    print("   (no thread: before any asynchronous call; thread: the group's progress thread")
    print("   started, as in a training job)")
    head = (
        f"{'call':<42} | {'no thread':>9} {'- group':>8} | {'thread':>8} {'- group':>8} "
        "| rounds (thread)"
    )
    print(head)
    print("-" * len(head))
    for name, med in res["medians_us"].items():
        rounds = " ".join(f"{x:.1f}" for x in res["rounds_us"][name])
        i = idle.get(name, float("nan"))
        print(
            f"{name:<42} | {i:>9.2f} {i - idle_base:>+8.2f} | {med:>8.2f} {med - base:>+8.2f} "
            f"| {rounds}"
        )
    if res.get("local_us"):
        print("pieces alone (no communication):")
        for name, med in res["local_us"].items():
            print(f"  {name:<42} {med:>8.3f} us")
    if res.get("profile"):
        print(res["profile"])
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--what", nargs="+", default=["ddp", "fsdp", "overhead"])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--backend", default="meshcomm", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--overhead-worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--quick", action="store_true", help="world 2, 1 step: a smoke run")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.world, args.steps, args.warmup, args.repeats = 2, 1, 1, 1
        args.width, args.iters, args.rounds, args.overhead_worlds = 64, 20, 1, [2]
    if args.worker:
        _worker(args)
        return

    shape = ["--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch)]
    results: dict[str, Any] = {"argv": sys.argv[1:], "started": time.strftime("%F %T %Z")}
    for what in ("ddp", "fsdp"):
        if what not in args.what:
            continue
        runs: dict[str, list[dict[str, Any]]] = {b: [] for b in BACKENDS}
        for r in range(args.repeats):
            for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
                job = ["--what", what, "--backend", backend, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), *shape]  # fmt: skip
                runs[backend].append(_launch(args.world, job, timeout=900))
        results[what] = _train_table(what, runs, args.world)
        _print_train(what.upper() if what == "ddp" else "FSDP2", results[what])
    if "overhead" in args.what:
        for world in args.overhead_worlds:
            extra = ["--profile"] if args.profile and world == 1 else []
            job = ["--what", "overhead", "--iters", str(args.iters),
                   "--rounds", str(args.rounds), *extra]  # fmt: skip
            res = _launch(world, job, timeout=900)
            results[f"overhead w{world}"] = res
            _print_overhead(world, res)
    results["finished"] = time.strftime("%F %T %Z")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


# -- the ranks -----------------------------------------------------------------------------
def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import meshcomm.c10d  # noqa: F401 - registers backend "meshcomm"

    torch.set_num_threads(1)
    what = args.what[0]
    backend = "meshcomm" if what == "overhead" else args.backend
    dist.init_process_group(backend)
    try:
        result = _overhead(args) if what == "overhead" else _train(args, what)
        if dist.get_rank() == 0:
            print(MARK + json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


def _train(args: argparse.Namespace, what: str) -> dict[str, Any]:
    import contextlib

    import torch
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model: nn.Module = nn.Sequential(*layers[:-1])
    params = sum(p.numel() for p in model.parameters())
    if what == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.batch, args.width, generator=gen)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    def timed(n: int, ctx: Callable[[], Any] = contextlib.nullcontext) -> list[float]:
        times = []
        dist.barrier()
        for _ in range(n):
            start = time.perf_counter()
            with ctx():
                step()
            times.append((time.perf_counter() - start) * 1e3)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step's time: the slowest rank's
        return slowest.tolist()

    timed(args.warmup)
    steps = timed(args.steps)
    out = {"step_ms": statistics.median(steps), "steps_ms": steps, "params": params}
    out["batch"] = args.batch
    if what == "ddp":
        ddp: Any = model
        timed(1, ddp.no_sync)
        out["nosync_ms"] = statistics.median(timed(args.steps, ddp.no_sync))
    return out


def _overhead(args: argparse.Namespace) -> dict[str, Any]:
    import threading

    import numpy as np
    import torch
    import torch.distributed as dist

    from meshcomm import distributed as inplace
    from meshcomm.c10d._work import completed
    from meshcomm.reduction import ReduceOp as MeshOp

    pg: Any = dist.distributed_c10d._get_default_group()
    mg = pg.mesh_group
    t = torch.zeros(2, dtype=torch.float32)  # zeros stay zeros however often they are summed
    tl = [t]
    xt = t.numpy()
    x = np.zeros(2, np.float32)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.asyncOp = False
    handle = pg._handle
    SUM = MeshOp.SUM
    calls: dict[str, Callable[[], Any]] = {
        "dist.all_reduce(t)": lambda: dist.all_reduce(t),
        "pg.allreduce([t], opts).wait()": lambda: pg.allreduce(tl, opts).wait(),
        "pg._allreduce_inline([t], opts)": lambda: pg._allreduce_inline(tl, opts),
        "mesh_group.all_reduce(t.numpy(), out=)": lambda: mg.all_reduce(xt, SUM, out=xt),
        "mesh_group.all_reduce(x)": lambda: mg.all_reduce(x),
        "dist.all_reduce(t, async_op=True).wait()": lambda: dist.all_reduce(
            t, async_op=True
        ).wait(),
        "meshcomm.distributed.all_reduce(t)": lambda: inplace.all_reduce(t, group=handle),
    }

    def loop(fn: Callable[[], Any], n: int) -> float:
        mg.barrier()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n * 1e6

    def measure(names: list[str]) -> dict[str, list[float]]:
        for name in names:  # warm every route (plans made, channels open)
            loop(calls[name], max(10, args.iters // 10))
        rounds: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                rounds[name].append(loop(calls[name], args.iters))
        return rounds

    # First the blocking routes alone: no asynchronous call yet, so no progress thread.
    # Then every route, once an asynchronous call has started the group's progress thread
    # (as in a training job: DDP's and FSDP2's collectives are asynchronous).
    blocking = [n for n in calls if "async" not in n]
    idle = measure(blocking)
    no_thread = not any("progress" in th.name for th in threading.enumerate())
    rounds = measure(list(calls))
    out: dict[str, Any] = {
        "world": mg.size,
        "medians_us": {n: statistics.median(v) for n, v in rounds.items()},
        "rounds_us": rounds,
        "idle_medians_us": {n: statistics.median(v) for n, v in idle.items()},
        "idle_had_no_progress_thread": no_thread,
    }

    # The pieces alone, in this process only (no communication).
    def local(fn: Callable[[], Any], n: int = 20000) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - start) / n * 1e6)
        return best

    def options() -> Any:
        o = dist.AllreduceOptions()
        o.reduceOp = dist.ReduceOp.SUM
        o.asyncOp = False
        return o

    out["local_us"] = {
        "AllreduceOptions() + 2 fields (torch)": local(options),
        "completed([t]) (TorchWork creation)": local(lambda: completed(tl)),
        "TorchWork.wait() of a completed work": local(completed(tl).wait),
        "t.numpy()": local(t.numpy),
        "opts.reduceOp.op.value": local(lambda: opts.reduceOp.op.value),
        "_get_default_group()": local(dist.distributed_c10d._get_default_group),
        "pg in _world.pg_coalesce_state": local(
            lambda: pg in dist.distributed_c10d._world.pg_coalesce_state
        ),
    }
    if args.profile and mg.size == 1:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.iters):
            dist.all_reduce(t)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        out["profile"] = buf.getvalue()
    return out


if __name__ == "__main__":
    main()
