"""``meshrun --backend mpi``: start the ranks as one MPI job through ``mpiexec``.

meshrun runs ``mpiexec -n N python -m meshcomm.run_mpi PROGRAM ...`` and supervises that one
process. The user sees what meshrun shows for its own ranks:

- every output line labelled ``[rankN] `` (each rank labels its own lines through
  ``MESHCOMM_OUTPUT_PREFIX``: ``mpiexec`` merges all ranks into one stream);
- an uncaught exception on any rank stops every rank (``meshcomm.run_mpi`` calls
  ``MPI_Abort``), its traceback shown;
- meshrun's exit status is the job's (the failing rank's code; 128 + N for signal N);
- Ctrl-C (SIGINT, SIGTERM, SIGHUP) is passed on to ``mpiexec``, which passes it to the ranks;
  whatever still runs ``--grace-period`` seconds later is killed;
- the ``/dev/shm/mpich_shm_*`` files that an aborted MPICH job leaves are removed, when they
  were seen mapped by the job's own processes and nothing maps them any more
  (:mod:`meshcomm.launcher.mpich_shm`).

``meshcomm.init()`` in the ranks picks the mpi backend (``MESHCOMM_BACKEND=mpi``). meshrun
serves the job's store itself, as it does for tcp jobs, and names it to the ranks
(``MESHCOMM_MASTER_ADDR``, ``MESHCOMM_MASTER_PORT``, ``MESHCOMM_STORE_HOSTED=1``, with the
job's ``MESHCOMM_SECRET``): the hang verdicts then go through a store that no rank holds, so
they still name rank 0 when rank 0 itself is stuck (:mod:`meshcomm.rendezvous.mpi_store`).

Example:
    >>> mpiexec_command("/venv/bin/mpiexec", 4, ("/venv/bin/python", "train.py", "--lr", "1"))
    ['/venv/bin/mpiexec', '-n', '4', '/venv/bin/python', '-m', 'meshcomm.run_mpi', 'train.py', '--lr', '1']
"""  # noqa: E501

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from meshcomm.common.secret import SECRET_ENV
from meshcomm.launcher.mpich_shm import ShmWatch
from meshcomm.launcher.processes import (
    SHADOWING_VARIABLES,
    describe_exit,
    exit_status,
    rank_environment,
    send_signal,
    signal_name,
    supervised_command,
)

__all__ = ["MPIEXEC_ENV", "find_mpiexec", "launch_mpiexec", "mpi_environment", "mpiexec_command"]

#: Names the ``mpiexec`` to use (default: the one next to the interpreter, then PATH).
MPIEXEC_ENV = "MESHCOMM_MPIEXEC"

_PREFIX = "[rank{rank}] "
_TICK = 0.2


def find_mpiexec(env: Mapping[str, str] | None = None) -> str | None:
    """Return the ``mpiexec`` to use, or None if there is none.

    ``MESHCOMM_MPIEXEC`` first; then the one next to this interpreter (a virtual environment
    with MPICH or Open MPI from PyPI, matching the mpi4py it imports); then ``PATH``.

    Example:
        >>> find_mpiexec({"MESHCOMM_MPIEXEC": "/opt/mpi/bin/mpirun"})
        '/opt/mpi/bin/mpirun'
    """
    env = os.environ if env is None else env
    named = env.get(MPIEXEC_ENV, "").strip()
    if named:
        return named
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    return shutil.which("mpiexec", path=env.get("PATH"))


def mpiexec_command(mpiexec: str, nprocs: int, command: Sequence[str]) -> list[str]:
    """``mpiexec -n N`` over ``command``; a Python command runs under ``meshcomm.run_mpi``.

    ``command`` is meshrun's: ``(python, script, ...)``, ``(python, "-m", module, ...)``, or
    any program (``--no-python``), which runs as it is, without the abort wrapper.
    """
    head = [mpiexec, "-n", str(nprocs)]
    if len(command) >= 2 and _is_python(command[0]):
        return [*head, command[0], "-m", "meshcomm.run_mpi", *command[1:]]
    return [*head, *command]


def _is_python(program: str) -> bool:
    return program == sys.executable or Path(program).name.startswith("python")


