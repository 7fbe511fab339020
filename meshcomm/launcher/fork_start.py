"""``meshrun``'s fork start method: ranks forked from a launcher that imported numpy once.

Starting a rank the usual way costs a fresh interpreter, ``site``, ``import numpy`` and the
import of meshcomm itself, once per rank; on a machine with fewer cores than ranks that is
most of a short job's wall time. With the fork start method the launcher imports numpy and
meshcomm's hot modules once, then forks each rank, which runs the program the way
``python script.py`` / ``python -m module`` would: as a fresh ``__main__`` module, with its
own ``sys.argv``, ``sys.path[0]``, environment, standard streams, signal dispositions,
process group and parent-death signal, and Python's exit semantics (non-daemon threads
joined, ``atexit`` handlers run, ``SystemExit`` codes, an unhandled ``KeyboardInterrupt``
ends the process by SIGINT).

Forking is only safe in a process with one thread: :func:`single_threaded` checks the
kernel's task list (so BLAS worker threads count too), and numpy is imported here only when
the ranks' environment asks for one BLAS thread, so its pool starts no threads.

Example:
    >>> exit_code(SystemExit(None)), exit_code(SystemExit(3))
    (0, 3)
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import gc
import importlib
import io
import os
import signal
import sys
import threading
import types
from collections.abc import Mapping, Sequence
from importlib.machinery import SourceFileLoader

__all__ = [
    "HOT_MODULES",
    "can_fork",
    "exit_code",
    "fork_rank",
    "preload",
    "single_threaded",
]

#: Modules a rank of a typical meshcomm program imports before its first collective.
HOT_MODULES = (
    "meshcomm.world",
    "meshcomm.mesh",
    "meshcomm.ops",
    "meshcomm.backends.tcp",
    "meshcomm.rendezvous",
    "meshcomm.store.tcp",
    "meshcomm.group",
    "meshcomm.group.lower",
    "meshcomm.diagnostics.fingerprint",
    "meshcomm.backends.local",
)

# BLAS libraries read these when numpy loads them; any other value starts worker threads.
_BLAS_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

# The interpreter options under which ``python script.py`` would see a different sys.path
# (or none of the environment) than the launcher: then ranks are spawned instead.
_PATH_FLAGS = ("isolated", "ignore_environment", "no_site", "safe_path")


def can_fork(script: str | None) -> bool:
    """True when ranks of this program may be forked instead of spawned.

    The launcher must run on Linux (parent-death signal) under an interpreter whose
    ``sys.path`` a rank would share, and the program must be a module (``-m``) or a Python
    source file (a directory, zip application or ``.pyc`` is left to ``python`` itself).

    Example:
        >>> can_fork("no/such/file.py")
        False
    """
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    if any(getattr(sys.flags, name, 0) for name in _PATH_FLAGS):
        return False
    if script is None:
        return True
    if not os.path.isfile(script) or script.endswith((".pyc", ".pyo")):
        return False
    with contextlib.suppress(OSError), open(script, "rb") as f:
        return f.read(4) != b"PK\x03\x04"  # a zip application starts like any zip file
    return False


def single_threaded() -> bool:
    """True if this process has exactly one thread, native ones included (Linux)."""
    if threading.active_count() != 1:
        return False
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def preload(env: Mapping[str, str]) -> None:
    """Import numpy and :data:`HOT_MODULES` here, once, for every forked rank to share.

    numpy is imported only if ``env`` (a rank's environment) limits BLAS to one thread, and
    under those same variables, so the ranks get the thread pool they would have got
    themselves. A module that fails to import is left for the rank to import (and report).
    """
    one_thread = env.get("OPENBLAS_NUM_THREADS", env.get("OMP_NUM_THREADS")) == "1"
    if one_thread and "numpy" not in sys.modules:
        saved = {name: os.environ.get(name) for name in _BLAS_VARIABLES}
        for name in _BLAS_VARIABLES:
            if name in env:
                os.environ[name] = env[name]
        try:
            with contextlib.suppress(ImportError):
                importlib.import_module("numpy")
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    if "numpy" in sys.modules:
        for name in HOT_MODULES:
            with contextlib.suppress(ImportError):
                importlib.import_module(name)
    # Collect now, so no garbage object closes a reused descriptor number in a rank later;
    # then freeze, so the ranks' collectors do not touch (and copy) the shared pages.
    gc.collect()
    gc.freeze()


def fork_rank(
    *,
    target: str,
    args: Sequence[str],
    module: bool,
    env: Mapping[str, str],
    stdout_fd: int | None,
    stderr_fd: int | None,
    signals: Mapping[int, object],
) -> int:
    """Fork one rank; return its pid in the launcher. The child never returns.

    Args:
        target: the script path, or the module name with ``module=True``.
        args: the program's arguments (``sys.argv[1:]``).
        module: run ``target`` as ``python -m`` would.
        env: the rank's whole environment.
        stdout_fd: the write end of the rank's stdout pipe; None keeps the launcher's.
        stderr_fd: the same for stderr.
        signals: the dispositions to give back to the launcher's caught signals.
    """
    parent = os.getpid()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()  # else the child would write the launcher's pending bytes again
    blocked = list(signals)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        pid = os.fork()
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        raise
    if pid == 0:
        code = 1
        try:
            _become_rank(parent, env, stdout_fd, stderr_fd, signals, old_mask)
            code = _run_program(target, args, module)
        except BaseException as exc:  # the rank could not be set up: say why, then exit 1
            with contextlib.suppress(BaseException):
                os.write(2, f"meshrun: cannot start the rank: {exc!r}\n".encode())
        finally:
            os._exit(code)
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    # Also here, so the launcher can signal the group even before the child runs.
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)
    return pid


def _become_rank(
    parent: int,
    env: Mapping[str, str],
    stdout_fd: int | None,
    stderr_fd: int | None,
    signals: Mapping[int, object],
    old_mask: set[int | signal.Signals],
) -> None:
    from meshcomm.launcher.processes import set_parent_death_signal

    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the launcher died before the line above
        os._exit(1)
    signal.set_wakeup_fd(-1)
    for signum, handler in signals.items():
        signal.signal(signum, handler)  # type: ignore[arg-type]
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    if stdout_fd is not None and stderr_fd is not None:
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
    # What spawned ranks get from close_fds: the store's sockets, other ranks' pipes and
    # whatever meshrun inherited stay out of the rank.
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536)
    os.environ.clear()
    os.environ.update(env)
    _reopen_std_streams()


def _reopen_std_streams() -> None:
    # As the interpreter makes them under PYTHONUNBUFFERED=1, which spawned ranks get.
    old_in, old_out, old_err = sys.stdin, sys.stdout, sys.stderr

    def text(stream: object, fd: int, mode: str, name: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        raw.name = name
        buffer: io.RawIOBase | io.BufferedReader = io.BufferedReader(raw) if mode == "rb" else raw
        return io.TextIOWrapper(
            buffer,  # type: ignore[arg-type]
            encoding=getattr(stream, "encoding", None),
            errors=getattr(stream, "errors", None),
            write_through=mode == "wb",
        )

    sys.stdin = text(old_in, 0, "rb", "<stdin>")
    sys.stdout = text(old_out, 1, "wb", "<stdout>")
    sys.stderr = text(old_err, 2, "wb", "<stderr>")
    # Final in typeshed, but the interpreter sets them at start-up, as a rank's start is here.
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr  # type: ignore[misc]


def _run_program(target: str, args: Sequence[str], module: bool) -> int:
    main = types.ModuleType("__main__")
    # The interpreter's own __main__ starts with these two.
    main.__dict__.update(__builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = main
    interrupted = False
    try:
        if module:
            import runpy

            sys.argv = [target, *args]  # argv[0] becomes the module's file, as with -m
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.realpath(target))
            path = os.path.abspath(target)  # the interpreter's __file__ for a script
            main.__file__ = path
            main.__cached__ = None  # type: ignore[attr-defined]
            main.__loader__ = SourceFileLoader("__main__", path)
            with open(path, "rb") as f:
                source = f.read()
            exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)
        code = 0
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException as exc:  # reported as the interpreter would
        interrupted = isinstance(exc, KeyboardInterrupt)
        _report(exc)
        code = 1
    code = _finalize(code)
    if interrupted:
        # As the interpreter does: let the parent see death by SIGINT, not an exit code.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def exit_code(exc: SystemExit) -> int:
    """The status ``python`` exits with for an uncaught ``SystemExit`` (printing its text)."""
    value = exc.code
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    with contextlib.suppress(Exception):
        print(value, file=sys.stderr)
    return 1


def _report(exc: BaseException) -> None:
    # Drop this module's and runpy's frames, so the traceback starts at the program.
    tb = exc.__traceback__
    ours = {__file__}
    with contextlib.suppress(Exception):
        import runpy

        ours.add(runpy.__file__)
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    exc.__traceback__ = tb
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException:  # a broken hook must not hide the error
        import traceback

        traceback.print_exception(type(exc), exc, tb)


def _finalize(code: int) -> int:
    # The interpreter's shutdown order: join non-daemon threads, run atexit, flush.
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        with contextlib.suppress(BaseException):
            shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # the interpreter's own rule
            if stream is sys.stdout and code == 0:
                code = 120
    return code
