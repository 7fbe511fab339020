"""``meshcomm.ops`` inside ``torch.compile``: torch operators, no graph breaks, eager's numbers.

- The tensor-parallel block of tests/test_autodiff.py (every differentiable op) compiled
  with ``fullgraph=True`` gives eager's loss and gradients (float64, 1e-12) at worlds 2
  and 4, static and ``dynamic=True`` shapes, with 0 graph breaks (``torch._dynamo.explain``).
- A tensor-parallel MLP trained 3 steps with a compiled loss and a compiled optimizer step
  follows eager's parameters.
- ``async_op=True`` traces to a ``start`` and a ``wait`` node with the compute between them.
- The failure of the first report: the block compiled without ``fullgraph`` and explained,
  then eager collectives on the same group; and a bad call raises at trace time and leaves
  the group working.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("jax") is None,
    reason="needs torch (make test installs it)",
)

TOL = 1e-12


def _close(label: str, got: Any, want: Any, problems: list[str]) -> None:
    import torch

    if got.shape != want.shape or not torch.allclose(got, want, rtol=0, atol=TOL):
        problems.append(f"{label}: {got} != {want}")


# -- the block of tests/test_autodiff.py, compiled ------------------------------------------------
def block_rank(group: Any, dp: int, tp: int) -> list[str]:
    import torch
    from test_autodiff import block, meshcomm_collectives, shards

    from meshcomm.mesh import init_device_mesh

    mesh = init_device_mesh((dp, tp), ("dp", "tp"))
    c = meshcomm_collectives(torch.tanh)
    problems: list[str] = []

    def fn(x: Any, w1: Any, w2: Any) -> Any:
        return block(c, x, w1, w2, tp)

    def run(f: Any) -> list[Any]:
        leaves = [torch.tensor(a, requires_grad=True) for a in shards(dp, tp, group.rank)]
        loss = f(*leaves)
        loss.backward()
        return [loss.detach(), *(t.grad for t in leaves)]

    with mesh:
        want = run(fn)
        for label, compiled in (
            ("static", torch.compile(fn, fullgraph=True)),
            ("dynamic", torch.compile(fn, fullgraph=True, dynamic=True)),
        ):
            for name, g, w in zip(("loss", "x", "w1", "w2"), run(compiled), want, strict=True):
                _close(f"{label} {name} rank {group.rank}", g, w, problems)
        leaves = [torch.tensor(a, requires_grad=True) for a in shards(dp, tp, group.rank)]
        explained = torch._dynamo.explain(fn)(*leaves)
        if explained.graph_break_count:
            problems.append(f"graph breaks: {explained.break_reasons}")
    return problems


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("dp", "tp"), [(1, 2), (2, 2)], ids=["1x2", "2x2"])
def test_compiled_block_gives_eager_loss_and_gradients(dp: int, tp: int) -> None:
    from meshcomm.testing import run_ranks

    per_rank = run_ranks(block_rank, dp * tp, args=(dp, tp), timeout=360)
    problems = [p for rank in per_rank for p in rank]
    assert not problems, "\n".join(problems[:10])


# -- a compiled training step ---------------------------------------------------------------------
def training_rank(group: Any) -> list[str]:
    import torch

    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    mesh = init_device_mesh((1, group.size), ("dp", "tp"))
    rng = np.random.default_rng(7)
    x = torch.tensor(rng.standard_normal((8, 4)))
    y = torch.tensor(rng.standard_normal((8, 4)))
    start = [rng.standard_normal((4, 3)) * 0.5, rng.standard_normal((3, 4)) * 0.5]

    def loss_fn(w1: Any, w2: Any) -> Any:
        xv = ops.pcast(x, "tp", to="varying")
        out = ops.psum(torch.tanh(xv @ w1) @ w2, "tp")
        return ((out - y) ** 2).mean()

    def train(compiled: bool) -> list[Any]:
        params = [torch.tensor(a + group.rank, requires_grad=True) for a in start]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        loss = torch.compile(loss_fn, fullgraph=True) if compiled else loss_fn
        step = torch.compile(opt.step) if compiled else opt.step
        for _ in range(3):
            opt.zero_grad()
            loss(*params).backward()
            step()
        return [p.detach() for p in params]

    problems: list[str] = []
    with mesh:
        for i, (g, w) in enumerate(zip(train(True), train(False), strict=True)):
            _close(f"param {i} rank {group.rank}", g, w, problems)
    return problems


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_compiled_training_step_follows_eager() -> None:
    from meshcomm.testing import run_ranks

    problems = [p for rank in run_ranks(training_rank, 2, timeout=240) for p in rank]
    assert not problems, "\n".join(problems)


# -- every op alone, compiled ---------------------------------------------------------------------
def ops_rank(group: Any) -> list[str]:
    import torch

    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    mesh = init_device_mesh((group.size,), ("tp",))
    n, r = group.size, group.rank
    x = torch.arange(6.0 * n, dtype=torch.float64).reshape(2 * n, 3) + 10 * r
    cases = {
        "psum": lambda t: ops.psum(t, "tp"),
        "pmean": lambda t: ops.pmean(t, "tp"),
        "pmax": lambda t: ops.pmax(t, "tp"),
        "pmin": lambda t: ops.pmin(t, "tp"),
        "pprod": lambda t: ops.pprod(t, "tp"),
        "premul": lambda t: ops.all_reduce(t, "tp", "premul_sum", factor=0.5),
        "bxor": lambda t: ops.all_reduce(t.to(torch.int64), "tp", "bxor"),
        "psum bool": lambda t: ops.psum(t > 12, "tp"),
        "pmean int": lambda t: ops.pmean(t.to(torch.int32), "tp"),
        "gather": lambda t: ops.all_gather(t, "tp", axis=1),
        "gather tiled": lambda t: ops.all_gather(t, "tp", axis=-1, tiled=True),
        "scatter": lambda t: ops.psum_scatter(t, "tp", scatter_dimension=0, tiled=True),
        "all_to_all": lambda t: ops.all_to_all(t, "tp", 0, 1, tiled=True),
        "ppermute": lambda t: ops.ppermute(t, "tp", [(i, (i + 1) % n) for i in range(n)]),
        "pshuffle": lambda t: ops.pshuffle(t, "tp", list(reversed(range(n)))),
        "pbroadcast": lambda t: ops.pbroadcast(t, "tp", n - 1),
        "tree": lambda t: ops.psum({"a": t, "b": [t.to(torch.float32), t[0]]}, "tp"),
        "mesh=": lambda t: ops.psum(t, "tp", mesh=mesh),
    }
    problems: list[str] = []
    with mesh:
        for name, fn in cases.items():
            want = fn(x)
            got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
            for g, w in zip(
                torch.utils._pytree.tree_leaves(got),
                torch.utils._pytree.tree_leaves(want),
                strict=True,
            ):
                if g.dtype != w.dtype or not torch.equal(g, w):
                    problems.append(f"{name} rank {r}: {g} != {w}")
    return problems


@pytest.mark.timeout(300)
def test_every_op_compiled_equals_eager() -> None:
    from meshcomm.testing import run_ranks

    problems = [p for rank in run_ranks(ops_rank, 3, timeout=240) for p in rank]
    assert not problems, "\n".join(problems[:10])


# -- async: start and wait ------------------------------------------------------------------------
def async_rank(group: Any) -> list[str]:
    import torch

    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    mesh = init_device_mesh((group.size,), ("tp",))
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs: list[Any] = []

    def forward_graph(gm: Any, inputs: Any) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    capture = aot_autograd(fw_compiler=forward_graph)

    def overlapped(x: Any, w: Any) -> Any:
        work = ops.psum({"x": x}, "tp", async_op=True)
        local = torch.tanh(w @ w)  # independent of the collective
        return work.wait()["x"] * 2 + local.sum()

    x = torch.full((3,), float(group.rank + 1))
    w = torch.eye(2)
    problems: list[str] = []
    with mesh:
        want = ops.psum(x, "tp") * 2 + torch.tanh(w @ w).sum()
        for backend in (capture, "inductor"):
            got = torch.compile(overlapped, fullgraph=True, backend=backend)(x, w)
            if not torch.allclose(got, want):
                problems.append(f"{backend}: {got} != {want}")
        order = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
        start, wait = order.index("meshcomm.start.default"), order.index("meshcomm.wait.default")
        if "aten.tanh.default" not in order[start:wait]:
            problems.append(f"compute is not between start and wait: {order}")
        grad = torch.ones(2, requires_grad=True)
        try:
            torch.compile(lambda t: ops.psum(t, "tp", async_op=True).wait())(grad)
            problems.append("async with grad did not raise")
        except Exception as exc:  # torch wraps it as it passes the compiler
            if "async_op=True with inputs that need gradients" not in str(exc):
                problems.append(f"async with grad: {exc}")
    return problems


@pytest.mark.timeout(300)
def test_async_op_traces_to_start_and_wait_with_compute_between() -> None:
    from meshcomm.testing import run_ranks

    problems = [p for rank in run_ranks(async_rank, 2, timeout=240) for p in rank]
    assert not problems, "\n".join(problems)


# -- the first report: no poisoning ---------------------------------------------------------------
def _chain(exc: BaseException | None) -> str:
    """The messages of ``exc`` and of every exception it arose from."""
    seen = []
    while exc is not None and len(seen) < 10:
        seen.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return " <- ".join(seen)


def report_rank(group: Any) -> list[str]:
    import torch

    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    mesh = init_device_mesh((group.size,), ("tp",))
    problems: list[str] = []

    def tp_block(x: Any, w: Any) -> Any:
        xv = ops.pcast(x, "tp", to="varying")
        return ops.psum(torch.relu(xv @ w), "tp").sum()

    def bad(x: Any) -> Any:
        return ops.psum_scatter(x, "tp", tiled=True)  # 5 rows do not split over the axis

    x, w = torch.ones(2, 3), torch.ones(3, 4, requires_grad=True)
    with mesh:
        torch.compile(tp_block)(x, w).backward()  # the report: graph-breaks, then poisons
        explained = torch._dynamo.explain(tp_block)(x, w)
        if explained.graph_break_count:
            problems.append(f"graph breaks: {explained.break_reasons}")
        try:
            torch.compile(bad, fullgraph=True)(torch.ones(5, 2))
            problems.append("an indivisible psum_scatter compiled")
        except Exception as exc:  # Dynamo's own error, ours in its chain
            if "must be divisible by the axis size" not in _chain(exc):
                problems.append(f"indivisible psum_scatter: {_chain(exc)}")
        try:
            torch.compile(bad)(torch.ones(5, 2))
            problems.append("an indivisible psum_scatter ran")
        except Exception as exc:
            if "must be divisible by the axis size" not in _chain(exc):
                problems.append(f"indivisible psum_scatter: {_chain(exc)}")
        out = ops.psum(np.full(2, group.rank), "tp")  # eager, same group: still works
        if out.tolist() != [sum(range(group.size))] * 2:
            problems.append(f"eager psum after compiling: {out}")
    return problems


@pytest.mark.timeout(300)
def test_compiling_the_reported_block_leaves_the_group_working() -> None:
    from meshcomm.testing import run_ranks

    problems = [p for rank in run_ranks(report_rank, 2, timeout=240) for p in rank]
    assert not problems, "\n".join(problems)


# -- CUDA tensors (a GPU machine only) ------------------------------------------------------------
def _cuda() -> bool:
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["tcp", "cpu:tcp,cuda:nccl"])
def test_compiled_block_on_cuda_tensors(backend: str) -> None:
    import torch

    if not _cuda():
        pytest.skip("needs an NVIDIA GPU, torch with CUDA and cupy")
    import meshcomm
    from meshcomm import ops

    meshcomm.init(world_size=1, rank=0, backend=backend)
    try:
        mesh = meshcomm.init_device_mesh((1, 1), mesh_dim_names=("dp", "tp"))

        def f(x: Any, w: Any) -> Any:
            xv = ops.pcast(x, "tp", to="varying")
            g = ops.all_gather(ops.psum(torch.tanh(xv @ w), "tp"), "tp", axis=0, tiled=True)
            return ops.pmean((ops.psum_scatter(g, "tp", tiled=True) ** 2).sum(), ("dp", "tp"))

        x = torch.randn(8, 4, dtype=torch.float64, device="cuda")
        w = torch.randn(4, 5, dtype=torch.float64, device="cuda", requires_grad=True)
        with mesh:
            f(x, w).backward()
            want = w.grad.clone()
            w.grad = None
            torch.compile(f, fullgraph=True)(x, w).backward()
            assert w.grad.device.type == "cuda" and torch.allclose(w.grad, want, rtol=0, atol=TOL)
            work = torch.compile(lambda t: ops.psum(t, "tp", async_op=True).wait())
            assert torch.equal(work(x), x)
    finally:
        meshcomm.shutdown()
        torch._dynamo.reset()


# -- other tracers --------------------------------------------------------------------------------
def test_make_fx_and_export_record_the_operators() -> None:
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from meshcomm import ops, world
    from meshcomm.mesh import init_device_mesh

    def f(x: Any) -> Any:
        return ops.all_gather(ops.psum(x, "tp") * 2, "tp", tiled=True)

    class Block(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return f(x)

    try:
        with init_device_mesh((1,), ("tp",)):
            graphs = [make_fx(f)(torch.ones(3)), torch.export.export(Block(), (torch.ones(3),))]
            for traced in graphs:
                called = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
                assert "meshcomm.psum.default" in called, called
                assert "meshcomm.all_gather.default" in called, called
            assert torch.equal(graphs[0](torch.ones(3)), torch.full((3,), 2.0))
            assert torch.equal(graphs[1].module()(torch.ones(3)), torch.full((3,), 2.0))
    finally:
        world.shutdown()
