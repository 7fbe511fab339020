"""One script, two implementations: torch.distributed (gloo) or meshcomm.distributed.

``DIST_IMPL=torch`` runs it on torch's own backend (launch with torchrun); ``DIST_IMPL=meshcomm``
on meshcomm's (launch with meshrun). Nothing else differs: the code below only uses names
both modules share. Each rank writes what it saw to ``$DIST_OUT/rank<N>.pkl``:

- ``seeds``: the text printed by the examples of ``shared/seeds/collectives_with_examples.txt``
  (as written, plus fixed versions of the ones whose dtypes disagree);
- ``random``: a seeded sequence of random collectives (ops, dtypes, shapes, roots, groups);
- ``p2p``, ``objects``, ``async``: point to point, object collectives, async handles;
- ``ddp``: parameters after a few DistributedDataParallel steps (several configurations).

tests/test_distributed_torch.py runs both and compares every entry (DDP to float tolerance,
everything else exactly).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import random
import sys
from collections.abc import Callable
from typing import Any

# Set by _import() in main(): importing this file (pytest --doctest-modules does) needs no torch.
torch: Any = None
dist: Any = None
DDP: Any = None

N_RANDOM = int(os.environ.get("DIST_N_RANDOM", "80"))


def canon(value: Any) -> Any:
    """A comparable, picklable form of tensors (nested in lists, tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.is_complex():
            data = torch.view_as_real(t).to(torch.float64).tolist()
        elif t.dtype == torch.bool:
            data = t.tolist()
        else:
            data = t.to(torch.float64).tolist()
        return ("tensor", str(t.dtype), tuple(t.shape), data)
    if isinstance(value, (list, tuple)):
        return type(value)(canon(v) for v in value)
    if isinstance(value, dict):
        return {k: canon(v) for k, v in value.items()}
    return value


# -- the seed examples ----------------------------------------------------------------------
def ex_broadcast() -> None:
    tensor = torch.tensor([0])
    if dist.get_rank() == 0:
        tensor += 1  # Only rank 0 modifies the tensor
    dist.broadcast(tensor, src=0)
    print(f"Rank {dist.get_rank()}: {tensor}")


def ex_all_reduce() -> None:
    tensor = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    print(f"Rank {dist.get_rank()}: {tensor}")


def ex_reduce() -> None:
    tensor = torch.tensor([dist.get_rank() + 1])
    dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
    if dist.get_rank() == 0:
        print(f"Reduced result: {tensor}")


def ex_all_gather() -> None:
    tensor = torch.tensor([dist.get_rank()])
    gather_list = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gather_list, tensor)
    print(f"Rank {dist.get_rank()}: {gather_list}")


def ex_gather() -> None:
    tensor = torch.tensor([dist.get_rank()])
    if dist.get_rank() == 0:
        gather_list = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    else:
        gather_list = None
    dist.gather(tensor, gather_list, dst=0)
    if dist.get_rank() == 0:
        print(f"Gathered result: {gather_list}")


def ex_reduce_scatter() -> None:  # as written: int64 inputs, float32 output
    input = [torch.tensor([dist.get_rank() + 1]) for _ in range(dist.get_world_size())]
    output = torch.empty(1)
    dist.reduce_scatter(output, input, op=dist.ReduceOp.SUM)
    print(f"Rank {dist.get_rank()}: {output}")


def ex_all_to_all() -> None:  # as written: tensors where lists belong
    input = torch.tensor([dist.get_rank()] * dist.get_world_size())
    output = torch.empty(dist.get_world_size(), dtype=torch.int)
    dist.all_to_all(output, input)
    print(f"Rank {dist.get_rank()}: {output}")


def ex_barrier() -> None:
    print(f"Rank {dist.get_rank()} reached barrier.")
    dist.barrier()
    print(f"Rank {dist.get_rank()} passed barrier.")


def ex_send_fixed() -> None:  # the send example with matching dtypes
    tensor = torch.tensor([1.0, 2.0, 3.0])
    if dist.get_rank() == 0:
        dist.send(tensor=tensor, dst=1)
    elif dist.get_rank() == 1:
        recv_tensor = torch.empty(3)
        dist.recv(tensor=recv_tensor, src=0)
        print(recv_tensor)


def ex_scatter_fixed() -> None:
    if dist.get_rank() == 0:
        scatter_list = [torch.tensor([float(i)]) for i in range(dist.get_world_size())]
    else:
        scatter_list = None
    tensor = torch.empty(1)
    dist.scatter(tensor, scatter_list, src=0)
    print(f"Rank {dist.get_rank()}: {tensor}")


