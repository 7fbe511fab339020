"""meshcomm.distributed in one process: API parity with torch 2.13, buffers, errors, stores,
the sampler, and every call in a world of one (where each collective is the identity).

Multi-rank behaviour is in tests/test_distributed_ranks.py (oracles) and
tests/test_distributed_torch.py (side by side with torch's gloo).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import threading
import types
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import meshcomm
import meshcomm.distributed as dist
from meshcomm import world
from meshcomm.distributed._errors import DistTypeError, translate
from meshcomm.distributed._sampler import torch_randperm
from meshcomm.distributed._tensors import as_buffer
from meshcomm.errors import (
    CommError,
    CommTimeout,
    MeshCommError,
    PeerError,
    ProtocolError,
    RendezvousError,
    StoreError,
    StoreTimeout,
)

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed")
BF16 = np.dtype(ml_dtypes.bfloat16)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def one(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A default group of one, destroyed afterwards."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    dist.init_process_group("gloo", world_size=1, rank=0, timeout=timedelta(seconds=20))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# -- API parity with torch 2.13 ---------------------------------------------------------------
FUNCTIONS = [
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "is_available",
    "is_mpi_available",
    "is_nccl_available",
    "is_gloo_available",
    "is_ucc_available",
    "is_xccl_available",
    "is_backend_available",
    "is_torchelastic_launched",
    "get_backend",
    "get_backend_config",
    "get_rank",
    "get_world_size",
    "get_default_backend_for_device",
    "get_node_local_rank",
    "get_pg_count",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
    "get_group_rank",
    "get_global_rank",
    "get_process_group_ranks",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "send_object_list",
    "recv_object_list",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "barrier",
    "monitored_barrier",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "supports_complex",
]


def _params(fn: Any) -> list[tuple[str, Any, Any]]:
    sig = inspect.signature(fn)
    out = []
    for p in sig.parameters.values():
        if p.name.startswith("_") or p.name == "self":
            continue
        default = p.default
        if default is not inspect.Parameter.empty and type(default).__name__ == "RedOpType":
            default = int(default)
        out.append((p.name, p.kind, default))
    return out


@needs_torch
@pytest.mark.parametrize("name", FUNCTIONS)
def test_signature_matches_torch(name: str) -> None:
    import torch.distributed as tdist

    assert _params(getattr(dist, name)) == _params(getattr(tdist, name))


@needs_torch
def test_class_signatures_match_torch() -> None:
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler

    from meshcomm.distributed.device_mesh import init_device_mesh as ours_mesh

    assert _params(dist.P2POp.__init__) == _params(tdist.P2POp.__init__)
    assert _params(dist.DistributedSampler.__init__) == _params(DistributedSampler.__init__)
    assert _params(dist.DistributedDataParallel.__init__) == _params(
        DistributedDataParallel.__init__
    )
    assert [p[0] for p in _params(ours_mesh)] == [p[0] for p in _params(init_device_mesh)]


@needs_torch
def test_names_and_constants_match_torch() -> None:
    import torch.distributed as tdist

    ours = {k: int(v) for k, v in dist.ReduceOp.RedOpType.__members__.items()}
    theirs = {k: int(v) for k, v in tdist.ReduceOp.RedOpType.__members__.items()}
    assert ours == theirs
    for name in theirs:
        assert str(getattr(dist.ReduceOp, name)) == str(getattr(tdist.ReduceOp, name))
    assert dist.GroupMember.NON_GROUP_MEMBER == tdist.GroupMember.NON_GROUP_MEMBER
    assert {k: int(v) for k, v in dist.DebugLevel.__members__.items()} == {
        k: int(v) for k, v in tdist.DebugLevel.__members__.items()
    }
    for name in ("GLOO", "NCCL", "MPI", "UCC", "XCCL", "UNDEFINED"):
        assert getattr(dist.Backend, name) == getattr(tdist.Backend, name)
    assert dist.get_default_backend_for_device("cpu") == tdist.get_default_backend_for_device("cpu")
    for cls in ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError"):
        assert issubclass(getattr(dist, cls), RuntimeError)


def test_exports_are_explicit() -> None:
    missing = [n for n in dist.__all__ if not hasattr(dist, n)]
    assert not missing
    assert sorted(dist.__all__) == dist.__all__


@needs_torch
def test_porting_doc_lists_every_torch_name() -> None:
    import torch.distributed as tdist

    text = (ROOT / "docs" / "porting.md").read_text()
    listed = set(re.findall(r"^\| `(\w+)`", text, flags=re.M))
    # Submodules are attributes only once something imported them (torch's own parallel
    # stack, imported by other tests in this process): they are no names of the API.
    public = {
        n
        for n in dir(tdist)
        if not n.startswith("_") and not isinstance(getattr(tdist, n), types.ModuleType)
    }
    assert not public - listed, sorted(public - listed)


# -- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("error", "dist_class"),
    [
        (CommTimeout("t"), dist.DistBackendError),
        (PeerError("p", rank=3), dist.DistNetworkError),
        (ProtocolError("x"), dist.DistBackendError),
        (CommError("c"), dist.DistBackendError),
        (StoreTimeout("s"), dist.DistStoreError),
        (StoreError("s"), dist.DistStoreError),
        (RendezvousError("r"), dist.DistError),
    ],
)
def test_errors_translate_onto_both_trees(error: MeshCommError, dist_class: type) -> None:
    new = translate(error)
    assert isinstance(new, dist_class) and isinstance(new, type(error))
    assert isinstance(new, RuntimeError) and isinstance(new, MeshCommError)
    assert str(new) == str(error)
    if isinstance(error, PeerError):
        assert new.rank == 3  # type: ignore[attr-defined]
    if isinstance(error, (CommTimeout, StoreTimeout)):
        assert isinstance(new, TimeoutError)


def test_public_functions_raise_dist_errors(one: None) -> None:
    with pytest.raises(dist.DistStoreError) as info:
        dist.HashStore().wait(["never"], timedelta(milliseconds=50))
    assert isinstance(info.value, StoreTimeout)
    with pytest.raises(DistTypeError) as err:
        dist.all_reduce(np.ones(2), op=dist.ReduceOp.BAND)
    assert isinstance(err.value, TypeError) and isinstance(err.value, RuntimeError)
    assert "band" in str(err.value)


# -- buffers ------------------------------------------------------------------------------------
def test_numpy_buffers_are_written_in_place(one: None) -> None:
    x = np.arange(6.0).reshape(2, 3)
    view = x.T  # non-contiguous
    dist.broadcast(view, src=0)
    dist.all_reduce(view, op=dist.ReduceOp.SUM)
    assert np.shares_memory(view, x) and np.array_equal(x, np.arange(6.0).reshape(2, 3))
    swapped = np.arange(3, dtype=">i4")
    out = [np.zeros(3, ">i4")]
    dist.all_gather(out, swapped)
    assert out[0].tolist() == [0, 1, 2]
    frozen = np.ones(2)
    frozen.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        dist.all_reduce(frozen)


@needs_torch
def test_torch_buffers(one: None) -> None:
    import torch

    t = torch.arange(6.0).reshape(2, 3)
    ptr = t.data_ptr()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert t.data_ptr() == ptr and t.tolist() == [[0, 1, 2], [3, 4, 5]]
    strided = torch.zeros(3, 2).t()  # non-contiguous output
    dist.all_gather_single(strided, torch.arange(6.0).reshape(2, 3))
    assert strided.tolist() == [[0, 1, 2], [3, 4, 5]]
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    out = [torch.zeros(2, dtype=torch.bfloat16)]
    dist.all_gather(out, b)
    assert out[0].dtype == torch.bfloat16 and out[0].tolist() == [1.5, -2.0]
    buf = as_buffer(b, "tensor")
    assert buf.dtype == BF16 and buf.host.dtype == BF16
    p = torch.nn.Parameter(torch.ones(2))  # requires grad: written through a detached view
    dist.all_reduce(p)
    assert p.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="overlapping"):
        dist.all_reduce(torch.zeros(1).expand(3))
    with pytest.raises(TypeError, match="float8"):
        dist.all_reduce(torch.zeros(2, dtype=torch.float8_e4m3fn))
    with pytest.raises(TypeError, match="meta"):
        dist.all_reduce(torch.zeros(2, device="meta"))
    c = torch.tensor([1 + 2j])
    dist.all_reduce(c)
    assert c.tolist() == [1 + 2j]


@pytest.mark.parametrize("value", [[1.0], 3.0, "x", None, (np.zeros(1),)])
def test_unsupported_kinds_are_type_errors(one: None, value: Any) -> None:
    with pytest.raises(TypeError, match=type(value).__name__):
        dist.all_reduce(value)


# -- world of one: every call -----------------------------------------------------------------
def test_state_and_lifecycle(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized() and dist.group.WORLD is None
    with pytest.raises(ValueError, match="not been initialized"):
        dist.get_rank()
    with pytest.raises(ValueError, match="Invalid backend"):
        dist.init_process_group("ucx", world_size=1, rank=0)
    dist.init_process_group("cpu:gloo,cuda:nccl", world_size=1, rank=0)
    try:
        assert dist.get_backend() == "cpu:gloo,cuda:nccl"
        assert dist.group.WORLD is dist.GroupMember.WORLD
        assert dist.group.WORLD.rank() == 0 and dist.group.WORLD.size() == 1
        assert dist.get_pg_count() == 1
        with pytest.raises(ValueError, match="twice"):
            dist.init_process_group("gloo")
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized() and not world.is_initialized()
    with pytest.raises(ValueError):
        dist.destroy_process_group()


def test_adopts_a_world_made_with_meshcomm_init() -> None:
    meshcomm.init(world_size=1, rank=0)
    try:
        dist.init_process_group("gloo")
        assert dist.get_world_size() == 1
        dist.destroy_process_group()
        assert world.is_initialized()  # left to its owner
        with pytest.raises(ValueError, match="world_size=2"):
            dist.init_process_group("gloo", world_size=2, rank=0)
    finally:
        meshcomm.shutdown()


def test_init_with_a_store(monkeypatch: pytest.MonkeyPatch) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), world_size=1, rank=0)
    dist.destroy_process_group()
    if HAVE_TORCH:
        import torch.distributed as tdist

        dist.init_process_group("gloo", store=tdist.HashStore(), world_size=1, rank=0)
        dist.destroy_process_group()


def test_every_collective_in_a_world_of_one(one: None) -> None:
    x = np.array([1.0, 2.0])
    assert dist.all_reduce(x, op=dist.ReduceOp.PRODUCT) is None
    dist.reduce(x, dst=0)
    dist.broadcast(x, src=0)
    gl = [np.zeros(2)]
    dist.gather(x, gl, dst=0)
    y = np.zeros(2)
    dist.scatter(y, [x], src=0)
    assert y.tolist() == [1.0, 2.0] and gl[0].tolist() == [1.0, 2.0]
    dist.reduce_scatter(y, [x * 3])
    assert y.tolist() == [3.0, 6.0]
    with pytest.warns(FutureWarning):
        dist.reduce_scatter_tensor(y, x)
    with pytest.warns(FutureWarning):
        dist.all_gather_into_tensor(y, x)
    out = [np.zeros(2)]
    dist.all_to_all(out, [x])
    dist.all_to_all_single(y, x * 2, [2], [2])
    assert out[0].tolist() == [1.0, 2.0] and y.tolist() == [2.0, 4.0]
    with pytest.warns(FutureWarning):
        dist.all_reduce_coalesced([x, y])
    dist.barrier()
    dist.monitored_barrier()
    objs: list[Any] = [{"a": 1}]
    dist.broadcast_object_list(objs, src=0)
    dist.all_gather_object(objs, "me")
    assert objs == ["me"]
    so: list[Any] = [None]
    dist.scatter_object_list(so, [3], src=0)
    assert so == [3]
    w = dist.all_reduce(x, async_op=True)
    assert w.wait() and w.is_success() and w.result() == [x]


def test_point_to_point_to_self(one: None) -> None:
    got = np.zeros(3)
    recv = dist.irecv(got, src=0)
    send = dist.isend(np.arange(3.0), dst=0)
    assert recv.wait() and send.wait() and got.tolist() == [0.0, 1.0, 2.0]
    assert recv.source_rank() == 0
    with pytest.raises(ValueError, match="destination rank should not be"):
        dist.send(got, dst=0)
    with pytest.raises(ValueError, match="Invalid ``op``"):
        dist.P2POp(dist.send, got, 0)
    with pytest.raises(ValueError, match="P2POp"):
        dist.batch_isend_irecv([])


def test_groups_in_a_world_of_one(one: None) -> None:
    g = dist.new_group([0], timeout=timedelta(seconds=5), backend="gloo")
    assert dist.get_process_group_ranks(g) == [0] and g.timeout == timedelta(seconds=5)
    assert dist.get_group_rank(g, 0) == 0 and dist.get_global_rank(g, 0) == 0
    with pytest.raises(ValueError, match="not part of group"):
        dist.get_group_rank(g, 1)
    with pytest.raises(ValueError, match="outside the world"):
        dist.new_group([1])
    with pytest.raises(ValueError, match="duplicate"):
        dist.new_group([0, 0])
    cur, subs = dist.new_subgroups(group_size=1)
    assert cur is subs[0] and cur.size() == 1
    with pytest.raises(ValueError, match="must not exceed"):
        dist.new_subgroups(group_size=2)
    with pytest.raises(ValueError, match="appeared in both"):
        dist.new_subgroups_by_enumeration([[0], [0]])
    assert dist.split_group(split_ranks=[[0]]).size() == 1
    with pytest.raises(ValueError, match="cannot be None or empty"):
        dist.split_group(split_ranks=[])
    dist.destroy_process_group(g)
    with pytest.raises(ValueError, match="destroyed"):
        dist.all_reduce(np.ones(1), group=g)
    # a meshcomm group passed straight in
    x = np.ones(2)
    dist.all_reduce(x, group=world.get_world())
    assert dist.get_rank(dist.GroupMember.NON_GROUP_MEMBER) == -1


def test_work_and_future() -> None:
    work = dist.Work.completed("noop", [1])
    assert work.wait(timeout=timedelta(seconds=1)) and work.get_future().value() == [1]
    fut = dist.Future()
    chained = fut.then(lambda f: f.value() + 1)
    threading.Timer(0.05, fut.set_result, args=(41,)).start()
    assert chained.wait(timeout=5) == 42
    bad = dist.Future.done_with(1).then(lambda f: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        bad.wait()
    with pytest.raises(dist.DistBackendError):
        dist.Future().wait(timeout=0.01)


def test_reduce_ops_and_deprecated_alias() -> None:
    assert dist.ReduceOp(dist.ReduceOp.MAX) == dist.ReduceOp.MAX
    assert dist.supports_complex(dist.ReduceOp.SUM)
    assert not dist.supports_complex(dist.ReduceOp.BXOR)
    with pytest.warns(FutureWarning, match="deprecated"):
        assert dist.reduce_op.SUM == dist.ReduceOp.SUM
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        repr(dist.reduce_op.__class__)  # introspection stays quiet


def test_backends_and_debug_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dist.is_available() and dist.is_gloo_available()
    assert not dist.is_ucc_available()
    assert dist.get_default_backend_for_device("cuda:1") == "nccl"
    with pytest.raises(ValueError, match="Default backend not registered"):
        dist.get_default_backend_for_device("xpu")
    with pytest.raises(ValueError, match="pairing"):
        dist.init_process_group("cpu:gloo:x", world_size=1, rank=0)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    dist.set_debug_level_from_env()
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL
    dist.set_debug_level(dist.DebugLevel.OFF)
    assert os.environ["TORCH_DISTRIBUTED_DEBUG"] == "OFF"
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "LOUD")
    with pytest.raises(ValueError, match="LOUD"):
        dist.set_debug_level_from_env()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert dist.is_torchelastic_launched()
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert dist.get_node_local_rank() == 3


# -- stores -------------------------------------------------------------------------------------
def test_stores_take_torch_parameters(tmp_path: Path) -> None:
    master = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))
    client = dist.TCPStore(host_name="127.0.0.1", port=master.port, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert master.get("k") == b"v" and master.add("n", 2) == 2 and not master.libuvBackend
    with pytest.raises(dist.DistStoreError) as info:
        client.wait(["missing"], timedelta(milliseconds=100))
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(ValueError, match="master_listen_fd"):
        dist.TCPStore("127.0.0.1", 0, is_master=True, master_listen_fd=3)
    client.close()
    master.close()
    fs = dist.FileStore(str(tmp_path / "store"), -1)
    fs.set("a", b"1")
    assert dist.FileStore(str(tmp_path / "store")).get("a") == b"1"
    prefixed = dist.PrefixStore("job", dist.HashStore())
    prefixed.set("x", "y")
    assert prefixed.underlying_store.get("job/x") == b"y" and prefixed.has_extended_api()
    if HAVE_TORCH:
        import torch.distributed as tdist

        inner = tdist.HashStore()
        dist.PrefixStore("p", inner).set("k", "v")
        assert inner.get("p/k") == b"v"


# -- the sampler ---------------------------------------------------------------------------------
@needs_torch
@pytest.mark.parametrize("n", [0, 1, 7, 10, 33])
@pytest.mark.parametrize("replicas", [1, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_matches_torch(n: int, replicas: int, drop_last: bool) -> None:
    from torch.utils.data import DistributedSampler

    data = list(range(n))
    for shuffle in (False, True):
        for rank in range(replicas):
            kw = {"num_replicas": replicas, "rank": rank, "shuffle": shuffle, "seed": 7}
            ours = dist.DistributedSampler(data, drop_last=drop_last, **kw)
            theirs = DistributedSampler(data, drop_last=drop_last, **kw)
            for epoch in (0, 3):
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                assert list(ours) == list(theirs) and len(ours) == len(theirs)


@needs_torch
def test_randperm_matches_torch_for_large_seeds() -> None:
    import torch

    for seed in (0, 1, 2**32 + 3, 2**63 - 1):
        assert (
            torch_randperm(500, seed)
            == torch.randperm(500, generator=torch.Generator().manual_seed(seed)).tolist()
        )


def test_sampler_checks_its_rank() -> None:
    with pytest.raises(ValueError, match="Invalid rank 2"):
        dist.DistributedSampler(range(4), num_replicas=2, rank=2)
    with pytest.raises(RuntimeError):
        dist.DistributedSampler(range(4))  # no default group


# -- DDP and the device mesh in a world of one --------------------------------------------------
@needs_torch
def test_ddp_in_a_world_of_one_equals_plain_training(one: None) -> None:
    import torch

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))

    plain, wrapped = net(), net()
    ddp = dist.DistributedDataParallel(wrapped, bucket_cap_mb=0.00001, gradient_as_bucket_view=True)
    x = torch.randn(6, 3)
    plain(x).sum().backward()
    ddp(x).sum().backward()
    for p, q in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert len(ddp._buckets) > 1
    with pytest.raises(ValueError, match="device_ids"):
        dist.DistributedDataParallel(net(), device_ids=[0])


@needs_torch
def test_ddp_unused_parameters(one: None) -> None:
    import torch

    class Half(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = torch.nn.Linear(2, 1)
            self.unused = torch.nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    strict = dist.DistributedDataParallel(Half())
    with pytest.raises(RuntimeError, match="find_unused_parameters=True"):
        strict(torch.ones(1, 2)).sum().backward()
    lenient = dist.DistributedDataParallel(Half(), find_unused_parameters=True)
    lenient(torch.ones(1, 2)).sum().backward()
    assert lenient.module.used.weight.grad is not None
    assert lenient.module.unused.weight.grad is None


def test_device_mesh_in_a_world_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    from meshcomm.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    try:
        assert dist.get_backend() == "gloo"
        assert mesh.get_coordinate() == [0, 0] and mesh.ndim == 2
        assert repr(mesh) == "DeviceMesh('cpu', [[0]], mesh_dim_names=('dp', 'tp'))"
        g = mesh.get_group("dp")
        assert g is mesh.get_group("dp") and dist.get_world_size(g) == 1
        assert len(mesh.get_all_groups()) == 2 and mesh["tp"].mesh_dim_names == ("tp",)
        with pytest.raises(ValueError, match="backend_override"):
            init_device_mesh("cpu", (1,), backend_override={0: "nccl"})
    finally:
        dist.destroy_process_group()
