"""torchrun 2.13's flags on ``meshrun``'s parser, and what each one becomes.

:func:`add_torchrun_flags` adds every torchrun flag ``meshrun``'s own parser lacks (both the
dash and underscore spellings, as torchrun); :func:`torchrun_options` reads them back into a
:class:`TorchrunOptions`. docs/launch.md has the table of every flag and its meaning here.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_torchrun_flags(parser)
    >>> ns = parser.parse_args(["--max-restarts", "2", "--tee", "3", "--role", "trainer"])
    >>> opts = torchrun_options(ns, nproc=2, error=parser.error)
    >>> opts.max_restarts, opts.role, opts.logs.tee
    (2, 'trainer', {0: 3, 1: 3})
"""

from __future__ import annotations

import argparse
import math
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NoReturn

from meshcomm.errors import InvalidArgument
from meshcomm.launcher.rank_logs import LogPlan
from meshcomm.launcher.torchrun_flags import (
    FlagError,
    parse_bool,
    parse_local_ranks,
    parse_rdzv_conf,
    parse_seconds,
    parse_signals,
    parse_std_map,
)

__all__ = [
    "DEFAULT_JOIN_TIMEOUT",
    "RDZV_BACKENDS",
    "STOP_SIGNALS",
    "TorchrunOptions",
    "add_torchrun_flags",
    "apply_pet_defaults",
    "refuse_under_mpiexec",
    "torchrun_environment",
    "torchrun_options",
    "visible_device",
]

