"""Every collective torch's classes call on a backend, in one rank: for tests/test_c10d_backend.py.

Run once per backend and world size, under torchrun or meshrun::

    torchrun --nproc-per-node N c10d_collectives.py BACKEND OUT_DIR

Scenarios: ``collectives`` (every ``torch.distributed`` collective and point-to-point call,
async works and their futures, subgroups), ``funcol`` (torch's functional collectives,
eager and under ``torch.compile(fullgraph=True)``), ``ddp`` (torch's own
DistributedDataParallel with and without a comm hook, ZeroRedundancyOptimizer,
DistributedSampler defaults) and, on backend "meshcomm", ``unsupported`` (features the
backend refuses before any I/O). Each check records its value as a tensor under a key, or
its traceback under the same key in ``errors``, so one failure hides nothing else. Each rank
``torch.save``s ``{"rank", "backend", "values", "errors", "info"}`` to ``OUT_DIR/rank<N>.pt``.

``C10D_ONLY=collectives,ddp`` runs only the scenarios named; ``C10D_ADOPT=1`` calls
``meshcomm.init()`` before ``init_process_group`` (the default group adopts that world).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

Record = dict[str, Any]

DTYPE = torch.float64
ANY_TAG = 7


class Recorder:
    """Collects values and errors by key."""

    def __init__(self) -> None:
        self.values: dict[str, torch.Tensor] = {}
        self.errors: dict[str, str] = {}
        self.info: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        """Record ``value`` (a tensor, a list of tensors, or numbers) under ``key``."""
        if key in self.values or key in self.errors:
            raise KeyError(f"recorded twice: {key!r}")
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            value = torch.stack([v.detach().reshape(-1) for v in value])
        elif not isinstance(value, torch.Tensor):
            value = torch.tensor(value)
        self.values[key] = value.detach().clone()

    def check(self, key: str, fn: Callable[[], Any]) -> None:
        """Run ``fn`` and record what it returns, or its traceback."""
        try:
            self.put(key, fn())
        except Exception:
            self.errors[key] = traceback.format_exc()
            print(f"rank {dist.get_rank()}: {key}: {self.errors[key]}", file=sys.stderr)


def _ops(dtype: torch.dtype) -> list[tuple[str, Any]]:
    ops: list[tuple[str, Any]] = [
        ("sum", dist.ReduceOp.SUM),
        ("product", dist.ReduceOp.PRODUCT),
        ("min", dist.ReduceOp.MIN),
        ("max", dist.ReduceOp.MAX),
    ]
    if dtype.is_floating_point:
        ops.append(("avg", dist.ReduceOp.AVG))
    else:
        ops += [("band", dist.ReduceOp.BAND), ("bor", dist.ReduceOp.BOR)]
        ops += [("bxor", dist.ReduceOp.BXOR)]
    return ops


def _data(rank: int, n: int, dtype: torch.dtype, shift: int = 0) -> torch.Tensor:
    """A rank's deterministic input: distinct per rank, exact in every dtype."""
    base = torch.arange(n, dtype=torch.float64) + 3 * rank + shift + 1
    if dtype.is_floating_point:
        return (base / 8 + 0.1 * rank).to(dtype)
    return (base.to(torch.int64) * 5 + rank).to(dtype)


