"""``meshrun``'s command line: the parser, and its checks into a :class:`LaunchConfig`.

torchrun's own flags are added and read back by :mod:`meshcomm.launcher.torchrun_options`; this
module
holds meshrun's flags, the checks that combine them, and where the store and the job's
secret come from.

Example:
    >>> cfg = parse_args(["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1",
    ...                   "--master-addr", "10.0.0.1", "--no-secret", "x.py"])
    >>> cfg.world_size, cfg.node_rank, cfg.master_port, cfg.bind_addr
    (4, 1, 29500, '0.0.0.0')
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from meshcomm.common.secret import SECRET_ENV
from meshcomm.errors import InvalidArgument
from meshcomm.launcher.config import START_METHOD_VARIABLE, START_METHODS, LaunchConfig
from meshcomm.launcher.fork_start import can_fork
from meshcomm.launcher.job_secret import launch_secret, read_secret_file
from meshcomm.launcher.processes import DEFAULT_GRACE_PERIOD
from meshcomm.launcher.torchrun_flags import FlagError, parse_endpoint
from meshcomm.launcher.torchrun_options import (
    TorchrunOptions,
    add_torchrun_flags,
    apply_pet_defaults,
    refuse_under_mpiexec,
    torchrun_options,
)

__all__ = ["DEFAULT_C10D_PORT", "DEFAULT_MASTER_PORT", "build_parser", "parse_args"]

#: Port node 0 listens on when ``--nnodes`` > 1 and no ``--master-port`` is given (torchrun's).
DEFAULT_MASTER_PORT = 29500
#: Port of a ``--rdzv-backend c10d`` endpoint given without one (torchrun's).
DEFAULT_C10D_PORT = 29400


def build_parser() -> argparse.ArgumentParser:
    """``meshrun``'s parser: its own flags and torchrun's, unchecked (see :func:`parse_args`).

    Example:
        >>> build_parser().parse_args(["--nnodes", "2", "x.py"]).nnodes
        '2'
    """
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
        "--elastic",
        action="store_true",
        help="a rank that fails does not stop the others: they shrink their world and go on "
        "(meshcomm.elastic); the job succeeds when any rank finishes with 0",
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
    parser = build_parser()
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
    if ns.elastic and ns.backend == "mpi":
        parser.error(
            "--elastic needs the tcp backend: MPICH's wheel has no ULFM (MPIX_Comm_shrink), so "
            "an mpi job cannot go on without a rank; use --max-restarts to restart it whole"
        )
    if ns.backend == "mpi":
        if nnodes != 1:
            parser.error(
                "--backend mpi starts one node's ranks; for several nodes run mpiexec (with "
                "-hosts/--host) or srun directly: see docs/backends/mpi.md"
            )
        refuse_under_mpiexec(options, parser.error)
        from meshcomm.launcher.mpiexec import find_mpiexec

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
        elastic=ns.elastic,
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
