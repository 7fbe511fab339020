"""Run a Python program under MPI so that an uncaught exception on one rank aborts them all.

Without it, a rank that dies of an exception leaves its peers waiting in their next
collective until meshcomm's timeout (and MPI_Finalize may then wait for the dead rank).
Like ``python -m mpi4py``, this runs the program and, when it raises, prints the traceback
with the rank, then calls ``MPI_Abort`` on ``MPI_COMM_WORLD`` so the launcher stops every rank::

    mpiexec -n 8 python -m meshcomm.run_mpi train.py --epochs 3
    mpiexec -n 8 python -m meshcomm.run_mpi -m mypkg.train --epochs 3
    mpiexec -n 2 python -m meshcomm.run_mpi -c "import meshcomm; print(meshcomm.init('mpi'))"
    srun -n 8 python -m meshcomm.run_mpi train.py

``sys.exit(0)`` (or None) ends the rank normally; ``sys.exit(n)`` with another code aborts
the job with that code (an error message string aborts with 1). ``KeyboardInterrupt`` aborts
with 130. MPI is initialized (by importing ``mpi4py.MPI``) before the program starts.

``MESHCOMM_OUTPUT_PREFIX`` (``meshrun --backend mpi`` sets it to ``[rank{rank}] ``) labels
every line the rank writes to stdout and stderr with that pattern, ``{rank}`` replaced.

Example:
    >>> parse_args(["-m", "pkg.mod", "--flag"])
    ('module', 'pkg.mod', ['--flag'])
    >>> parse_args(["train.py", "-x"])
    ('path', 'train.py', ['-x'])
"""

from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from meshcomm.launcher.line_prefix import LinePrefix

__all__ = ["PREFIX_ENV", "main", "parse_args"]

#: A pattern such as ``[rank{rank}] ``: prefix every output line of the rank with it.
PREFIX_ENV = "MESHCOMM_OUTPUT_PREFIX"

_USAGE = (
    "usage: python -m meshcomm.run_mpi [-h] (SCRIPT | -m MODULE | -c COMMAND) [ARGS...]\n"
    "Run a program under MPI; an uncaught exception on any rank aborts every rank."
)


def parse_args(argv: Sequence[str]) -> tuple[str, str, list[str]]:
    """Split the command line into (kind, target, the program's own arguments).

    ``kind`` is "path", "module" or "command", as for ``python`` itself.

    Raises:
        SystemExit: no program was given (prints the usage), or ``-h``.
    """
    args = list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE, file=sys.stderr if not args else sys.stdout)
        raise SystemExit(2 if not args else 0)
    head = args[0]
    if head in ("-m", "-c"):
        if len(args) < 2:
            print(f"{_USAGE}\nerror: {head} needs an argument", file=sys.stderr)
            raise SystemExit(2)
        return ("module" if head == "-m" else "command"), args[1], args[2:]
    if head.startswith("-"):
        print(f"{_USAGE}\nerror: unknown option {head}", file=sys.stderr)
        raise SystemExit(2)
    return "path", head, args[1:]


def _run(kind: str, target: str, rest: list[str]) -> None:
    if kind == "module":
        sys.argv = [target, *rest]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "command":
        sys.argv = ["-c", *rest]
        namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        exec(compile(target, "<string>", "exec"), namespace)
    else:
        sys.argv = [target, *rest]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as python does
        runpy.run_path(target, run_name="__main__")


# Seconds between printing the failure and calling MPI_Abort (on the failure path only).
_FORWARD_GRACE_S = 0.5


def _is_ours(filename: str) -> bool:
    return filename in (__file__, runpy.__file__) or "runpy" in filename


def _abort(mpi: Any, code: int, reason: str, prefix: LinePrefix | None) -> NoReturn:
    world = mpi.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    sys.stdout.flush()
    print(
        f"meshcomm.run_mpi: rank {rank} of {size}: {reason}; aborting all {size} ranks "
        f"(MPI_Abort, exit code {code})",
        file=sys.stderr,
        flush=True,
    )
    if prefix is not None:
        prefix.stop()
    # MPI_Abort makes the launcher kill every rank at once; give its stdio forwarder a moment
    # to pass on the traceback just written, or the one message that explains the abort is lost.
    time.sleep(_FORWARD_GRACE_S)
    world.Abort(code)
    os._exit(code)  # Abort does not return; this is only for a broken MPI


def main(argv: Sequence[str] | None = None) -> int:
    """Run the program named by ``argv`` (default ``sys.argv[1:]``); abort MPI if it raises.

    Returns:
        0 when the program finished (or exited with code 0).
    """
    kind, target, rest = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        from mpi4py import MPI
    except ImportError as exc:
        print(
            f"meshcomm.run_mpi: needs mpi4py (pip install 'meshcomm[mpi]'): {exc}",
            file=sys.stderr,
        )
        return 2
    prefix = _start_prefix(MPI)
    try:
        _run(kind, target, rest)
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0:
            return _done(prefix)
        if isinstance(code, int):
            _abort(MPI, code, f"the program exited with code {code}", prefix)
        print(code, file=sys.stderr)
        _abort(MPI, 1, "the program exited with an error message", prefix)
    except KeyboardInterrupt:
        traceback.print_exc()
        _abort(MPI, 130, "interrupted (KeyboardInterrupt)", prefix)
    except BaseException as exc:
        rank = MPI.COMM_WORLD.Get_rank()
        tb = exc.__traceback__
        while tb is not None and _is_ours(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next  # start the traceback at the program, not at this launcher
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        label = "" if prefix is not None else f"[rank {rank}] "  # already labelled otherwise
        sys.stderr.write("".join(f"{label}{line}\n" for line in text.splitlines()))
        _abort(MPI, 1, f"uncaught {type(exc).__name__}: {exc}", prefix)
    return _done(prefix)


def _start_prefix(mpi: Any) -> LinePrefix | None:
    pattern = os.environ.get(PREFIX_ENV)
    if not pattern:
        return None
    prefix = LinePrefix(pattern.replace("{rank}", str(mpi.COMM_WORLD.Get_rank())).encode())
    prefix.start()
    return prefix


def _done(prefix: LinePrefix | None) -> int:
    if prefix is not None:
        prefix.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