def scenario_collectives(rec: Recorder) -> None:
    """Every collective and point-to-point call of ``torch.distributed``."""
    r, n = dist.get_rank(), dist.get_world_size()

    # all_reduce: every op gloo takes, three dtypes.
    for dtype in (torch.float64, torch.float32, torch.int64):
        for name, op in _ops(dtype):

            def reduce_(dtype: torch.dtype = dtype, op: Any = op) -> torch.Tensor:
                t = _data(r, 5, dtype)
                dist.all_reduce(t, op=op)
                return t

            rec.check(f"all_reduce {name} {dtype}", reduce_)

    def strided() -> torch.Tensor:
        base = _data(r, 24, DTYPE).reshape(4, 6)
        view = base[:, 1:5:2]  # non-contiguous
        assert not view.is_contiguous()
        dist.all_reduce(view)
        return base

    def transposed() -> torch.Tensor:
        base = _data(r, 12, DTYPE).reshape(3, 4)
        view = base.t()
        dist.all_reduce(view, op=dist.ReduceOp.MAX)
        return base

    def strided_reference() -> torch.Tensor:
        base = _data(r, 24, DTYPE).reshape(4, 6)
        view = base[:, 1:5:2].contiguous()
        dist.all_reduce(view)
        base[:, 1:5:2] = view
        return base

    def zero_size() -> torch.Tensor:
        t = torch.empty(0, 3, dtype=DTYPE)
        dist.all_reduce(t)
        return torch.tensor(list(t.shape))

    def broadcast_strided(contiguous: bool) -> torch.Tensor:
        base = _data(r, 12, DTYPE).reshape(3, 4)
        view = base[:, ::2]
        if contiguous:
            copy = view.contiguous()
            dist.broadcast(copy, src=1)
            view.copy_(copy)
        else:
            dist.broadcast(view, src=1)
        return base

    rec.check("broadcast strided", lambda: broadcast_strided(False))
    rec.check("broadcast strided reference", lambda: broadcast_strided(True))
    rec.check("all_reduce strided", strided)
    rec.check("all_reduce strided reference", strided_reference)
    rec.check("all_reduce transposed", transposed)
    rec.check("all_reduce zero-size", zero_size)

    def coalesced() -> list[torch.Tensor]:
        ts = [_data(r, 3, DTYPE), _data(r, 4, DTYPE, 7)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist.all_reduce_coalesced(ts)
        # torch warns that it is deprecated; the backend must not add a warning of its own.
        rec.info["coalesced warnings"] = [str(w.message) for w in caught]
        return [torch.cat(ts)]

    rec.check("all_reduce_coalesced", coalesced)

    def all_reduce_cm() -> list[torch.Tensor]:
        ts = [_data(r, 3, DTYPE), _data(r, 2, DTYPE, 4)]
        with dist._coalescing_manager():
            for t in ts:
                dist.all_reduce(t)
        return [torch.cat(ts)]

    rec.check("coalescing_manager all_reduce", all_reduce_cm)

    def all_gather() -> list[torch.Tensor]:
        outs = [torch.zeros(3, dtype=DTYPE) for _ in range(n)]
        dist.all_gather(outs, _data(r, 3, DTYPE))
        return outs

    def all_gather_into() -> torch.Tensor:
        out = torch.zeros(n * 2, 3, dtype=DTYPE)
        dist.all_gather_into_tensor(out, _data(r, 6, DTYPE).reshape(2, 3))
        return out

    def all_gather_cm() -> list[torch.Tensor]:
        outs = [torch.zeros(n * 2, dtype=DTYPE), torch.zeros(n * 3, dtype=DTYPE)]
        ins = [_data(r, 2, DTYPE), _data(r, 3, DTYPE, 9)]
        with dist._coalescing_manager():
            for o, i in zip(outs, ins, strict=True):
                dist.all_gather_into_tensor(o, i)
        return [torch.cat(outs)]

    def all_gather_cm_async() -> list[torch.Tensor]:
        outs = [torch.zeros(n * 2, dtype=DTYPE), torch.zeros(n * 2, dtype=DTYPE)]
        ins = [_data(r, 2, DTYPE), _data(r, 2, DTYPE, 5)]
        with dist._coalescing_manager(async_ops=True) as cm:
            for o, i in zip(outs, ins, strict=True):
                dist.all_gather_into_tensor(o, i)
        cm.wait()
        return [torch.cat(outs)]

    rec.check("all_gather", all_gather)
    rec.check("all_gather_into_tensor", all_gather_into)
    rec.check("coalescing_manager all_gather_into_tensor", all_gather_cm)
    rec.check("coalescing_manager async all_gather_into_tensor", all_gather_cm_async)

    def all_gather_coalesced() -> list[torch.Tensor]:
        outs = [[torch.zeros(2, dtype=DTYPE) for _ in range(2)] for _ in range(n)]
        dist.all_gather_coalesced(outs, [_data(r, 2, DTYPE), _data(r, 2, DTYPE, 3)])
        return [torch.cat([torch.cat(o) for o in outs])]

    rec.check("all_gather_coalesced", all_gather_coalesced)

    for name, op in _ops(DTYPE):

        def reduce_scatter(op: Any = op) -> torch.Tensor:
            out = torch.zeros(3, dtype=DTYPE)
            dist.reduce_scatter(out, [_data(r, 3, DTYPE, 10 * j) for j in range(n)], op=op)
            return out

        def reduce_scatter_tensor(op: Any = op) -> torch.Tensor:
            out = torch.zeros(2, 2, dtype=DTYPE)
            dist.reduce_scatter_tensor(out, _data(r, 4 * n, DTYPE).reshape(2 * n, 2), op=op)
            return out

        rec.check(f"reduce_scatter {name}", reduce_scatter)
        rec.check(f"reduce_scatter_tensor {name}", reduce_scatter_tensor)

    def reduce_scatter_cm() -> list[torch.Tensor]:
        outs = [torch.zeros(2, dtype=DTYPE), torch.zeros(1, dtype=DTYPE)]
        ins = [_data(r, 2 * n, DTYPE), _data(r, n, DTYPE, 6)]
        with dist._coalescing_manager():
            for o, i in zip(outs, ins, strict=True):
                dist.reduce_scatter_tensor(o, i)
        return [torch.cat(outs)]

    rec.check("coalescing_manager reduce_scatter_tensor", reduce_scatter_cm)

    def all_to_all() -> list[torch.Tensor]:
        outs = [torch.zeros(2, dtype=DTYPE) for _ in range(n)]
        dist.all_to_all(outs, [_data(r, 2, DTYPE, 10 * j) for j in range(n)])
        return outs

    def all_to_all_single() -> torch.Tensor:
        out = torch.zeros(2 * n, 3, dtype=DTYPE)
        dist.all_to_all_single(out, _data(r, 6 * n, DTYPE).reshape(2 * n, 3))
        return out

    def all_to_all_single_splits() -> torch.Tensor:
        # rank r sends j + 1 rows to rank j; receives r + 1 rows from everyone.
        ins = [j + 1 for j in range(n)]
        outs = [r + 1] * n
        x = _data(r, sum(ins) * 2, DTYPE).reshape(sum(ins), 2)
        out = torch.zeros(sum(outs), 2, dtype=DTYPE)
        dist.all_to_all_single(out, x, outs, ins)
        return out

    rec.check("all_to_all", all_to_all)
    rec.check("all_to_all_single", all_to_all_single)
    rec.check("all_to_all_single splits", all_to_all_single_splits)

    def broadcast() -> torch.Tensor:
        t = _data(r, 4, DTYPE)
        dist.broadcast(t, src=n - 1)
        return t

    def reduce_sum() -> torch.Tensor:
        t = _data(r, 4, DTYPE)
        dist.reduce(t, dst=1)
        return t if r == 1 else torch.zeros(4, dtype=DTYPE)

    def reduce_max() -> torch.Tensor:
        t = _data(r, 4, torch.int64)
        dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
        return t if r == 0 else torch.zeros(4, dtype=torch.int64)

    def gather() -> torch.Tensor:
        outs = [torch.zeros(3, dtype=DTYPE) for _ in range(n)] if r == n - 1 else None
        dist.gather(_data(r, 3, DTYPE), outs, dst=n - 1)
        return torch.stack(outs) if outs is not None else torch.zeros(n, 3, dtype=DTYPE)

    def scatter() -> torch.Tensor:
        out = torch.zeros(3, dtype=DTYPE)
        pieces = [_data(r, 3, DTYPE, 10 * j) for j in range(n)] if r == 1 else None
        dist.scatter(out, pieces, src=1)
        return out

    rec.check("broadcast", broadcast)
    rec.check("reduce sum", reduce_sum)
    rec.check("reduce max int64", reduce_max)
    rec.check("gather", gather)
    rec.check("scatter", scatter)

    def ring() -> torch.Tensor:
        got = torch.zeros(3, dtype=DTYPE)
        to, frm = (r + 1) % n, (r - 1) % n
        if r % 2 == 0:
            dist.send(_data(r, 3, DTYPE), to)
            dist.recv(got, frm)
        else:
            dist.recv(got, frm)
            dist.send(_data(r, 3, DTYPE), to)
        return got

    def recv_any() -> torch.Tensor:
        if r != 0:
            # Its own tag: a receive from any rank may match any later message of its tag.
            dist.send(torch.full((2,), float(r), dtype=DTYPE), 0, tag=ANY_TAG)
            return torch.zeros(n - 1, 3, dtype=DTYPE)
        rows = []
        for _ in range(n - 1):
            t = torch.zeros(2, dtype=DTYPE)
            sender = dist.recv(t, tag=ANY_TAG)
            rows.append(torch.cat([torch.tensor([float(sender)], dtype=DTYPE), t]))
        return torch.stack(sorted(rows, key=lambda row: float(row[0])))

    def isend_irecv() -> torch.Tensor:
        got = torch.zeros(3, dtype=DTYPE)
        works = [dist.irecv(got, (r - 1) % n), dist.isend(_data(r, 3, DTYPE), (r + 1) % n)]
        for w in works:
            w.wait()
        return got

    def batch() -> torch.Tensor:
        a, b = torch.zeros(2, dtype=DTYPE), torch.zeros(2, dtype=DTYPE)
        ops = [
            dist.P2POp(dist.isend, _data(r, 2, DTYPE), (r + 1) % n),
            dist.P2POp(dist.isend, _data(r, 2, DTYPE, 20), (r - 1) % n),
            dist.P2POp(dist.irecv, a, (r - 1) % n),
            dist.P2POp(dist.irecv, b, (r + 1) % n),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return torch.cat([a, b])

    rec.check("send recv ring", ring)
    rec.check("recv any source", recv_any)
    rec.check("isend irecv", isend_irecv)
    rec.check("batch_isend_irecv", batch)
    rec.check("barrier", lambda: [dist.barrier(), 1][1])

    def subgroups() -> list[torch.Tensor]:
        # Every rank but 0; and at world >= 3, the two ends.
        tail = dist.new_group(list(range(1, n)))
        ends = dist.new_group([0, n - 1]) if n >= 3 else None
        found = []
        if r >= 1:
            t = _data(r, 3, DTYPE)
            dist.all_reduce(t, group=tail)
            outs = [torch.zeros(3, dtype=DTYPE) for _ in range(n - 1)]
            dist.all_gather(outs, _data(r, 3, DTYPE), group=tail)
            b = _data(r, 3, DTYPE)
            dist.broadcast(b, group=tail, group_src=n - 2)
            found += [t, torch.cat(outs), b]
        else:
            assert dist.get_rank(tail) == -1
            found += [torch.zeros(3, dtype=DTYPE), torch.zeros(3 * (n - 1), dtype=DTYPE)]
            found += [torch.zeros(3, dtype=DTYPE)]
        if ends is not None:
            e = _data(r, 3, DTYPE)
            if r in (0, n - 1):
                dist.all_reduce(e, group=ends, op=dist.ReduceOp.MAX)
            found.append(e)
        dist.barrier()
        return [torch.cat(found)]

    rec.check("new_group subsets", subgroups)

    def objects() -> list[torch.Tensor]:
        # torch's object collectives: pickles over broadcast / all_gather / gather / scatter.
        everyone: list[Any] = [None] * n
        dist.all_gather_object(everyone, {"rank": r, "name": "x" * (r + 1)})
        sent: list[Any] = [f"from {r}", r * 1.5]
        dist.broadcast_object_list(sent, src=n - 1)
        gathered: list[Any] | None = [None] * n if r == 0 else None
        dist.gather_object(("g", r), gathered, dst=0)
        got: list[Any] = [None]
        dist.scatter_object_list(got, [("s", j) for j in range(n)] if r == 1 else None, src=1)
        flat = [float(e["rank"] * 10 + len(e["name"])) for e in everyone]
        flat += [float(sent[0] == f"from {n - 1}"), float(sent[1])]
        flat += [float(g[1]) for g in gathered] if gathered is not None else [-1.0] * n
        flat += [float(got[0][1])]
        return [torch.tensor(flat, dtype=DTYPE)]

    rec.check("object collectives", objects)

    def async_all_reduce() -> list[torch.Tensor]:
        a = _data(r, 3, DTYPE)
        w = dist.all_reduce(a, async_op=True)
        assert w is not None
        fut = w.get_future()
        w.wait()
        value = fut.wait()
        assert isinstance(value, list) and value[0] is a, value
        return [a]

    def async_all_gather() -> list[torch.Tensor]:
        out = torch.zeros(n * 2, dtype=DTYPE)
        w = dist.all_gather_into_tensor(out, _data(r, 2, DTYPE), async_op=True)
        assert w is not None
        value = w.get_future().wait()
        w.wait()
        assert w.is_completed() and w.is_success()
        # What the future holds differs by backend (gloo: the input; NCCL, meshcomm: the
        # output): recorded apart, checked by the test.
        rec.put("async all_gather_into_tensor future", value[0])
        return [out]

    def async_broadcast() -> list[torch.Tensor]:
        b = _data(r, 2, DTYPE)
        w = dist.broadcast(b, src=0, async_op=True)
        assert w is not None
        w.wait()
        assert w.is_completed() and w.is_success()
        chained = w.get_future().then(lambda f: f.value()[0] * 2).wait()
        return [b, chained]

    rec.check("async all_reduce", async_all_reduce)
    rec.check("async all_gather_into_tensor", async_all_gather)
    rec.check("async broadcast then", async_broadcast)


def scenario_funcol(rec: Recorder) -> None:
    """torch.distributed._functional_collectives on the default group, eager and compiled."""
    import torch.distributed._functional_collectives as fc

    r, n = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    assert world is not None

    def eager() -> dict[str, torch.Tensor]:
        x = _data(r, 2 * n, DTYPE)
        return {
            "all_reduce": fc.all_reduce(x, "sum", world),
            "all_reduce max": fc.all_reduce(x, "max", world),
            "all_gather_tensor": fc.all_gather_tensor(x.reshape(n, 2), 1, world),
            "reduce_scatter_tensor": fc.reduce_scatter_tensor(x, "sum", 0, world),
            "all_to_all_single": fc.all_to_all_single(x, None, None, world),
            "all_to_all_single splits": fc.all_to_all_single(
                _data(r, n * (n + 1) // 2, DTYPE), [r + 1] * n, [j + 1 for j in range(n)], world
            ),
            "broadcast": fc.broadcast(x, n - 1, world),
            "all_reduce_coalesced": torch.cat(
                fc.all_reduce_coalesced([x, _data(r, 3, DTYPE, 4)], "sum", world)
            ),
            "all_gather_into_tensor_coalesced": torch.cat(
                fc.all_gather_into_tensor_coalesced([x, _data(r, 3, DTYPE, 4)], world)
            ),
            "reduce_scatter_tensor_coalesced": torch.cat(
                fc.reduce_scatter_tensor_coalesced([x, _data(r, n, DTYPE, 4)], "sum", [0, 0], world)
            ),
        }

    try:
        for key, value in eager().items():
            rec.put(f"funcol eager {key}", value)
    except Exception:
        rec.errors["funcol eager"] = traceback.format_exc()

    def step(a: torch.Tensor) -> torch.Tensor:
        s = fc.all_reduce(a * 2, "sum", world)
        g = fc.all_gather_tensor(s + 1, 0, world)
        rs = fc.reduce_scatter_tensor(g, "sum", 0, world)
        return rs + fc.all_to_all_single(a, None, None, world)

    def compiled() -> torch.Tensor:
        torch._dynamo.reset()
        fn = torch.compile(step, fullgraph=True, backend=os.environ.get("C10D_COMPILE", "inductor"))
        return fn(_data(r, 2 * n, DTYPE))

    # Compiled on meshcomm only: the test compares it with gloo's eager step.
    if dist.get_backend() == "meshcomm" and os.environ.get("C10D_COMPILE", "inductor") != "none":
        rec.check("funcol compiled", compiled)
    rec.check("funcol eager step", lambda: step(_data(r, 2 * n, DTYPE)))


def scenario_ddp(rec: Recorder) -> None:
    """torch's DistributedDataParallel, ZeroRedundancyOptimizer and DistributedSampler."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DistributedSampler

    r, n = dist.get_rank(), dist.get_world_size()

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(DTYPE)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + r)
        return torch.randn(5, 6, generator=g, dtype=DTYPE), torch.randn(
            5, 3, generator=g, dtype=DTYPE
        )

    def train(hook: bool, zero: bool) -> torch.Tensor:
        ddp = DDP(model(), find_unused_parameters=False, bucket_cap_mb=1)
        if hook:
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        opt: Any
        if zero:
            opt = ZeroRedundancyOptimizer(
                ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01
            )
        else:
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            loss = ((ddp(x) - y) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach().reshape(1))
        params = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
        return torch.cat([params, torch.cat(losses)])

    rec.check("ddp default", lambda: train(hook=False, zero=False))
    rec.check("ddp allreduce_hook", lambda: train(hook=True, zero=False))
    rec.check("ddp zero adam", lambda: train(hook=False, zero=True))

    def sampler() -> torch.Tensor:
        data = list(range(23))
        s = DistributedSampler(data)  # type: ignore[var-annotated]
        assert (s.num_replicas, s.rank) == (n, r)
        s.set_epoch(3)
        return torch.tensor(list(iter(s)))

    rec.check("sampler defaults", sampler)


def scenario_unsupported(rec: Recorder) -> None:
    """Features the meshcomm backend refuses, before any I/O (rank 0 only, then a check)."""
    from meshcomm.c10d import Unsupported

    r, n = dist.get_rank(), dist.get_world_size()
    pg = dist.group.WORLD
    assert pg is not None
    found: dict[str, str] = {}
    if r == 0:
        opts = dist.AllreduceOptions()
        opts.timeout = timedelta(seconds=7)
        attempts: dict[str, Callable[[], Any]] = {
            "timeout": lambda: pg.allreduce([torch.ones(2)], opts),
            "two tensors": lambda: pg.allreduce([torch.ones(2), torch.ones(2)]),
            "two broadcast": lambda: pg.broadcast([torch.ones(2), torch.ones(2)]),
        }
        for name, attempt in attempts.items():
            try:
                attempt()
            except Unsupported as exc:
                found[name] = f"{type(exc).__name__}: {exc}"
            else:
                found[name] = "no error"
    rec.info["unsupported"] = found
    # Nothing went out: the next collective is matched on every rank.
    t = torch.full((2,), float(r + 1), dtype=DTYPE)
    dist.all_reduce(t)
    rec.put("unsupported then all_reduce", t)
    assert t.tolist() == [n * (n + 1) / 2] * 2


SCENARIOS: dict[str, Callable[[Recorder], None]] = {
    "collectives": scenario_collectives,
    "funcol": scenario_funcol,
    "ddp": scenario_ddp,
    "unsupported": scenario_unsupported,
}


def main() -> None:
    """Run the scenarios on the backend of argv[1]; save this rank's record under argv[2]."""
    backend, out_dir = sys.argv[1], Path(sys.argv[2])
    import meshcomm.c10d

    if os.environ.get("C10D_ADOPT") == "1":
        import meshcomm

        meshcomm.init()
    dist.init_process_group(
        backend, timeout=timedelta(seconds=float(os.environ.get("C10D_TIMEOUT", "60")))
    )
    rec = Recorder()
    rec.info["world_group"] = type(dist.group.WORLD).__name__
    if os.environ.get("C10D_ADOPT") == "1":
        import meshcomm

        mesh_group = getattr(dist.group.WORLD, "mesh_group", None)
        rec.info["adopted"] = mesh_group is meshcomm.get_world()
    only = [s for s in os.environ.get("C10D_ONLY", "").split(",") if s]
    for name, scenario in SCENARIOS.items():
        if (only and name not in only) or (name == "unsupported" and backend != "meshcomm"):
            continue
        start = time.perf_counter()
        try:
            scenario(rec)
        except Exception:
            rec.errors[name] = traceback.format_exc()
        rec.info[f"seconds {name}"] = round(time.perf_counter() - start, 2)
    dist.barrier()
    torch.save(
        {
            "rank": dist.get_rank(),
            "backend": dist.get_backend(),
            "values": rec.values,
            "errors": rec.errors,
            "info": rec.info,
        },
        out_dir / f"rank{dist.get_rank()}.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
