"""``meshrun``: start one process per rank, torchrun-style, and supervise them.

Usage (the same spellings as ``torchrun``; ``--nproc_per_node`` works too)::

    meshrun --nproc-per-node 4 train.py --lr 0.1
    meshrun --nproc-per-node 4 -m mypkg.train
    meshrun --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 \\
        --nproc-per-node 8 train.py

Each rank gets the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), so
``meshcomm.init()`` (and ``torch.distributed.init_process_group("env://")``) work unchanged.
The launcher itself hosts the rendezvous store and sets ``MESHCOMM_STORE_HOSTED=1``: on one
node it binds 127.0.0.1 on a port the kernel picks (no race), on several nodes node 0 binds
``--master-port`` on every interface.

``--backend mpi`` starts the ranks as one MPI job instead, through ``mpiexec`` (see
:mod:`meshcomm._mpiexec`): same output labels, same stop-everything-on-failure, same exit
status. ``--backend NAME`` otherwise sets ``MESHCOMM_BACKEND`` for ``meshcomm.init()``.

Output lines are prefixed ``[rank3] ``. If a rank fails, the others get SIGTERM, then
SIGKILL after ``--grace-period`` seconds; ``meshrun`` prints which rank failed and the tail of
its stderr, and exits with that rank's status (128 + N for signal N). Ctrl-C stops every rank
and exits 130. Ranks die with ``meshrun`` even if it is SIGKILLed (Linux).

Every torchrun 2.13 flag is accepted (docs/launch.md has the table): ``--max-restarts N``
restarts this node's ranks after a failure (each attempt in a fresh store, with
``TORCHELASTIC_RESTART_COUNT``); ``--log-dir``, ``-r/--redirects``, ``-t/--tee`` and
``--local-ranks-filter`` route the ranks' output as torchrun does (:mod:`meshcomm._rank_logs`);
``--rdzv-backend static|c10d --rdzv-endpoint HOST:PORT`` names the store, c10d numbering the
nodes as they join (:mod:`meshcomm._node_rdzv`). The flags are parsed in
:mod:`meshcomm._run_options`.

By default (``--start-method fork``) a Python program's ranks are forked from ``meshrun``
after it imported numpy and meshcomm once (:mod:`meshcomm._forkrun`), which makes a short
job several times faster on a few cores; ``--start-method spawn`` (or
``MESHRUN_START_METHOD=spawn``) starts a fresh interpreter per rank.

Example:
    >>> import subprocess, sys
    >>> cmd = [sys.executable, "-m", "meshcomm.run", "--nproc-per-node", "2",
    ...        "-m", "platform"]
    >>> out = subprocess.run(cmd, capture_output=True, timeout=60).stdout.decode()
    >>> sorted(line.split()[0] for line in out.splitlines())
    ['[rank0]', '[rank1]']
"""

from __future__ import annotations

import argparse
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from meshcomm._forkrun import can_fork, fork_rank, preload, single_threaded
from meshcomm._launch_secret import launch_secret, read_secret_file
from meshcomm._procs import (
    DEFAULT_GRACE_PERIOD,
    SHADOWING_VARIABLES,
    describe_exit,
    exit_status,
    rank_environment,
    send_signal,
    signal_name,
    supervised_command,
)
from meshcomm._rank_logs import AttemptLogs, Route, RunLogs
from meshcomm._report import REPORT_DIR_ENV, TIMEOUT_FILE
from meshcomm._run_options import (
    STOP_SIGNALS,
    TorchrunOptions,
    add_torchrun_flags,
    apply_pet_defaults,
    refuse_under_mpiexec,
    torchrun_environment,
    torchrun_options,
)
from meshcomm._secret import SECRET_ENV
from meshcomm._torchrun_flags import STD_ERR, STD_OUT, FlagError, parse_endpoint
from meshcomm._where import Gathering
from meshcomm.errors import InvalidArgument, MeshCommError

if TYPE_CHECKING:
    from meshcomm.store.server import StoreServer

__all__ = [
    "START_METHODS",
    "START_METHOD_VARIABLE",
    "LaunchConfig",
    "child_environment",
    "launch",
    "main",
    "parse_args",
    "report_signal",
    "should_restart",
]

#: How ranks are started; see :class:`LaunchConfig`.
START_METHODS = ("fork", "spawn")
#: Environment variable giving the default ``--start-method``.
START_METHOD_VARIABLE = "MESHRUN_START_METHOD"

#: Port node 0 listens on when ``--nnodes`` > 1 and no ``--master-port`` is given (torchrun's).
DEFAULT_MASTER_PORT = 29500
#: Port of a ``--rdzv-backend c10d`` endpoint given without one (torchrun's).
DEFAULT_C10D_PORT = 29400

# Lines of each rank's stderr kept for the failure summary.
_TAIL_LINES = 200
# Lines shown in the summary when the tail holds no "Traceback" header.
_SHOWN_LINES = 20
# A line longer than this is forwarded in pieces, so one rank cannot grow our memory.
_MAX_LINE = 64 * 1024
# After the last rank exits, how long to keep reading pipes its children may still hold.
_DRAIN_SECONDS = 2.0
# Longest sleep of the supervision loop; exits also wake it through pidfds where available.
_TICK_WITH_PIDFD = 1.0

# Seconds meshrun waits for the ranks' reports (SIGUSR1, the first Ctrl-C, a timeout).
_REPORT_SECONDS = 3.0
_REPORT_POLL = 0.05

