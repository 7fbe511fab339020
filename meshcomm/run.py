"""``meshrun``: start one process per rank, torchrun-style, and supervise them.

Usage (the same spellings as ``torchrun``; ``--nproc_per_node`` works too)::

    meshrun --nproc-per-node 4 train.py --lr 0.1
    meshrun --nproc-per-node 4 -m mypkg.train
    meshrun --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 \\
        --nproc-per-node 8 train.py

Each rank gets the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), so
``meshcomm.init()`` and ``torch.distributed.init_process_group("gloo")`` (env://) work
unchanged, alone or both in one program. The launcher itself hosts meshcomm's rendezvous
store, named by ``MESHCOMM_MASTER_ADDR``/``MESHCOMM_MASTER_PORT`` with
``MESHCOMM_STORE_HOSTED=1``: on one node it binds 127.0.0.1 on a port the kernel picks (no
race), on several nodes node 0 binds ``--master-port`` on every interface. ``MASTER_PORT`` is
another free port that node 0's launcher keeps for torch's rank 0, which serves torch's own
store there as it does without torchrun's agent (:mod:`meshcomm.launcher.torch_port`).

``--backend mpi`` starts the ranks as one MPI job instead, through ``mpiexec`` (see
:mod:`meshcomm.launcher.mpiexec`): same output labels, same stop-everything-on-failure, same exit
status, and the same store served by the launcher (for the hang verdicts). ``--backend
NAME`` otherwise sets ``MESHCOMM_BACKEND`` for ``meshcomm.init()``.

Output lines are prefixed ``[rank3] ``. If a rank fails, the others get SIGTERM, then
SIGKILL after ``--grace-period`` seconds; ``meshrun`` prints which rank failed and the tail of
its stderr, and exits with that rank's status (128 + N for signal N). Ctrl-C stops every rank
and exits 130. Ranks die with ``meshrun`` even if it is SIGKILLed (Linux).

Every torchrun 2.13 flag is accepted (docs/launch.md has the table): ``--max-restarts N``
restarts this node's ranks after a failure (each attempt in a fresh store, with
``TORCHELASTIC_RESTART_COUNT``); ``--log-dir``, ``-r/--redirects``, ``-t/--tee`` and
``--local-ranks-filter`` route the ranks' output as torchrun does
(:mod:`meshcomm.launcher.rank_logs`);
``--rdzv-backend static|c10d --rdzv-endpoint HOST:PORT`` names the store, c10d numbering the
nodes as they join (:mod:`meshcomm.launcher.node_rendezvous`). torchrun's flags are parsed in
:mod:`meshcomm.launcher.torchrun_options`.

This module runs the attempts (``--max-restarts``) around the store this node hosts; the
parts live apart: the command line in :mod:`meshcomm.launcher.command_line`, :class:`LaunchConfig`
and each
rank's environment in :mod:`meshcomm.launcher.config`, one attempt's supervision in
:mod:`meshcomm.launcher.supervisor` (the ranks' output in :mod:`meshcomm.launcher.output`), and
meshrun's signals in :mod:`meshcomm.launcher.signals`.

By default (``--start-method fork``) a Python program's ranks are forked from ``meshrun``
after it imported numpy and meshcomm once (:mod:`meshcomm.launcher.fork_start`), which makes a short
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

import functools
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from meshcomm.errors import MeshCommError
from meshcomm.launcher.command_line import parse_args
from meshcomm.launcher.config import (
    START_METHOD_VARIABLE,
    START_METHODS,
    LaunchConfig,
    child_environment,
)
from meshcomm.launcher.fork_start import preload, single_threaded
from meshcomm.launcher.rank_logs import RunLogs
from meshcomm.launcher.signals import catch_stop_signals, report_signal
from meshcomm.launcher.supervisor import Supervisor
from meshcomm.launcher.torch_port import (
    PortReservation,
    fetch_endpoint,
    node0_address,
    publish_endpoint,
)

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
    with catch_stop_signals(signals) as (wakeup_fd, received, handlers):
        try:
            config, server, serving = _rendezvous(config)
        except (MeshCommError, OSError) as exc:  # names the address and the reason
            print(f"meshrun: {exc}", file=sys.stderr)
            return 1
        port = server.port if server is not None else config.master_port
        reservation = None
        try:
            config, reservation = _torch_endpoint(config, port, hosts_store=server is not None)
        except (MeshCommError, OSError) as exc:
            print(f"meshrun: {exc}", file=sys.stderr)
            if server is not None:
                server.close()
            return 1
        publish = None
        if reservation is not None and config.nnodes > 1:
            publish = functools.partial(
                publish_endpoint,
                config,
                port,
                config.torch_master_addr or config.master_addr,
                reservation.port,
            )
        run_logs = RunLogs(config.torchrun.logs, config.run_id)
        to_start = None if serving else server
        try:
            restart = 0
            while True:
                attempt = Supervisor(
                    config, port, run_logs.attempt(restart, config.nproc_per_node), restart
                )
                if restart == 0 and run_logs.run_dir is not None:
                    attempt.err.say(f"rank log files in {run_logs.run_dir}")
                status = _run_attempt(attempt, to_start, handlers, wakeup_fd, received, publish)
                to_start = publish = None
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
            if reservation is not None:
                reservation.close()


def _torch_endpoint(
    config: LaunchConfig, store_port: int, hosts_store: bool
) -> tuple[LaunchConfig, PortReservation | None]:
    """Set where torch's rank 0 serves torch's own store (``MASTER_ADDR``/``MASTER_PORT``).

    Node 0 reserves the port for the whole run (restarts reuse it; torch rebinds it past
    ``TIME_WAIT``); the other nodes wait for node 0 to publish it in meshrun's store.
    """
    if config.node_rank == 0:
        reservation = PortReservation()
        addr = node0_address(config, hosts_store)
        return replace(config, torch_master_addr=addr, torch_master_port=reservation.port), (
            reservation
        )
    addr, port = fetch_endpoint(config, store_port)
    return replace(config, torch_master_addr=addr, torch_master_port=port), None


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
        from meshcomm.launcher.node_rendezvous import join_nodes

        config, server = join_nodes(config)
        return config, server, True
    if config.node_rank == 0:
        return config, _host_store(config), False
    return config, None, False


def _run_attempt(
    supervisor: Supervisor,
    server: StoreServer | None,
    handlers: dict[int, Any],
    wakeup_fd: int | None,
    received: list[int],
    publish: Callable[[], None] | None = None,
) -> int:
    """Start one attempt's ranks (forked when this process may fork) and supervise them.

    ``publish`` (node 0 of several) tells the other nodes torch's endpoint once this node's
    store serves.
    """
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
    if publish is not None:
        try:
            publish()
        except MeshCommError as exc:
            supervisor.err.say(str(exc))
            supervisor.abort()
            return 1
    return supervisor.run(wakeup_fd, received)


def _launch_mpi(config: LaunchConfig) -> int:
    """One MPI job through ``mpiexec``, beside the store this launcher serves for it.

    The store is the one a tcp job gets (``--master-addr``/``--master-port``, the job's
    secret); the ranks join it instead of one that their rank 0 would serve
    (:mod:`meshcomm.rendezvous.mpi_store`), so a verdict still names rank 0 when rank 0 is stuck.
    """
    from meshcomm.launcher.mpiexec import launch_mpiexec
    from meshcomm.rendezvous.mpi_store import wants_store

    if config.mpiexec is None:  # parse_args finds one; a hand-made LaunchConfig may not
        print("meshrun: backend 'mpi' needs an mpiexec (LaunchConfig.mpiexec)", file=sys.stderr)
        return 1
    server = None
    if wants_store(os.environ, config.nproc_per_node):
        try:
            server = _host_store(config)
        except (MeshCommError, OSError) as exc:  # names the address and the reason
            print(f"meshrun: {exc}", file=sys.stderr)
            return 1
        server.start()
    try:
        with catch_stop_signals(config.torchrun.stop_signals) as (_, received, _handlers):
            return launch_mpiexec(
                config.mpiexec,
                config.nproc_per_node,
                config.command,
                prefix=config.prefix,
                grace_period=config.grace_period,
                stop_signals=received,
                secret=config.secret,
                store=None if server is None else (config.master_addr, server.port),
            )
    finally:
        if server is not None:
            server.close()


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
