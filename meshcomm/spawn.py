"""``meshcomm.spawn``: run ``fn(rank, *args)`` in N processes, like ``torch.multiprocessing.spawn``.

The parent hosts the rendezvous store (a ``StoreServer`` on 127.0.0.1, port picked by the
kernel) and gives each process the torchrun environment, so ``meshcomm.init()`` inside ``fn``
needs no arguments. Processes start with the ``spawn`` method (a fresh interpreter: ``fn``
and ``args`` must be picklable, so ``fn`` is a module-level function).

Failure behaviour matches ``meshrun``: when one process raises (or exits non-zero, or dies
from a signal), the others get SIGTERM, then SIGKILL after a grace period, and the parent
raises :class:`ProcessRaisedException` (with the child's traceback text) or
:class:`ProcessExitedException`. The processes die with the parent if it is killed (Linux).
The parent notes each exit in the store, and before it stops the others which rank failed
(:mod:`meshcomm.launcher.exit_notes`), so the survivors' errors name the first failure.

The module is callable as :func:`spawn` itself, so both spellings of torch's work:
``import meshcomm.spawn as mp; mp.spawn(fn, nprocs=2)`` (as ``torch.multiprocessing``, with
``mp.start_processes`` and ``mp.ProcessContext``) and ``meshcomm.spawn(fn, nprocs=2)``.

Example:
    >>> import operator
    >>> import meshcomm.spawn as mp
    >>> mp.spawn(operator.add, args=(0,), nprocs=2, timeout=120)  # operator.add(rank, 0) per rank
    >>> mp(operator.add, args=(0,), nprocs=2, timeout=120)  # the module called: the same
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import time
import traceback
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshcomm.common.secret import SECRET_ENV
from meshcomm.common.timeout import Timeout, to_seconds
from meshcomm.errors import (
    InvalidArgument,
    ProcessExitedException,
    ProcessRaisedException,
    SpawnError,
    SpawnTimeout,
)
from meshcomm.launcher.exit_notes import ExitNotary, ExitNote
from meshcomm.launcher.job_secret import launch_secret
from meshcomm.launcher.processes import (
    DEFAULT_GRACE_PERIOD,
    SHADOWING_VARIABLES,
    describe_exit,
    rank_environment,
    set_parent_death_signal,
)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from meshcomm.launcher.torch_port import PortReservation
    from meshcomm.store.server import StoreServer


__all__ = [
    "ProcessContext",
    "ProcessExitedException",
    "ProcessRaisedException",
    "SpawnContext",
    "SpawnError",
    "SpawnTimeout",
    "spawn",
    "start_processes",
]


def _wait_any(objects: list[Any], timeout: float | None) -> list[Any]:
    """``multiprocessing.connection.wait``, imported when first needed."""
    from multiprocessing.connection import wait

    return wait(objects, timeout=timeout)


# Longest single wait of join(); exits wake it earlier through the process sentinels.
_POLL_SECONDS = 1.0
# Exit status of a child whose fn was interrupted by Ctrl-C (128 + SIGINT, as a shell says).
_INTERRUPTED = 130


def _entry(
    fn: Callable[..., object],
    rank: int,
    args: tuple[object, ...],
    env: dict[str, str],
    errors: Connection,
    parent_pid: int,
) -> None:
    """Body of every spawned process: tie it to the parent, set the rank's env, run fn."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before prctl: nobody would ever stop this process
    for name in SHADOWING_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(env)
    try:
        fn(rank, *args)
    except KeyboardInterrupt:
        # Ctrl-C reached the whole terminal's process group; the parent reports it.
        sys.exit(_INTERRUPTED)
    except Exception:
        # OSError: the parent is gone or already tearing down, so there is nobody to tell.
        with contextlib.suppress(OSError):
            errors.send_bytes(traceback.format_exc().encode(errors="replace"))
        sys.exit(1)
    finally:
        errors.close()


