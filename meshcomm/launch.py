"""Launcher detection: what the program that started this process says about it.

:func:`detect_launch` reads a launcher's environment variables. It is a pure function over a
mapping, so it is tested with plain dicts. Launchers, first match wins::

    meshcomm   MESHCOMM_RANK, MESHCOMM_WORLD_SIZE, MESHCOMM_LOCAL_RANK, ...
    torchrun   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (also meshrun, meshcomm.spawn)
    openmpi    OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK, ...
    mpich      PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS (Hydra, Intel MPI)
    slurm      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (only inside an ``srun`` step)
    single     none of the above: a world of one

An ipyparallel engine (``IPP_CLUSTER_ID``, ``IPP_PROFILE_DIR``, ``IPP_CONNECTION_INFO``, or an
engine id in the running kernel) is no launcher: it has no rank or world size of its own.
:func:`detect_ipyparallel` recognises one, so that ``meshcomm.init()`` there says what it
needs (``meshcomm.jupyter.start_cluster`` provides it) instead of making a world of one.

The store address comes from ``MESHCOMM_MASTER_ADDR``/``MESHCOMM_MASTER_PORT``, then
``MASTER_ADDR``/``MASTER_PORT``, then (SLURM only) the first node of the step's node list.
Who serves the store there (:attr:`LaunchInfo.store_host`) is rank 0, unless
``MESHCOMM_STORE_HOSTED=1`` (meshrun and spawn host a meshcomm store) or
``TORCHELASTIC_USE_AGENT_STORE=True`` (torchrun's agent serves torch's own TCPStore).

Under an MPI launcher with no store address, :func:`mpi_share_store_address` lets rank 0
start the store and sends its address to the other ranks through MPI itself (mpi4py,
imported only then).

Example:
    >>> info = detect_launch({"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
    ...                       "MASTER_PORT": "29500"})
    >>> info.launcher, info.rank, info.world_size, info.master_addr, info.master_port
    ('torchrun', 1, 4, '10.0.0.1', 29500)
    >>> info.store_host
    'rank0'
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from meshcomm.errors import InvalidArgument, MeshCommError, RendezvousError

__all__ = [
    "ELASTIC_ENV",
    "JOIN_ENV",
    "STORE_HOSTS",
    "LaunchInfo",
    "check_port",
    "check_rank_size",
    "detect_ipyparallel",
    "detect_launch",
    "expand_nodelist",
    "mpi_share_store_address",
    "running_engine_id",
    "started_by_mpi",
]

#: Set to "1" by ``meshrun --elastic``: the launcher lets the other ranks go on when one
#: fails (:mod:`meshcomm.elastic` shrinks the world).
ELASTIC_ENV = "MESHCOMM_ELASTIC"
#: Set to "1" in a rank that ``meshrun --elastic --max-restarts`` started in place of a lost
#: one: its ElasticMesh joins the running mesh instead of forming the first world.
JOIN_ENV = "MESHCOMM_ELASTIC_JOIN"
#: Values of :attr:`LaunchInfo.store_host`: who serves the store at the master address.
STORE_HOSTS = ("rank0", "launcher", "torchelastic")

#: Launcher variables, in precedence order: (name, rank, size, local rank, local size).
_LAUNCHERS = (
    (
        "meshcomm",
        "MESHCOMM_RANK",
        "MESHCOMM_WORLD_SIZE",
        "MESHCOMM_LOCAL_RANK",
        "MESHCOMM_LOCAL_WORLD_SIZE",
    ),
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)
_MPI_LAUNCHERS = ("openmpi", "mpich")
# Set in the ranks of an ``srun`` step only when SLURM wired an MPI process manager interface
# into it (``--mpi=pmi2``, ``--mpi=pmix``); a plain ``srun --mpi=none`` sets none of them.
_SLURM_MPI_VARS = ("PMI_RANK", "PMI_FD", "PMIX_RANK", "PMIX_NAMESPACE")
# A SLURM job with no MASTER_PORT derives one from its job id: every rank computes the same
# port without talking, and concurrent jobs on one node rarely collide. The range stays below
# Linux's ephemeral ports (32768+) so outgoing connections do not take it first.
_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 15000
# Hostnames are at most 255 bytes (DNS); fixed-size MPI buffers keep pickle off the wire.
_MPI_NAME_BYTES = 256
_MPI_ADDR_BYTES = 1024


@dataclass(frozen=True)
class LaunchInfo:
    """What a launcher's environment says about this process.

    Attributes:
        launcher: "meshcomm", "torchrun", "openmpi", "mpich", "slurm" or "single".
        rank: this process's world rank.
        world_size: number of processes in the world.
        local_rank: rank among the processes on this host, None if the launcher does not say.
        local_world_size: processes on this host, None if the launcher does not say.
        master_addr: host of the rendezvous store, None if unknown.
        master_port: port of the rendezvous store, None if unknown.
        store_host: who serves the store at the master address: "rank0" (rank 0 starts a
            meshcomm store), "launcher" (meshrun or spawn serve a meshcomm store) or
            "torchelastic" (torchrun's agent serves a torch TCPStore).

    Example:
        >>> LaunchInfo("single", 0, 1, 0, 1, None, None).world_size
        1
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    master_addr: str | None
    master_port: int | None
    store_host: str = "rank0"

    @property
    def is_mpi(self) -> bool:
        """True under an MPI launcher (Open MPI, MPICH, Intel MPI)."""
        return self.launcher in _MPI_LAUNCHERS


def check_port(port: int, source: str) -> int:
    """Return ``port`` if it is in [1, 65535]; ``source`` names it in the error.

    Raises:
        InvalidArgument: the port is out of range.

    Example:
        >>> check_port(29500, "MASTER_PORT")
        29500
    """
    if not 1 <= port <= 65535:
        raise InvalidArgument(f"{source} must be a port in [1, 65535], got {port}")
    return port


def check_rank_size(rank: int, world_size: int, source: str) -> None:
    """Check that ``rank`` lies in a world of ``world_size``; ``source`` names both.

    Raises:
        InvalidArgument: the world size is below 1 or the rank outside [0, world_size).

    Example:
        >>> check_rank_size(1, 2, "RANK=1, WORLD_SIZE=2")  # rank 1 of 2: fine, returns None
        >>> check_rank_size(2, 2, "RANK=2, WORLD_SIZE=2")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        meshcomm.errors.InvalidArgument: rank must be in [0, 2) for a world of 2, got 2 (...)
    """
    if world_size <= 0:
        raise InvalidArgument(f"world size must be >= 1, got {world_size} ({source})")
    if rank < 0:
        raise InvalidArgument(f"rank must be >= 0, got {rank} ({source})")
    if rank >= world_size:
        raise InvalidArgument(
            f"rank must be in [0, {world_size}) for a world of {world_size}, got {rank} ({source})"
        )


def _env_int(env: Mapping[str, str], var: str, launcher: str, minimum: int) -> int | None:
    raw = env.get(var)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise InvalidArgument(
            f"environment variable {var} (launcher {launcher}) must be an integer, got {raw!r}"
        ) from None
    if value < minimum:
        raise InvalidArgument(
            f"environment variable {var} (launcher {launcher}) must be >= {minimum}, got {value}"
        )
    return value


def _env_flag(env: Mapping[str, str], var: str) -> bool:
    raw = env.get(var, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise InvalidArgument(f"{var} must be 0 or 1 (or true/false), got {env[var]!r}")


# -- SLURM ------------------------------------------------------------------------------------


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list such as ``"node[03-05,07],gpu1"`` into host names.

    Ranges keep their zero padding; several bracket groups in one name expand as a product.

    Raises:
        InvalidArgument: the list is empty or malformed (unbalanced brackets, bad range).

    Example:
        >>> expand_nodelist("node[03-05,07],gpu1")
        ['node03', 'node04', 'node05', 'node07', 'gpu1']
        >>> expand_nodelist("r[1-2]n[1,3]")
        ['r1n1', 'r1n3', 'r2n1', 'r2n3']
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist):
        names = [""]
        for literal, group in re.findall(r"([^\[\]]*)(?:\[([^\[\]]*)\])?", item):
            suffixes = _expand_ranges(group, nodelist) if group else [""]
            names = [n + literal + s for n in names for s in suffixes]
        hosts.extend(names)
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            break
        if ch == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    items.append(nodelist[start:])
    if depth != 0 or any(not item.strip() for item in items):
        raise InvalidArgument(f"malformed SLURM node list {nodelist!r}")
    return [item.strip() for item in items]


def _expand_ranges(group: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for part in group.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if match is None:
            raise InvalidArgument(f"malformed range {part!r} in SLURM node list {nodelist!r}")
        lo, hi = match.group(1), match.group(2) or match.group(1)
        if int(hi) < int(lo):
            raise InvalidArgument(f"descending range {part!r} in SLURM node list {nodelist!r}")
        out.extend(str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1))
    return out


def _slurm_tasks_on_node(spec: str, node_id: int) -> int | None:
    # SLURM_STEP_TASKS_PER_NODE looks like "2(x3),1": 2 tasks on 3 nodes, then 1.
    node = 0
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return None
        node += int(match.group(2) or 1)
        if node_id < node:
            return int(match.group(1))
    return None


def _slurm_extras(env: Mapping[str, str]) -> tuple[int | None, str | None, int | None]:
    local_size = _env_int(env, "SLURM_NTASKS_PER_NODE", "slurm", 1)
    node_id = _env_int(env, "SLURM_NODEID", "slurm", 0)
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if local_size is None and spec and node_id is not None:
        local_size = _slurm_tasks_on_node(spec, node_id)
    nodelist = (
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    )
    master = expand_nodelist(nodelist)[0] if nodelist else None
    job_id = _env_int(env, "SLURM_JOB_ID", "slurm", 0)
    if job_id is None:
        job_id = _env_int(env, "SLURM_JOBID", "slurm", 0)
    port = None if job_id is None else _SLURM_PORT_BASE + job_id % _SLURM_PORT_SPAN
    return local_size, master, port


# -- detection --------------------------------------------------------------------------------


def detect_launch(env: Mapping[str, str]) -> LaunchInfo:
    """Work out rank, world size and the store's address from a launcher's environment.

    A pure function: pass ``os.environ`` or any mapping. The first launcher whose rank and
    size variables are present wins (see the module docstring for the order). SLURM counts
    only inside a job step started by ``srun`` (``SLURM_STEP_ID`` or ``SLURM_STEPID`` set),
    not in the batch script of an allocation.

    The store is torchrun's agent store ("torchelastic") when ``TORCHELASTIC_USE_AGENT_STORE``
    is true and neither ``MESHCOMM_STORE_HOSTED`` nor a ``MESHCOMM_MASTER_*`` address says
    otherwise: an explicit meshcomm setting always wins over the inherited torch one.

    Args:
        env: environment variables.

    Returns:
        The launch description; a world of one ("single") when no launcher is found.

    Raises:
        InvalidArgument: a variable is not an integer, only one of a launcher's rank and size
            variables is set, the rank is outside the world, or a flag is not 0/1/true/false.

    Example:
        >>> detect_launch({}).launcher
        'single'
        >>> info = detect_launch({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"})
        >>> info.launcher, info.rank, info.master_addr
        ('openmpi', 2, None)
        >>> detect_launch({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost",
        ...                "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}
        ...              ).store_host
        'torchelastic'
    """
    store_host = _store_host(env)
    for name, rank_var, size_var, local_var, local_size_var in _LAUNCHERS:
        if name == "slurm" and "SLURM_STEP_ID" not in env and "SLURM_STEPID" not in env:
            continue
        if rank_var not in env and size_var not in env:
            continue
        if rank_var not in env or size_var not in env:
            present, missing = (rank_var, size_var) if rank_var in env else (size_var, rank_var)
            raise InvalidArgument(
                f"launcher {name}: {present} is set but {missing} is not; set both or neither"
            )
        rank = _env_int(env, rank_var, name, 0)
        size = _env_int(env, size_var, name, 1)
        assert rank is not None and size is not None  # both present, checked above
        check_rank_size(rank, size, f"{rank_var}={rank}, {size_var}={size}")
        local_rank = _env_int(env, local_var, name, 0)
        local_size = _env_int(env, local_size_var, name, 1)
        derived_addr, derived_port = None, None
        if name == "slurm":
            local_size, derived_addr, derived_port = _slurm_extras(env)
        addr, port = _master_from_env(env, derived_addr, derived_port)
        return LaunchInfo(name, rank, size, local_rank, local_size, addr, port, store_host)
    addr, port = _master_from_env(env, None, None)
    return LaunchInfo("single", 0, 1, 0, 1, addr, port, store_host)


#: Variables ipyparallel's launchers set in every engine they start.
_IPP_VARS = ("IPP_CLUSTER_ID", "IPP_PROFILE_DIR", "IPP_CONNECTION_INFO")


def detect_ipyparallel(env: Mapping[str, str], engine_id: int | None = None) -> str | None:
    """Describe the ipyparallel engine this process is, or return None if it is none.

    A pure function like :func:`detect_launch`; ``engine_id`` is the id of the running
    engine kernel when the caller knows it (:func:`running_engine_id`).

    Example:
        >>> detect_ipyparallel({"IPP_CLUSTER_ID": "1700000000-ab12"}, engine_id=3)
        'ipyparallel engine 3 (cluster 1700000000-ab12)'
        >>> detect_ipyparallel({}) is None
        True
    """
    present = [var for var in _IPP_VARS if env.get(var)]
    if not present and engine_id is None:
        return None
    text = "ipyparallel engine" if engine_id is None else f"ipyparallel engine {engine_id}"
    cluster = env.get("IPP_CLUSTER_ID")
    if cluster:
        return f"{text} (cluster {cluster})"
    if present:
        return f"{text} ({', '.join(present)} set)"
    return text


def running_engine_id() -> int | None:
    """Return the engine id if this process runs an ipyparallel engine kernel, else None.

    Looks only at modules already imported: it never imports IPython or ipyparallel.

    Example:
        >>> running_engine_id() is None  # a plain interpreter
        True
    """
    import sys

    if "ipyparallel" not in sys.modules or "IPython" not in sys.modules:
        return None
    try:
        shell = sys.modules["IPython"].get_ipython()
        engine_id = getattr(getattr(shell, "kernel", None), "engine_id", None)
    except Exception:  # a half-initialised IPython is no engine we can name
        return None
    if isinstance(engine_id, int) and engine_id >= 0:
        return engine_id
    return None


def started_by_mpi(env: Mapping[str, str]) -> bool:
    """True when an MPI launcher started this process as a rank of one MPI job.

    That is ``mpiexec``/``mpirun`` (Open MPI, MPICH, Intel MPI, MVAPICH), or an ``srun`` step
    with an MPI plugin (``--mpi=pmi2``/``pmix``: the PMI variables are set). A launcher that
    starts each rank as its own process (meshrun, torchrun, ``meshcomm.spawn``) wins even
    inside an outer ``mpiexec``: its ranks are not one MPI job. A pure function over ``env``.

    Example:
        >>> started_by_mpi({"PMI_RANK": "0", "PMI_SIZE": "2"})
        True
        >>> started_by_mpi({"RANK": "0", "WORLD_SIZE": "2", "PMI_RANK": "0", "PMI_SIZE": "1"})
        False
        >>> started_by_mpi({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"})
        False
        >>> started_by_mpi({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
        ...                 "PMIX_RANK": "0"})
        True
    """
    info = detect_launch(env)
    if info.is_mpi:
        return True
    return info.launcher == "slurm" and any(env.get(v) for v in _SLURM_MPI_VARS)


def _store_host(env: Mapping[str, str]) -> str:
    if _env_flag(env, "MESHCOMM_STORE_HOSTED"):
        return "launcher"
    # torch itself accepts only "True"; "1" and any case are accepted here too.
    agent = _env_flag(env, "TORCHELASTIC_USE_AGENT_STORE")
    if agent and not env.get("MESHCOMM_MASTER_ADDR") and not env.get("MESHCOMM_MASTER_PORT"):
        return "torchelastic"
    return "rank0"


def _master_from_env(
    env: Mapping[str, str], derived_addr: str | None, derived_port: int | None
) -> tuple[str | None, int | None]:
    addr = env.get("MESHCOMM_MASTER_ADDR") or env.get("MASTER_ADDR") or derived_addr
    port: int | None = derived_port
    for var in ("MESHCOMM_MASTER_PORT", "MASTER_PORT"):
        value = _env_int(env, var, "env", 1) if env.get(var) else None
        if value is not None:
            port = check_port(value, f"environment variable {var}")
            break
    return (addr.strip() if addr else None), port


# -- the store address through MPI ------------------------------------------------------------


def mpi_share_store_address(
    rank: int, world_size: int, deadline: float, start_server: Callable[[str], int]
) -> tuple[str, int]:
    """Under an MPI launcher, give every rank the address of a store that rank 0 starts.

    Every rank takes part (it is collective over ``MPI_COMM_WORLD``). Rank 0 calls
    ``start_server(host)`` with 127.0.0.1 when all ranks share its host, else with its
    address on the interface that reaches the others; a failure there reaches every rank.
    MPI operations are non-blocking and polled, so none outlives ``deadline``.

    Args:
        rank: this process's rank (must match ``MPI_COMM_WORLD``).
        world_size: the world size (must match ``MPI_COMM_WORLD``).
        deadline: ``time.monotonic()`` value after which a pending MPI operation fails.
        start_server: on rank 0 only: start the store on ``host`` and return its port.

    Returns:
        The store's (host, port), the same on every rank.

    Raises:
        RendezvousError: mpi4py is missing, the ranks do not match MPI's, the deadline passed,
            or rank 0 could not start the store (every rank gets rank 0's reason).

    Example:
        Under ``mpiexec``, on every rank (``start`` starts the store and returns its port)::

            host, port = mpi_share_store_address(rank, size, time.monotonic() + 60, start)
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RendezvousError(
            f"rank {rank}: started by an MPI launcher without MASTER_ADDR/MASTER_PORT, so the "
            "store address must travel through MPI, which needs mpi4py: "
            "pip install meshcomm[mpi], or set MASTER_ADDR and MASTER_PORT"
        ) from exc
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (rank, world_size):
        raise RendezvousError(
            f"rank {rank} of {world_size} does not match MPI_COMM_WORLD (rank {comm.Get_rank()} "
            f"of {comm.Get_size()}); set MASTER_ADDR and MASTER_PORT to rendezvous without MPI"
        )
    names = _mpi_allgather_name(MPI, comm, socket.gethostname(), deadline)
    payload: dict[str, Any] = {}
    if rank == 0:
        try:
            host = "127.0.0.1" if len(set(names)) == 1 else _routable_address(names)
            payload = {"host": host, "port": int(start_server(host))}
        except (MeshCommError, OSError) as exc:
            # Every rank must still get an answer, or they would wait out the timeout in MPI.
            payload = {"error": f"rank 0 could not start the store server: {exc}"[:800]}
    payload = _mpi_bcast_json(MPI, comm, payload, deadline)
    if "error" in payload:
        raise RendezvousError(f"rank {rank}: {payload['error']}")
    try:
        return str(payload["host"]), int(payload["port"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RendezvousError(f"rank 0 broadcast a malformed store address: {payload!r}") from exc


def _mpi_wait(request: Any, deadline: float, what: str) -> None:
    delay = 0.0005
    while not request.Test():
        if time.monotonic() >= deadline:
            raise RendezvousError(f"MPI {what} did not complete before the rendezvous timeout")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _mpi_allgather_name(mpi: Any, comm: Any, name: str, deadline: float) -> list[str]:
    send = bytearray(_MPI_NAME_BYTES)
    raw = name.encode()[: _MPI_NAME_BYTES - 1]
    send[: len(raw)] = raw
    recv = bytearray(_MPI_NAME_BYTES * comm.Get_size())
    _mpi_wait(comm.Iallgather([send, mpi.BYTE], [recv, mpi.BYTE]), deadline, "hostname allgather")
    chunks = (recv[i : i + _MPI_NAME_BYTES] for i in range(0, len(recv), _MPI_NAME_BYTES))
    return [bytes(chunk).rstrip(b"\0").decode(errors="replace") for chunk in chunks]


def _mpi_bcast_json(
    mpi: Any, comm: Any, payload: dict[str, Any], deadline: float
) -> dict[str, Any]:
    buf = bytearray(_MPI_ADDR_BYTES)
    raw = json.dumps(payload).encode()[:_MPI_ADDR_BYTES]
    buf[: len(raw)] = raw
    _mpi_wait(comm.Ibcast([buf, mpi.BYTE], root=0), deadline, "store address broadcast")
    try:
        decoded = json.loads(bytes(buf).rstrip(b"\0"))
    except ValueError as exc:
        raise RendezvousError(f"rank 0 broadcast a malformed store address: {exc}") from exc
    if not isinstance(decoded, dict):
        raise RendezvousError(f"rank 0 broadcast a malformed store address: {decoded!r}")
    return decoded


def _routable_address(peer_names: list[str]) -> str:
    """Return this host's address on the interface that reaches the other hosts."""
    me = socket.gethostname()
    for peer in peer_names:
        if peer == me:
            continue
        try:
            peer_ip = socket.gethostbyname(peer)
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                # connect() on UDP sends nothing; it only picks the outgoing interface.
                probe.connect((peer_ip, 9))
                address = str(probe.getsockname()[0])
            if not address.startswith("127."):
                return address
        except OSError:
            continue
    return socket.gethostbyname(me)