#: ``--rdzv-backend`` values meshrun implements (torchrun's etcd backends need etcd).
RDZV_BACKENDS = ("static", "c10d")
#: Signals that stop the job unless ``--signals-to-handle`` names others.
STOP_SIGNALS: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Seconds a node waits for the others to join (torchrun's ``join_timeout`` default).
DEFAULT_JOIN_TIMEOUT = 600.0


@dataclass(frozen=True)
class TorchrunOptions:
    """The torchrun flags, checked and converted.

    Attributes:
        rdzv_backend: ``static`` (node ranks from ``--node-rank``) or ``c10d`` (node ranks
            in the order nodes join the store at ``--rdzv-endpoint``).
        rdzv_endpoint: ``--rdzv-endpoint`` as given ("" if not).
        join_timeout: seconds to wait for every node to join (``--rdzv-conf join_timeout``).
        is_host: ``--rdzv-conf is_host``: whether this node hosts the c10d store (None: it
            does if it can bind the endpoint).
        max_restarts: restarts of the local group after a failure.
        monitor_interval: seconds between checks of the ranks where exits cannot wake
            meshrun at once (no pidfd).
        role: ``ROLE_NAME`` of the ranks.
        logs: where the ranks' output goes.
        local_addr: the address this node's ranks listen on (``MESHCOMM_HOST``), or None.
        stop_signals: signals that stop the job.
        virtual_local_rank: every rank sees ``LOCAL_RANK=0`` and only its own GPU.
    """

    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    is_host: bool | None = None
    max_restarts: int = 0
    monitor_interval: float = 0.1
    role: str = "default"
    logs: LogPlan = field(default_factory=LogPlan)
    local_addr: str | None = None
    stop_signals: tuple[int, ...] = STOP_SIGNALS
    virtual_local_rank: bool = False


def add_torchrun_flags(parser: argparse.ArgumentParser) -> None:
    """Add torchrun's flags that ``meshrun`` does not define itself."""
    add = parser.add_argument
    add("--rdzv-backend", "--rdzv_backend", dest="rdzv_backend", default="static",
        metavar="NAME", help="static (default; node ranks from --node-rank) or c10d (node "
        "ranks in join order, the store at --rdzv-endpoint)")  # fmt: skip
    add("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default="",
        metavar="HOST:PORT", help="the store every node connects to (overrides --master-addr "
        "and --master-port)")  # fmt: skip
    add("--rdzv-conf", "--rdzv_conf", dest="rdzv_conf", default="", metavar="K=V,...",
        help="rendezvous settings: join_timeout (seconds, default 600), is_host (c10d); "
        "torchrun's elastic-only keys are ignored")  # fmt: skip
    add("--max-restarts", "--max_restarts", dest="max_restarts", default=0, type=int,
        metavar="N", help="restart this node's ranks up to N times after a failure; "
        "ranks see TORCHELASTIC_RESTART_COUNT; default 0")  # fmt: skip
    add("--monitor-interval", "--monitor_interval", dest="monitor_interval", default=0.1,
        type=float, metavar="SECONDS", help="how often ranks are checked where their exit "
        "cannot wake meshrun at once; default 0.1")  # fmt: skip
    add("--event-log-handler", "--event_log_handler", dest="event_log_handler",
        default="null", metavar="NAME", help="accepted for torchrun compatibility; meshrun "
        "logs no torchelastic events")  # fmt: skip
    add("--role", default="default", metavar="NAME",
        help="the ranks' ROLE_NAME; default 'default'")  # fmt: skip
    add("--run-path", "--run_path", dest="run_path", action="store_true",
        help="run the script in a Python interpreter (overrides --no-python); meshrun's fork "
        "start method already runs it in a process forked from meshrun")  # fmt: skip
    add("--log-dir", "--log_dir", dest="log_dir", default=None, metavar="DIR",
        help="base directory of the rank log files: "
        "DIR/<rdzv-id>_<random>/attempt_<n>/<local_rank>/{stdout,stderr}.log")  # fmt: skip
    add("-r", "--redirects", default="0", metavar="SPEC",
        help="send the ranks' streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both, "
        "or per local rank (0:1,1:2)")  # fmt: skip
    add(
        "-t",
        "--tee",
        default="0",
        metavar="SPEC",
        help="write the ranks' streams to log files and the console (format of --redirects)",
    )
    add("--local-ranks-filter", "--local_ranks_filter", dest="local_ranks_filter",
        default="", metavar="RANKS", help="show only these local ranks' output on the "
        "console (e.g. 0,1); log files are still written")  # fmt: skip
    for stream in ("stdout", "stderr"):
        add(f"--duplicate-{stream}-filters", f"--duplicate_{stream}_filters",
            dest=f"duplicate_{stream}_filters", default="", metavar="WORDS",
            help=f"also copy {stream} lines holding any of these comma-separated words to "
            f"attempt_<n>/filtered_{stream}.log (',,' is a literal comma)")  # fmt: skip
    add(
        "--local-addr",
        "--local_addr",
        dest="local_addr",
        default=None,
        metavar="ADDR",
        help="the address this node's ranks listen on and advertise (MESHCOMM_HOST)",
    )
    add("--logs-specs", "--logs_specs", dest="logs_specs", default=None, metavar="NAME",
        help="not supported: torchrun LogsSpecs plug-ins are torch classes")  # fmt: skip
    add(
        "--numa-binding",
        "--numa_binding",
        dest="numa_binding",
        default=None,
        metavar="MODE",
        help="not supported: bind ranks yourself (numactl, taskset)",
    )
    add("--signals-to-handle", "--signals_to_handle", dest="signals_to_handle",
        default=None, metavar="SIGNALS", help="signals that stop every rank (comma-separated); "
        "default SIGINT,SIGTERM,SIGHUP")  # fmt: skip
    add("--virtual-local-rank", "--virtual_local_rank", dest="virtual_local_rank",
        action="store_true", help="LOCAL_RANK=0 in every rank, and CUDA_VISIBLE_DEVICES "
        "naming only its own GPU")  # fmt: skip


def torchrun_options(
    ns: argparse.Namespace, nproc: int, error: Callable[[str], NoReturn]
) -> TorchrunOptions:
    """Check and convert the flags :func:`add_torchrun_flags` added.

    Args:
        ns: the parsed namespace.
        nproc: ranks on this node (per-rank maps are checked against it).
        error: the parser's ``error``: prints the message and exits with status 2.
    """
    if ns.rdzv_backend not in RDZV_BACKENDS:
        error(f"--rdzv-backend {ns.rdzv_backend!r}: meshrun supports static and c10d "
              "(torchrun's etcd backends need an etcd server)")  # fmt: skip
    if ns.max_restarts < 0:
        error(f"--max-restarts must be 0 or more, got {ns.max_restarts}")
    if not (math.isfinite(ns.monitor_interval) and ns.monitor_interval > 0):
        error(f"--monitor-interval must be a positive number of seconds, "
              f"got {ns.monitor_interval}")  # fmt: skip
    if ns.logs_specs is not None:
        error(f"--logs-specs {ns.logs_specs!r}: not supported (torchrun LogsSpecs plug-ins are "
              "torch classes); use --log-dir, --redirects and --tee")  # fmt: skip
    if ns.numa_binding is not None:
        error(f"--numa-binding {ns.numa_binding!r}: not supported; bind ranks with numactl or "
              "taskset inside the program's command")  # fmt: skip
    if not ns.role:
        error("--role must not be empty")
    try:
        conf = parse_rdzv_conf(ns.rdzv_conf)
        join_timeout = DEFAULT_JOIN_TIMEOUT
        if "join_timeout" in conf:
            join_timeout = parse_seconds(conf["join_timeout"], "--rdzv-conf join_timeout")
        is_host = parse_bool(conf["is_host"], "--rdzv-conf is_host") if "is_host" in conf else None
        # Other keys steer torchrun's elastic membership, which meshrun has not: ignored.
        if "read_timeout" in conf:  # checked, then ignored: store reads use MESHCOMM_TIMEOUT
            parse_seconds(conf["read_timeout"], "--rdzv-conf read_timeout")
        logs = LogPlan(
            log_dir=ns.log_dir,
            redirects=parse_std_map(ns.redirects, "--redirects", nproc),
            tee=parse_std_map(ns.tee, "--tee", nproc),
            shown=parse_local_ranks(ns.local_ranks_filter, "--local-ranks-filter", nproc),
            stdout_filters=_filters(ns.duplicate_stdout_filters),
            stderr_filters=_filters(ns.duplicate_stderr_filters),
        )
        stop = STOP_SIGNALS
        if ns.signals_to_handle is not None:
            stop = parse_signals(ns.signals_to_handle, "--signals-to-handle")
    except FlagError as exc:
        error(str(exc))
    if ns.virtual_local_rank:
        try:  # the last local rank is the first to lack a GPU
            visible_device(os.environ.get("CUDA_VISIBLE_DEVICES"), nproc - 1)
        except InvalidArgument as exc:
            error(str(exc))
    return TorchrunOptions(
        rdzv_backend=ns.rdzv_backend,
        rdzv_endpoint=ns.rdzv_endpoint,
        join_timeout=join_timeout,
        is_host=is_host,
        max_restarts=ns.max_restarts,
        monitor_interval=ns.monitor_interval,
        role=ns.role,
        logs=logs,
        local_addr=ns.local_addr,
        stop_signals=stop,
        virtual_local_rank=ns.virtual_local_rank,
    )


def torchrun_environment(
    env: dict[str, str],
    opts: TorchrunOptions,
    local_rank: int,
    restart: int,
    rank_log_dir: str | None,
) -> None:
    """Set what torchrun's flags change in one rank's environment ``env``.

    Args:
        env: the rank's environment, changed in place.
        opts: the flags.
        local_rank: the rank's index on this node.
        restart: ``TORCHELASTIC_RESTART_COUNT``.
        rank_log_dir: the rank's log directory, if files are written.

    Example:
        >>> env = {}
        >>> torchrun_environment(env, TorchrunOptions(role="r"), 0, 1, None)
        >>> env["ROLE_NAME"], env["TORCHELASTIC_RESTART_COUNT"]
        ('r', '1')
    """
    env["ROLE_NAME"] = opts.role
    env["TORCHELASTIC_RESTART_COUNT"] = str(restart)
    env["TORCHELASTIC_MAX_RESTARTS"] = str(opts.max_restarts)
    if rank_log_dir is not None:
        env["TORCHELASTIC_ERROR_FILE"] = os.path.join(rank_log_dir, "error.json")
    if opts.local_addr is not None:
        env["MESHCOMM_HOST"] = opts.local_addr
    if opts.virtual_local_rank:
        # As torchrun: each rank sees one GPU, as device 0 (the list given, else by index).
        env["CUDA_VISIBLE_DEVICES"] = visible_device(env.get("CUDA_VISIBLE_DEVICES"), local_rank)
        env["LOCAL_RANK"] = "0"


def visible_device(visible: str | None, local_rank: int) -> str:
    """The one GPU a ``--virtual-local-rank`` rank sees: its entry of the inherited list.

    Raises:
        InvalidArgument: the inherited ``CUDA_VISIBLE_DEVICES`` names fewer GPUs than ranks.

    Example:
        >>> visible_device("4,5", 1), visible_device(None, 1)
        ('5', '1')
    """
    if visible is None:
        return str(local_rank)
    devices = visible.split(",")
    if local_rank >= len(devices):
        raise InvalidArgument(
            f"--virtual-local-rank: local rank {local_rank} has no GPU in "
            f"CUDA_VISIBLE_DEVICES={visible!r}"
        )
    return devices[local_rank].strip()


def refuse_under_mpiexec(options: TorchrunOptions, error: Callable[[str], NoReturn]) -> None:
    """mpiexec starts and labels the ranks itself: meshrun cannot restart or split them."""
    used = [
        flag
        for flag, on in (
            ("--max-restarts", options.max_restarts > 0),
            ("--log-dir/--redirects/--tee/--duplicate-*-filters", options.logs.writes_files),
            ("--local-ranks-filter", options.logs.shown is not None),
            ("--rdzv-backend c10d", options.rdzv_backend == "c10d"),
            ("--virtual-local-rank", options.virtual_local_rank),
        )
        if on
    ]
    if used:
        error(f"--backend mpi: {', '.join(used)} not supported (mpiexec runs the ranks)")


# The flags whose default torchrun takes from PET_<NAME> (its argparse actions env/check_env).
_PET_NAMES = frozenset(
    [
        "nnodes",
        "nproc_per_node",
        "rdzv_backend",
        "rdzv_endpoint",
        "rdzv_id",
        "rdzv_conf",
        "standalone",
        "max_restarts",
        "monitor_interval",
        "start_method",
        "event_log_handler",
        "role",
        "module",
        "no_python",
        "run_path",
        "log_dir",
        "redirects",
        "tee",
        "local_ranks_filter",
        "duplicate_stdout_filters",
        "duplicate_stderr_filters",
        "node_rank",
        "master_addr",
        "master_port",
        "local_addr",
        "signals_to_handle",
        "shutdown_timeout",
        "virtual_local_rank",
    ]
)


def apply_pet_defaults(
    parser: argparse.ArgumentParser,
    environ: Mapping[str, str],
    error: Callable[[str], NoReturn],
) -> None:
    """Take flag defaults from ``PET_*`` variables, as torchrun does (``PET_NNODES=2``).

    A flag given on the command line still wins. On/off flags (``--standalone``) take
    ``0`` or ``1``. ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` is the ``--shutdown-timeout`` default
    when ``PET_SHUTDOWN_TIMEOUT`` is not set, as in torchrun.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_torchrun_flags(parser)
        >>> apply_pet_defaults(parser, {"PET_MAX_RESTARTS": "2"}, parser.error)
        >>> parser.parse_args([]).max_restarts
        2
    """
    for action in parser._actions:
        if "--shutdown-timeout" in action.option_strings:
            # torchrun's fallback when --shutdown-timeout is not given (PET_ still wins).
            fallback = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
            if fallback is not None:
                try:
                    action.default = parse_seconds(fallback, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
                except FlagError as exc:
                    error(str(exc))
        for option in action.option_strings:
            name = option.lstrip("-").replace("-", "_")
            variable = f"PET_{name.upper()}"
            if name not in _PET_NAMES or variable not in environ:
                continue
            raw = environ[variable]
            if isinstance(action, argparse._StoreTrueAction):
                if raw.strip() not in ("0", "1"):
                    error(f"{variable}={raw!r} (the default of {option}): expected 0 or 1")
                action.default = raw.strip() == "1"
            else:
                action.default = raw  # argparse converts a str default with the action's type
            break


def _filters(raw: str) -> tuple[str, ...]:
    """torchrun's comma-separated list: ``,,`` stands for a literal comma."""
    marker = "\0"
    return tuple(word.replace(marker, ",") for word in raw.replace(",,", marker).split(",") if word)