class SpawnContext:
    """Handle on the processes of a :func:`spawn` call made with ``join=False``.

    Attributes:
        processes: the ``multiprocessing`` processes, index = rank.

    Example:
        >>> import operator
        >>> ctx = spawn(operator.add, args=(0,), nprocs=2, join=False)
        >>> len(ctx.pids())
        2
        >>> ctx.join(timeout=120)
        True
    """

    def __init__(
        self,
        processes: list[BaseProcess],
        errors: list[Connection],
        server: StoreServer | None,
        grace_period: float = DEFAULT_GRACE_PERIOD,
        torch_port: PortReservation | None = None,
        notary: ExitNotary | None = None,
    ) -> None:
        self.processes = processes
        self._notary = notary
        self._stopped_after: int | None = None  # the failure the others were stopped for
        self._torch_port = torch_port
        self._errors: dict[int, Connection] = dict(enumerate(errors))
        self._tracebacks: dict[int, str] = {}
        self._server = server
        self._grace_period = grace_period
        self._exit_order: list[int] = []
        self._failure: SpawnError | None = None
        self._done = False

    def pids(self) -> list[int]:
        """Return the process ids, index = rank."""
        return [p.pid for p in self.processes if p.pid is not None]

    def join(self, timeout: Timeout | None = None) -> bool:
        """Wait for the processes; stop them all and raise if one fails.

        Args:
            timeout: seconds (or ``timedelta``) to wait; None waits until they all exit.

        Returns:
            True once every process exited with code 0; False if the timeout expired first
            (the processes keep running; call ``join`` again or :meth:`terminate`).

        Raises:
            ProcessRaisedException: ``fn`` raised in some process (its traceback attached).
            ProcessExitedException: a process exited non-zero or was killed by a signal.
            KeyboardInterrupt: Ctrl-C while waiting; the processes are stopped first.
        """
        if self._failure is not None:
            raise self._failure
        if self._done:
            return True
        deadline = None if timeout is None else time.monotonic() + to_seconds(timeout)
        try:
            while True:
                self._collect()
                failed = [r for r in self._exit_order if self.processes[r].exitcode != 0]
                if failed:
                    running = sum(p.exitcode is None for p in self.processes)
                    self._note_stopping(failed[0])
                    self.terminate()
                    self._failure = self._error(failed[0], running)
                    raise self._failure
                if len(self._exit_order) == len(self.processes):
                    self._finish()
                    return True
                wait = _POLL_SECONDS
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        return False
                # The ones _collect saw running (not ``exitcode is None`` again: one that exits
                # in between would be left out of the wait, and seen only after _POLL_SECONDS).
                exited = set(self._exit_order)
                live = [p.sentinel for r, p in enumerate(self.processes) if r not in exited]
                _wait_any([*live, *self._errors.values()], timeout=wait)
        except KeyboardInterrupt:
            self.terminate()
            raise

    def terminate(self) -> None:
        """Stop every process still running: SIGTERM, then SIGKILL after the grace period.

        Idempotent; also closes the store the processes shared.
        """
        live = [p for p in self.processes if p.exitcode is None]
        for proc in live:
            proc.terminate()
        deadline = time.monotonic() + self._grace_period
        while live and time.monotonic() < deadline:
            _wait_any([p.sentinel for p in live], timeout=deadline - time.monotonic())
            live = [p for p in live if p.exitcode is None]
        for proc in live:
            proc.kill()
        for proc in self.processes:
            proc.join(timeout=self._grace_period)
        self._collect()
        self._finish()

    def _note_stopping(self, failed: int) -> None:
        """Note in the store, before the signals, that the running ranks are stopped after
        rank ``failed``'s failure."""
        self._stopped_after = failed
        if self._notary is not None:
            for rank, proc in enumerate(self.processes):
                if proc.exitcode is None:
                    self._notary.note(ExitNote(rank, stopped_after=failed))

    def _collect(self) -> None:
        """Read tracebacks that arrived and note processes that exited, in order."""
        for rank, conn in list(self._errors.items()):
            try:
                while conn.poll(0):
                    self._tracebacks[rank] = conn.recv_bytes().decode(errors="replace")
            except (EOFError, OSError):
                conn.close()
                del self._errors[rank]
        for rank, proc in enumerate(self.processes):
            if rank not in self._exit_order and proc.exitcode is not None:
                self._exit_order.append(rank)
                if self._notary is not None and not self._done:
                    self._notary.note(ExitNote(rank, proc.exitcode, self._stopped_after))

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        if self._notary is not None:
            self._notary.close()
        for conn in self._errors.values():
            conn.close()
        self._errors.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._torch_port is not None:
            self._torch_port.close()
            self._torch_port = None

    def _error(self, rank: int, stopped_count: int) -> SpawnError:
        proc = self.processes[rank]
        code = proc.exitcode
        pid = proc.pid
        assert code is not None and pid is not None  # rank is in _exit_order
        plural = "process" if stopped_count == 1 else "processes"
        stopped = f"; stopped {stopped_count} running {plural}" if stopped_count else ""
        text = self._tracebacks.get(rank)
        if text is not None:
            return ProcessRaisedException(
                f"rank {rank} (pid {pid}) raised an exception{stopped}:\n\n{text.rstrip()}",
                rank,
                pid,
                text,
            )
        return ProcessExitedException(
            f"rank {rank} (pid {pid}) {describe_exit(code)}{stopped}", rank, pid, code
        )


