"""Process groups with a device backend: cupy arrays over NCCL, numpy arrays over tcp.

Without a GPU (CI): the backend names ``init`` takes, and the errors where cupy or a GPU is
missing. With a GPU and cupy (a lent machine, through the device tool):

    python -m pytest tests/test_nccl_groups.py -v

runs a world of one with ``backend="cpu:tcp,cuda:nccl"`` (NCCL refuses two ranks on one
GPU): every collective of the group and of ``meshcomm.ops`` on cupy arrays and torch CUDA
tensors against numpy, results of the caller's kind on its device, the stream contract,
async calls, mesh axes (NCCL communicators per axis), the TypeError for what NCCL lacks,
and host arrays still over tcp. The multi-rank layouts are tested on CI with numpy
(tests/test_device_lower.py).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
from test_nccl import GPU_SKIP

from meshcomm.backends.spec import canonical, parse_backend
from meshcomm.errors import InvalidArgument
from meshcomm.testing import run_ranks

needs_gpu = pytest.mark.skipif(bool(GPU_SKIP), reason=GPU_SKIP or "ok")
PAIR = "cpu:tcp,cuda:nccl"


# == without a GPU ==========================================================================
@pytest.mark.parametrize(
    ("spec", "pair"),
    [("tcp", ("tcp", None)), ("MPI", ("mpi", None)), ("nccl", ("tcp", "nccl")),
     ("cpu:tcp,cuda:nccl", ("tcp", "nccl")), ("cuda:nccl, cpu:tcp", ("tcp", "nccl")),
     ("cuda:nccl", ("tcp", "nccl")), ("cpu:mpi", ("mpi", None))],
)  # fmt: skip
def test_backend_names_and_pairs(spec: str, pair: tuple[str, str | None]) -> None:
    assert parse_backend(spec) == pair
    assert canonical(spec) == (pair[0] if pair[1] is None else f"cpu:{pair[0]},cuda:{pair[1]}")


@pytest.mark.parametrize(
    ("spec", "words"),
    [("gloo", "unknown backend 'gloo'"), ("cpu:nccl", "cpu arrays go over one of tcp"),
     ("cuda:tcp", "cuda arrays go over one of nccl"), ("cpu:tcp,cpu:mpi", "once each"),
     ("tpu:tcp", "once each")],
)  # fmt: skip
def test_bad_backend_names_say_what_is_known(spec: str, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        parse_backend(spec)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_init_with_nccl_without_cupy_names_the_extra() -> None:
    import meshcomm

    with pytest.raises(ImportError, match=r"pip install 'meshcomm\[cuda12\]'"):
        meshcomm.init(backend="cpu:tcp,cuda:nccl", world_size=1, rank=0)
    assert not meshcomm.is_initialized()


def test_compat_nccl_without_a_gpu_stages_cuda_tensors_over_tcp() -> None:
    from meshcomm.distributed._backend import meshcomm_backend

    expected = PAIR if not GPU_SKIP else "tcp"
    assert meshcomm_backend("nccl") == expected
    assert meshcomm_backend("cpu:gloo,cuda:nccl") == expected
    assert meshcomm_backend("cpu:mpi,cuda:nccl") == "mpi"


@pytest.mark.parametrize(
    ("world", "local", "gpus", "paired"),
    [(1, None, 1, True), (1, None, 0, False), (4, 4, 4, True), (4, 4, 2, False),
     (8, 2, 2, True), (2, None, 8, False), (2, 2, None, False)],
    ids=["alone", "no GPU", "one each", "shared", "two hosts", "local unknown", "cuda error"],
)  # fmt: skip
def test_the_default_pairs_nccl_only_with_a_gpu_per_local_rank(
    world: int, local: int | None, gpus: int | None, paired: bool
) -> None:
    from meshcomm.backends.spec import gpu_per_local_rank

    def count() -> int:
        if gpus is None:
            raise RuntimeError("cudaErrorNoDevice")
        return gpus

    assert gpu_per_local_rank(world, local, gpu_count=count) is paired


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_the_default_counts_no_gpu_without_cupy() -> None:
    from meshcomm.backends.spec import _cupy_gpu_count

    assert _cupy_gpu_count() == 0  # the pair is never the default then, and init works


def test_init_without_a_name_stays_on_host_backends_without_a_gpu() -> None:
    import os

    import meshcomm

    if os.path.exists("/dev/nvidiactl") and importlib.util.find_spec("cupy") is not None:
        pytest.skip("this host has a GPU driver and cupy: the default may pair with nccl")
    group = meshcomm.init(world_size=1, rank=0)
    try:
        assert group.backend == "self" and group.device_backend is None
    finally:
        meshcomm.shutdown()


# == on a GPU ===============================================================================
def _compare(problems: list[str], what: str, host: np.ndarray, expected: np.ndarray) -> None:
    """Add to ``problems`` where ``host`` (a result copied back) differs from ``expected``."""
    if host.shape != expected.shape or host.dtype != expected.dtype:
        problems.append(f"{what}: {host.dtype}{host.shape} != {expected.dtype}{expected.shape}")
    elif not np.array_equal(host, expected):
        problems.append(f"{what}: values differ")


def _on_nccl(group: Any) -> list[str]:
    import cupy as cp

    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    problems: list[str] = []
    n = group.size

    def same(what: str, got: Any, expected: Any) -> None:
        if expected is None:
            if got is not None:
                problems.append(f"{what}: expected None, got {type(got).__name__}")
            return
        if not isinstance(got, cp.ndarray):
            problems.append(f"{what}: a cupy input gave a {type(got).__name__}")
            return
        _compare(problems, what, cp.asnumpy(got), expected)

    if group.backend not in (PAIR, "cpu:self,cuda:nccl"):  # a world of one: "self"
        problems.append(f"group.backend is {group.backend!r}")
    for name in ("float32", "float64", "float16", "int8", "uint8", "int32", "int64", "uint64",
                 "bool", "complex64"):  # fmt: skip
        x = (np.arange(n * 6).reshape(n, 2, 3) % 5).astype(name)
        d = cp.asarray(x)
        ops_here = ["sum"] if name.startswith("complex") else ["sum", "max", "min"]
        for op in ops_here:
            same(f"all_reduce {name} {op}", group.all_reduce(d, op), group.all_reduce(x, op))
            same(
                f"reduce_scatter {name} {op}",
                group.reduce_scatter(d, op),
                group.reduce_scatter(x, op),
            )
            same(f"reduce {name} {op}", group.reduce(d, 0, op), group.reduce(x, 0, op))
        if name.startswith("float"):
            same(f"avg {name}", group.all_reduce(d, "avg"), group.all_reduce(x, "avg"))
            same(
                f"premul_sum {name}",
                group.all_reduce(d, "premul_sum", factor=2.0),
                group.all_reduce(x, "premul_sum", factor=2.0),
            )
        for axis in (0, 1, 3):
            same(f"all_gather {name} {axis}", group.all_gather(d, axis), group.all_gather(x, axis))
        same(f"all_to_all {name}", group.all_to_all(d, 0, 2), group.all_to_all(x, 0, 2))
        same(f"broadcast {name}", group.broadcast(d, 0), group.broadcast(x, 0))
        same(f"gather {name}", group.gather(d, 0), group.gather(x, 0))
        same(f"scatter {name}", group.scatter(d, 0), group.scatter(x, 0))
        perm = [(r, (r + 1) % n) for r in range(n)]
        same(f"permute {name}", group.permute(d, perm), group.permute(x, perm))
        strided = d[:, ::-1, ::2]
        same(
            f"all_reduce strided {name}",
            group.all_reduce(strided),
            group.all_reduce(cp.asnumpy(strided)),
        )
    scalar = np.float32(2.5)
    same("all_reduce 0-d", group.all_reduce(cp.asarray(scalar)), group.all_reduce(scalar))
    same("all_gather 0-d", group.all_gather(cp.asarray(scalar)), group.all_gather(scalar))
    # What NCCL lacks is a TypeError before any call; host arrays are unaffected.
    for name, op in (("int16", "sum"), ("int32", "bxor"), ("complex64", "max")):
        try:
            group.all_reduce(cp.ones(4, dtype=name), op)
            problems.append(f"{name} {op}: no error")
        except TypeError as exc:
            if "NCCL" not in str(exc) and "not defined" not in str(exc):
                problems.append(f"{name} {op}: {exc}")
    host = group.all_reduce(np.ones(3, np.int16))
    if type(host) is not np.ndarray:
        problems.append(f"numpy input gave {type(host).__name__}")
    # The stream contract: the result is used on the caller's stream with no host sync.
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.full(1 << 22, 2.0, dtype=cp.float32)
        y = group.all_reduce(x)
        total = float((y * 3).sum())
    if total != 6.0 * n * (1 << 22):
        problems.append(f"stream contract: {total}")
    work = group.all_gather(cp.arange(4), async_op=True)
    same("async all_gather", work.wait(), np.stack([np.arange(4)] * n))
    cp.cuda.get_current_stream().synchronize()
    if not work.is_completed():  # is_completed asks the GPU (an event), as torch's NCCL work
        problems.append("an async device call is not completed after a synchronize")
    # Mesh axes: each axis group gets an NCCL communicator of its own.
    with init_device_mesh((n, 1), ("dp", "tp")):
        x = cp.arange(6, dtype=cp.float32).reshape(2, 3)
        same("ops.psum tp", ops.psum(x, "tp"), np.arange(6, dtype=np.float32).reshape(2, 3))
        same("ops.psum dp", ops.psum(x, "dp"), n * np.arange(6, dtype=np.float32).reshape(2, 3))
        same("ops.all_gather dp", ops.all_gather(x, "dp"), np.stack([cp.asnumpy(x)] * n))
    return problems


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("native", ["0", "1"])
def test_a_group_runs_cupy_arrays_over_nccl(native: str) -> None:
    env = {"MESHCOMM_NCCL_NATIVE": native}
    for problems in run_ranks(_on_nccl, 1, backend=PAIR, timeout=240, env=env):
        assert problems == [], "\n".join(problems[:30])


def _split_on_nccl(group: Any) -> list[str]:
    """With the native binding, a group's split makes the group's NCCL communicator if it
    was not made yet, then splits it with ``ncclCommSplit`` (a mesh's axes this way)."""
    import cupy as cp

    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    problems: list[str] = []
    x = cp.arange(6, dtype=cp.float32)
    child = group.split(0)  # before any device call on the group
    for who, made in (("the group", group._device._nccl), ("the split", child._device._nccl)):
        if type(made).__name__ != "NativeComm":
            problems.append(f"{who}'s NCCL communicator is {type(made).__name__}")
    got = cp.asnumpy(child.all_reduce(x))
    if not np.array_equal(got, np.arange(6, dtype=np.float32) * group.size):
        problems.append(f"all_reduce on the split group gave {got}")
    again = group.split(0)  # from the live communicator
    if type(again._device._nccl).__name__ != "NativeComm":
        problems.append("a second split was not ncclCommSplit")
    if group.split(None) is not None:
        problems.append("split(None) gave a group")
    with init_device_mesh((group.size, 1), ("dp", "tp")):
        y = cp.asnumpy(ops.psum(x, "dp"))
        if not np.array_equal(y, np.arange(6, dtype=np.float32) * group.size):
            problems.append(f"ops.psum over a split mesh axis gave {y}")
    return problems


@needs_gpu
@pytest.mark.gpu
def test_a_native_split_of_a_live_group_is_nccls_split() -> None:
    env = {"MESHCOMM_NCCL_NATIVE": "1"}
    for problems in run_ranks(_split_on_nccl, 1, backend=PAIR, timeout=120, env=env):
        assert problems == [], "\n".join(problems)


def _torch_on_nccl(group: Any) -> list[str]:
    import torch

    import meshcomm.distributed as dist
    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    problems: list[str] = []
    with init_device_mesh((group.size,), ("tp",)):
        x = torch.arange(6, dtype=torch.float32, device="cuda", requires_grad=True)
        y = ops.psum(x, "tp")
        if not (isinstance(y, torch.Tensor) and y.device.type == "cuda"):
            problems.append(f"ops.psum gave {type(y).__name__} on {getattr(y, 'device', '?')}")
        (y * y).sum().backward()
        if x.grad is None or not torch.equal(x.grad, 2 * x.detach() * group.size):
            problems.append(f"psum gradient {x.grad}")
    dist.init_process_group("nccl")
    n = float(group.size)
    t = torch.ones(5, device="cuda")
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((5,), n, device="cuda")):
        problems.append(f"compat all_reduce {t}")
    last = group.ledger()[-1]
    if (last["op"], last["device"]) != ("all_reduce", True):
        problems.append(f"compat all_reduce of a CUDA tensor did not go over NCCL: {last}")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # torch's current stream is cupy's for the call
        u = torch.full((1 << 20,), 2.0, device="cuda")
        work = dist.all_reduce(u, dist.ReduceOp.AVG, async_op=True)
        work.wait()
        total = float((u * 3).sum())
    if total != 6.0 * (1 << 20):
        problems.append(f"compat async avg on a side stream: {total}")
    strided = torch.ones(8, device="cuda")[::2]  # not dense: the result is copied in
    dist.all_reduce(strided)
    if not torch.equal(strided, torch.full((4,), n, device="cuda")):
        problems.append(f"compat all_reduce of a strided tensor {strided}")
    b = torch.arange(4.0, device="cuda")
    dist.broadcast(b, src=0)
    if not torch.equal(b, torch.arange(4.0, device="cuda")):
        problems.append(f"compat broadcast {b}")
    h = torch.ones(3, dtype=torch.bfloat16, device="cuda")  # bfloat16: through host memory
    dist.all_reduce(h)
    if not torch.equal(h, torch.full((3,), n, dtype=torch.bfloat16, device="cuda")):
        problems.append(f"compat bfloat16 all_reduce {h}")
    dist.destroy_process_group()
    return problems


