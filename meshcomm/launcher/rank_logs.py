"""Where each rank's output goes: torchrun's ``--log-dir``, ``--redirects``, ``--tee``,
``--local-ranks-filter`` and ``--duplicate-std{out,err}-filters``, for ``meshrun``.

The directory layout is torchrun 2.13's (``DefaultLogsSpecs`` in
``torch/distributed/elastic/multiprocessing/api.py``)::

    <log_dir>/<run_id>_<random>/attempt_<restart>/<local_rank>/stdout.log
    <log_dir>/<run_id>_<random>/attempt_<restart>/<local_rank>/stderr.log
    <log_dir>/<run_id>_<random>/attempt_<restart>/filtered_stdout.log
    <log_dir>/<run_id>_<random>/attempt_<restart>/filtered_stderr.log

``<run_id>_<random>`` is made once per ``meshrun`` (``tempfile.mkdtemp``), so runs sharing
a ``--log-dir`` never mix; without ``--log-dir`` it lies in a fresh ``meshrun_*`` temporary
directory, as torchrun's lies in ``torchelastic_*``. The files hold what the rank wrote,
unprefixed; the console gets ``[rankN] `` lines as always. A redirected stream goes to its
file only; a tee'd one to its file and the console; a rank outside ``--local-ranks-filter``
is not shown on the console (its files are still written).

Example:
    >>> import tempfile
    >>> plan = LogPlan(log_dir=tempfile.mkdtemp(), redirects={0: 3, 1: 0}, tee={0: 0, 1: 1})
    >>> attempt = RunLogs(plan, "job").attempt(0, 2)
    >>> attempt.route(0, 1).console, attempt.route(1, 1).console, attempt.route(1, 2).file
    (False, True, None)
    >>> attempt.close()
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import IO

from meshcomm.launcher.torchrun_flags import STD_ERR, STD_OUT

__all__ = ["AttemptLogs", "LogPlan", "Route", "RunLogs"]

_NAMES = {STD_OUT: "stdout", STD_ERR: "stderr"}


@dataclass(frozen=True)
class LogPlan:
    """What the flags asked for; built by :func:`meshcomm.run.parse_args`.

    Attributes:
        log_dir: ``--log-dir``; None: a temporary directory, made only if a file is needed.
        redirects: ``{local_rank: bits}`` of ``--redirects`` (1 stdout, 2 stderr).
        tee: ``{local_rank: bits}`` of ``--tee``.
        shown: local ranks shown on the console (``--local-ranks-filter``); None: all.
        stdout_filters: ``--duplicate-stdout-filters``: stdout lines holding any of these
            also go to ``filtered_stdout.log``.
        stderr_filters: the same for stderr.
    """

    log_dir: str | None = None
    redirects: dict[int, int] = field(default_factory=dict)
    tee: dict[int, int] = field(default_factory=dict)
    shown: frozenset[int] | None = None
    stdout_filters: tuple[str, ...] = ()
    stderr_filters: tuple[str, ...] = ()

    @property
    def writes_files(self) -> bool:
        """True if a log directory is made (``--log-dir``, or any redirect, tee or filter)."""
        return (
            self.log_dir is not None
            or any(self.redirects.values())
            or any(self.tee.values())
            or bool(self.stdout_filters or self.stderr_filters)
        )

    @property
    def active(self) -> bool:
        """True if output must pass through meshrun even with ``--no-prefix``."""
        return self.writes_files or self.shown is not None


@dataclass
class Route:
    """Where one stream of one rank goes.

    Attributes:
        file: its log file (unprefixed lines), or None.
        console: whether its lines are shown on meshrun's console.
        filtered: the attempt's ``filtered_std*.log`` and the filters, or None.
    """

    file: IO[bytes] | None
    console: bool
    filtered: tuple[IO[bytes], tuple[bytes, ...]] | None = None

    def write(self, lines: list[bytes], prefix: bytes) -> str | None:
        """Write whole lines (without their newline) to the file and the filtered log.

        Returns:
            None, or a message when a file could not be written (a full disk): from then
            on this stream goes to the console instead, so that no line is lost.
        """
        try:
            if self.file is not None:
                self.file.write(b"".join(line + b"\n" for line in lines))
            if self.filtered is not None:
                out, needles = self.filtered
                chosen = [line for line in lines if any(n in line for n in needles)]
                if chosen:
                    out.write(b"".join(prefix + line + b"\n" for line in chosen))
        except OSError as exc:
            name = getattr(self.file, "name", "a log file")
            self.file, self.filtered, self.console = None, None, True
            return f"cannot write {name}: {exc}; this stream goes to the console from now on"
        return None


class RunLogs:
    """The log directory of one ``meshrun`` run: one ``attempt_<n>`` per (re)start."""

    def __init__(self, plan: LogPlan, run_id: str) -> None:
        self.plan = plan
        self.run_id = run_id
        self.run_dir: str | None = None

    def attempt(self, restart: int, nproc: int) -> AttemptLogs:
        """Make ``attempt_<restart>`` (emptied if it exists) and open its files."""
        attempt_dir = None
        if self.plan.writes_files:
            if self.run_dir is None:
                # Absolute: TORCHELASTIC_ERROR_FILE must hold for a rank that changes directory.
                base = os.path.abspath(self.plan.log_dir or tempfile.mkdtemp(prefix="meshrun_"))
                os.makedirs(base, exist_ok=True)
                self.run_dir = tempfile.mkdtemp(prefix=f"{self.run_id}_", dir=base)
            attempt_dir = os.path.join(self.run_dir, f"attempt_{restart}")
            shutil.rmtree(attempt_dir, ignore_errors=True)
            os.makedirs(attempt_dir)
        return AttemptLogs(self.plan, attempt_dir, nproc)


class AttemptLogs:
    """The open files of one attempt; :meth:`close` when its ranks are gone."""

    def __init__(self, plan: LogPlan, attempt_dir: str | None, nproc: int) -> None:
        self.plan = plan
        self.dir = attempt_dir
        self._files: list[IO[bytes]] = []
        self._filtered: dict[int, tuple[IO[bytes], tuple[bytes, ...]]] = {}
        if attempt_dir is None:
            return
        for local_rank in range(nproc):
            os.mkdir(os.path.join(attempt_dir, str(local_rank)))
        for stream, filters in ((STD_OUT, plan.stdout_filters), (STD_ERR, plan.stderr_filters)):
            if filters:
                path = os.path.join(attempt_dir, f"filtered_{_NAMES[stream]}.log")
                self._filtered[stream] = (self._open(path), tuple(f.encode() for f in filters))

    def rank_dir(self, local_rank: int) -> str | None:
        """``attempt_<n>/<local_rank>``, or None when no files are written."""
        return None if self.dir is None else os.path.join(self.dir, str(local_rank))

    def on_console(self, local_rank: int, stream: int) -> bool:
        """Whether ``stream`` of ``local_rank`` is shown on meshrun's console."""
        tee = bool(self.plan.tee.get(local_rank, 0) & stream)
        redirect = bool(self.plan.redirects.get(local_rank, 0) & stream) or tee
        shown = self.plan.shown is None or local_rank in self.plan.shown
        return shown and (tee or not redirect)

    def route(self, local_rank: int, stream: int) -> Route:
        """Where ``stream`` (:data:`STD_OUT` or :data:`STD_ERR`) of ``local_rank`` goes."""
        tee = bool(self.plan.tee.get(local_rank, 0) & stream)
        redirect = bool(self.plan.redirects.get(local_rank, 0) & stream) or tee
        rank_dir = self.rank_dir(local_rank)
        file = None
        if redirect and rank_dir is not None:
            file = self._open(os.path.join(rank_dir, f"{_NAMES[stream]}.log"))
        return Route(file, self.on_console(local_rank, stream), self._filtered.get(stream))

    def _open(self, path: str) -> IO[bytes]:
        # Unbuffered: a file shows what the rank wrote as soon as meshrun read it.
        handle = open(path, "wb", buffering=0)  # noqa: SIM115 - closed by close()
        self._files.append(handle)
        return handle

    def close(self) -> None:
        """Close every file of this attempt."""
        for handle in self._files:
            handle.close()
        self._files.clear()