def _check_picklable(what: str, value: object) -> None:
    try:
        pickle.dumps(value)
    except Exception as exc:
        raise InvalidArgument(
            f"meshcomm.spawn: {what} must be picklable to reach a spawned process "
            f"(fn must be a module-level function, not a lambda or local function): {exc}"
        ) from exc


def _host_store(secret: str) -> StoreServer:
    from meshcomm.store.server import StoreServer

    server = StoreServer("127.0.0.1", 0, secret=secret)
    server.start()
    return server


def spawn(
    fn: Callable[..., object],
    args: tuple[object, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    timeout: Timeout | None = None,
) -> SpawnContext | None:
    """Run ``fn(rank, *args)`` in ``nprocs`` new processes with a ready rendezvous.

    Each process gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MESHCOMM_MASTER_ADDR``, ``MESHCOMM_MASTER_PORT`` and ``MESHCOMM_STORE_HOSTED=1`` (the
    store is a ``StoreServer`` this process hosts on 127.0.0.1) and ``MESHCOMM_SECRET``
    (this process's own if set, else a fresh one per call; the store admits only holders of
    it), so ``meshcomm.init()`` in ``fn`` joins a world of ``nprocs``; and ``MASTER_ADDR``,
    ``MASTER_PORT`` (a port kept free for rank 0) so torch's own
    ``init_process_group`` (``"meshcomm"``, ``"gloo"``) works in ``fn`` too. If one
    process fails, the others are stopped (SIGTERM, then SIGKILL after a few seconds) and
    an exception says which rank failed and why. The
    processes die if this one is killed; start them from a thread that outlives them (Linux
    ties them to the starting thread).

    Args:
        fn: a picklable (module-level) function called as ``fn(rank, *args)``.
        args: further arguments for ``fn``; must be picklable.
        nprocs: number of processes (ranks ``0 .. nprocs - 1``).
        join: wait for the processes and return None; False returns a
            :class:`SpawnContext` at once.
        timeout: with ``join=True``, seconds (or ``timedelta``) the processes may run; when
            it expires they are stopped and :class:`SpawnTimeout` is raised. None: no limit.

    Returns:
        None with ``join=True``; otherwise the :class:`SpawnContext`.

    Raises:
        InvalidArgument: bad ``nprocs`` or ``timeout``, unpicklable ``fn``/``args``, or a
            timeout given with ``join=False`` (pass it to :meth:`SpawnContext.join`).
        ProcessRaisedException: ``fn`` raised in a process; has ``rank`` and ``traceback``.
        ProcessExitedException: a process exited non-zero or was killed by a signal.
        SpawnTimeout: the processes ran past ``timeout``.

    Example:
        >>> ctx = spawn(pow, args=(-1,), nprocs=2, join=False)  # pow(0, -1) fails on rank 0
        >>> try:
        ...     ctx.join(timeout=120)
        ... except ProcessRaisedException as exc:
        ...     print(exc.rank, exc.traceback.splitlines()[-1])
        0 ZeroDivisionError: 0.0 cannot be raised to a negative power
    """
    if not callable(fn):
        raise TypeError(f"meshcomm.spawn: fn must be callable, got {type(fn).__name__} {fn!r}")
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise InvalidArgument(f"meshcomm.spawn: nprocs must be an int >= 1, got {nprocs!r}")
    if not isinstance(args, tuple):
        raise TypeError(f"meshcomm.spawn: args must be a tuple, got {type(args).__name__}")
    seconds = None if timeout is None else to_seconds(timeout)
    if seconds is not None and not join:
        raise InvalidArgument(
            "meshcomm.spawn: timeout applies with join=True; with join=False pass it to "
            f"SpawnContext.join() (got timeout={timeout!r})"
        )
    _check_picklable("fn", fn)
    _check_picklable("args", args)

    import multiprocessing  # here: ``import meshcomm`` (every rank) need not pay for it

    mp = multiprocessing.get_context("spawn")
    # One secret per job (or the caller's MESHCOMM_SECRET): the store and links admit only
    # these processes. It reaches them through their environment, never a socket.
    secret = launch_secret()
    server = _host_store(secret)
    # torch's own init_process_group (env://) has rank 0 serve torch's store on MASTER_PORT:
    # a port kept free for it, apart from meshcomm's store (as meshrun does).
    from meshcomm.launcher.torch_port import PortReservation

    torch_port = PortReservation()
    processes: list[BaseProcess] = []
    readers: list[Connection] = []
    try:
        for rank in range(nprocs):
            env = rank_environment(
                rank=rank,
                world_size=nprocs,
                local_rank=rank,
                local_world_size=nprocs,
                master_addr="127.0.0.1",
                master_port=torch_port.port,
                launcher="meshcomm.spawn",
            )
            env["TORCHELASTIC_USE_AGENT_STORE"] = "False"
            # meshcomm finds the store through its own variables, which win over
            # MASTER_ADDR/MASTER_PORT: torch's tutorials have fn set those itself (to an
            # address nobody serves here) before init_process_group.
            env["MESHCOMM_MASTER_ADDR"] = "127.0.0.1"
            env["MESHCOMM_MASTER_PORT"] = str(server.port)
            env[SECRET_ENV] = secret
            reader, writer = mp.Pipe(duplex=False)
            proc = mp.Process(
                target=_entry,
                args=(fn, rank, args, env, writer, os.getpid()),
                name=f"meshcomm-rank{rank}",
            )
            proc.start()
            writer.close()  # the child holds the only write end: EOF means it is gone
            processes.append(proc)
            readers.append(reader)
    except BaseException:
        SpawnContext(processes, readers, server, torch_port=torch_port).terminate()
        raise
    notary = ExitNotary("127.0.0.1", server.port, secret)
    context = SpawnContext(processes, readers, server, torch_port=torch_port, notary=notary)
    if not join:
        return context
    if not context.join(seconds):
        running = [r for r, p in enumerate(processes) if p.exitcode is None]
        context.terminate()
        raise SpawnTimeout(
            f"meshcomm.spawn: rank(s) {running} still running after {seconds:g} s; "
            "stopped all processes",
            running,
        )
    return None


#: torch.multiprocessing's name of the handle ``join=False`` returns.
ProcessContext = SpawnContext


def start_processes(
    fn: Callable[..., object],
    args: tuple[object, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
) -> SpawnContext | None:
    """``torch.multiprocessing.start_processes``: :func:`spawn` with torch's extra parameters.

    Args:
        fn: as :func:`spawn`.
        args: as :func:`spawn`.
        nprocs: as :func:`spawn`.
        join: as :func:`spawn`.
        daemon: accepted for torch's signature; the processes die with this one either way.
        start_method: only ``"spawn"`` (meshcomm starts every rank in a fresh interpreter).

    Returns:
        As :func:`spawn`.

    Raises:
        InvalidArgument: a ``start_method`` other than ``"spawn"``; as :func:`spawn`.

    Example:
        >>> import operator
        >>> start_processes(operator.add, args=(0,), nprocs=2, start_method="spawn")
    """
    if start_method != "spawn":
        raise InvalidArgument(
            f"meshcomm.spawn.start_processes: start_method={start_method!r} is not supported; "
            "meshcomm starts every rank with 'spawn' (a fresh interpreter)"
        )
    return spawn(fn, args, nprocs, join)


class _CallableModule(types.ModuleType):
    """This module's class: calling the module calls :func:`spawn`.

    ``meshcomm.spawn`` names both this module and its function; whichever one a script
    reaches (``import meshcomm.spawn as mp`` or ``meshcomm.spawn(...)``), it works.
    """

    def __call__(
        self,
        fn: Callable[..., object],
        args: tuple[object, ...] = (),
        nprocs: int = 1,
        join: bool = True,
        timeout: Timeout | None = None,
    ) -> SpawnContext | None:
        return spawn(fn, args, nprocs, join, timeout)


sys.modules[__name__].__class__ = _CallableModule
