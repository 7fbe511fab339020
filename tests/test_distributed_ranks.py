"""meshcomm.distributed on real multi-process worlds, every call checked against an oracle.

One launch per world runs the whole suite (:func:`suite`): each rank knows every rank's
inputs (they come from seeds), so it computes the expected result of each collective with
numpy and compares. World 4 runs it on numpy arrays and torch tensors (contiguous, strided
and bfloat16) and trains DistributedDataParallel; world 3 (odd size) on numpy arrays only,
without importing torch. A failure comes back as a line naming the rank and the check.
"""

from __future__ import annotations

import importlib.util
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from meshcomm.group import ProcessGroup as MeshGroup
from meshcomm.testing import run_ranks

HAVE_TORCH = importlib.util.find_spec("torch") is not None
TIMEOUT = 150.0
BF16 = np.dtype(ml_dtypes.bfloat16)


# -- data and oracles -------------------------------------------------------------------------
def data(seed: int, rank: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Small integers (exact in every dtype, sums included) from a seed and a rank."""
    rng = np.random.default_rng(seed * 1009 + rank)
    vals = rng.integers(-8, 9, size=shape)
    dt = np.dtype(dtype)
    if dt.kind == "u":
        vals = np.abs(vals)
    if dt.kind == "c":
        return (vals + 1j * rng.integers(-8, 9, size=shape)).astype(dt)
    return vals.astype(dt)


class Kind:
    """How the suite builds caller buffers: numpy arrays or torch tensors (maybe strided)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def make(self, values: np.ndarray) -> Any:
        if self.name == "numpy":
            return values.copy()
        import torch

        flat = np.ascontiguousarray(values)
        if flat.dtype == BF16:
            t = torch.from_numpy(flat.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(flat.copy())
        if self.name == "torch-strided" and t.ndim == 2:
            # the same values, laid out transposed in memory: a non-contiguous view
            t = t.t().contiguous().t()
        return t

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self.make(np.zeros(shape, dtype))

    @staticmethod
    def values(x: Any) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x
        import torch

        t = x.detach()
        if t.dtype == torch.bfloat16:
            return t.contiguous().view(torch.int16).numpy().view(BF16)
        return t.numpy()


class Suite:
    """Collects failures as lines: ``rank R: check: what went wrong``."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []

    def eq(self, name: str, got: Any, want: np.ndarray) -> None:
        g = np.asarray(Kind.values(got))
        if g.dtype != want.dtype or g.shape != want.shape or not np.array_equal(g, want):
            self.failures.append(f"rank {self.rank}: {name}: got {g!r}, want {want!r}")

    def true(self, name: str, cond: bool, detail: Any = "") -> None:
        if not cond:
            self.failures.append(f"rank {self.rank}: {name}: {detail}")

    def raises(self, name: str, kinds: type | tuple[type, ...], fn: Callable[[], Any]) -> str:
        try:
            fn()
        except kinds as exc:
            return str(exc)
        except Exception as exc:
            self.failures.append(f"rank {self.rank}: {name}: raised {type(exc).__name__}: {exc}")
            return ""
        self.failures.append(f"rank {self.rank}: {name}: did not raise {kinds}")
        return ""

    def section(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self.failures.append(
                f"rank {self.rank}: section {name} crashed:\n{traceback.format_exc()}"
            )


# -- the sections ---------------------------------------------------------------------------
def collectives(s: Suite, dist: Any, kind: Kind, dtype: Any, seed: int) -> None:
    r, w = dist.get_rank(), dist.get_world_size()
    dt = np.dtype(dtype)
    shape = (2, 3)
    xs = [data(seed, q, shape, dt) for q in range(w)]
    label = f"{kind.name}/{dt.name}"

    x = kind.make(xs[r])
    dist.all_reduce(x)
    s.eq(f"all_reduce sum {label}", x, np.sum(xs, axis=0).astype(dt))
    ordered = dt.kind != "c"  # complex numbers have no max/min
    if ordered:
        x = kind.make(xs[r])
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        s.eq(f"all_reduce max {label}", x, np.max(xs, axis=0).astype(dt))
    if dt.kind == "f" or dt == BF16:
        x = kind.make(xs[r] * 2)
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
        s.eq(f"all_reduce avg {label}", x, (np.sum(xs, axis=0) * 2 / w).astype(dt))
        x = kind.make(xs[r])
        dist.all_reduce(x, op=dist._make_nccl_premul_sum(2.0))
        s.eq(f"all_reduce premul {label}", x, (np.sum(xs, axis=0) * 2).astype(dt))
    for root in range(w):
        x = kind.make(xs[r])
        dist.broadcast(x, src=root)
        s.eq(f"broadcast root {root} {label}", x, xs[root])
        x = kind.make(xs[r])
        op, oracle = (dist.ReduceOp.MIN, np.min) if ordered else (dist.ReduceOp.SUM, np.sum)
        dist.reduce(x, dst=root, op=op)
        s.eq(
            f"reduce root {root} {label}", x, oracle(xs, axis=0).astype(dt) if r == root else xs[r]
        )
        gl = [kind.empty(shape, dt) for _ in range(w)] if r == root else None
        dist.gather(kind.make(xs[r]), gl, dst=root)
        if gl is not None:
            for q in range(w):
                s.eq(f"gather root {root} [{q}] {label}", gl[q], xs[q])
        y = kind.empty(shape, dt)
        chunks = [data(seed + 1, root * 100 + q, shape, dt) for q in range(w)]
        dist.scatter(y, [kind.make(c) for c in chunks] if r == root else None, src=root)
        s.eq(f"scatter root {root} {label}", y, chunks[r])
    outs = [kind.empty(shape, dt) for _ in range(w)]
    dist.all_gather(outs, kind.make(xs[r]))
    for q in range(w):
        s.eq(f"all_gather [{q}] {label}", outs[q], xs[q])
    big = kind.empty((2 * w, 3), dt)
    dist.all_gather_single(big, kind.make(xs[r]))
    s.eq(f"all_gather_single {label}", big, np.concatenate(xs))
    ins = [[data(seed + 2, q * 100 + j, shape, dt) for j in range(w)] for q in range(w)]
    y = kind.empty(shape, dt)
    dist.reduce_scatter(y, [kind.make(v) for v in ins[r]])
    s.eq(f"reduce_scatter {label}", y, np.sum([ins[q][r] for q in range(w)], axis=0).astype(dt))
    y = kind.empty((2, 3), dt)
    dist.reduce_scatter_single(y, kind.make(np.concatenate(ins[r])))
    s.eq(
        f"reduce_scatter_single {label}",
        y,
        np.sum([ins[q][r] for q in range(w)], axis=0).astype(dt),
    )
    outs = [kind.empty(shape, dt) for _ in range(w)]
    dist.all_to_all(outs, [kind.make(v) for v in ins[r]])
    for q in range(w):
        s.eq(f"all_to_all [{q}] {label}", outs[q], ins[q][r])
    y = kind.empty((2 * w, 3), dt)
    dist.all_to_all_single(y, kind.make(np.concatenate(ins[r])))
    s.eq(f"all_to_all_single {label}", y, np.concatenate([ins[q][r] for q in range(w)]))
    rows = [[(q + j) % 3 for j in range(w)] for q in range(w)]  # rows[q][j]: q sends to j
    src = data(seed + 3, r, (sum(rows[r]), 3), dt)
    y = kind.empty((sum(rows[q][r] for q in range(w)), 3), dt)
    dist.all_to_all_single(y, kind.make(src), [rows[q][r] for q in range(w)], rows[r])
    pieces = []
    for q in range(w):
        theirs = data(seed + 3, q, (sum(rows[q]), 3), dt)
        start = sum(rows[q][:r])
        pieces.append(theirs[start : start + rows[q][r]])
    s.eq(f"all_to_all_single uneven {label}", y, np.concatenate(pieces))


def uneven_and_async(s: Suite, dist: Any) -> None:
    r, w = dist.get_rank(), dist.get_world_size()
    # all_gather of different sizes per rank (every rank knows the sizes)
    outs = [np.zeros(q + 1, np.int64) for q in range(w)]
    dist.all_gather(outs, np.full(r + 1, r, np.int64))
    for q in range(w):
        s.eq(f"all_gather uneven [{q}]", outs[q], np.full(q + 1, q, np.int64))
    # all_to_all with different sizes per pair
    ins = [np.full(r + j + 1, 10 * r + j, np.float64) for j in range(w)]
    outs2 = [np.zeros(q + r + 1) for q in range(w)]
    dist.all_to_all(outs2, ins)
    for q in range(w):
        s.eq(f"all_to_all uneven [{q}]", outs2[q], np.full(q + r + 1, 10 * q + r, np.float64))
    # several async operations in flight, then waited in reverse order
    xs = [np.full(4, float(r + k)) for k in range(4)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    y = np.zeros(3)
    works.append(dist.broadcast(y if r else np.arange(3.0), src=0, async_op=True))
    gl = [np.zeros(2) for _ in range(w)]
    works.append(dist.all_gather(gl, np.full(2, float(r)), async_op=True))
    for work in reversed(works):
        s.true("wait returns True", work.wait() is True)
    for k, x in enumerate(xs):
        s.eq(f"async all_reduce {k}", x, np.full(4, float(sum(q + k for q in range(w)))))
    if r:
        s.eq("async broadcast", y, np.arange(3.0))
    for q in range(w):
        s.eq(f"async all_gather [{q}]", gl[q], np.full(2, float(q)))
    work = works[0]
    s.true("is_completed", work.is_completed())
    s.true("is_success", work.is_success())
    s.true("exception", work.exception() is None)
    s.true("result", work.result()[0] is xs[0], work.result())
    fut = dist.all_reduce(np.ones(2), async_op=True).get_future()
    chained = fut.then(lambda f: float(f.value()[0].sum()))
    s.true("future then", chained.wait() == 2.0 * w, chained.wait())
    s.true("async barrier", dist.barrier(async_op=True).wait())
    ins3 = [np.full(j + 1, float(r)) for j in range(w)]
    outs3 = [np.zeros(r + 1) for _ in range(w)]
    work = dist.all_to_all(outs3, ins3, async_op=True)
    right, left = (r + 1) % w, (r - 1) % w
    got = np.zeros(1)
    rreq = dist.irecv(got, src=left, tag=21)  # deferred ...
    sreq = dist.isend(np.array([float(r)]), dst=right, tag=21)
    total = np.ones(1)
    dist.all_reduce(total)  # ... and issued before this collective
    for req in (work, rreq, sreq):
        req.wait()
    for q in range(w):
        s.eq(f"async all_to_all uneven [{q}]", outs3[q], np.full(r + 1, float(q)))
    s.eq("irecv across a collective", got, np.array([float(left)]))
    s.eq("collective after a deferred irecv", total, np.array([float(w)]))
    dist.barrier(timeout=30)


def p2p(s: Suite, dist: Any) -> None:
    r, w = dist.get_rank(), dist.get_world_size()
    right, left = (r + 1) % w, (r - 1) % w
    buf = np.zeros(3)
    req = dist.isend(np.full(3, float(r)), dst=right, tag=3)
    s.true("recv returns the sender", dist.recv(buf, src=left, tag=3) == left)
    req.wait()
    s.eq("ring", buf, np.full(3, float(left)))
    # every rank posts its receive before its send: the receive is deferred
    buf2 = np.zeros(2, np.int32)
    rreq = dist.irecv(buf2, src=left)
    sreq = dist.isend(np.array([r, -r], np.int32), dst=right)
    rreq.wait()
    sreq.wait()
    s.eq("irecv before isend", buf2, np.array([left, -left], np.int32))
    s.true("irecv source_rank", rreq.source_rank() == left)
    buf3 = np.zeros(2)
    ops = [
        dist.P2POp(dist.irecv, buf3, left, tag=9),
        dist.P2POp(dist.isend, np.array([r, 0.5]), right, tag=9),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    s.eq("batch_isend_irecv", buf3, np.array([left, 0.5]))
    if r == 0:
        got = []
        for _ in range(w - 1):
            t = np.zeros(1, np.int64)
            sender = dist.recv(t)
            got.append((sender, int(t[0])))
        s.true("recv from any source", sorted(got) == [(q, q * q) for q in range(1, w)], got)
    else:
        dist.send(np.array([r * r], np.int64), dst=0)
    # a message that does not fit the receiver's tensor: a clear error on the receiver
    if r == 0:
        dist.send(np.arange(3, dtype=np.int64), dst=1, tag=11)
    elif r == 1:
        msg = s.raises(
            "recv dtype mismatch",
            dist.DistBackendError,
            lambda: dist.recv(np.zeros(3, np.float32), src=0, tag=11),
        )
        s.true("mismatch names both dtypes", "int64" in msg and "float32" in msg, msg)
    s.raises("send to self", ValueError, lambda: dist.send(np.zeros(1), dst=r))
    dist.barrier()


def objects(s: Suite, dist: Any) -> None:
    r, w = dist.get_rank(), dist.get_world_size()
    objs: list[Any] = [{"k": [1, 2]}, "text", None] if r == w - 1 else [0, 0, 0]
    dist.broadcast_object_list(objs, src=w - 1)
    s.true("broadcast_object_list", objs == [{"k": [1, 2]}, "text", None], objs)
    gathered: list[Any] = [None] * w
    dist.all_gather_object(gathered, {"rank": r, "pad": "x" * r})
    s.true(
        "all_gather_object", gathered == [{"rank": q, "pad": "x" * q} for q in range(w)], gathered
    )
    gl = [None] * w if r == 0 else None
    dist.gather_object((r, r * r), gl, dst=0)
    if r == 0:
        s.true("gather_object", gl == [(q, q * q) for q in range(w)], gl)
    out: list[Any] = [None]
    dist.scatter_object_list(out, [list(range(q)) for q in range(w)] if r == 1 else None, src=1)
    s.true("scatter_object_list", out == [list(range(r))], out)
    if r == 0:
        dist.send_object_list([{"a": 1}, "b"], dst=w - 1)
    elif r == w - 1:
        got: list[Any] = [None, None]
        s.true("recv_object_list source", dist.recv_object_list(got) == 0)
        s.true("recv_object_list", got == [{"a": 1}, "b"], got)
    dist.barrier()


def groups(s: Suite, dist: Any) -> None:
    r, w = dist.get_rank(), dist.get_world_size()
    evens = list(range(0, w, 2))
    g = dist.new_group(evens)
    if r in evens:
        me = evens.index(r)
        s.true("group rank", dist.get_rank(g) == me and dist.get_world_size(g) == len(evens))
        s.true("get_process_group_ranks", dist.get_process_group_ranks(g) == evens)
        s.true("get_group_rank", dist.get_group_rank(g, evens[-1]) == len(evens) - 1)
        s.true("get_global_rank", dist.get_global_rank(g, 0) == 0)
        x = np.array([float(r)])
        dist.all_reduce(x, group=g)
        s.eq("sub-group all_reduce", x, np.array([float(sum(evens))]))
        y = np.array([float(r)])
        dist.broadcast(y, group=g, group_src=len(evens) - 1)
        s.eq("group_src", y, np.array([float(evens[-1])]))
        z = np.array([1.0])
        dist.reduce(z, group=g, group_dst=0)
        if me == 0:
            s.eq("group_dst", z, np.array([float(len(evens))]))
        s.raises(
            "src and group_src", ValueError, lambda: dist.broadcast(y, src=0, group=g, group_src=0)
        )
        s.raises("src outside the group", ValueError, lambda: dist.broadcast(y, src=1, group=g))
    else:
        s.true("non-member gets NON_GROUP_MEMBER", g == dist.GroupMember.NON_GROUP_MEMBER, g)
        s.true("non-member rank", dist.get_rank(g) == -1 and dist.get_world_size(g) == -1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = dist.all_reduce(np.ones(1), group=g)
            back = dist.recv(np.ones(1), src=0, group=g)
        s.true("non-member all_reduce is a no-op", out is None and back == -1)
        s.true("non-member warns", any("does not belong" in str(c.message) for c in caught))
        s.raises("non-member send", ValueError, lambda: dist.send(np.ones(1), dst=0, group=g))
    cur, subs = dist.new_subgroups(group_size=2) if w % 2 == 0 else dist.new_subgroups(group_size=1)
    size = 2 if w % 2 == 0 else 1
    s.true("new_subgroups", cur.size() == size and len(subs) == w // size, (cur, subs))
    s.true(
        "new_subgroups others",
        sum(x == dist.GroupMember.NON_GROUP_MEMBER for x in subs) == w // size - 1,
    )
    x = np.array([r])
    dist.all_reduce(x, group=cur)
    first = r - r % size
    s.eq("new_subgroups all_reduce", x, np.array([sum(range(first, first + size))]))
    enum = [[q for q in range(w) if q % 2 == 1], [0]]
    cur2, subs2 = dist.new_subgroups_by_enumeration(enum)
    s.true("by_enumeration list", len(subs2) == 2)
    if r == 0 or r % 2 == 1:
        s.true("by_enumeration", cur2 is not None and dist.get_process_group_ranks(cur2) in enum)
    else:
        s.true("by_enumeration outside", cur2 is None)
    split = dist.split_group(split_ranks=[[w - 1 - q for q in range(w)]])  # reversed order
    s.true("split_group order", split is not None and split.rank() == w - 1 - r)
    keep = dist.new_group(list(range(w))[::-1], sort_ranks=False)
    s.true("sort_ranks=False", keep.rank() == w - 1 - r)
    dist.destroy_process_group(keep)
    s.raises("destroyed group", ValueError, lambda: dist.all_reduce(np.ones(1), group=keep))
    dist.barrier()


def monitored(s: Suite, dist: Any) -> None:
    r, w = dist.get_rank(), dist.get_world_size()
    dist.monitored_barrier(timeout=30)
    if r != w - 1:  # the last rank does not come
        msg = s.raises(
            "monitored_barrier", dist.DistError, lambda: dist.monitored_barrier(timeout=1)
        )
        s.true(
            "names the missing rank", f"Rank {w - 1} failed to pass monitoredBarrier" in msg, msg
        )
    dist.barrier()  # the group still works
    if w > 2 and r in (0, 1):  # the last monitored_barrier: no later call to keep aligned
        msg = s.raises(
            "monitored_barrier wait_all_ranks",
            RuntimeError,
            lambda: dist.monitored_barrier(timeout=1, wait_all_ranks=True),
        )
        missing = list(range(2, w))
        if len(missing) == 1:
            want = f"Rank {missing[0]} failed"
        else:
            want = "Ranks " + ", ".join(map(str, missing)) + " failed"
        s.true("names all missing ranks", want in msg, msg)
    dist.barrier()


def argument_errors(s: Suite, dist: Any) -> None:
    r, w = dist.get_rank(), dist.get_world_size()
    s.raises("init twice", ValueError, lambda: dist.init_process_group("gloo"))
    s.raises(
        "float band",
        (RuntimeError, TypeError),
        lambda: dist.all_reduce(np.ones(2), op=dist.ReduceOp.BAND),
    )
    s.raises(
        "complex max",
        ValueError,
        lambda: dist.all_reduce(np.ones(2, np.complex64), op=dist.ReduceOp.MAX),
    )
    s.raises("a list", TypeError, lambda: dist.all_reduce([1.0, 2.0]))
    frozen = np.ones(2)
    frozen.setflags(write=False)
    s.raises("read-only", ValueError, lambda: dist.all_reduce(frozen))
    s.raises(
        "mixed dtypes",
        ValueError,
        lambda: dist.all_gather([np.zeros(1)] * w, np.zeros(1, np.float32)),
    )
    s.raises(
        "list length", ValueError, lambda: dist.all_gather([np.zeros(1)] * (w + 1), np.zeros(1))
    )
    gl = [np.zeros(1)] * w
    if r != 0:
        s.raises("gather_list off dst", ValueError, lambda: dist.gather(np.zeros(1), gl, dst=0))
    else:
        s.raises(
            "gather_list missing on dst", ValueError, lambda: dist.gather(np.zeros(1), None, dst=0)
        )
    s.raises(
        "split sizes",
        ValueError,
        lambda: dist.all_to_all_single(np.zeros(w), np.zeros(w), [w + 1] + [0] * (w - 1)),
    )
    s.raises("no src", ValueError, lambda: dist.broadcast(np.zeros(1)))
    s.raises("rank outside the world", ValueError, lambda: dist.new_group([w]))
    s.true("get_backend", dist.get_backend() == "gloo", dist.get_backend())
    dist.barrier()


def device_mesh(s: Suite, dist: Any) -> None:
    from meshcomm.distributed.device_mesh import init_device_mesh

    r, w = dist.get_rank(), dist.get_world_size()
    shape = (2, w // 2) if w % 2 == 0 else (1, w)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    tp = mesh.get_group("tp")
    x = np.array([float(r)])
    dist.all_reduce(x, group=tp)
    row = mesh.mesh[r // shape[1]]
    s.eq("mesh tp all_reduce", x, np.array([float(row.sum())]))
    s.true("mesh local rank", mesh.get_local_rank("tp") == r % shape[1])
    s.true(
        "mesh slice",
        mesh["dp"].size() == shape[0] and dist.get_world_size(mesh["dp"].get_group()) == shape[0],
    )
    dist.barrier()


def sampler(s: Suite, dist: Any) -> None:
    w = dist.get_world_size()
    samp = dist.DistributedSampler(range(23), seed=5)
    samp.set_epoch(2)
    mine = list(samp)
    everyone: list[Any] = [None] * w
    dist.all_gather_object(everyone, mine)
    flat = sorted(i for part in everyone for i in part)
    s.true("sampler covers the data", set(flat) == set(range(23)) and len(mine) == len(samp), flat)


def ddp(s: Suite, dist: Any) -> None:
    """DDP gradients against the oracle: the average of every rank's local gradient."""
    import torch

    r, w = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(r)  # a different start on every rank: DDP must broadcast rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ddp_model = dist.DistributedDataParallel(model, bucket_cap_mb=0.0001)
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        s.true("DDP broadcast at wrap", torch.equal(p, q))

    def batch(q: int, step: int) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(100 * q + step)
        return torch.randn(5, 4, generator=gen), torch.randn(5, 2, generator=gen)

    def local_grads(q: int, steps: list[int]) -> list[Any]:
        reference.zero_grad()
        for step in steps:
            x, y = batch(q, step)
            torch.nn.functional.mse_loss(reference(x), y).backward()
        return [p.grad.clone() for p in reference.parameters()]

    x, y = batch(r, 0)
    torch.nn.functional.mse_loss(ddp_model(x), y).backward()
    want = [sum(gs) / w for gs in zip(*(local_grads(q, [0]) for q in range(w)), strict=True)]
    for p, g in zip(model.parameters(), want, strict=True):
        s.true("DDP averaged gradient", torch.allclose(p.grad, g, atol=1e-6), (p.grad, g))
    model.zero_grad()
    with ddp_model.no_sync():
        x, y = batch(r, 1)
        torch.nn.functional.mse_loss(ddp_model(x), y).backward()
    local = local_grads(r, [1])
    for p, g in zip(model.parameters(), local, strict=True):
        s.true("no_sync keeps local gradients", torch.allclose(p.grad, g, atol=1e-6))
    x, y = batch(r, 2)
    torch.nn.functional.mse_loss(ddp_model(x), y).backward()
    want = [sum(gs) / w for gs in zip(*(local_grads(q, [1, 2]) for q in range(w)), strict=True)]
    for p, g in zip(model.parameters(), want, strict=True):
        s.true("sync after no_sync", torch.allclose(p.grad, g, atol=1e-5), (p.grad, g))
    dist.barrier()


def suite(group: MeshGroup, use_torch: bool) -> list[str]:
    import meshcomm.distributed as dist

    dist.init_process_group("gloo")  # adopts the world run_ranks made
    s = Suite(dist.get_rank())
    kinds = [Kind("numpy")] + ([Kind("torch"), Kind("torch-strided")] if use_torch else [])
    dtypes: list[Any] = [np.float32, np.int64, BF16, np.complex64, np.uint8]
    for i, kind in enumerate(kinds):
        for j, dt in enumerate(dtypes):
            s.section(
                f"collectives {kind.name} {dt}",
                lambda k=kind, d=dt, n=10 * i + j: collectives(s, dist, k, d, n),
            )
    for name, fn in [
        ("uneven and async", uneven_and_async),
        ("p2p", p2p),
        ("objects", objects),
        ("groups", groups),
        ("monitored_barrier", monitored),
        ("argument errors", argument_errors),
        ("device mesh", device_mesh),
        ("sampler", sampler),
    ]:
        s.section(name, lambda f=fn: f(s, dist))
    if use_torch:
        s.section("ddp", lambda: ddp(s, dist))
    dist.destroy_process_group()
    return s.failures


def check(results: list[list[str]]) -> None:
    failures = [line for per_rank in results for line in per_rank]
    assert not failures, "\n".join(failures[:30])


@pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
def test_world_of_four_numpy_and_torch() -> None:
    check(run_ranks(suite, 4, timeout=TIMEOUT, args=(True,)))


def test_world_of_three_numpy() -> None:
    check(run_ranks(suite, 3, timeout=TIMEOUT, args=(False,)))
