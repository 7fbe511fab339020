"""Process supervision shared by ``meshrun`` (:mod:`meshcomm.run`) and :func:`meshcomm.spawn`.

Both launchers follow one policy: when a rank fails, every other rank gets SIGTERM, then
SIGKILL after a grace period; the launcher reports the first failure and exits (or raises)
with it. This module holds the pieces both use: the environment of a rank, exit-code wording,
shell-style exit statuses, signalling a process that may already be gone, and tying a
child's life to its parent (``PR_SET_PDEATHSIG``).

Example:
    >>> describe_exit(1), describe_exit(-9)
    ('exited with code 1', 'killed by SIGKILL')
    >>> exit_status(1), exit_status(-9)
    (1, 137)
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable, Sequence

from meshcomm.errors import InvalidArgument

__all__ = [
    "DEFAULT_GRACE_PERIOD",
    "LAUNCHER_ENV",
    "SHADOWING_VARIABLES",
    "describe_exit",
    "exit_status",
    "rank_environment",
    "send_signal",
    "set_parent_death_signal",
    "signal_name",
    "supervised_command",
]

#: Names the launcher that started a rank with torchrun's variables (see rank_environment).
LAUNCHER_ENV = "MESHCOMM_LAUNCHER"

#: Seconds a process gets between SIGTERM and SIGKILL when its job is stopped.
DEFAULT_GRACE_PERIOD = 5.0

#: Variables that ``meshcomm.init()`` reads before the torchrun ones; an inherited value (a
#: launcher started inside another job) would override the rank's real identity.
SHADOWING_VARIABLES = (
    "MESHCOMM_RANK",
    "MESHCOMM_WORLD_SIZE",
    "MESHCOMM_LOCAL_RANK",
    "MESHCOMM_LOCAL_WORLD_SIZE",
    "MESHCOMM_MASTER_ADDR",
    "MESHCOMM_MASTER_PORT",
)

# linux/prctl.h; stable kernel ABI.
_PR_SET_PDEATHSIG = 1

_prctl: Callable[..., int] | None = None
_prctl_loaded = False


def rank_environment(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    master_addr: str,
    master_port: int,
    group_rank: int = 0,
    group_world_size: int = 1,
    run_id: str = "none",
    launcher: str = "meshrun",
) -> dict[str, str]:
    """Return the torchrun variables of one rank whose launcher hosts the store.

    ``MESHCOMM_STORE_HOSTED=1`` tells ``meshcomm.init()`` that rank 0 must connect to the
    store at ``MASTER_ADDR:MASTER_PORT`` as a client instead of starting a server there.
    ``MESHCOMM_LAUNCHER`` names the launcher (``meshrun``, ``meshcomm.spawn``): torchrun's
    variables alone would make ``meshcomm-info`` say torchrun.

    Example:
        >>> env = rank_environment(rank=1, world_size=2, local_rank=1, local_world_size=2,
        ...                        master_addr="127.0.0.1", master_port=29500)
        >>> env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"], env["MESHCOMM_STORE_HOSTED"]
        ('1', '2', '29500', '1')
    """
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(group_world_size),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "MESHCOMM_STORE_HOSTED": "1",
        LAUNCHER_ENV: launcher,
    }


def signal_name(signum: int) -> str:
    """Return the name of a signal number (``"SIGKILL"``), or ``"signal N"`` if unknown.

    Example:
        >>> signal_name(15)
        'SIGTERM'
    """
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    """Describe a process exit status as ``Popen.returncode`` reports it.

    Args:
        returncode: the exit code, or minus the signal number that killed the process
            (the convention of ``subprocess`` and ``multiprocessing``).

    Example:
        >>> describe_exit(0), describe_exit(-15)
        ('exited with code 0', 'killed by SIGTERM')
    """
    if returncode < 0:
        return f"killed by {signal_name(-returncode)}"
    return f"exited with code {returncode}"


def exit_status(returncode: int) -> int:
    """Return the status a shell would report: the exit code, or 128 + the signal number.

    Example:
        >>> exit_status(3), exit_status(-2)
        (3, 130)
    """
    if returncode < 0:
        return 128 + (-returncode)
    return returncode


def send_signal(pid: int, signum: int, *, group: bool = False) -> bool:
    """Send ``signum`` to a process (or to its whole process group) that may already be gone.

    Args:
        pid: the process id; with ``group=True`` also its process-group id (the process must
            lead its own group, as ``meshrun`` ranks do).
        signum: the signal to send.
        group: signal every process in the group, so a rank's own children go too.

    Returns:
        True if the signal was delivered, False if no such process (group) exists any more.

    Example:
        >>> import subprocess, sys
        >>> proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        >>> send_signal(proc.pid, signal.SIGTERM)
        True
        >>> proc.wait(timeout=30)
        -15
    """
    try:
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except ProcessLookupError:
        return False
    except PermissionError:
        # A recycled pid owned by someone else: not ours to signal any more.
        return False
    return True


def _load_prctl() -> Callable[..., int] | None:
    """Resolve libc's ``prctl`` once; None where it does not exist (not Linux)."""
    global _prctl, _prctl_loaded
    if not _prctl_loaded:
        _prctl_loaded = True
        if sys.platform.startswith("linux"):
            try:
                _prctl = ctypes.CDLL(None, use_errno=True).prctl
            except (OSError, AttributeError):
                _prctl = None
    return _prctl


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux only).

    The signal fires when the *thread* that started this process exits, so start children
    from a thread that outlives them (the main thread, normally). Callers must then check
    ``os.getppid()``: a parent that died before this call leaves the process orphaned.

    Returns:
        True if the kernel accepted the request, False on platforms without ``prctl``.

    Example:
        >>> isinstance(set_parent_death_signal(0), bool)  # 0 clears it again
        True
    """
    prctl = _load_prctl()
    if prctl is None:
        return False
    return bool(prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0)


# Runs as `python -I -S -c _SHIM <launcher pid> <command...>` and execs the command in place:
# the rank keeps this pid, its own process group, and the parent-death signal (prctl
# settings survive exec). A shim instead of subprocess's preexec_fn, because preexec_fn can
# deadlock when the launcher has threads (the store server has).
_SHIM = """\
import ctypes, os, sys
os.setpgid(0, 0)
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    sys.stderr.write(f"meshrun: cannot run {sys.argv[2]!r}: {exc}\\n")
    os._exit(127)
"""


def supervised_command(command: Sequence[str], parent_pid: int | None = None) -> list[str]:
    """Wrap ``command`` so it runs in its own process group and dies with its launcher.

    The wrapped command first starts a small Python shim (isolated mode, no ``site``) that
    makes the process lead a new process group (so the launcher can stop it together with
    the processes it starts, and a terminal's Ctrl-C reaches only the launcher), asks Linux
    to SIGKILL it when the launcher dies (even from SIGKILL), then ``exec``s ``command``
    in the same process. A command that cannot be found exits with status 127.

    Args:
        command: the program and its arguments.
        parent_pid: the launcher's pid; None means ``os.getpid()``. If the launcher is
            already gone when the shim runs, the shim exits with status 1.

    Example:
        >>> import subprocess, sys
        >>> cmd = supervised_command([sys.executable, "-c", "print('hi')"])
        >>> subprocess.run(cmd, capture_output=True, timeout=30).stdout
        b'hi\\n'
    """
    if not command:
        raise InvalidArgument("the command to run is empty")
    pid = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-I", "-S", "-c", _SHIM, str(pid), *command]
