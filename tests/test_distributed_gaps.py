"""The gaps found porting Megatron-LM and torch's ``mp.spawn`` examples, closed and checked on
real multi-process worlds (2 and 3 ranks):

- ``_all_gather_base``, ``_reduce_scatter_base`` (torch's deprecated private aliases) and
  ``_coalescing_manager`` (Megatron's gradient and parameter buckets);
- native meshcomm groups (a mesh's ``get_group``, ``meshcomm.new_group``, the world) as
  ``group=`` of every function of ``meshcomm.distributed`` that takes one;
- ``import meshcomm.spawn as mp; mp.spawn(...)`` next to ``meshcomm.spawn(...)``;
- a spawned worker that sets its own ``MASTER_ADDR``/``MASTER_PORT`` (torch's tutorial).
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import traceback
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import meshcomm.distributed as dist
from meshcomm.group import ProcessGroup as MeshGroup
from meshcomm.testing import run_ranks

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
BF16 = np.dtype(ml_dtypes.bfloat16)
TIMEOUT = 120.0


class Checks:
    """Collects failures as lines naming the rank and the check."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []

    def eq(self, name: str, got: Any, want: Any) -> None:
        g, w = _values(got), _values(want)
        if g.dtype != w.dtype or g.shape != w.shape or not np.array_equal(g, w):
            self.failures.append(f"rank {self.rank}: {name}: got {g!r}, want {w!r}")

    def true(self, name: str, ok: bool, detail: Any = "") -> None:
        if not ok:
            self.failures.append(f"rank {self.rank}: {name} {detail}")

    def raises(
        self, name: str, exc: type[BaseException], match: str, fn: Callable[[], Any]
    ) -> None:
        try:
            fn()
        except exc as err:
            if match not in str(err):
                self.failures.append(f"rank {self.rank}: {name}: {match!r} not in {err}")
            return
        except Exception as err:
            self.failures.append(f"rank {self.rank}: {name}: raised {type(err).__name__} {err}")
            return
        self.failures.append(f"rank {self.rank}: {name}: did not raise {exc.__name__}")

    def section(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self.failures.append(f"rank {self.rank}: {name} raised:\n{traceback.format_exc()}")


def _values(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    import torch

    t = x.detach()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(BF16)
    return t.contiguous().numpy()


def _data(rank: int, n: int, dtype: Any, seed: int = 0) -> np.ndarray:
    """Small integers (exact in every dtype and sum) from a rank and a seed."""
    rng = np.random.default_rng(1000 * seed + rank)
    return rng.integers(-8, 9, size=n).astype(dtype)


def _tensor(values: np.ndarray) -> Any:
    import torch

    if values.dtype == BF16:
        return torch.from_numpy(values.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(values.copy())


# -- _coalescing_manager, _all_gather_base, _reduce_scatter_base -----------------------------
def coalescing(c: Checks, world: int) -> None:
    """Megatron's patterns inside coalescing blocks, against numpy oracles."""
    import torch

    me = dist.get_rank()
    dtypes = [np.float32, np.float64, BF16, np.int64]
    sizes = [5, 3, 7, 4]

    # all_reduce of buckets of several dtypes (one strided), async block
    ins = [_data(me, n, dt, seed=i) for i, (n, dt) in enumerate(zip(sizes, dtypes, strict=True))]
    want = [
        sum(_data(r, n, dt, seed=i).astype(np.float64) for r in range(world)).astype(dt)
        for i, (n, dt) in enumerate(zip(sizes, dtypes, strict=True))
    ]
    bufs = [_tensor(x) for x in ins]
    strided = torch.zeros(2, 6, dtype=torch.float64)[:, ::2]  # 6 values, not contiguous
    strided.copy_(torch.arange(6.0).reshape(2, 3) + me)
    with dist._coalescing_manager(None, torch.device("cpu"), async_ops=True) as cm:
        handles = [dist.all_reduce(b, group=None, async_op=True) for b in bufs]
        dist.all_reduce(strided)
    c.true("one fused handle", len(cm.works) == 1, cm.works)

    def wait_queued() -> None:
        handles[0].wait()  # even looking the method up raises, as in torch

    c.raises("queued call's handle", ValueError, "Illegal to call wait", wait_queued)
    cm.wait()
    for i, (b, w) in enumerate(zip(bufs, want, strict=True)):
        c.eq(f"coalesced all_reduce {i}", b, w)
    expect = sum(np.arange(6.0).reshape(2, 3) + r for r in range(world))
    c.eq("coalesced all_reduce strided", strided, expect)

    # reduce-scatter of gradient buffers into their own shards (Megatron's distributed
    # optimizer), sync block, the deprecated names mixed; AVG over floats
    grads = [_tensor(_data(me, world * n, np.float64, seed=10 + i)) for i, n in enumerate(sizes)]
    total = [
        sum(_data(r, world * n, np.float64, seed=10 + i) for r in range(world))
        for i, n in enumerate(sizes)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with dist._coalescing_manager(async_ops=False) as cm:
            for i, g in enumerate(grads):
                shard = g.view(world, -1)[me]  # output aliases the input, as in Megatron
                rs = dist._reduce_scatter_base if i % 2 else dist.reduce_scatter_tensor
                rs(shard, g, op=dist.ReduceOp.AVG, async_op=True)
    c.true("sync block keeps no handle", cm.works == [], cm.works)
    for i, (g, t) in enumerate(zip(grads, total, strict=True)):
        c.eq(
            f"coalesced reduce_scatter {i}", g.view(world, -1)[me], t.reshape(world, -1)[me] / world
        )

    # all-gather of parameter shards into the full buffers, the deprecated names mixed
    params = [torch.zeros(world * n, dtype=torch.float32) for n in sizes]
    for i, (p, n) in enumerate(zip(params, sizes, strict=True)):
        p.view(world, -1)[me].copy_(_tensor(_data(me, n, np.float32, seed=20 + i)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with dist._coalescing_manager(dist.group.WORLD, async_ops=True) as cm:
            for i, p in enumerate(params):
                ag = dist._all_gather_base if i % 2 else dist.all_gather_into_tensor
                ag(p, p.view(world, -1)[me], async_op=True)
    cm.wait()
    for i, (p, n) in enumerate(zip(params, sizes, strict=True)):
        want_p = np.concatenate([_data(r, n, np.float32, seed=20 + i) for r in range(world)])
        c.eq(f"coalesced all_gather {i}", p, want_p)

    # other collectives and other groups inside a block are issued at once
    pair = dist.new_group([0, 1])
    x, y = np.full(2, float(me)), np.ones(1)
    with dist._coalescing_manager() as cm:
        dist.all_reduce(y)
        dist.broadcast(x, src=1)
        c.eq("broadcast inside a block ran at once", x, np.full(2, 1.0))
        if me < 2:
            z = np.ones(1)
            dist.all_reduce(z, group=pair)
            c.eq("another group inside a block ran at once", z, np.full(1, 2.0))
        c.eq("queued all_reduce waits for the block", y, np.ones(1))
    c.eq("queued all_reduce after the block", y, np.full(1, float(world)))

    # refused before any I/O: mixed kinds, mixed ops, a nested block
    def mixed_kinds() -> None:
        with dist._coalescing_manager():
            dist.all_reduce(np.ones(1))
            dist.all_gather_single(np.zeros(world), np.ones(1))

    c.raises(
        "mixed kinds", RuntimeError, "mixed types: all_reduce then all_gather_single", mixed_kinds
    )

    def mixed_ops() -> None:
        with dist._coalescing_manager():
            dist.all_reduce(np.ones(1))
            dist.all_reduce(np.ones(1), op=dist.ReduceOp.MAX)

    c.raises("mixed ops", ValueError, f"rank {me}, group '0'", mixed_ops)

    def nested() -> None:
        with dist._coalescing_manager(), dist._coalescing_manager():
            pass

    c.raises("nested", ValueError, "already open on group '0'", nested)
    after = np.full(1, float(me))
    dist.all_reduce(after)  # nothing of the refused blocks went out
    c.eq("world usable after refused blocks", after, np.full(1, float(sum(range(world)))))

    # a rank outside the group: the block does nothing
    solo = dist.new_group([0])
    with dist._coalescing_manager(solo, async_ops=True) as cm:
        w = np.ones(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dist.all_reduce(w, group=solo)
    if me == 0:
        cm.wait()
        c.eq("block of a group of one", w, np.ones(1))
    else:
        c.true("block outside the group", cm.works == [], cm.works)
    dist.barrier()


def coalescing_main(group: MeshGroup) -> list[str]:
    dist.init_process_group("gloo")  # adopts the world run_ranks made
    c = Checks(dist.get_rank())
    c.section("coalescing", lambda: coalescing(c, group.size))
    dist.destroy_process_group()
    return c.failures


def check(results: list[list[str]]) -> None:
    failures = [line for per_rank in results for line in per_rank]
    assert not failures, "\n".join(failures[:20])


@needs_torch
@pytest.mark.parametrize("world", [2, 3])
def test_coalescing_manager(world: int) -> None:
    check(run_ranks(coalescing_main, world, timeout=TIMEOUT))


@pytest.fixture
def one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    dist.init_process_group("gloo", world_size=1, rank=0, timeout=timedelta(seconds=20))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@needs_torch
@pytest.mark.parametrize(
    "name", ["_all_gather_base", "_reduce_scatter_base", "_coalescing_manager"]
)
def test_private_names_match_torch(name: str) -> None:
    import torch.distributed as tdist

    def params(fn: Any) -> list[tuple[str, Any]]:
        out = []
        for p in inspect.signature(fn).parameters.values():
            default = p.default
            if type(default).__name__ == "RedOpType":
                default = int(default)
            out.append((p.name, default))
        return out

    assert params(getattr(dist, name)) == params(getattr(tdist, name))


def test_private_aliases_warn_as_torch(one: None) -> None:
    out = np.zeros(2)
    with pytest.warns(FutureWarning, match=r"_all_gather_base` is a private function") as rec:
        dist._all_gather_base(out, np.array([1.0, 2.0]))
    assert rec[0].filename == __file__  # points at the caller, as torch's
    assert "all_gather_single" in str(rec[0].message)
    with pytest.warns(FutureWarning, match=r"_reduce_scatter_base` is a private function"):
        work = dist._reduce_scatter_base(out, np.array([3.0, 4.0]), async_op=True)
    assert work is not None and work.wait()
    assert out.tolist() == [3.0, 4.0]
    for fn in (dist.all_gather_into_tensor, dist.reduce_scatter_tensor):
        with pytest.warns(FutureWarning) as rec:
            fn(out, np.array([5.0, 6.0]))
        assert rec[0].filename == __file__, fn.__name__
    with pytest.warns(FutureWarning) as rec:
        dist.all_reduce_coalesced([out])
    assert rec[0].filename == __file__


# -- native meshcomm groups as group= ---------------------------------------------------------
def native_groups(c: Checks, world: MeshGroup) -> None:
    """Every function of meshcomm.distributed that takes a group, given meshcomm's own."""
    import meshcomm

    me, n = world.rank, world.size
    mesh = meshcomm.init_device_mesh((n,), mesh_dim_names=("tp",))
    tp = mesh.get_group("tp")
    pair = world.new_group([0, 1])  # a meshcomm group; None on rank 2
    for label, g in (("world", world), ("mesh tp", tp)):
        c.true(f"{label} is native", isinstance(g, MeshGroup), type(g))
        c.eq(f"get_rank({label})", np.array(dist.get_rank(g)), np.array(me))
        c.eq(f"get_world_size({label})", np.array(dist.get_world_size(group=g)), np.array(n))
        c.eq(f"ranks({label})", np.array(dist.get_process_group_ranks(g)), np.arange(n))
        c.eq(f"group rank({label})", np.array(dist.get_group_rank(g, n - 1)), np.array(n - 1))
        c.eq(f"global rank({label})", np.array(dist.get_global_rank(g, n - 1)), np.array(n - 1))
        c.true(f"get_backend({label})", dist.get_backend(g) == "gloo", dist.get_backend(g))
        x = np.full(2, float(me))
        dist.all_reduce(x, group=g)
        c.eq(f"all_reduce({label})", x, np.full(2, float(sum(range(n)))))
        dist.barrier(group=g)
        dist.monitored_barrier(group=g, timeout=timedelta(seconds=30))
        objs: list[Any] = [None] * n
        dist.all_gather_object(objs, me, group=g)
        c.true(f"all_gather_object({label})", objs == list(range(n)), objs)
        box: list[Any] = [me]
        dist.broadcast_object_list(box, src=n - 1, group=g)
        c.true(f"broadcast_object_list({label})", box == [n - 1], box)
        got: list[Any] = [None]
        dist.scatter_object_list(got, list(range(10, 10 + n)) if me == 0 else None, group=g)
        c.true(f"scatter_object_list({label})", got == [10 + me], got)
        gathered = [None] * n if me == 0 else None
        dist.gather_object(me * 2, gathered, group=g)
        c.true(f"gather_object({label})", me != 0 or gathered == [2 * r for r in range(n)])
        with dist._coalescing_manager(g, async_ops=True) as cm:
            y = np.ones(3)
            dist.all_reduce(y, group=g)
        cm.wait()
        c.eq(f"coalesced({label})", y, np.full(3, float(n)))
        cur, subs = dist.new_subgroups(1, group=g)
        c.true(f"new_subgroups({label})", cur.size() == 1 and len(subs) == n, (cur, subs))
        half = dist.split_group(g, [[0], list(range(1, n))])
        c.true(
            f"split_group({label})", half is not None and half.size() == (1 if me == 0 else n - 1)
        )
    if pair is not None:  # point to point on a native sub-group (ranks 0 and 1)
        other = 1 - me
        a, b = np.full(2, float(me)), np.zeros(2)
        ops = [dist.P2POp(dist.isend, a, other, group=pair), dist.P2POp(dist.irecv, b, other, pair)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        c.eq("batch_isend_irecv(native pair)", b, np.full(2, float(other)))
        if me == 0:
            dist.send_object_list(["hi"], dst=1, group=pair)
        else:
            box = [None]
            dist.recv_object_list(box, src=0, group=pair)
            c.true("recv_object_list(native pair)", box == ["hi"], box)
        out = np.zeros(2)
        dist.all_to_all_single(out, np.array([10.0 * me, 10.0 * me + 1]), group=pair)
        c.eq("all_to_all_single(native pair)", out, np.array([float(me), 10.0 + me]))
    if HAVE_TORCH:
        import torch

        torch.manual_seed(me)
        model = dist.DistributedDataParallel(torch.nn.Linear(3, 1), process_group=tp)
        first = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        ref = first.clone()
        dist.broadcast(ref, src=0, group=tp)
        c.true("DDP(process_group=native) broadcast rank 0's", torch.equal(first, ref))
        model(torch.full((2, 3), float(me))).sum().backward()
        grad = model.module.bias.grad.clone()
        c.eq("DDP(process_group=native) averaged", grad, torch.full((1,), 2.0))
    sampler = dist.DistributedSampler(range(10), shuffle=False)
    c.true("DistributedSampler defaults", (sampler.num_replicas, sampler.rank) == (n, me))
    dist.barrier()


def native_main(group: MeshGroup) -> list[str]:
    dist.init_process_group("gloo")
    c = Checks(dist.get_rank())
    c.section("native groups", lambda: native_groups(c, group))
    dist.destroy_process_group()
    return c.failures


@pytest.mark.parametrize("world", [2, 3])
def test_native_groups_everywhere(world: int) -> None:
    check(run_ranks(native_main, world, timeout=TIMEOUT))


# -- meshcomm.spawn the module, and workers that set MASTER_ADDR/MASTER_PORT ----------------
TUTORIAL = """
import os
import sys

import numpy as np

import meshcomm.distributed as dist

STYLE, PORT, WORLD, ASKED = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


def setup(rank, world_size):
    # torch's mp.spawn tutorial: each worker names the address itself
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = PORT
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def worker(rank, world_size):
    setup(rank, world_size)
    t = np.full(2, float(rank))
    dist.all_reduce(t)
    print(f"rank {rank} of {dist.get_world_size()}: {t.tolist()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if STYLE == "module":
        import meshcomm.spawn as mp

        mp.spawn(worker, args=(ASKED,), nprocs=WORLD, join=True)
    elif STYLE == "attribute":
        import meshcomm

        meshcomm.spawn(worker, args=(ASKED,), nprocs=WORLD)
    else:
        from meshcomm.spawn import spawn

        spawn(worker, args=(ASKED,), nprocs=WORLD)
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_tutorial(tmp_path: Any, style: str, world: int, asked: int) -> Any:
    import os
    import subprocess
    import sys

    script = tmp_path / "tutorial.py"
    script.write_text(TUTORIAL)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHCOMM_", "MASTER_"))}
    env["MESHCOMM_TIMEOUT"] = "60"
    args = [sys.executable, str(script), style, str(_free_port()), str(world), str(asked)]
    return subprocess.run(args, check=False, capture_output=True, text=True, timeout=90, env=env)


@pytest.mark.parametrize(("style", "world"), [("module", 2), ("attribute", 3), ("function", 2)])
def test_spawn_tutorial_sets_its_own_master_address(tmp_path: Any, style: str, world: int) -> None:
    proc = _run_tutorial(tmp_path, style, world, world)
    assert proc.returncode == 0, proc.stderr[-3000:]
    total = float(sum(range(world)))
    # Ranks share the pipe: two prints can land on one line, so match records, not lines.
    lines = sorted(re.findall(r"rank \d+ of \d+: \[[^\]]*\]", proc.stdout))
    assert lines == [f"rank {r} of {world}: {[total, total]}" for r in range(world)]


def test_spawn_worker_asking_another_world_size_fails_at_once(tmp_path: Any) -> None:
    import time

    start = time.monotonic()
    proc = _run_tutorial(tmp_path, "module", 2, 3)
    assert proc.returncode != 0
    assert "init_process_group got world_size=3 but WORLD_SIZE=2" in proc.stderr, proc.stderr
    assert time.monotonic() - start < 45  # not the rendezvous timeout


def test_spawn_module_is_the_callable() -> None:
    import meshcomm
    import meshcomm.spawn as mp
    from meshcomm.spawn import spawn

    assert isinstance(mp, type(inspect))  # a module, as torch.multiprocessing
    assert meshcomm.spawn is mp and callable(mp)
    assert inspect.isfunction(spawn) and mp.spawn is spawn
    assert mp.ProcessContext is mp.SpawnContext
    assert list(inspect.signature(mp).parameters) == list(inspect.signature(spawn).parameters)
    with pytest.raises(meshcomm.InvalidArgument, match="start_method='fork'"):
        mp.start_processes(print, start_method="fork")
