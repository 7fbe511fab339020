"""The supervision of one attempt: start this node's ranks, forward their output, stop them all.

A :class:`Supervisor` forks or spawns the ranks, reads their pipes
(:mod:`meshcomm.launcher.output`),
reaps them (through pidfds where the kernel has them), reacts to meshrun's own signals and to a
rank's failure (SIGTERM, then SIGKILL after the grace period; each exit, and before the
signals which rank failed, noted in the job's store for the survivors' errors:
:mod:`meshcomm.launcher.exit_notes`), gathers the ranks' reports
(:mod:`meshcomm.diagnostics.job_report`) and says at the end who failed and why.
:func:`meshcomm.run.launch`
runs one per attempt.
"""

from __future__ import annotations

import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any

from meshcomm.diagnostics.job_report import Gathering
from meshcomm.diagnostics.signal_report import REPORT_DIR_ENV, TIMEOUT_FILE
from meshcomm.launch import JOIN_ENV
from meshcomm.launcher.config import LaunchConfig, child_environment
from meshcomm.launcher.exit_notes import ExitNotary, ExitNote
from meshcomm.launcher.fork_start import fork_rank
from meshcomm.launcher.output import Lines, Sink
from meshcomm.launcher.processes import (
    describe_exit,
    exit_status,
    send_signal,
    signal_name,
    supervised_command,
)
from meshcomm.launcher.rank_logs import AttemptLogs
from meshcomm.launcher.signals import report_signal
from meshcomm.launcher.torchrun_flags import STD_ERR, STD_OUT

__all__ = ["Forked", "Rank", "Supervisor"]

# Lines of each rank's stderr kept for the failure summary.
_TAIL_LINES = 200
# Lines shown in the summary when the tail holds no "Traceback" header.
_SHOWN_LINES = 20
# After the last rank exits, how long to keep reading pipes its children may still hold.
_DRAIN_SECONDS = 2.0
# Longest sleep of the supervision loop; exits also wake it through pidfds where available.
_TICK_WITH_PIDFD = 1.0

# Seconds meshrun waits for the ranks' reports (SIGUSR1, the first Ctrl-C, a timeout).
_REPORT_SECONDS = 3.0
_REPORT_POLL = 0.05

# How long to wait for ranks after SIGKILL before reporting them and exiting anyway.
_AFTER_SIGKILL = 10.0


class Forked:
    """The part of ``subprocess.Popen`` the supervisor uses, for a rank it forked."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Reap the rank if it exited; its exit code (as ``Popen.returncode``) or None."""
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
        """Wait up to ``timeout`` seconds for the rank to exit (``subprocess.TimeoutExpired``)."""
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


@dataclass
class Rank:
    """One rank the supervisor started: its process, pidfd, stderr tail and how it ended."""

    rank: int
    proc: subprocess.Popen[bytes] | Forked
    pidfd: int | None
    tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))
    returncode: int | None = None
    # The last signal meshrun sent it (None: it ended on its own).
    sent: int | None = None