def mpi_environment(
    nprocs: int,
    prefix: bool,
    base: Mapping[str, str] | None = None,
    store: tuple[str, int] | None = None,
) -> dict[str, str]:
    """The environment ``mpiexec`` starts the ranks with.

    meshrun's and torchrun's variables from an outer launcher are dropped (they would make
    ``meshcomm.init`` take the ranks for separate processes); ``MESHCOMM_BACKEND=mpi``;
    ``store``, the (host, port) of the store meshrun serves, as meshcomm's own variables
    (never ``MASTER_ADDR``/``MASTER_PORT``, which torch's ``env://`` would take as its own).

    Example:
        >>> env = mpi_environment(2, True, base={"RANK": "3", "HOME": "/root"})
        >>> sorted(env)
        ['HOME', 'MESHCOMM_BACKEND', 'MESHCOMM_OUTPUT_PREFIX', 'OMP_NUM_THREADS', 'PYTHONUNBUFFERED']
        >>> env = mpi_environment(2, False, base={}, store=("127.0.0.1", 40001))
        >>> env["MESHCOMM_MASTER_ADDR"], env["MESHCOMM_MASTER_PORT"], env["MESHCOMM_STORE_HOSTED"]
        ('127.0.0.1', '40001', '1')
    """  # noqa: E501
    env = dict(os.environ if base is None else base)
    torchrun = rank_environment(
        rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="", master_port=0
    )
    for name in (*SHADOWING_VARIABLES, *torchrun):
        env.pop(name, None)
    env["MESHCOMM_BACKEND"] = "mpi"
    env["PYTHONUNBUFFERED"] = "1"
    if prefix:
        env["MESHCOMM_OUTPUT_PREFIX"] = _PREFIX
    if nprocs > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    if store is not None:
        env["MESHCOMM_MASTER_ADDR"], env["MESHCOMM_MASTER_PORT"] = store[0], str(store[1])
        env["MESHCOMM_STORE_HOSTED"] = "1"
    return env


def launch_mpiexec(
    mpiexec: str,
    nprocs: int,
    command: Sequence[str],
    *,
    prefix: bool,
    grace_period: float,
    stop_signals: list[int],
    secret: str | None = None,
    store: tuple[str, int] | None = None,
) -> int:
    """Run the job; return meshrun's exit status.

    Args:
        mpiexec: the launcher to run.
        nprocs: ranks.
        command: meshrun's per-rank command.
        prefix: label output lines with the rank.
        grace_period: seconds between passing on a stop signal and SIGKILL.
        stop_signals: filled by meshrun's signal handler with the signals it receives.
        secret: the job's ``MESHCOMM_SECRET``, passed to the ranks through mpiexec's
            environment (which it forwards); None: the ranks get none (unauthenticated).
        store: the (host, port) of the store meshrun serves for the job; None: rank 0
            serves one itself (:mod:`meshcomm.rendezvous.mpi_store`).
    """
    argv = mpiexec_command(mpiexec, nprocs, command)
    env = mpi_environment(nprocs, prefix, store=store)
    if secret:
        env[SECRET_ENV] = secret
    else:
        env.pop(SECRET_ENV, None)
    try:
        proc = subprocess.Popen(
            supervised_command(argv),
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except OSError as exc:
        print(f"meshrun: cannot start {mpiexec!r}: {exc}", file=sys.stderr)
        return 1
    stop: int | None = None
    kill_at: float | None = None
    watch = ShmWatch(proc.pid)
    while True:
        try:
            code = proc.wait(timeout=_TICK)
            break
        except subprocess.TimeoutExpired:
            pass
        watch.scan()
        if stop_signals:
            signum = stop_signals.pop(0)
            if stop is None:
                stop = signum
                print(f"meshrun: received {signal_name(signum)}; stopping the job", file=sys.stderr)
                # mpiexec passes the signal on to every rank.
                send_signal(proc.pid, signum)
                kill_at = time.monotonic() + grace_period
            else:
                kill_at = 0.0  # a second Ctrl-C: do not wait for the grace period
        if kill_at is not None and time.monotonic() >= kill_at:
            send_signal(proc.pid, 9, group=True)
            kill_at = float("inf")
    # MPI_Abort skips MPICH's own unlinking; a clean job has removed its files already.
    watch.cleanup()
    if stop is not None:
        return 128 + stop
    if code != 0:
        print(
            f"meshrun: mpiexec -n {nprocs} {describe_exit(code)}; the job has stopped",
            file=sys.stderr,
        )
    return exit_status(code)
