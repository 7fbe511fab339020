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
