"""The CUDA IPC path on a GPU: ranks that share one GPU collect on the device (issue 36).

Needs an NVIDIA GPU and cupy; skipped with the reason elsewhere (CI, the CPU checks run the
same protocol over the shared-memory stand-in: tests/test_cuda_ipc.py). On a lent machine:

    python -m pytest tests/test_gpu_ipc.py -v        (or: bash bench/gpu_checks.sh ipc)

At worlds 2 and 4, every rank on GPU 0: the world started with the default backend takes
the path (``group.backend == "cpu:tcp,cuda:cuda_ipc"``); every primitive of the device
communicator equals the numpy oracle for every op and dtype cupy holds (with
``MESHCOMM_CUDA_IPC_EVENTS`` off and on); the conformance suite through cupy inputs equals
the host path; ``meshcomm.ops`` keeps cupy arrays, torch CUDA tensors and jax GPU arrays
on the device, and their gradients; opened windows are cached.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_gpu import SKIP  # cupy and a GPU, or why not

from meshcomm.testing import run_ranks

TIMEOUT = 240.0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(SKIP), reason=SKIP or "ok")]
#: Every rank on GPU 0, and the path asked for (a world of run_ranks names its backend).
ON_ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0", "MESHCOMM_CUDA_IPC": "1"}


def _on_ipc(group: Any) -> None:
    if group.device_backend != "cuda_ipc":
        raise AssertionError(f"the world runs {group.backend!r}, not the cuda_ipc path")


def _chosen(group: Any) -> tuple[str, str | None]:
    from meshcomm.backends.cuda_ipc.selection import last_choice

    choice = last_choice()
    return group.backend, None if choice is None else choice.reason


@pytest.mark.parametrize("nprocs", [2, 4])
def test_the_default_world_on_one_gpu_takes_the_path(nprocs: int) -> None:
    unnamed: Any = None
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    for backend, reason in run_ranks(_chosen, nprocs, timeout=TIMEOUT, backend=unnamed, env=env):
        assert backend == "cpu:tcp,cuda:cuda_ipc", (backend, reason)
        assert reason == f"{nprocs} ranks share 1 GPU on this host", reason


def _primitives(group: Any) -> list[str]:
    import cupy
    from test_cuda_ipc import check_collectives

    _on_ipc(group)
    return check_collectives(group._device, cupy)


@pytest.mark.parametrize("events", ["0", "1"])
@pytest.mark.parametrize("nprocs", [2, 4])
def test_every_primitive_equals_the_numpy_oracle(nprocs: int, events: str) -> None:
    env = {**ON_ONE_GPU, "MESHCOMM_CUDA_IPC_EVENTS": events}
    for problems in run_ranks(_primitives, nprocs, timeout=TIMEOUT, env=env):
        assert problems == [], "\n".join(problems[:20])


def _conformance(group: Any) -> list[str]:
    from test_gpu import _conformance_on_device

    _on_ipc(group)
    return _conformance_on_device(group)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_the_conformance_suite_on_device_memory_equals_the_host_path(nprocs: int) -> None:
    for rank, failures in enumerate(
        run_ranks(_conformance, nprocs, timeout=TIMEOUT, env=ON_ONE_GPU)
    ):
        assert failures == [], f"rank {rank}: " + "\n".join(failures[:20])


def _ops(group: Any) -> list[str]:
    from test_gpu import _ops_on_device

    _on_ipc(group)
    return _ops_on_device(group)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_ops_keep_cupy_arrays(nprocs: int) -> None:
    for rank, problems in enumerate(run_ranks(_ops, nprocs, timeout=TIMEOUT, env=ON_ONE_GPU)):
        assert problems == [], f"rank {rank}: {problems}"


def _torch(group: Any) -> list[str]:
    from test_gpu import _torch_cuda_ops

    _on_ipc(group)
    return _torch_cuda_ops(group)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_ops_keep_torch_cuda_tensors_and_differentiate(nprocs: int) -> None:
    pytest.importorskip("torch")
    for rank, problems in enumerate(run_ranks(_torch, nprocs, timeout=TIMEOUT, env=ON_ONE_GPU)):
        assert problems == [], f"rank {rank}: {problems}"


def _jax(group: Any) -> list[str]:
    from test_gpu import _jax_gpu_ops

    _on_ipc(group)
    return _jax_gpu_ops(group)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_ops_keep_jax_gpu_arrays_and_differentiate(nprocs: int) -> None:
    jax = pytest.importorskip("jax")
    try:
        jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"jax sees no GPU ({exc})")
    env = {**ON_ONE_GPU, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    for rank, problems in enumerate(run_ranks(_jax, nprocs, timeout=TIMEOUT, env=env)):
        assert problems == [], f"rank {rank}: {problems}"


def _cached(group: Any) -> tuple[int, int]:
    import cupy

    from meshcomm.reduction import ReduceOp

    _on_ipc(group)
    dev = group._device
    x = cupy.ones(1 << 10, cupy.float32)
    for _ in range(20):
        dev.all_reduce(x, ReduceOp.SUM)
    cupy.cuda.runtime.deviceSynchronize()
    return dev._mem.opens, int(float(x[0]))


def test_opened_windows_are_cached() -> None:
    for opens, first in run_ranks(_cached, 4, timeout=TIMEOUT, env=ON_ONE_GPU):
        assert opens == 3, opens  # once per peer, not per call
        assert first == 4**20, first
