"""GPU arrays on the host backends: cupy in, cupy out; torch CUDA tensors through the compat API.

These need an NVIDIA GPU and cupy (the ``cuda12``/``cuda13`` extras); CI has neither, so they
skip there with the reason. They run on a lent GPU machine through the device tool:

    python -m pytest tests/test_gpu.py -v

Every rank of a test shares the one GPU. The checks are the same numpy oracles as everywhere:
the conformance suite runs through :class:`DeviceGroup`, which hands the real process group
cupy copies of every input it can and checks that each result comes back as a cupy array.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshcomm.testing import run_ranks

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 240.0


def _why_skip() -> str:
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install 'meshcomm[cuda12]' or 'meshcomm[cuda13]')"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "cupy sees no CUDA GPU"
    except Exception as exc:  # no driver, no device: cupy raises its own CUDA errors
        return f"no usable CUDA GPU ({type(exc).__name__}: {exc})"
    return ""


SKIP = _why_skip()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(SKIP), reason=SKIP or "ok")]


# == the conformance suite with device inputs ===============================================
def _to_device(x: Any) -> Any:
    """A cupy copy of a numpy array cupy can hold; anything else unchanged."""
    import cupy

    if type(x) is not np.ndarray or not x.dtype.isnative or x.dtype.kind not in "biufc":
        return x
    return cupy.asarray(x)


class DeviceGroup:
    """A process group seen through cupy: inputs go in as cupy arrays, results must come back
    as cupy arrays (or None), and are handed to the suite as numpy for its oracles."""

    _COLLECTIVES = frozenset(
        {
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "all_to_all",
            "broadcast",
            "reduce",
            "gather",
            "scatter",
            "permute",
            "send",
        }
    )

    def __init__(self, group: Any) -> None:
        self._group = group

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._group, name)
        if name not in self._COLLECTIVES:
            return attr

        def call(x: Any, *args: Any, **kwargs: Any) -> Any:
            device_in = _to_device(x)
            on_device = device_in is not x or (x is None and self._arrives(kwargs))
            out = attr(device_in, *args, **kwargs)
            if kwargs.get("async_op"):
                return _HostWork(out, on_device)
            return _to_host(out, on_device, name)

        return call

    def _arrives(self, kwargs: dict[str, Any]) -> bool:
        """Whether a rank passing None gets a cupy array: in a group with a device backend,
        for a dtype cupy holds (``routes.arrival_route``)."""
        dtype = kwargs.get("dtype")
        if dtype is None or self._group.device_backend is None:
            return False  # the call is refused, or runs on the host
        return np.dtype(dtype).kind in "biufc"


def _to_host(out: Any, expect_device: bool, name: str) -> Any:
    import cupy

    if out is None:
        return out
    if isinstance(out, cupy.ndarray) != expect_device:
        where = "a cupy" if expect_device else "a host"
        raise TypeError(f"{name}: {where} call gave a {type(out).__module__} result")
    return cupy.asnumpy(out) if expect_device else out


class _HostWork:
    def __init__(self, work: Any, expect_device: bool) -> None:
        self._work, self._device = work, expect_device

    def wait(self, timeout: float | None = None) -> Any:
        return _to_host(self._work.wait(timeout), self._device, "async")

    def get_future(self) -> concurrent.futures.Future[Any]:
        host: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def done(device: concurrent.futures.Future[Any]) -> None:
            exc = device.exception()
            if exc is not None:
                host.set_exception(exc)
            else:
                host.set_result(_to_host(device.result(), self._device, "future"))

        self._work.get_future().add_done_callback(done)
        return host

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _conformance_on_device(group: Any) -> list[str]:
    from meshcomm.testing import run_conformance

    return run_conformance(DeviceGroup(group), quick=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_conformance_with_cupy_inputs(nprocs: int) -> None:
    for rank, failures in enumerate(run_ranks(_conformance_on_device, nprocs, timeout=TIMEOUT)):
        assert failures == [], f"rank {rank}: " + "\n".join(failures[:20])


# == meshcomm.ops on a mesh, cupy in and cupy out ============================================
def _ops_on_device(group: Any) -> list[str]:
    import cupy

    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    mesh = init_device_mesh((2, group.size // 2), mesh_dim_names=("dp", "tp"))
    rank, n_tp = mesh.get_rank(), mesh.size("tp")
    tp_ranks = [int(r) for r in mesh.mesh[mesh.get_coordinate()[0]]]

    def host(r: int) -> np.ndarray:
        return (np.arange(n_tp * 3, dtype=np.float32) + 10 * r).reshape(n_tp, 3)

    x = cupy.asarray(host(rank))
    before = x.copy()
    problems: list[str] = []
    with mesh:
        results = {
            "psum": (ops.psum(x, "tp"), sum(host(r) for r in tp_ranks)),
            "pmax": (ops.pmax(x, "tp"), np.max([host(r) for r in tp_ranks], axis=0)),
            "all_gather": (ops.all_gather(x, "tp"), np.stack([host(r) for r in tp_ranks])),
            "psum_scatter": (
                ops.psum_scatter(x, "tp"),
                sum(host(r) for r in tp_ranks)[mesh.get_local_rank("tp")],
            ),
            "all_to_all": (
                ops.all_to_all(x, "tp", 0, 0, tiled=True),
                np.concatenate([host(r)[mesh.get_local_rank("tp")][None] for r in tp_ranks]),
            ),
            "psum over both": (
                ops.psum(x, ("dp", "tp")),
                sum(host(r) for r in range(group.size)),
            ),
            "async psum": (
                ops.psum(x, "tp", async_op=True).wait(),
                sum(host(r) for r in tp_ranks),
            ),
        }
        tree = ops.psum({"a": x, "b": [x[0]]}, "tp")
    total = sum(host(r) for r in tp_ranks)
    results["pytree a"] = (tree["a"], total)
    results["pytree b"] = (tree["b"][0], total[0])
    for name, (got, want) in results.items():
        if not isinstance(got, cupy.ndarray):
            problems.append(f"{name}: got a {type(got).__name__}, not a cupy array")
        elif not np.array_equal(cupy.asnumpy(got), want):
            problems.append(f"{name}: got {cupy.asnumpy(got)}, expected {want}")
    if not bool((x == before).all()):
        problems.append("the input was modified")
    return problems


@pytest.mark.parametrize("nprocs", [2, 4])
def test_ops_return_cupy_arrays(nprocs: int) -> None:
    for rank, problems in enumerate(run_ranks(_ops_on_device, nprocs, timeout=TIMEOUT)):
        assert problems == [], f"rank {rank}: {problems}"


# == meshcomm.distributed with torch CUDA tensors and cupy arrays, in place ==================
def _compat_on_device(group: Any) -> list[str]:
    import cupy
    import torch

    import meshcomm.distributed as dist

    dist.init_process_group("gloo")  # adopts the world run_ranks made
    rank, size = dist.get_rank(), dist.get_world_size()
    problems: list[str] = []

    def expect(name: str, got: Any, want: Any) -> None:
        host = got.cpu().float().numpy() if isinstance(got, torch.Tensor) else cupy.asnumpy(got)
        if not np.allclose(host, want):
            problems.append(f"{name}: got {host}, expected {want}")

    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    expect("all_reduce", t, np.full(4, size * (size + 1) / 2))
    if t.device.type != "cuda":
        problems.append(f"all_reduce moved the tensor to {t.device}")

    b = torch.full((2, 3), float(rank), device="cuda", dtype=torch.bfloat16)
    dist.all_reduce(b, op=dist.ReduceOp.MAX)
    expect("bfloat16 max", b, np.full((2, 3), size - 1.0))

    src = torch.arange(3, device="cuda", dtype=torch.float64) * (rank + 1)
    dist.broadcast(src, src=size - 1)
    expect("broadcast", src, np.arange(3) * size)

    out = torch.empty(size * 2, device="cuda")
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank), device="cuda"))
    expect("all_gather_into_tensor", out, np.repeat(np.arange(size, dtype=np.float32), 2))

    chunk = torch.empty(2, device="cuda")
    dist.reduce_scatter_tensor(chunk, torch.ones(size * 2, device="cuda"))
    expect("reduce_scatter_tensor", chunk, np.full(2, float(size)))

    work = dist.all_reduce(torch.ones(5, device="cuda"), async_op=True)
    work.wait()

    c = cupy.full((3,), rank + 1, dtype=cupy.int32)
    dist.all_reduce(c)
    expect("cupy all_reduce", c, np.full(3, size * (size + 1) // 2))

    pieces = [cupy.zeros(2, dtype=cupy.float32) for _ in range(size)]
    dist.all_gather(pieces, cupy.full((2,), float(rank), dtype=cupy.float32))
    for r, piece in enumerate(pieces):
        expect(f"cupy all_gather[{r}]", piece, np.full(2, float(r)))

    model = torch.nn.Linear(4, 2).cuda()
    torch.manual_seed(rank)  # different data on each rank; the same weights after the wrap
    ddp = dist.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(8, 4, device="cuda")).sum().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(gathered, flat)
    if not all(torch.equal(gathered[0], g) for g in gathered):
        problems.append("DDP parameters differ between ranks after 3 steps")
    dist.destroy_process_group()
    return problems


def test_distributed_with_cuda_tensors() -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("this torch build has no CUDA")
    for rank, problems in enumerate(run_ranks(_compat_on_device, 2, timeout=TIMEOUT)):
        assert problems == [], f"rank {rank}: {problems}"


# == the mpi backend with cupy arrays, under a real mpiexec ==================================
_MPI_SCRIPT = """
import sys
import cupy, numpy as np
import meshcomm
from meshcomm.backends.mpi import cuda_support
from meshcomm.reduction import ReduceOp
from meshcomm.testing import run_conformance
sys.path.insert(0, sys.argv[1])
from test_gpu import DeviceGroup