def ex_reduce_scatter_fixed() -> None:
    input = [torch.tensor([float(dist.get_rank() + 1)]) for _ in range(dist.get_world_size())]
    output = torch.empty(1)
    dist.reduce_scatter(output, input, op=dist.ReduceOp.SUM)
    print(f"Rank {dist.get_rank()}: {output}")


def ex_all_to_all_fixed() -> None:
    n = dist.get_world_size()
    input = list(torch.tensor([dist.get_rank()] * n, dtype=torch.int).chunk(n))
    output = list(torch.empty(n, dtype=torch.int).chunk(n))
    dist.all_to_all(output, input)
    print(f"Rank {dist.get_rank()}: {output}")


SEEDS: list[Callable[[], None]] = [
    ex_broadcast,
    ex_all_reduce,
    ex_reduce,
    ex_all_gather,
    ex_gather,
    ex_reduce_scatter,
    ex_all_to_all,
    ex_barrier,
    ex_send_fixed,
    ex_scatter_fixed,
    ex_reduce_scatter_fixed,
    ex_all_to_all_fixed,
]


def run_seeds() -> dict[str, str]:
    out = {}
    for fn in SEEDS:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                fn()
            except Exception as exc:  # the examples as written raise; compare the kind
                print(f"raised {type(exc).__name__}")
        out[fn.__name__] = buf.getvalue()
        dist.barrier()
    return out


# -- random collectives --------------------------------------------------------------------
# The dtypes gloo supports (torch dtype names).
DTYPES = [
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "uint8",
    "int32",
    "int64",
    "bool",
    "complex64",
]
KINDS = [
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "all_to_all_single_uneven",
    "gather",
    "scatter",
]
SHAPES = [(1,), (3,), (2, 3), (4, 1, 2)]


def ops_for(dtype: torch.dtype) -> list[Any]:
    R = dist.ReduceOp
    if dtype == torch.bool:
        return [R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR, R.PRODUCT]
    if dtype.is_complex:
        return [R.SUM, R.AVG]
    if dtype.is_floating_point:
        return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def make(seed: int, shape: tuple[int, ...], dtype: torch.dtype, product: bool) -> torch.Tensor:
    rng = random.Random(seed)
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        vals: list[Any] = [rng.random() < 0.5 for _ in range(n)]
    elif product:
        choices = [1, 2] if dtype == torch.uint8 else [-1, 1, 2]
        vals = [rng.choice(choices) for _ in range(n)]
    elif dtype == torch.uint8:
        vals = [rng.randint(0, 8) for _ in range(n)]
    else:
        vals = [rng.randint(-8, 8) for _ in range(n)]
    if dtype.is_complex:
        imag = [rng.randint(-8, 8) for _ in range(n)]
        return torch.complex(
            torch.tensor(vals, dtype=torch.float32), torch.tensor(imag, dtype=torch.float32)
        ).reshape(shape)
    return torch.tensor(vals).to(dtype).reshape(shape)