def _compat_collectives_on_nccl(group: Any) -> list[str]:
    """Every compat collective of CUDA tensors goes over NCCL and equals torch's meaning."""
    import warnings

    import torch

    import meshcomm.distributed as dist

    dist.init_process_group("nccl")
    n, me = group.size, group.rank
    problems: list[str] = []

    def check(what: str, got: Any, want: Any, ledger: bool = True) -> None:
        last = group.ledger()[-1]
        if ledger and not last["device"]:
            problems.append(f"{what} went through host memory: {last}")
        if not (got.device.type == "cuda" and torch.equal(got, want.to(got.device))):
            problems.append(f"{what}: got {got}, expected {want}")

    def cuda(values: Any) -> Any:
        return torch.as_tensor(values, dtype=torch.float32, device="cuda")

    mine = cuda(np.arange(6.0) + me)
    every = torch.cat([cuda(np.arange(6.0) + r) for r in range(n)])
    out = torch.empty(6 * n, device="cuda")
    dist.all_gather_single(out, mine)
    check("all_gather_single", out, every)
    work = dist.all_gather_single(out.zero_(), mine, async_op=True)
    work.wait()
    check("async all_gather_single", out, every)
    parts = [torch.empty(6, device="cuda") for _ in range(n)]
    dist.all_gather(parts, mine)
    check("all_gather", torch.cat(parts), every)
    chunk = torch.empty(6, device="cuda")
    dist.reduce_scatter_single(chunk, torch.ones(6 * n, device="cuda"))
    check("reduce_scatter_single", chunk, cuda(np.full(6, float(n))))
    dist.reduce_scatter(chunk, [torch.full((6,), 2.0, device="cuda") for _ in range(n)])
    check("reduce_scatter", chunk, cuda(np.full(6, 2.0 * n)))
    summed = mine.clone()
    dist.reduce(summed, dst=0)
    if me == 0:
        check("reduce", summed, every.reshape(n, 6).sum(0))
    gathered = [torch.empty(6, device="cuda") for _ in range(n)] if me == 0 else None
    dist.gather(mine, gathered, dst=0)
    if gathered is not None:
        check("gather", torch.cat(gathered), every)
    got = torch.empty(6, device="cuda")
    sent = [cuda(np.arange(6.0) * r) for r in range(n)] if me == 0 else None
    dist.scatter(got, sent, src=0)
    check("scatter", got, cuda(np.arange(6.0) * me))
    swapped = torch.empty(6 * n, device="cuda")
    dist.all_to_all_single(swapped, torch.cat([mine] * n))
    check("all_to_all_single", swapped, every)
    # Uneven pieces go point to point on a sibling group (device messages between ranks;
    # at world 1 only this rank's own piece, kept on the device).
    rows = torch.empty(2 * n, 3, device="cuda")
    dist.all_to_all_single(rows, torch.ones(2 * n, 3, device="cuda"), [2] * n, [2] * n)
    check("uneven all_to_all_single", rows, torch.ones(2 * n, 3), ledger=False)
    pieces = [torch.empty(2, device="cuda") for _ in range(n)]
    dist.all_to_all(pieces, [torch.full((2,), float(me), device="cuda") for _ in range(n)])
    check("all_to_all", torch.cat(pieces), cuda(np.repeat(np.arange(n, dtype=float), 2)), False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        a, b = torch.ones(3, device="cuda"), torch.full((2, 2), 2.0, device="cuda")
        dist.all_reduce_coalesced([a, b])
    check("all_reduce_coalesced", torch.cat([a, b.reshape(-1)]), cuda([n] * 3 + [2.0 * n] * 4))
    dist.destroy_process_group()
    return problems


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    "check",
    [
        _torch_on_nccl,  # kind and gradients kept, compat all_reduce/broadcast over NCCL
        _compat_collectives_on_nccl,  # every other compat collective over NCCL
    ],
)
def test_torch_cuda_tensors_over_nccl(check: Any) -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    for problems in run_ranks(check, 1, backend=PAIR, timeout=240):
        assert problems == [], "\n".join(problems)


