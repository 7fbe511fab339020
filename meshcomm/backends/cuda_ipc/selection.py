"""When a world takes the CUDA IPC path for GPU arrays, decided by one pure function.

:func:`choose` reads only its arguments (the host backend, whether the caller named one,
the world and local sizes, the GPU count, each local rank's device, the peer access
between those devices, whether cupy is there, and ``MESHCOMM_CUDA_IPC``); the tests call
it with every case on a CPU. :func:`local_facts` asks cupy for the facts of this host;
:func:`world_device` makes the world's device communicator when every rank's choice is to
take the path (an all_gather of the choices, only on a host with cupy and a GPU, so a CPU
machine's worlds pay nothing), and logs why not once, at debug level, on logger
``meshcomm.backends.cuda_ipc`` (:func:`last_choice` returns it).

``MESHCOMM_CUDA_IPC``: unset or ``auto``: the path is taken by a world started with the
default backend (tcp, no backend named) whose ranks all run on this host, with fewer GPUs
than ranks (with a GPU for every rank, the default pairs tcp with nccl), where cupy is
installed and every pair of the GPUs used has peer access. ``1`` (``on``): take it
wherever it can run, named backend or not, nccl's case too (an error says why where it
cannot). ``0`` (``off``): never; GPU arrays are staged through host memory. A world that
names nccl (``"cpu:tcp,cuda:nccl"``, torch's ``init_process_group("nccl")``) on one host
with fewer GPUs than ranks takes this path instead, with a warning (:func:`instead_of_nccl`;
``0`` keeps nccl, which refuses two ranks on one GPU).

Example:
    >>> choose(backend="tcp", named=False, world_size=4, local_world_size=4, gpu_count=1,
    ...        device_ids=[0, 0, 0, 0], peer_access=[[True]], cupy=True, setting="")
    Choice(use=True, forced=False, reason='4 ranks share 1 GPU on this host')
    >>> choose(backend="tcp", named=False, world_size=4, local_world_size=4, gpu_count=1,
    ...        device_ids=[0, 0, 0, 0], peer_access=[[True]], cupy=False, setting="").reason
    'cupy is not installed'
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from meshcomm.backends.base import Communicator
from meshcomm.errors import InvalidArgument
from meshcomm.store.base import Store

__all__ = [
    "IPC_ENV",
    "Choice",
    "choose",
    "last_choice",
    "instead_of_nccl",
    "local_facts",
    "parse_setting",
    "world_device",
]

#: ``auto`` (default), ``1`` (take the path wherever it can run) or ``0`` (never).
IPC_ENV = "MESHCOMM_CUDA_IPC"
_LOG = logging.getLogger("meshcomm.backends.cuda_ipc")
_ON, _OFF = ("1", "on", "true", "yes", "force"), ("0", "off", "false", "no")
#: The world communicator's keys in the store.
_PREFIX = "meshcomm/cuda_ipc"


class Choice(NamedTuple):
    """Whether a world takes the CUDA IPC path, and why (in words, for the log).

    Attributes:
        use: take it.
        forced: it was asked for (``MESHCOMM_CUDA_IPC=1`` or ``cuda:cuda_ipc``): where
            ``use`` is False, the world raises instead of staging.
        reason: why, in words.

    Example:
        >>> Choice(False, False, "cupy is not installed").use
        False
    """

    use: bool
    forced: bool
    reason: str


class _Last:
    choice: Choice | None = None


def parse_setting(value: str | None) -> str:
    """``"auto"``, ``"on"`` or ``"off"`` from :data:`IPC_ENV`'s value.

    Raises:
        InvalidArgument: any other value, named with the accepted ones.

    Example:
        >>> parse_setting(None), parse_setting("1"), parse_setting(" OFF ")
        ('auto', 'on', 'off')
    """
    text = (value or "").strip().lower()
    if text in ("", "auto"):
        return "auto"
    if text in _ON:
        return "on"
    if text in _OFF:
        return "off"
    raise InvalidArgument(f"{IPC_ENV}={value!r}: expected auto, 1 (on) or 0 (off)")


def choose(
    *,
    backend: str,
    named: bool,
    world_size: int,
    local_world_size: int | None,
    gpu_count: int,
    device_ids: Sequence[int],
    peer_access: Sequence[Sequence[bool]],
    cupy: bool,
    setting: str | None,
) -> Choice:
    """Whether a world takes the CUDA IPC path for GPU arrays (module docstring).

    Args:
        backend: the host backend ("tcp", "mpi", "self").
        named: the caller named the backend (``init(backend=...)``, ``MESHCOMM_BACKEND``).
        world_size: ranks in the world.
        local_world_size: ranks on this host (None: unknown).
        gpu_count: GPUs this host's ranks see.
        device_ids: the GPU of each local rank.
        peer_access: ``peer_access[i][j]``: GPU i can read GPU j's memory.
        cupy: cupy can be imported.
        setting: :data:`IPC_ENV`'s value (None or empty: auto).

    Raises:
        InvalidArgument: ``setting`` is not a known value.

    Example:
        >>> choose(backend="tcp", named=False, world_size=2, local_world_size=2,
        ...        gpu_count=2, device_ids=[0, 1], peer_access=[[True, True], [True, True]],
        ...        cupy=True, setting=None).reason
        'a GPU for every rank: the default pairs tcp with nccl'
    """
    mode = parse_setting(setting)
    forced = mode == "on"

    def no(reason: str) -> Choice:
        return Choice(False, forced, reason)

    if mode == "off":
        return no(f"{IPC_ENV}=0")
    if backend != "tcp":
        return no(f"the host backend is {backend}; the cuda_ipc path runs beside tcp")
    if named and not forced:
        return no(
            f"a backend was named; {IPC_ENV}=1 or backend='cpu:tcp,cuda:cuda_ipc' asks for "
            "this path"
        )
    if world_size < 2 and not forced:
        return no("a world of one has nobody to share a GPU with")
    if local_world_size != world_size:
        return no(f"the world spans hosts ({world_size} ranks, {local_world_size} on this host)")
    if not cupy:
        return no("cupy is not installed")
    if gpu_count < 1:
        return no("cupy sees no GPU")
    if gpu_count >= world_size and not forced:
        return no("a GPU for every rank: the default pairs tcp with nccl")
    used = sorted(set(device_ids))
    for i in used:
        for j in used:
            if i != j and not peer_access[i][j]:
                return no(f"GPU {i} cannot read GPU {j}'s memory (no peer access)")
    gpus = f"{len(used)} GPU" + ("s" if len(used) > 1 else "")
    return Choice(True, forced, f"{world_size} ranks share {gpus} on this host")


def instead_of_nccl(
    *, world_size: int, local_world_size: int | None, gpu_count: int, setting: str | None
) -> str | None:
    """Why a world that named nccl takes the cuda_ipc path instead, or None where it keeps
    nccl: its ranks all run on this host and share fewer GPUs than there are ranks, which
    NCCL refuses ("Duplicate GPU detected"), unless :data:`IPC_ENV` is ``0``. A world that
    spans hosts, or a host without a GPU, keeps nccl (and its own error).

    Example:
        >>> instead_of_nccl(world_size=4, local_world_size=4, gpu_count=1, setting=None)
        '4 ranks share 1 GPU on this host, which NCCL refuses'
        >>> instead_of_nccl(world_size=4, local_world_size=4, gpu_count=4, setting=None) is None
        True
    """
    if parse_setting(setting) == "off" or world_size < 2 or local_world_size != world_size:
        return None
    if gpu_count < 1 or gpu_count >= world_size:
        return None
    gpus = f"{gpu_count} GPU" + ("s" if gpu_count > 1 else "")
    return f"{world_size} ranks share {gpus} on this host, which NCCL refuses"


def local_facts(local_world_size: int) -> tuple[bool, int, list[int], list[list[bool]]]:
    """This host's facts for :func:`choose`: cupy importable, the GPU count, each local
    rank's device (local rank modulo the count) and the peer access matrix. Nothing is
    imported on a host without ``/dev/nvidiactl`` or without cupy.

    Example:
        >>> has_cupy, count, ids, access = local_facts(2)
        >>> len(ids) == 2 and len(access) == count
        True
    """
    has_cupy = importlib.util.find_spec("cupy") is not None
    if not has_cupy or not os.path.exists("/dev/nvidiactl"):
        return has_cupy, 0, [0] * local_world_size, []
    import cupy

    runtime = cupy.cuda.runtime
    try:
        count = int(runtime.getDeviceCount())
    except Exception:  # cupy's CUDA errors: no driver, no device
        return True, 0, [0] * local_world_size, []
    access = [
        [i == j or bool(runtime.deviceCanAccessPeer(i, j)) for j in range(count)]
        for i in range(count)
    ]
    return True, count, [r % count for r in range(local_world_size)] if count else [], access


def last_choice() -> Choice | None:
    """The choice of this process's last :func:`world_device` (None: none made yet).

    Example:
        >>> last_choice() is None or isinstance(last_choice(), Choice)
        True
    """
    return _Last.choice


def world_device(
    host: Communicator,
    *,
    local_rank: int | None,
    local_world_size: int | None,
    store: Store | None,
    backend: str,
    named: bool,
    asked: bool,
    env: Mapping[str, str],
) -> Communicator | None:
    """The world's CUDA IPC device communicator, or None (GPU arrays staged).

    Args:
        host: the world's host communicator (the choices are gathered over it; the device
            communicator gets a host communicator of its own from it).
        local_rank, local_world_size: this rank on this host (from the launcher).
        store: the job's store (window handles travel through it).
        backend: the host backend; named: the caller named it; asked: the caller named
            ``cuda:cuda_ipc`` (as ``MESHCOMM_CUDA_IPC=1``).
        env: the environment (``MESHCOMM_CUDA_IPC``).

    Raises:
        InvalidArgument: the path was asked for and cannot run (why), or a rank of the
            world refused it.
    """
    size = host.size
    local = local_world_size if local_world_size is not None else (1 if size == 1 else 0)
    has_cupy, count, ids, access = local_facts(max(local, 1))
    setting = "on" if asked else env.get(IPC_ENV)
    choice = choose(
        backend=backend,
        named=named,
        world_size=size,
        local_world_size=local_world_size,
        gpu_count=count,
        device_ids=ids,
        peer_access=access,
        cupy=has_cupy,
        setting=setting,
    )
    # Every rank of one host has the same facts; only its setting may differ: agree.
    if size > 1 and backend == "tcp" and has_cupy and count and local == size:
        votes = np.empty(size, np.int64)
        host.all_gather(np.array([int(choice.use)], np.int64), votes)
        refused = [r for r in range(size) if not votes[r]]
        if choice.use and refused:
            choice = Choice(False, choice.forced, f"rank {refused[0]} did not take it")
    _Last.choice = choice
    _LOG.debug(
        "rank %d: cuda_ipc path %s: %s", host.rank, "on" if choice.use else "off", choice.reason
    )
    if not choice.use:
        if choice.forced:
            raise InvalidArgument(
                f"rank {host.rank}: the cuda_ipc path cannot run: {choice.reason}"
            )
        return None
    if store is None:  # a world of one (asked for): its handles stay in this process
        from meshcomm.store import HashStore

        store = HashStore()
    import cupy

    here = host.rank if local_rank is None else local_rank  # one host: the world rank
    cupy.cuda.Device(ids[here % len(ids)]).use()
    from meshcomm.backends.cuda_ipc.communicator import IpcCommunicator
    from meshcomm.backends.cuda_ipc.memory import CudaIpcMemory

    return IpcCommunicator(host.sub(list(range(size))), CudaIpcMemory(), store, _PREFIX)
