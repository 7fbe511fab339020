"""What ``meshrun`` starts on this node: :class:`LaunchConfig`, and each rank's environment.

:func:`meshcomm.run.parse_args` builds the config from the command line; the supervisor
(:mod:`meshcomm.launcher.supervisor`) gives each rank :func:`child_environment`.

Example:
    >>> cfg = LaunchConfig(nproc_per_node=2, nnodes=1, node_rank=0, master_addr="127.0.0.1",
    ...                    master_port=0, bind_addr="127.0.0.1", command=("x",))
    >>> cfg.world_size, child_environment(cfg, 1, 29500, base={})["RANK"]
    (2, '1')
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from meshcomm.common.secret import SECRET_ENV
from meshcomm.launch import ELASTIC_ENV
from meshcomm.launcher.processes import DEFAULT_GRACE_PERIOD, SHADOWING_VARIABLES, rank_environment
from meshcomm.launcher.torchrun_options import TorchrunOptions, torchrun_environment

__all__ = ["START_METHODS", "START_METHOD_VARIABLE", "LaunchConfig", "child_environment"]

#: How ranks are started; see :class:`LaunchConfig`.
START_METHODS = ("fork", "spawn")
#: Environment variable giving the default ``--start-method``.
START_METHOD_VARIABLE = "MESHRUN_START_METHOD"


@dataclass(frozen=True)
class LaunchConfig:
    """Everything ``meshrun`` needs to start one node's ranks (see :func:`meshcomm.run.parse_args`).

    Attributes:
        nproc_per_node: ranks started on this node.
        nnodes: nodes in the job.
        node_rank: this node's index in ``[0, nnodes)``; node 0 hosts the store.
        master_addr: address every rank connects to for the store.
        master_port: port of the store; 0 lets the kernel pick (single node only).
        bind_addr: address this node's store binds (node 0 only).
        command: the argv each rank runs (interpreter included).
        script_file: the Python file the ranks run; None with ``-m`` or ``--no-python``.
        prefix: prefix each output line with ``[rankN] ``.
        grace_period: seconds between SIGTERM and SIGKILL when stopping ranks.
        run_id: ``TORCHELASTIC_RUN_ID`` given to the ranks.
        start_method: ``"fork"``: ranks are forked from the launcher, which imported numpy
            and meshcomm once (Python targets only); ``"spawn"``: each rank is a fresh
            process started from ``command``.
        backend: the backend ``meshcomm.init()`` picks in the ranks (None: its default);
            "mpi" starts the ranks through ``mpiexec``.
        elastic: a failed rank does not stop the others (``meshrun --elastic``); the ranks
            see ``MESHCOMM_ELASTIC=1``.
        mpiexec: the ``mpiexec`` for ``backend="mpi"``.
        secret: the job's ``MESHCOMM_SECRET`` given to every rank and to the store this node
            hosts; None runs the job unauthenticated (``--no-secret``).
        torchrun: torchrun's other flags: restarts, logs, rendezvous backend, role, ...
        torch_master_addr: ``MASTER_ADDR`` in the ranks: node 0's address, where torch's
            rank 0 serves torch's own store; None: ``master_addr``.
        torch_master_port: ``MASTER_PORT`` in the ranks: the port node 0's launcher keeps
            for torch's rank 0 (:mod:`meshcomm.launcher.torch_port`); None (a config that
            :func:`meshcomm.run.launch` has not prepared) names meshrun's store instead.
    """

    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    bind_addr: str
    command: tuple[str, ...]
    prefix: bool = True
    grace_period: float = DEFAULT_GRACE_PERIOD
    run_id: str = "none"
    script_file: str | None = None
    start_method: str = "spawn"
    backend: str | None = None
    elastic: bool = False
    mpiexec: str | None = None
    # Never in a repr: a LaunchConfig may be printed or logged.
    secret: str | None = field(default=None, repr=False)
    torchrun: TorchrunOptions = field(default_factory=TorchrunOptions)
    torch_master_addr: str | None = None
    torch_master_port: int | None = None

    @property
    def world_size(self) -> int:
        """Ranks in the whole job: ``nnodes * nproc_per_node``."""
        return self.nnodes * self.nproc_per_node


def child_environment(
    config: LaunchConfig,
    local_rank: int,
    master_port: int,
    base: dict[str, str] | None = None,
    *,
    restart: int = 0,
    rank_log_dir: str | None = None,
) -> dict[str, str]:
    """Return the environment of one rank: ``base`` plus the torchrun variables.

    meshcomm finds meshrun's store through ``MESHCOMM_MASTER_ADDR``/``MESHCOMM_MASTER_PORT``
    (with ``MESHCOMM_STORE_HOSTED=1``); ``MASTER_ADDR``/``MASTER_PORT`` are left to torch's
    own ``init_process_group``, whose rank 0 serves torch's store there
    (``config.torch_master_*``), as it does without torchrun's agent.

    Args:
        config: the launch configuration.
        local_rank: the rank's index on this node, in ``[0, nproc_per_node)``.
        master_port: the store's actual port (the kernel's pick when configured as 0).
        base: the environment to extend; None means ``os.environ``.
        restart: ``TORCHELASTIC_RESTART_COUNT``: how many times this node's ranks restarted.
        rank_log_dir: the rank's ``attempt_<n>/<local_rank>`` log directory, if any; its
            ``error.json`` becomes ``TORCHELASTIC_ERROR_FILE`` (torch's ``@record`` writes it).

    Example:
        >>> from meshcomm.run import parse_args
        >>> cfg = parse_args(["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1",
        ...                   "--master-addr", "10.0.0.1", "--no-secret", "x.py"])
        >>> env = child_environment(cfg, 1, 29500, base={})
        >>> env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["GROUP_RANK"]
        ('3', '4', '1', '1')
        >>> "MESHCOMM_SECRET" in env  # --no-secret; else the job's secret
        False
        >>> env["MESHCOMM_MASTER_ADDR"], env["MESHCOMM_MASTER_PORT"]  # meshrun's store
        ('10.0.0.1', '29500')
    """
    env = dict(os.environ if base is None else base)
    for name in SHADOWING_VARIABLES:
        env.pop(name, None)
    env.update(
        rank_environment(
            rank=config.node_rank * config.nproc_per_node + local_rank,
            world_size=config.world_size,
            local_rank=local_rank,
            local_world_size=config.nproc_per_node,
            master_addr=config.master_addr,
            master_port=master_port,
            group_rank=config.node_rank,
            group_world_size=config.nnodes,
            run_id=config.run_id,
        )
    )
    # meshcomm's own variables outrank MASTER_*, so meshcomm.init() keeps meshrun's store
    # whatever torch's rank 0 serves on MASTER_PORT.
    env["MESHCOMM_MASTER_ADDR"] = config.master_addr
    env["MESHCOMM_MASTER_PORT"] = str(master_port)
    if config.torch_master_port is not None:
        env["MASTER_ADDR"] = config.torch_master_addr or config.master_addr
        env["MASTER_PORT"] = str(config.torch_master_port)
    # An inherited True (meshrun inside a torchrun worker) would make torch's rank 0 wait
    # for an agent's store that nobody serves here.
    env["TORCHELASTIC_USE_AGENT_STORE"] = "False"
    torchrun_environment(env, config.torchrun, local_rank, restart, rank_log_dir)
    env["PYTHONUNBUFFERED"] = "1"
    if config.secret:
        env[SECRET_ENV] = config.secret
    else:
        env.pop(SECRET_ENV, None)  # --no-secret: an inherited secret would contradict it
    if config.backend is not None:
        env["MESHCOMM_BACKEND"] = config.backend
    if config.elastic:
        env[ELASTIC_ENV] = "1"
    else:
        env.pop(ELASTIC_ENV, None)
    if config.nproc_per_node > 1:
        # N ranks each starting a BLAS thread per core would oversubscribe the cores N times.
        env.setdefault("OMP_NUM_THREADS", "1")
    return env