def run_random(groups: dict[str, Any], members: dict[str, list[int]]) -> list[Any]:
    rank = dist.get_rank()
    rng = random.Random(2024)
    results: list[Any] = []
    for i in range(N_RANDOM):
        kind = rng.choice(KINDS)
        name = rng.choice(sorted(groups))
        dtype = getattr(torch, rng.choice(DTYPES))
        shape = rng.choice(SHAPES)
        op = rng.choice(ops_for(dtype))
        ranks = members[name]
        root = rng.choice(ranks)
        use_group_rank = name != "world" and rng.random() < 0.5
        size = len(ranks)
        splits = [[rng.randint(0, 3) for _ in range(size)] for _ in range(size)]
        if rank not in ranks:
            continue
        g = groups[name]
        me = ranks.index(rank)
        root_kw = {"group_src": ranks.index(root)} if use_group_rank else {"src": root}
        dst_kw = {"group_dst": ranks.index(root)} if use_group_rank else {"dst": root}
        if kind in ("reduce", "gather"):
            root_kw = dst_kw
        product = op == dist.ReduceOp.PRODUCT
        x = make(1000 * i + rank, shape, dtype, product)
        if kind == "all_reduce":
            dist.all_reduce(x, op=op, group=g)
            out: Any = x
        elif kind == "reduce":
            dist.reduce(x, op=op, group=g, **root_kw)
            out = x if rank == root else None
        elif kind == "broadcast":
            dist.broadcast(x, group=g, **root_kw)
            out = x
        elif kind == "all_gather":
            outs = [torch.zeros_like(x) for _ in range(size)]
            dist.all_gather(outs, x, group=g)
            out = outs
        elif kind == "all_gather_single":
            y = torch.zeros((size * x.shape[0], *x.shape[1:]), dtype=dtype)
            dist.all_gather_single(y, x, group=g)
            out = y
        elif kind == "reduce_scatter":
            ins = [make(1000 * i + 100 * rank + j, shape, dtype, product) for j in range(size)]
            dist.reduce_scatter(x, ins, op=op, group=g)
            out = x
        elif kind == "reduce_scatter_single":
            big = make(1000 * i + 7 * rank, (size * shape[0], *shape[1:]), dtype, product)
            dist.reduce_scatter_single(x, big, op=op, group=g)
            out = x
        elif kind == "all_to_all":
            ins = [make(1000 * i + 100 * rank + j, shape, dtype, False) for j in range(size)]
            outs = [torch.zeros_like(x) for _ in range(size)]
            dist.all_to_all(outs, ins, group=g)
            out = outs
        elif kind == "all_to_all_single":
            big = make(1000 * i + 7 * rank, (size * shape[0], *shape[1:]), dtype, False)
            y = torch.zeros_like(big)
            dist.all_to_all_single(y, big, group=g)
            out = y
        elif kind == "all_to_all_single_uneven":
            send_rows = splits[me]
            recv_rows = [splits[j][me] for j in range(size)]
            big = make(1000 * i + 7 * rank, (sum(send_rows), 2), dtype, False)
            y = torch.zeros((sum(recv_rows), 2), dtype=dtype)
            dist.all_to_all_single(y, big, recv_rows, send_rows, group=g)
            out = y
        elif kind == "gather":
            gl = [torch.zeros_like(x) for _ in range(size)] if rank == root else None
            dist.gather(x, gl, group=g, **root_kw)
            out = gl
        else:  # scatter
            sl = [make(1000 * i + 100 * rank + j, shape, dtype, False) for j in range(size)]
            y = torch.zeros_like(x)
            dist.scatter(y, sl if rank == root else None, group=g, **root_kw)
            out = y
        results.append((i, kind, name, str(dtype), str(op), canon(out)))
    return results


# -- point to point, objects, async ----------------------------------------------------------
def run_p2p(groups: dict[str, Any], members: dict[str, list[int]]) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    out: dict[str, Any] = {}
    # isend then a blocking recv (the tutorial's ring step)
    buf = torch.zeros(3)
    req = dist.isend(torch.full((3,), float(rank)), dst=right, tag=5)
    src = dist.recv(buf, src=left, tag=5)
    req.wait()
    out["ring"] = (src, canon(buf))
    # irecv posted before isend on every rank
    buf2 = torch.zeros(2, dtype=torch.int64)
    rreq = dist.irecv(buf2, src=left)
    sreq = dist.isend(torch.tensor([rank, 10 * rank]), dst=right)
    rreq.wait()
    sreq.wait()
    out["irecv_first"] = canon(buf2)
    # batch_isend_irecv, receives listed first
    buf3 = torch.zeros(2, dtype=torch.float64)
    ops = [
        dist.P2POp(dist.irecv, buf3, left),
        dist.P2POp(dist.isend, torch.tensor([rank + 0.5, -rank], dtype=torch.float64), right),
    ]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    out["batch"] = canon(buf3)
    # receive from any source
    if rank == 0:
        got = []
        for _ in range(world - 1):
            t = torch.zeros(1, dtype=torch.int32)
            s = dist.recv(t)
            got.append((s, int(t.item())))
        out["any"] = sorted(got)
    else:
        dist.send(torch.tensor([rank * rank], dtype=torch.int32), dst=0)
    # group ranks in a sub-group
    name = "tail"
    if rank in members[name]:
        g = groups[name]
        me, n = members[name].index(rank), len(members[name])
        t = torch.zeros(1)
        ops = [
            dist.P2POp(dist.isend, torch.tensor([float(rank)]), group=g, group_peer=(me + 1) % n),
            dist.P2POp(dist.irecv, t, group=g, group_peer=(me - 1) % n),
        ]
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        out["group_peer"] = canon(t)
    dist.barrier()
    return out


