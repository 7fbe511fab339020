"""Test helpers: run a function on N ranks, and the conformance suite every backend passes.

- :func:`run_ranks` starts N processes (with :func:`meshcomm.spawn.spawn`), joins them into
  a world with ``meshcomm.init``, calls ``fn(group, *args)`` on each, and returns the
  per-rank results. A rank's exception is re-raised in the caller with its rank and
  traceback; nothing ever hangs past ``timeout``.
- :func:`run_conformance` runs inside every rank of any world (any backend, any size) and
  checks every collective against numpy oracles. It returns readable failure strings, so
  ``assert not failures`` shows exactly what broke.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> with ProcessGroup(SelfCommunicator()) as g:
    ...     run_conformance(g, quick=True)
    []
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from meshcomm.backends.conformance import run_conformance

__all__ = ["run_conformance", "run_ranks"]


# == run_ranks ==============================================================================
class _RemoteTraceback(Exception):
    """Carries a rank's formatted traceback as the ``__cause__`` of a re-raised exception."""

    def __str__(self) -> str:
        return str(self.args[0])


def _result_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.pickle")


def _write(path: str, payload: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(payload, f)
    os.replace(tmp, path)


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    backend: str,
    env: Mapping[str, str],
    directory: str,
    args: tuple[Any, ...],
) -> None:
    """Body of each process: join the world, run ``fn``, leave the outcome in a file."""
    os.environ.update(env)
    from meshcomm import world

    try:
        group = world.init(backend=backend)
        result = fn(group, *args)
    except BaseException as exc:
        text = traceback.format_exc()
        try:
            blob = pickle.dumps(exc)
        except Exception:
            blob = None
        _write(_result_path(directory, rank), ("error", blob, text))
        raise
    _write(_result_path(directory, rank), ("ok", result, ""))
    world.shutdown()


def run_ranks(
    fn: Callable[..., Any],
    nprocs: int,
    *,
    backend: str = "tcp",
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    args: Sequence[Any] = (),
) -> list[Any]:
    """Run ``fn(group, *args)`` on ``nprocs`` new processes forming one world.

    Each process calls ``meshcomm.world.init(backend=backend)`` with the launcher
    environment :func:`meshcomm.spawn.spawn` provides, then ``fn`` with the world group.
    Unless ``MESHCOMM_TIMEOUT`` is set (in ``env`` or here), the world's timeout is half of
    ``timeout`` (at least 10 s), so a stuck collective reports its own error before the
    harness stops it.

    Args:
        fn: a module-level (picklable) function ``fn(group, *args)``; its return value
            must be picklable.
        nprocs: number of ranks.
        backend: the backend passed to ``init``.
        timeout: seconds all ranks together may take; then every process is stopped.
        env: extra environment variables for the ranks (``MESHCOMM_DEBUG`` ...).
        args: further picklable arguments for ``fn``.

    Returns:
        The return values, index = rank.

    Raises:
        Exception: the exception of the rank that failed first, re-raised here with the
            rank's traceback as its ``__cause__`` (or the launcher's
            :class:`~meshcomm.spawn.SpawnError` when it cannot be reproduced here).
        meshcomm.spawn.SpawnTimeout: the ranks ran past ``timeout``.

    Example:
        >>> import operator
        >>> run_ranks(operator.attrgetter("rank", "size"), 2, timeout=60)
        [(0, 2), (1, 2)]
    """
    from meshcomm.spawn import SpawnError, spawn

    child_env = dict(env or {})
    if "MESHCOMM_TIMEOUT" not in child_env and not os.environ.get("MESHCOMM_TIMEOUT"):
        child_env["MESHCOMM_TIMEOUT"] = str(max(10.0, timeout / 2))
    with tempfile.TemporaryDirectory(prefix="meshcomm-ranks-") as directory:
        payload = (fn, backend, child_env, directory, tuple(args))
        try:
            spawn(_rank_main, args=payload, nprocs=nprocs, timeout=timeout)
        except SpawnError as exc:
            if exc.rank is not None:
                _reraise(directory, exc.rank, exc)
            raise
        results = []
        for rank in range(nprocs):
            with open(_result_path(directory, rank), "rb") as f:
                results.append(pickle.load(f)[1])  # our own children wrote these files
        return results


def _reraise(directory: str, rank: int, launcher_error: BaseException) -> None:
    """Raise rank ``rank``'s own exception if it left one behind; else return."""
    try:
        with open(_result_path(directory, rank), "rb") as f:
            status, blob, text = pickle.load(f)
        if status != "error" or blob is None:
            return
        original = pickle.loads(blob)
    except Exception:
        return  # nothing (readable) was left: the launcher's error says what it knows
    if not isinstance(original, BaseException):
        return
    note = f"raised on rank {rank}"
    if hasattr(original, "add_note"):
        original.add_note(note)
    raise original from _RemoteTraceback(f"{note}; its traceback:\n\n{text.rstrip()}")