# How long to wait for ranks after SIGKILL before reporting them and exiting anyway.
_AFTER_SIGKILL = 10.0


@dataclass(frozen=True)
class LaunchConfig:
    """Everything ``meshrun`` needs to start one node's ranks; built by :func:`parse_args`.

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
        mpiexec: the ``mpiexec`` for ``backend="mpi"``.
        secret: the job's ``MESHCOMM_SECRET`` given to every rank and to the store this node
            hosts; None runs the job unauthenticated (``--no-secret``).
        torchrun: torchrun's other flags: restarts, logs, rendezvous backend, role, ...
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
    mpiexec: str | None = None
    # Never in a repr: a LaunchConfig may be printed or logged.
    secret: str | None = field(default=None, repr=False)
    torchrun: TorchrunOptions = field(default_factory=TorchrunOptions)

    @property
    def world_size(self) -> int:
        """Ranks in the whole job: ``nnodes * nproc_per_node``."""
        return self.nnodes * self.nproc_per_node


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshrun",
        description="Start one process per rank with a torchrun-compatible environment.",
        allow_abbrev=False,
    )
    add = parser.add_argument
    add(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        default="1",
        metavar="N",
        help="ranks on this node: a number, 'cpu' (one per CPU), 'gpu' (one per NVIDIA GPU) "
        "or 'auto' (gpu if any, else cpu); default 1",
    )
    add(
        "--nnodes",
        default="1",
        metavar="M",
        help="nodes in the job (M, or M:M; elastic MIN:MAX ranges with MIN < MAX are refused); "
        "default 1",
    )
    add(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        default=0,
        type=int,
        metavar="K",
        help="this node's index in [0, M); node 0 hosts the store; default 0",
    )
    add(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        default=None,
        metavar="ADDR",
        help="address of node 0 (the store); default 127.0.0.1",
    )
    add(
        "--master-port",
        "--master_port",
        dest="master_port",
        default=None,
        type=int,
        metavar="PORT",
        help=f"port of the store; default: a free port on one node, {DEFAULT_MASTER_PORT} "
        "on several",
    )
    add(
        "--standalone",
        action="store_true",
        help="single node, store on 127.0.0.1 and a free port (ignores --master-*)",
    )
    add(
        "--rdzv-id",
        "--rdzv_id",
        "--run-id",
        "--run_id",
        dest="run_id",
        default="none",
        metavar="ID",
        help="job id exported as TORCHELASTIC_RUN_ID; default 'none'",
    )
    add(
        "-m",
        "--module",
        action="store_true",
        help="run the target as a module, like python -m",
    )
    add(
        "--no-python",
        "--no_python",
        dest="no_python",
        action="store_true",
        help="run the target as an executable, without the Python interpreter",
    )
    add(
        "--no-prefix",
        dest="no_prefix",
        action="store_true",
        help="do not prefix output lines with [rankN]; ranks write to meshrun's terminal",
    )
    add(
        "--grace-period",
        "--shutdown-timeout",
        "--shutdown_timeout",
        dest="grace_period",
        default=DEFAULT_GRACE_PERIOD,
        type=float,
        metavar="SECONDS",
        help=f"seconds between SIGTERM and SIGKILL when stopping ranks; "
        f"default {DEFAULT_GRACE_PERIOD:g}",
    )
    add(
        "--start-method",
        "--start_method",
        dest="start_method",
        # torchrun's forkserver has no counterpart here: it runs as spawn.
        choices=(*START_METHODS, "forkserver"),
        default=None,
        help="fork: ranks are forked from meshrun after it imported numpy and meshcomm once "
        "(Python programs on Linux; the default); spawn: a fresh interpreter per rank. "
        f"Default: ${START_METHOD_VARIABLE}, else fork",
    )
    add(
        "--backend",
        default=None,
        choices=("tcp", "mpi", "nccl"),
        help="the backend meshcomm.init() uses in the ranks; mpi starts them as one MPI job "
        "through mpiexec (with meshcomm.run_mpi: a failing rank aborts them all)",
    )
    add(
        "--mpiexec",
        default=None,
        metavar="PATH",
        help="the mpiexec for --backend mpi; default: $MESHCOMM_MPIEXEC, the one next to "
        "this Python, then PATH",
    )
    add(
        "--secret-file",
        "--secret_file",
        dest="secret_file",
        default=None,
        metavar="PATH",
        help=f"read the job's secret from PATH (mode 0600; the same file on every node); "
        f"default: ${SECRET_ENV}, else a fresh random secret on one node. Several nodes need "
        "one of the two",
    )
    add(
        "--no-secret",
        "--no_secret",
        dest="no_secret",
        action="store_true",
        help="run unauthenticated: any process that can reach the store or a rank's port can "
        "join or disturb the job (torchrun's behaviour)",
    )
    add_torchrun_flags(parser)
    # Optional here so that a missing script gets its own message (see parse_args).
    add("script", nargs="?", metavar="script", help="the program: a .py file, or a module with -m")
    add("script_args", nargs=argparse.REMAINDER, help="arguments passed to the program")
    return parser


def _gpu_count() -> int:
    # /dev/nvidiaN exist once the driver is loaded; no CUDA library needed to count them.
    try:
        names = os.listdir("/dev")
    except OSError:
        return 0
    return sum(1 for n in names if n.startswith("nvidia") and n[len("nvidia") :].isdigit())


def _parse_nproc(raw: str, parser: argparse.ArgumentParser) -> int:
    value = raw.strip().lower()
    if value == "cpu" or (value == "auto" and _gpu_count() == 0):
        return os.cpu_count() or 1
    if value in ("gpu", "auto"):
        count = _gpu_count()
        if count == 0:
            parser.error(f"--nproc-per-node {raw}: no NVIDIA GPU found (no /dev/nvidiaN)")
        return count
    try:
        nproc = int(value)
    except ValueError:
        parser.error(f"--nproc-per-node must be a positive integer, cpu, gpu or auto; got {raw!r}")
    if nproc < 1:
        parser.error(f"--nproc-per-node must be at least 1, got {nproc}")
    return nproc


def _parse_nnodes(raw: str, parser: argparse.ArgumentParser) -> int:
    low, sep, high = raw.partition(":")
    try:
        nnodes = int(low)
        if sep and int(high) < nnodes:
            parser.error(f"--nnodes {raw}: MIN:MAX needs MIN <= MAX")
        if sep and int(high) != nnodes:
            # Starting at MIN and admitting nodes up to MAX needs elastic membership (a world
            # that grows and shrinks), which meshcomm has not: refuse rather than guess.
            parser.error(
                f"--nnodes {raw}: elastic membership (MIN:MAX with MIN < MAX) is not supported; "
                f"give one number, e.g. --nnodes {high} (every node must join)"
            )
    except ValueError:
        parser.error(f"--nnodes must be a positive integer (or N:N), got {raw!r}")
    if nnodes < 1:
        parser.error(f"--nnodes must be at least 1, got {nnodes}")
    return nnodes


def parse_args(argv: Sequence[str] | None = None) -> LaunchConfig:
    """Parse ``meshrun`` arguments into a :class:`LaunchConfig`.

    Args:
        argv: the arguments after the program name; None means ``sys.argv[1:]``.

    Raises:
        SystemExit: with status 2 and a usage message, for bad or inconsistent arguments.

    Example:
        >>> cfg = parse_args(["--nproc_per_node", "4", "train.py", "--lr", "0.1"])
        >>> cfg.world_size, cfg.master_addr, cfg.master_port, cfg.command[-3:]
        (4, '127.0.0.1', 0, ('train.py', '--lr', '0.1'))
    """
    parser = _build_parser()
    apply_pet_defaults(parser, os.environ, parser.error)
    ns = parser.parse_args(argv)
    if ns.script is None:
        parser.error(
            "the script to run is missing: meshrun [options] train.py [args] "
            "(or -m module, or --no-python program)"
        )
    nproc = _parse_nproc(ns.nproc_per_node, parser)
    nnodes = _parse_nnodes(ns.nnodes, parser)
    options = torchrun_options(ns, nproc, parser.error)
    if ns.run_path:
        ns.no_python = False  # torchrun: --run-path takes precedence over --no-python
    if ns.standalone and nnodes != 1:
        parser.error(f"--standalone runs a single node, but --nnodes is {nnodes}")
    if options.max_restarts and nnodes > 1:
        # A restart must restart every node together, at the same count (torchrun's agents
        # agree on it through the rendezvous); meshrun's nodes do not coordinate, so a node
        # would restart alone and wait for peers that finished or never come back.
        parser.error(
            f"--max-restarts {options.max_restarts} with --nnodes {nnodes}: restarts are "
            "supported on one node only (meshrun's nodes cannot restart together)"
        )
    if options.rdzv_backend == "c10d" and nnodes > 1:
        ns.node_rank = 0  # a placeholder: c10d numbers the nodes as they join (launch)
    if not 0 <= ns.node_rank < nnodes:
        parser.error(
            f"--node-rank must be in [0, {nnodes}) for --nnodes {nnodes}, got {ns.node_rank}"
        )
    if ns.master_port is not None and not 0 <= ns.master_port <= 65535:
        parser.error(f"--master-port must be in [0, 65535], got {ns.master_port}")
    if not (math.isfinite(ns.grace_period) and ns.grace_period > 0):
        parser.error(f"--grace-period must be a positive number of seconds, got {ns.grace_period}")
    if ns.module and ns.no_python:
        parser.error("--module and --no-python cannot be combined")
    mpiexec = None
    if ns.backend == "mpi":
        if nnodes != 1:
            parser.error(
                "--backend mpi starts one node's ranks; for several nodes run mpiexec (with "
                "-hosts/--host) or srun directly: see docs/backends/mpi.md"
            )
        refuse_under_mpiexec(options, parser.error)
        from meshcomm._mpiexec import find_mpiexec

        mpiexec = ns.mpiexec or find_mpiexec()
        if mpiexec is None:
            parser.error(
                "--backend mpi needs mpiexec: pip install 'meshcomm[mpi]' (MPICH and mpi4py), "
                "or name it with --mpiexec or MESHCOMM_MPIEXEC"
            )
    elif ns.mpiexec is not None:
        parser.error("--mpiexec is only used with --backend mpi")

    if options.rdzv_endpoint and not ns.standalone:
        ns.master_addr, ns.master_port = _endpoint(options, parser)
    if ns.standalone or (nnodes == 1 and ns.master_addr is None and ns.master_port is None):
        master_addr, master_port, bind_addr = "127.0.0.1", 0, "127.0.0.1"
    elif nnodes == 1:
        master_addr = ns.master_addr or "127.0.0.1"
        master_port = 0 if ns.master_port is None else ns.master_port
        bind_addr = master_addr
    else:
        master_addr = ns.master_addr or "127.0.0.1"
        master_port = DEFAULT_MASTER_PORT if ns.master_port is None else ns.master_port
        if master_port == 0:
            parser.error("--master-port 0 only works on one node: other nodes must know the port")
        # Node 0 may be reached through any of its addresses (as torchrun's store allows).
        bind_addr = "0.0.0.0"

    if ns.start_method == "forkserver":  # torchrun's flag value; not a meshrun method
        ns.start_method = "spawn"
    start_method = ns.start_method or os.environ.get(START_METHOD_VARIABLE) or "fork"
    if start_method not in START_METHODS:
        parser.error(
            f"${START_METHOD_VARIABLE} must be one of {', '.join(START_METHODS)}, "
            f"got {start_method!r}"
        )
    secret = _job_secret(ns, nnodes, parser)
    script_file = None if ns.module or ns.no_python else ns.script
    if ns.no_python:
        command: tuple[str, ...] = (ns.script, *ns.script_args)
        start_method = "spawn"
    else:
        python = os.environ.get("PYTHON_EXEC") or sys.executable
        if ns.module:
            command = (python, "-m", ns.script, *ns.script_args)
        else:
            command = (python, ns.script, *ns.script_args)
        if python != sys.executable or not can_fork(script_file):
            start_method = "spawn"  # fork runs the program in this interpreter
    return LaunchConfig(
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=ns.node_rank,
        master_addr=master_addr,
        master_port=master_port,
        bind_addr=bind_addr,
        command=command,
        prefix=not ns.no_prefix,
        grace_period=ns.grace_period,
        run_id=ns.run_id,
        script_file=script_file,
        start_method=start_method,
        backend=ns.backend,
        mpiexec=mpiexec,
        secret=secret,
        torchrun=options,
    )


def _endpoint(options: TorchrunOptions, parser: argparse.ArgumentParser) -> tuple[str, int]:
    """``--rdzv-endpoint`` as the store's address and port (torchrun's default ports)."""
    default = DEFAULT_C10D_PORT if options.rdzv_backend == "c10d" else DEFAULT_MASTER_PORT
    try:
        return parse_endpoint(options.rdzv_endpoint, "--rdzv-endpoint", default)
    except FlagError as exc:
        parser.error(str(exc))


def _job_secret(ns: argparse.Namespace, nnodes: int, parser: argparse.ArgumentParser) -> str | None:
    """The job's secret: ``--secret-file``, else ``MESHCOMM_SECRET``, else fresh (one node)."""
    if ns.no_secret:
        if ns.secret_file is not None:
            parser.error("--no-secret and --secret-file cannot be combined")
        return None
    if ns.secret_file is not None:
        try:
            return read_secret_file(ns.secret_file)
        except InvalidArgument as exc:
            parser.error(str(exc))
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    if nnodes > 1:
        # Each node's meshrun would make a different secret, and no rank could join.
        parser.error(
            f"--nnodes {nnodes}: every node needs the same secret: set {SECRET_ENV} to the "
            "same value on every node, or pass --secret-file PATH (a mode-0600 file every node "
            "can read); --no-secret runs the job unauthenticated"
        )
    return launch_secret({})


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

    Args:
        config: the launch configuration.
        local_rank: the rank's index on this node, in ``[0, nproc_per_node)``.
        master_port: the store's actual port (the kernel's pick when configured as 0).
        base: the environment to extend; None means ``os.environ``.
        restart: ``TORCHELASTIC_RESTART_COUNT``: how many times this node's ranks restarted.
        rank_log_dir: the rank's ``attempt_<n>/<local_rank>`` log directory, if any; its
            ``error.json`` becomes ``TORCHELASTIC_ERROR_FILE`` (torch's ``@record`` writes it).

    Example:
        >>> cfg = parse_args(["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1",
        ...                   "--master-addr", "10.0.0.1", "--no-secret", "x.py"])
        >>> env = child_environment(cfg, 1, 29500, base={})
        >>> env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["GROUP_RANK"]
        ('3', '4', '1', '1')
        >>> "MESHCOMM_SECRET" in env  # --no-secret; else the job's secret
        False
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
    torchrun_environment(env, config.torchrun, local_rank, restart, rank_log_dir)
    env["PYTHONUNBUFFERED"] = "1"
    if config.secret:
        env[SECRET_ENV] = config.secret
    else:
        env.pop(SECRET_ENV, None)  # --no-secret: an inherited secret would contradict it
    if config.backend is not None:
        env["MESHCOMM_BACKEND"] = config.backend
    if config.nproc_per_node > 1:
        # N ranks each starting a BLAS thread per core would oversubscribe the cores N times.
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


class _Sink:
    """One of meshrun's own output streams; a closed reader (``| head``) is not an error."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._broken = False

    def write(self, data: bytes) -> None:
        if self._broken or not data:
            return
        try:
            self._stream.flush()
            buffer = getattr(self._stream, "buffer", None)
            if buffer is None:  # a text-only replacement (doctest, some notebooks)
                self._stream.write(data.decode(errors="replace"))
                self._stream.flush()
            else:
                buffer.write(data)
                buffer.flush()
        except (BrokenPipeError, ValueError):
            self._broken = True

    def say(self, text: str) -> None:
        self.write(f"meshrun: {text}\n".encode())


class _Lines:
    """Split one rank's pipe into lines; prefix them for the console, copy them to log files."""

    def __init__(
        self, fd: int, sink: _Sink, prefix: bytes, tail: deque[bytes] | None, route: Route
    ) -> None:
        self.fd = fd
        self._sink = sink
        self._prefix = prefix
        self._tail = tail
        self._route = route
        self._partial = b""

    def read(self) -> bool:
        """Forward what the pipe holds; return False at end of file."""
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            self.flush()
            return False
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > _MAX_LINE:
            lines.append(self._partial)
            self._partial = b""
        self._emit(lines)
        return True

    def flush(self) -> None:
        if self._partial:
            self._emit([self._partial])
            self._partial = b""

    def _emit(self, lines: list[bytes]) -> None:
        if not lines:
            return
        if self._tail is not None:
            self._tail.extend(lines)
        problem = self._route.write(lines, self._prefix)
        if problem is not None:
            _Sink(sys.stderr).say(problem)
        if self._route.console:
            self._sink.write(b"".join(self._prefix + line + b"\n" for line in lines))


class _Forked:
    """The part of ``subprocess.Popen`` the supervisor uses, for a rank it forked."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is lost
                self.returncode = 255
                return self.returncode
            if pid != 0:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes] | _Forked
    pidfd: int | None
    tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))
    returncode: int | None = None
    # The last signal meshrun sent it (None: it ended on its own).
    sent: int | None = None


@contextmanager
def _catch_stop_signals(
    signals: Sequence[int] = STOP_SIGNALS,
) -> Iterator[tuple[int | None, list[int], dict[int, Any]]]:
    """Record ``signals`` (SIGINT/SIGTERM/SIGHUP) instead of dying; wake the loop by a pipe.

    Yields the pipe's read end (None outside the main thread, where Python allows no signal
    handlers; Ctrl-C then stops meshrun the default way and the ranks die with it), the
    list the handler appends signal numbers to, and the handlers it replaced (which forked
    ranks get back). A signal ignored when meshrun started (``nohup`` ignores SIGHUP, a
    shell's ``&`` SIGINT) stays ignored, as a shell leaves it: meshrun does not stop on it,
    and its ranks, forked or spawned, inherit it ignored.
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield None, received, {}
        return
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    os.set_blocking(wfd, False)

    def record(signum: int, _frame: Any) -> None:
        received.append(signum)

    old_wakeup = signal.set_wakeup_fd(wfd, warn_on_full_buffer=False)
    old_handlers: dict[int, Any] = {
        signum: signal.signal(signum, record)
        for signum in signals
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield rfd, received, old_handlers
    finally:
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(old_wakeup)
        os.close(rfd)
        os.close(wfd)


class _Supervisor:
    """Start this node's ranks, forward their output, and stop them all on the first failure."""

    def __init__(
        self, config: LaunchConfig, master_port: int, logs: AttemptLogs, restart: int = 0
    ) -> None:
        self.config = config
        self.master_port = master_port
        self.logs = logs
        self.restart = restart
        # Pipes whenever meshrun must see the lines: to prefix, filter or copy them to files.
        self.piped = config.prefix or logs.plan.active
        self.out = _Sink(sys.stdout)
        self.err = _Sink(sys.stderr)
        self.ranks: list[_Rank] = []
        self.selector = selectors.DefaultSelector()
        self.failures: list[_Rank] = []
        self.stop_signal: int | None = None  # a signal meshrun itself received
        self.kill_at: float | None = None  # when stopping: SIGKILL deadline
        self.drain_until: float | None = None
        self.give_up_at: float | None = None  # after SIGKILL: stop waiting for the ranks
        # Where the ranks leave their reports (meshcomm._where); one report at a time, and
        # a timed-out collective triggers one once.
        self.report_dir = tempfile.mkdtemp(prefix="meshrun-report-")
        self.gathering: Gathering | None = None
        self.timeout_reported = False

    # -- starting -------------------------------------------------------------------------

    def start(self, signals: dict[int, Any] | None = None) -> None:
        """Start every rank; with ``signals`` (the dispositions forked ranks get), fork them."""
        cfg = self.config
        for local_rank in range(cfg.nproc_per_node):
            rank = cfg.node_rank * cfg.nproc_per_node + local_rank
            env = child_environment(
                cfg,
                local_rank,
                self.master_port,
                restart=self.restart,
                rank_log_dir=self.logs.rank_dir(local_rank),
            )
            env[REPORT_DIR_ENV] = self.report_dir
            proc: subprocess.Popen[bytes] | _Forked
            if signals is not None:
                proc = self._fork(env, signals)
            else:
                pipe = subprocess.PIPE if self.piped else None
                proc = subprocess.Popen(
                    supervised_command(cfg.command),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=pipe,
                    stderr=pipe,
                )
            try:
                pidfd: int | None = os.pidfd_open(proc.pid)
            except (AttributeError, OSError):
                pidfd = None
            entry = _Rank(rank, proc, pidfd)
            self.ranks.append(entry)
            if pidfd is not None:
                self.selector.register(pidfd, selectors.EVENT_READ, None)
            if self.piped:
                self._watch_output(entry, local_rank)

    def _watch_output(self, entry: _Rank, local_rank: int) -> None:
        proc = entry.proc
        assert proc.stdout is not None and proc.stderr is not None  # piped by start()
        tag = f"[rank{entry.rank}] ".encode() if self.config.prefix else b""
        for stream, sink, tail, which in (
            (proc.stdout, self.out, None, STD_OUT),
            (proc.stderr, self.err, entry.tail, STD_ERR),
        ):
            fd = stream.fileno()
            os.set_blocking(fd, False)
            lines = _Lines(fd, sink, tag, tail, self.logs.route(local_rank, which))
            self.selector.register(fd, selectors.EVENT_READ, lines)

    def _fork(self, env: dict[str, str], signals: dict[int, Any]) -> _Forked:
        cfg = self.config
        if cfg.script_file is not None:
            target, args, module = cfg.script_file, cfg.command[2:], False
        else:  # (python, "-m", module, *args)
            target, args, module = cfg.command[2], cfg.command[3:], True
        pipes = (os.pipe(), os.pipe()) if self.piped else None
        try:
            pid = fork_rank(
                target=target,
                args=args,
                module=module,
                env=env,
                stdout_fd=pipes[0][1] if pipes else None,
                stderr_fd=pipes[1][1] if pipes else None,
                signals=signals,
            )
        except BaseException:
            for fd in (fd for pair in pipes or () for fd in pair):
                os.close(fd)
            raise
        if pipes is None:
            return _Forked(pid, None, None)
        (out_r, out_w), (err_r, err_w) = pipes
        os.close(out_w)
        os.close(err_w)
        return _Forked(pid, os.fdopen(out_r, "rb", buffering=0), os.fdopen(err_r, "rb", 0))

    # -- the loop ---------------------------------------------------------------------------

    def live(self) -> list[_Rank]:
        return [r for r in self.ranks if r.returncode is None]

    def run(self, wakeup_fd: int | None, received: list[int]) -> int:
        if wakeup_fd is not None:
            self.selector.register(wakeup_fd, selectors.EVENT_READ, "wakeup")
        with_pidfds = all(r.pidfd is not None for r in self.ranks)
        # Without pidfds an exit is only seen by polling: --monitor-interval sets how often.
        tick = _TICK_WITH_PIDFD if with_pidfds else self.config.torchrun.monitor_interval
        while True:
            self._reap()
            while received:
                self._on_signal(received.pop(0))
            self._check_timeout()
            if self.gathering is not None and self.gathering.poll():
                self.err.write(f"{self.gathering.text()}\n".encode())
                self.gathering = None
            # A stop waits for a report in progress (bounded by its deadline).
            stopping = self.failures or self.stop_signal is not None
            if stopping and self.kill_at is None and self.gathering is None:
                self._begin_stop()
            now = time.monotonic()
            if self.kill_at is not None and now >= self.kill_at and self.live():
                self._kill_all()
            if self.give_up_at is not None and now >= self.give_up_at:
                for entry in self.live():  # stuck in the kernel (state D); nothing more to do
                    self.err.say(f"rank {entry.rank} (pid {entry.proc.pid}) survived SIGKILL")
                break
            if not self.live():
                if self.drain_until is None:
                    self.drain_until = now + _DRAIN_SECONDS
                if not self._has_pipes() or now >= self.drain_until:
                    break
            timeout = tick if self.gathering is None else _REPORT_POLL
            for deadline in (self.kill_at, self.drain_until, self.give_up_at):
                if deadline is not None and deadline > now:
                    timeout = min(timeout, deadline - now)
            for key, _ in self.selector.select(max(timeout, 0.0)):
                if key.data == "wakeup":
                    self._drain_wakeup(key.fd)
                elif isinstance(key.data, _Lines) and not key.data.read():
                    self.selector.unregister(key.fd)
        self._close()
        self._summarize()
        if self.stop_signal is not None:
            return 128 + self.stop_signal
        if self.failures:
            assert self.failures[0].returncode is not None  # failures are reaped ranks
            return exit_status(self.failures[0].returncode)
        return 0

    def _has_pipes(self) -> bool:
        return any(isinstance(key.data, _Lines) for key in self.selector.get_map().values())

    def _drain_wakeup(self, fd: int) -> None:
        try:
            while os.read(fd, 512):
                pass
        except BlockingIOError:
            pass

    def _reap(self) -> None:
        for entry in self.live():
            code = entry.proc.poll()
            if code is None:
                continue
            entry.returncode = code
            if entry.pidfd is not None:
                self.selector.unregister(entry.pidfd)
                os.close(entry.pidfd)
                entry.pidfd = None
            if code != 0 and entry.sent is None and self.stop_signal is None:
                self.failures.append(entry)
                if len(self.failures) == 1:
                    others = len(self.live())
                    tail = f"; stopping the other {others} ranks" if others else ""
                    self.err.say(
                        f"rank {entry.rank} (pid {entry.proc.pid}) {describe_exit(code)}{tail}"
                    )

    def _on_signal(self, signum: int) -> None:
        if signum == report_signal(self.config):
            self._report("SIGUSR1")
        elif self.stop_signal is None:
            self.stop_signal = signum
            self.err.say(f"received {signal_name(signum)}; stopping {len(self.live())} ranks")
            if signum == signal.SIGINT and self.kill_at is None:
                self._report("Ctrl-C")  # the loop stops the ranks once it is printed
        else:
            # A second Ctrl-C: the user does not want to wait for the grace period (nor for
            # a report).
            self.gathering = None
            self._kill_all()

    def _report(self, why: str) -> None:
        """Start gathering where each rank is, unless a report is already under way."""
        if self.gathering is None:
            ranks = [(r.rank, r.proc.pid if r.returncode is None else None) for r in self.ranks]
            self.gathering = Gathering(self.report_dir, ranks, why, _REPORT_SECONDS)

    def _check_timeout(self) -> None:
        """A rank's collective timed out (it left the timeout file): report once."""
        if self.timeout_reported or self.kill_at is not None:
            return
        path = os.path.join(self.report_dir, TIMEOUT_FILE)
        try:
            with open(path, "rb") as f:
                first = f.read(200).decode(errors="replace").splitlines()[0]
        except (OSError, IndexError):
            return
        self.timeout_reported = True
        self._report(f"a collective timed out: {first}")

    def _begin_stop(self) -> None:
        self.kill_at = time.monotonic() + self.config.grace_period
        for entry in self.live():
            self._signal(entry, signal.SIGTERM)

    def _kill_all(self) -> None:
        self.kill_at = math.inf
        if self.give_up_at is None:
            self.give_up_at = time.monotonic() + _AFTER_SIGKILL
        for entry in self.live():
            self._signal(entry, signal.SIGKILL)

    def _signal(self, entry: _Rank, signum: int) -> None:
        entry.sent = signum
        # The rank leads its own group: signal the group so its children stop with it; a rank
        # that moved itself to another group still gets the signal directly.
        if not send_signal(entry.proc.pid, signum, group=True):
            send_signal(entry.proc.pid, signum)

    def abort(self) -> None:
        """Kill the ranks started so far (a later one could not start) and reap them."""
        self._kill_all()
        for entry in self.ranks:
            try:
                entry.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.err.say(f"rank {entry.rank} (pid {entry.proc.pid}) survived SIGKILL")
        self._close()

    def _close(self) -> None:
        shutil.rmtree(self.report_dir, ignore_errors=True)
        for key in list(self.selector.get_map().values()):
            if isinstance(key.data, _Lines):
                key.data.flush()
            self.selector.unregister(key.fd)
        self.selector.close()
        self.logs.close()
        for entry in self.ranks:
            if entry.pidfd is not None:
                os.close(entry.pidfd)
                entry.pidfd = None
            for stream in (entry.proc.stdout, entry.proc.stderr):
                if stream is not None:
                    stream.close()

    # -- the report ---------------------------------------------------------------------------

    def _summarize(self) -> None:
        for i, entry in enumerate(self.failures):
            assert entry.returncode is not None
            what = f"rank {entry.rank} (pid {entry.proc.pid}) {describe_exit(entry.returncode)}"
            if i > 0:
                self.err.say(f"{what} too")
            elif entry.tail:
                self._show_tail(what, entry)
            else:
                self.err.say(what)
            self._name_error_file(entry)
        stopped = [r for r in self.ranks if r.sent is not None]
        if not stopped:
            return
        cause = (
            f"meshrun received {signal_name(self.stop_signal)}"
            if self.stop_signal is not None
            else f"rank {self.failures[0].rank} failed"
        )
        killed = [r for r in stopped if r.sent == signal.SIGKILL]
        termed = [r for r in stopped if r.sent != signal.SIGKILL]
        if termed:
            self.err.say(f"stopped {_rank_list(termed)} with SIGTERM after {cause}")
        if killed:
            self.err.say(
                f"killed {_rank_list(killed)} with SIGKILL: still running "
                f"{self.config.grace_period:g} s after SIGTERM ({cause})"
            )

    def _name_error_file(self, entry: _Rank) -> None:
        # torch's @record writes the exception to TORCHELASTIC_ERROR_FILE; torchrun reports it.
        rank_dir = self.logs.rank_dir(
            entry.rank - self.config.node_rank * self.config.nproc_per_node
        )
        path = None if rank_dir is None else os.path.join(rank_dir, "error.json")
        if path is not None and os.path.exists(path):
            self.err.say(f"rank {entry.rank} wrote its error to {path}")

    def _show_tail(self, what: str, entry: _Rank) -> None:
        lines = list(entry.tail)
        starts = [i for i, line in enumerate(lines) if line.startswith(b"Traceback (most recent")]
        shown = lines[starts[-1] :] if starts else lines[-_SHOWN_LINES:]
        self.err.say(f"{what}; the end of its stderr:")
        tag = f"[rank{entry.rank}] ".encode()
        self.err.write(b"".join(tag + line + b"\n" for line in shown))


def _rank_list(entries: list[_Rank]) -> str:
    ranks = ", ".join(str(r.rank) for r in entries)
    return f"rank {ranks}" if len(entries) == 1 else f"ranks {ranks}"


def _host_store(config: LaunchConfig) -> StoreServer:
    """Bind the rendezvous store this node hosts (node 0 only); the caller starts it."""
    from meshcomm.store.server import StoreServer

    return StoreServer(config.bind_addr, config.master_port, secret=config.secret or "")


def _prepare_fork(config: LaunchConfig, port: int) -> bool:
    """Import what every forked rank shares; False if this process may not fork now."""
    if config.start_method != "fork":
        return False
    preload(child_environment(config, 0, port))
    # The store's thread starts after the forks; anything else running here (a caller's
    # thread, a BLAS pool) could hold a lock a rank would then wait on forever.
    return single_threaded()


def launch(config: LaunchConfig) -> int:
    """Run this node's ranks until they all exit; return ``meshrun``'s exit status.

    Node 0 hosts the store for the whole job (with ``--rdzv-backend c10d``: the node that
    owns the endpoint). Returns 0 if every rank exited 0; otherwise the first failing rank's
    status (its exit code, or 128 + the signal that killed it) in the last attempt
    (``--max-restarts``), or 128 + N if ``meshrun`` itself received signal N (130 for Ctrl-C).

    Example:
        >>> import sys
        >>> cfg = parse_args(["--nproc-per-node", "2", "--no-python",
        ...                   sys.executable, "-c", "import os; os.environ['RANK']"])
        >>> launch(cfg)
        0
    """
    if config.backend == "mpi":
        return _launch_mpi(config)
    report = report_signal(config)
    signals = config.torchrun.stop_signals + (() if report is None else (report,))
    with _catch_stop_signals(signals) as (wakeup_fd, received, handlers):
        try:
            config, server, serving = _rendezvous(config)
        except (MeshCommError, OSError) as exc:  # names the address and the reason
            print(f"meshrun: {exc}", file=sys.stderr)
            return 1
        port = server.port if server is not None else config.master_port
        run_logs = RunLogs(config.torchrun.logs, config.run_id)
        to_start = None if serving else server
        try:
            restart = 0
            while True:
                attempt = _Supervisor(
                    config, port, run_logs.attempt(restart, config.nproc_per_node), restart
                )
                if restart == 0 and run_logs.run_dir is not None:
                    attempt.err.say(f"rank log files in {run_logs.run_dir}")
                status = _run_attempt(attempt, to_start, handlers, wakeup_fd, received)
                to_start = None
                if not should_restart(status, attempt.stop_signal, restart, config):
                    return status
                stops = [n for n in received if n != report]
                if stops:  # a stop signal after the last rank exited: do not start again
                    return 128 + stops[0]
                restart += 1
                attempt.err.say(
                    f"restarting this node's {config.nproc_per_node} ranks "
                    f"(restart {restart} of --max-restarts {config.torchrun.max_restarts})"
                )
                if server is not None:
                    # Restarts are single-node: a fresh, empty store per attempt, so the new
                    # ranks never see the old world's keys, and (its thread gone) they can be
                    # forked again instead of spawned.
                    server.close()
                    server = None
                    try:
                        server = to_start = _host_store(config)
                    except (MeshCommError, OSError) as exc:  # the port was taken meanwhile
                        attempt.err.say(f"cannot restart: {exc}")
                        return status
                    port = server.port
        finally:
            if server is not None:
                server.close()


def report_signal(config: LaunchConfig) -> int | None:
    """The signal that asks meshrun where each rank is (``SIGUSR1``; it stops nothing).

    None when ``--signals-to-handle`` names ``SIGUSR1``: the user asked it to stop the job.

    Example:
        >>> report_signal(parse_args(["x.py"])) == signal.SIGUSR1
        True
        >>> report_signal(parse_args(["--signals-to-handle", "SIGTERM,SIGUSR1", "x.py"]))
    """
    return None if signal.SIGUSR1 in config.torchrun.stop_signals else signal.SIGUSR1


def should_restart(
    status: int, stop_signal: int | None, restart: int, config: LaunchConfig
) -> bool:
    """Whether a finished attempt is followed by another (``--max-restarts``).

    A failure restarts the whole local group while restarts remain; success, or a signal
    meshrun itself received (Ctrl-C), ends the run.

    Example:
        >>> cfg = parse_args(["--max-restarts", "1", "x.py"])
        >>> should_restart(1, None, 0, cfg), should_restart(1, None, 1, cfg)
        (True, False)
    """
    return status != 0 and stop_signal is None and restart < config.torchrun.max_restarts


def _rendezvous(config: LaunchConfig) -> tuple[LaunchConfig, StoreServer | None, bool]:
    """Bind (and, for c10d, join through) the store.

    Returns:
        The config with this node's rank, the store this launcher hosts (or None), and
        whether that store already serves (c10d's host serves so that the others can join).
    """
    if config.torchrun.rdzv_backend == "c10d" and config.nnodes > 1:
        from meshcomm._node_rdzv import join_nodes

        config, server = join_nodes(config)
        return config, server, True
    if config.node_rank == 0:
        return config, _host_store(config), False
    return config, None, False


def _run_attempt(
    supervisor: _Supervisor,
    server: StoreServer | None,
    handlers: dict[int, Any],
    wakeup_fd: int | None,
    received: list[int],
) -> int:
    """Start one attempt's ranks (forked when this process may fork) and supervise them."""
    config = supervisor.config
    try:
        # A store already serving (a restart, or c10d) has a thread: _prepare_fork says no, and
        # the ranks are spawned.
        fork = _prepare_fork(config, supervisor.master_port)
        if server is not None and not fork:
            server.start()
        supervisor.start(handlers if fork else None)
        if server is not None and fork:
            server.start()
    except OSError as exc:
        supervisor.err.say(f"cannot start {config.command[0]!r}: {exc}")
        supervisor.abort()
        return 1
    return supervisor.run(wakeup_fd, received)


def _launch_mpi(config: LaunchConfig) -> int:
    from meshcomm._mpiexec import launch_mpiexec

    if config.mpiexec is None:  # parse_args finds one; a hand-made LaunchConfig may not
        print("meshrun: backend 'mpi' needs an mpiexec (LaunchConfig.mpiexec)", file=sys.stderr)
        return 1
    with _catch_stop_signals(config.torchrun.stop_signals) as (_, received, _handlers):
        return launch_mpiexec(
            config.mpiexec,
            config.nproc_per_node,
            config.command,
            prefix=config.prefix,
            grace_period=config.grace_period,
            stop_signals=received,
            secret=config.secret,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshrun`` console script and of ``python -m meshcomm.run``.

    Args:
        argv: arguments after the program name; None means ``sys.argv[1:]``.

    Returns:
        The exit status (see :func:`launch`); 2 for bad arguments.
    """
    config = parse_args(argv)
    if config.script_file is not None and not os.path.exists(config.script_file):
        print(f"meshrun: error: no such script: {config.script_file}", file=sys.stderr)
        return 2
    return launch(config)


if __name__ == "__main__":
    sys.exit(main())