group = meshcomm.init(backend="mpi")
aware, how = cuda_support()
failures = run_conformance(DeviceGroup(group), quick=True)
x = cupy.arange(4, dtype=cupy.float32) + group.rank
want = np.arange(4, dtype=np.float32) * group.size + sum(range(group.size))
y = group.all_reduce(x)
if not isinstance(y, cupy.ndarray) or not np.array_equal(cupy.asnumpy(y), want):
    failures.append(f"group all_reduce gave {y!r}")
# The communicator itself takes device buffers: passed through (CUDA-aware) or staged.
group._comm.all_reduce(x, ReduceOp.SUM)
if not np.array_equal(cupy.asnumpy(x), want):
    failures.append(f"communicator all_reduce on a device buffer gave {x!r}")
print(f"rank {group.rank}: cuda-aware={aware} ({how}); failures={len(failures)}", flush=True)
for f in failures[:10]:
    print(f"rank {group.rank}: {f}", flush=True)
sys.exit(1 if failures else 0)
"""


def test_mpi_backend_with_cupy_arrays() -> None:
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (pip install 'meshcomm[mpi]')")
    local = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(local) if local.exists() else shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MESHCOMM_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "HYDRA_"))
    }
    # Open MPI refuses root and more ranks than cores unless told; MPICH ignores these.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env["OMPI_MCA_rmaps_base_oversubscribe"] = "1"
    env.setdefault("OMPI_MCA_plm_rsh_agent", "false")  # one host: no ssh needed, none there
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["MESHCOMM_TIMEOUT"] = "60"
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "mpi_cupy.py"
        script.write_text(_MPI_SCRIPT)
        proc = subprocess.run(
            [mpiexec, "-n", "2", sys.executable, str(script), str(REPO / "tests")],
            capture_output=True,
            text=True,
            env=env,
            timeout=TIMEOUT,
            check=False,
        )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("failures=0") == 2, proc.stdout


# == meshcomm.ops with torch CUDA tensors: CUDA in, CUDA out, gradients on the GPU ===========
def _torch_cuda_ops(group: Any) -> list[str]:
    import torch

    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    n, rank = group.size, group.rank
    device = torch.device("cuda", 0)
    problems: list[str] = []

    def host(r: int) -> np.ndarray:
        return np.arange(n * 2, dtype=np.float64).reshape(n, 2) + 10 * r

    x = torch.tensor(host(rank), device=device)
    before = x.clone()
    with init_device_mesh((n,), ("tp",)):
        wants = {
            "psum": (ops.psum(x, "tp"), sum(host(r) for r in range(n))),
            "all_gather": (ops.all_gather(x, "tp"), np.stack([host(r) for r in range(n)])),
            "psum_scatter": (ops.psum_scatter(x, "tp"), sum(host(r) for r in range(n))[rank]),
            "bfloat16 psum": (
                ops.psum(x.to(torch.bfloat16), "tp").float(),
                sum(host(r) for r in range(n)).astype(np.float32),
            ),
        }
        for name, (got, want) in wants.items():
            if not isinstance(got, torch.Tensor) or got.device != device:
                problems.append(
                    f"{name}: got {type(got).__name__} on {getattr(got, 'device', '?')}"
                )
            elif not np.allclose(got.cpu().numpy(), want):
                problems.append(f"{name}: got {got.cpu().numpy()}, expected {want}")
        # A gradient through all_gather: its backward (psum_scatter) runs on CUDA tensors too.
        w = x.clone().requires_grad_()
        (ops.all_gather(w, "tp") * 2).sum().backward()
        if w.grad is None or w.grad.device != device or not bool((w.grad == 2 * n).all()):
            problems.append(f"all_gather backward on CUDA: {w.grad}")
    if not bool((x == before).all()):
        problems.append("the input was modified")
    return problems


def test_ops_keep_torch_cuda_tensors_and_differentiate() -> None:
    pytest.importorskip("torch")
    for rank, problems in enumerate(run_ranks(_torch_cuda_ops, 2, timeout=TIMEOUT)):
        assert problems == [], f"rank {rank}: {problems}"


def _mixed_devices(group: Any) -> str:
    import cupy

    from meshcomm import ops
    from meshcomm.errors import CommError
    from meshcomm.mesh import init_device_mesh

    x = np.ones(4, np.float32)
    with init_device_mesh((group.size,), ("tp",)):
        try:
            ops.psum(cupy.asarray(x) if group.rank == 0 else x, "tp")
        except CommError as exc:
            return str(exc)
    return "no error"


def test_mixed_devices_across_ranks_are_named_in_debug_mode() -> None:
    messages = run_ranks(_mixed_devices, 2, timeout=TIMEOUT, env={"MESHCOMM_DEBUG": "DETAIL"})
    for message in messages:
        assert "global ranks [0] called all_reduce" in message and "on a GPU" in message, message
        assert "global ranks [1] called all_reduce" in message and "on the host" in message, message


# == meshcomm.ops with jax GPU arrays: GPU in, GPU out, jax.grad on the GPU =================
def _jax_gpu_ops(group: Any) -> list[str]:
    import jax
    import jax.numpy as jnp

    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    n, rank = group.size, group.rank
    gpu = jax.devices("gpu")[0]
    problems: list[str] = []
    x = jax.device_put(np.arange(4.0, dtype=np.float32) + rank, gpu)
    with init_device_mesh((n,), ("tp",)):
        y = ops.psum(x, "tp")
        want = sum(np.arange(4.0, dtype=np.float32) + r for r in range(n))
        if not isinstance(y, jax.Array) or y.devices() != {gpu}:
            where = y.devices() if isinstance(y, jax.Array) else "the host"
            problems.append(f"psum gave {type(y).__name__} on {where}")
        elif not np.allclose(np.asarray(y), want):
            problems.append(f"psum: {np.asarray(y)} != {want}")
        grad = jax.grad(lambda v: jnp.sum(ops.all_gather(v, "tp") * 2.0))(x)
        if grad.devices() != {gpu} or not np.allclose(np.asarray(grad), 2.0 * n):
            problems.append(f"all_gather gradient {np.asarray(grad)} on {grad.devices()}")
    return problems


def test_ops_keep_jax_gpu_arrays_and_differentiate() -> None:
    jax = pytest.importorskip("jax")
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"jax sees no GPU ({exc})")
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # ranks share the one GPU's memory
    for rank, problems in enumerate(run_ranks(_jax_gpu_ops, 2, timeout=TIMEOUT, env=env)):
        assert problems == [], f"rank {rank}: {problems}"