def run_objects() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    objs = [{"a": 1, "rank": rank}, [1, 2, rank], "x" * rank] if rank == 1 else [None] * 3
    dist.broadcast_object_list(objs, src=1)
    out["broadcast"] = objs
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, ("r", rank, list(range(rank))))
    out["all_gather"] = gathered
    gl = [None] * world if rank == 2 else None
    dist.gather_object({"from": rank}, gl, dst=2)
    out["gather"] = gl
    sl = [[i] * (i + 1) for i in range(world)] if rank == 3 % world else None
    so: list[Any] = [None]
    dist.scatter_object_list(so, sl, src=3 % world)
    out["scatter"] = so
    if rank == 0:
        dist.send_object_list(["hello", {"n": 3}], dst=1)
    elif rank == 1:
        got: list[Any] = [None, None]
        src = dist.recv_object_list(got, src=0)
        out["p2p"] = (src, got)
    dist.barrier()
    return out


def run_async(groups: dict[str, Any]) -> dict[str, Any]:
    rank = dist.get_rank()
    xs = [torch.full((4,), float(rank + k)) for k in range(3)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    y = torch.zeros(4)
    works.append(dist.broadcast(y if rank else torch.arange(4.0), src=0, async_op=True))
    for w in works:
        w.wait()
    res = works[0].result()
    done = [w.is_completed() for w in works]
    fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()
    value = fut.wait()
    return {
        "values": canon(xs),
        "bcast": canon(y if rank else None),
        "completed": done,
        "result": canon(res),
        "future": canon(value),
    }


# -- DistributedDataParallel ------------------------------------------------------------------
def train(model_fn: Callable[[], torch.nn.Module], steps: int, **ddp_kw: Any) -> Any:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = model_fn()
    if rank:  # a different start everywhere but rank 0: DDP must broadcast rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)
    ddp = DDP(model, **ddp_kw)
    gen = torch.Generator().manual_seed(100 + rank)
    loss_fn = torch.nn.MSELoss()
    for step in range(steps):
        model.zero_grad()
        x = torch.randn(8, 10, generator=gen)
        y = torch.randn(8, model_out(model), generator=gen)
        if step % 2 == 1:
            with ddp.no_sync():
                loss_fn(ddp(x), y).backward()
            x = torch.randn(8, 10, generator=gen)
        loss_fn(ddp(x), y).backward()
        with torch.no_grad():  # plain SGD (torch.optim would import torch._dynamo: seconds)
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(0.01 * p.grad)
    return [canon(p) for p in model.parameters()]


def model_out(model: torch.nn.Module) -> int:
    return 10 if isinstance(model, torch.nn.Linear) else 8


def run_ddp() -> dict[str, Any]:
    class TwoHeads(torch.nn.Module):
        """A module whose forward uses one head or the other (unused parameters)."""

        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(10, 16)
            self.a = torch.nn.Linear(16, 8)
            self.b = torch.nn.Linear(16, 8)

        def forward(self, x: Any) -> Any:
            h = torch.relu(self.body(x))
            return self.a(h) if dist.get_rank() % 2 == 0 else self.b(h)

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))

    return {
        "tutorial": train(lambda: torch.nn.Linear(10, 10), 3),
        "buckets": train(mlp, 4, bucket_cap_mb=0.001),
        "bucket_view": train(mlp, 2, gradient_as_bucket_view=True),
        "unused": train(TwoHeads, 3, find_unused_parameters=True),
    }


def _import() -> None:
    global torch, dist, DDP
    import torch

    if os.environ.get("DIST_IMPL") == "torch":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
    else:
        import meshcomm.distributed as dist
        from meshcomm.distributed import DistributedDataParallel as DDP


def main() -> None:
    _import()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups: dict[str, Any] = {"world": None}
    members: dict[str, list[int]] = {"world": list(range(world))}
    for name, ranks in (("even", list(range(0, world, 2))), ("tail", list(range(1, world)))):
        groups[name] = dist.new_group(ranks)
        members[name] = ranks
    out = {
        "seeds": run_seeds(),
        "random": run_random(groups, members),
        "p2p": run_p2p(groups, members),
        "objects": run_objects(),
        "async": run_async(groups),
        "ddp": run_ddp(),
        "sizes": [dist.get_world_size(g) for g in groups.values()],
        "ranks": [dist.get_rank(g) for g in groups.values()],
    }
    path = os.path.join(os.environ["DIST_OUT"], f"rank{rank}.pkl")
    with open(path, "wb") as f:
        pickle.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