def _p2p_on_nccl(group: Any) -> list[str]:
    """send/recv of device arrays at world 1: to itself (kept, not over NCCL), async, into
    cupy and numpy buffers, host messages between them; and the payload routes inside one
    NCCL group call (NCCL pairs a rank's send to itself only there)."""
    import cupy as cp

    problems: list[str] = []

    def same(what: str, got: Any, expected: np.ndarray, kind: type = cp.ndarray) -> None:
        if not isinstance(got, kind):
            problems.append(f"{what}: got a {type(got).__name__}, expected {kind.__name__}")
        else:
            _compare(problems, what, cp.asnumpy(got), expected)

    values = [np.arange(6.0).reshape(2, 3), np.float32(1.5) * np.ones((), np.float32),
              np.zeros((0, 3), np.int8), np.arange(8, dtype=np.int64)]  # fmt: skip
    for k, v in enumerate(values):
        group.send(cp.asarray(v), dst=0, tag=k)
        group.send(v, dst=0, tag=k)  # a host message on the same tag
    for k, v in enumerate(values):
        same(f"device message {k}", group.recv(0, k), v)
        same(f"host message {k}", group.recv(0, k), v, np.ndarray)
    strided = cp.arange(12.0).reshape(3, 4)[:, ::2]
    work = group.send(strided, dst=0, tag=9, async_op=True)
    strided[...] = -1  # after an async send: the copy was taken at issue
    work.wait()
    out = cp.empty((3, 2))
    got = group.recv(0, 9, out=out, async_op=True).wait()
    if got is not out:
        problems.append("recv into a cupy out returned another array")
    same("async strided into out", out, np.arange(12.0).reshape(3, 4)[:, ::2])
    group.send(cp.ones(4, cp.float32), dst=0, tag=10)
    host_out = np.zeros(4, np.float32)
    same("into a numpy out", group.recv(0, 10, out=host_out), np.ones(4, np.float32), np.ndarray)
    # The payload routes, paired by one NCCL group call.
    dev = group._device
    x, y = cp.arange(5, dtype=cp.float32), cp.zeros(5, dtype=cp.float32)
    token = dev.ready_token()
    dev._nccl_mod.groupStart()
    try:
        dev.send_payload(x, 0, token)
        dev.recv_payload(y, 0, token)
    finally:
        dev._nccl_mod.groupEnd()
    cp.cuda.Device().synchronize()
    same("payload routes", y, np.arange(5, dtype=np.float32))
    return problems


@needs_gpu
@pytest.mark.gpu
def test_device_arrays_point_to_point_at_world_1() -> None:
    for problems in run_ranks(_p2p_on_nccl, 1, backend=PAIR, timeout=120):
        assert problems == [], "\n".join(problems)


@needs_gpu
@pytest.mark.gpu
def test_init_without_a_name_pairs_nccl_where_each_local_rank_has_a_gpu() -> None:
    import cupy as cp

    import meshcomm

    group = meshcomm.init(world_size=1, rank=0)
    try:
        assert group.backend == "cpu:self,cuda:nccl"
        assert float(group.all_reduce(cp.ones(3)).sum()) == 3.0
        assert group.ledger()[-1]["device"] is True
    finally:
        meshcomm.shutdown()