class Supervisor:
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
        self.out = Sink(sys.stdout)
        self.err = Sink(sys.stderr)
        self.ranks: list[Rank] = []
        self.selector = selectors.DefaultSelector()
        self.failures: list[Rank] = []
        # --elastic: ranks that failed while others ran on (those shrink their world).
        self.lost: list[Rank] = []
        self.replaced = 0  # ranks started again in place of lost ones (--elastic)
        self.stop_signal: int | None = None  # a signal meshrun itself received
        self.kill_at: float | None = None  # when stopping: SIGKILL deadline
        self.drain_until: float | None = None
        self.give_up_at: float | None = None  # after SIGKILL: stop waiting for the ranks
        # Where the ranks leave their reports (meshcomm.diagnostics.job_report); one report at a
        # time, and
        # a timed-out collective triggers one once.
        self.report_dir = tempfile.mkdtemp(prefix="meshrun-report-")
        self.gathering: Gathering | None = None
        self.timeout_reported = False
        # How each rank went, in the job's store (best effort: never delays a stop long).
        self.notary = ExitNotary(config.master_addr, master_port, config.secret, restart)
        self.stopped_after: int | None = None  # the rank whose failure stopped the others

    # -- starting -------------------------------------------------------------------------

    def start(self, signals: dict[int, Any] | None = None) -> None:
        """Start every rank; with ``signals`` (the dispositions forked ranks get), fork them."""
        for local_rank in range(self.config.nproc_per_node):
            self._start_rank(local_rank, signals, self.restart)

    def _start_rank(
        self, local_rank: int, signals: dict[int, Any] | None, restart: int, joins: bool = False
    ) -> Rank:
        """Start one rank (forked with ``signals``, else spawned); ``joins``: it replaces a
        lost rank of an ``--elastic`` job and joins the running mesh."""
        cfg = self.config
        rank = cfg.node_rank * cfg.nproc_per_node + local_rank
        env = child_environment(
            cfg,
            local_rank,
            self.master_port,
            restart=restart,
            rank_log_dir=self.logs.rank_dir(local_rank),
        )
        env[REPORT_DIR_ENV] = self.report_dir
        if joins:
            env[JOIN_ENV] = "1"
        proc: subprocess.Popen[bytes] | Forked
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
        entry = Rank(rank, proc, pidfd)
        self.ranks.append(entry)
        if pidfd is not None:
            self.selector.register(pidfd, selectors.EVENT_READ, None)
        if self.piped:
            self._watch_output(entry, local_rank)
        return entry

    def _watch_output(self, entry: Rank, local_rank: int) -> None:
        proc = entry.proc
        assert proc.stdout is not None and proc.stderr is not None  # piped by start()
        tag = f"[rank{entry.rank}] ".encode() if self.config.prefix else b""
        for stream, sink, tail, which in (
            (proc.stdout, self.out, None, STD_OUT),
            (proc.stderr, self.err, entry.tail, STD_ERR),
        ):
            fd = stream.fileno()
            os.set_blocking(fd, False)
            lines = Lines(fd, sink, tag, tail, self.logs.route(local_rank, which))
            self.selector.register(fd, selectors.EVENT_READ, lines)

    def _fork(self, env: dict[str, str], signals: dict[int, Any]) -> Forked:
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
            return Forked(pid, None, None)
        (out_r, out_w), (err_r, err_w) = pipes
        os.close(out_w)
        os.close(err_w)
        return Forked(pid, os.fdopen(out_r, "rb", buffering=0), os.fdopen(err_r, "rb", 0))

    # -- the loop ---------------------------------------------------------------------------

    def live(self) -> list[Rank]:
        """The ranks not reaped yet."""
        return [r for r in self.ranks if r.returncode is None]

    def run(self, wakeup_fd: int | None, received: list[int]) -> int:
        """Supervise until every rank exited; return meshrun's exit status for this attempt.

        Args:
            wakeup_fd: the signal pipe of :func:`~meshcomm.launcher.signals.catch_stop_signals`.
            received: the signals recorded there, handled (and removed) as they come.
        """
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
                elif isinstance(key.data, Lines) and not key.data.read():
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
        return any(isinstance(key.data, Lines) for key in self.selector.get_map().values())

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
            self.notary.note(ExitNote(entry.rank, code, self.stopped_after))
            if entry.pidfd is not None:
                self.selector.unregister(entry.pidfd)
                os.close(entry.pidfd)
                entry.pidfd = None
            if code != 0 and entry.sent is None and self.stop_signal is None:
                if self.config.elastic and (others := len(self.live())):
                    self.lost.append(entry)
                    self.err.say(
                        f"rank {entry.rank} (pid {entry.proc.pid}) {describe_exit(code)}; the "
                        f"other {others} ranks go on without it (--elastic)"
                    )
                    self._replace(entry)
                    continue
                self.failures.append(entry)
                if len(self.failures) == 1:
                    others = len(self.live())
                    tail = f"; stopping the other {others} ranks" if others else ""
                    self.err.say(
                        f"rank {entry.rank} (pid {entry.proc.pid}) {describe_exit(code)}{tail}"
                    )

    def _replace(self, lost: Rank) -> None:
        """``--elastic --max-restarts N``: start a rank in place of ``lost`` (spawned: the
        store server's thread runs now), which joins the running mesh; N for the node."""
        if self.replaced >= self.config.torchrun.max_restarts:
            return
        self.replaced += 1
        local_rank = lost.rank - self.config.node_rank * self.config.nproc_per_node
        # The attempt's restart count: the replacement meets the others' store keys.
        entry = self._start_rank(local_rank, None, self.restart, joins=True)
        self.err.say(
            f"started rank {entry.rank} again (pid {entry.proc.pid}; replacement "
            f"{self.replaced} of --max-restarts {self.config.torchrun.max_restarts}): it joins "
            "the running mesh"
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
        if self.failures:
            self.stopped_after = self.failures[0].rank
        for entry in self.live():  # noted before the signal: survivors see it vanish later
            self.notary.note(ExitNote(entry.rank, stopped_after=self.stopped_after))
        for entry in self.live():
            self._signal(entry, signal.SIGTERM)

    def _kill_all(self) -> None:
        self.kill_at = math.inf
        if self.give_up_at is None:
            self.give_up_at = time.monotonic() + _AFTER_SIGKILL
        for entry in self.live():
            self._signal(entry, signal.SIGKILL)

    def _signal(self, entry: Rank, signum: int) -> None:
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
        self.notary.close()
        shutil.rmtree(self.report_dir, ignore_errors=True)
        for key in list(self.selector.get_map().values()):
            if isinstance(key.data, Lines):
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

    def _name_error_file(self, entry: Rank) -> None:
        # torch's @record writes the exception to TORCHELASTIC_ERROR_FILE; torchrun reports it.
        rank_dir = self.logs.rank_dir(
            entry.rank - self.config.node_rank * self.config.nproc_per_node
        )
        path = None if rank_dir is None else os.path.join(rank_dir, "error.json")
        if path is not None and os.path.exists(path):
            self.err.say(f"rank {entry.rank} wrote its error to {path}")

    def _show_tail(self, what: str, entry: Rank) -> None:
        lines = list(entry.tail)
        starts = [i for i, line in enumerate(lines) if line.startswith(b"Traceback (most recent")]
        local = entry.rank - self.config.node_rank * self.config.nproc_per_node
        if starts and self.logs.on_console(local, STD_ERR):
            # The traceback went by above, tagged with the rank: repeat only its error, the
            # lines after the last frame (the exception and what it adds, a verdict say).
            block = lines[starts[-1] :]
            first = next((i for i in range(1, len(block)) if not block[i].startswith(b" ")), 0)
            shown = block[first:]
            self.err.say(f"{what}; its error (the traceback is above):")
        else:
            shown = lines[-_SHOWN_LINES:]
            self.err.say(f"{what}; the end of its stderr:")
        tag = f"[rank{entry.rank}] ".encode()
        self.err.write(b"".join(tag + line + b"\n" for line in shown))


def _rank_list(entries: list[Rank]) -> str:
    ranks = ", ".join(str(r.rank) for r in entries)
    return f"rank {ranks}" if len(entries) == 1 else f"ranks {ranks}"
