"""Shared-memory files an MPICH job leaves in ``/dev/shm`` when it ends in ``MPI_Abort``.

MPICH (4.x, the ch4 device) maps one file per job and node, ``/dev/shm/mpich_shm_<id>_<node>``
(``<id>`` a hash of the job's PMI name: no launcher variable sets it), and unlinks it in
``MPI_Finalize``. ``MPI_Abort`` kills the ranks first, so each aborted job leaves its file
(2-4 MiB) until the machine reboots.

``meshrun --backend mpi`` tells its job's files apart by watching the job while it runs:
:class:`ShmWatch` looks at the memory maps of the processes below ``mpiexec`` and notes every
``mpich_shm_*`` name one of them maps. When the job has ended it removes a noted file only if
it still exists, belongs to this user, and no live process maps it or holds it open, so a
file another job uses is never touched. A job that aborts within its first fraction of a
second (before the first look) may still leave its file.

Linux only (``/proc``); elsewhere the watch notes nothing.

Example:
    >>> watch = ShmWatch(root_pid=2**22 + 1)   # no such process: nothing to note
    >>> watch.scan(now=0.0)
    >>> watch.names, watch.cleanup(wait=0.0)
    (set(), [])
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator

__all__ = ["SHM_DIR", "ShmWatch", "mapped_by"]

SHM_DIR = "/dev/shm"
_PREFIX = "mpich_shm_"
_PROC = "/proc"
# Look at the job's maps on every launcher tick until a name shows up (for at most
# _EAGER seconds: a job without MPICH's shared memory never maps one), then now and then (a
# job that spawns more worlds maps more files; a name once seen stays noted).
_EAGER = 10.0
_SLOW_SCAN = 2.0


class ShmWatch:
    """Note the ``mpich_shm_*`` files the processes below ``root_pid`` map; remove the ones
    left after the job ended.

    Attributes:
        names: file names (without the directory) seen mapped by the job's processes.
        pids: the processes seen mapping them.
    """

    def __init__(self, root_pid: int, shm_dir: str = SHM_DIR) -> None:
        self.root_pid = root_pid
        self.shm_dir = shm_dir
        self.names: set[str] = set()
        self.pids: set[int] = set()
        self._next_scan = 0.0
        self._eager_until: float | None = None

    def scan(self, now: float | None = None) -> None:
        """Look at the memory maps of the job's processes (throttled once a name was seen)."""
        now = time.monotonic() if now is None else now
        if self._eager_until is None:
            self._eager_until = now + _EAGER
        if now < self._next_scan or not os.path.isdir(_PROC):
            return
        for pid in _descendants(self.root_pid):
            found = _mapped_names(pid, self.shm_dir)
            if found:
                self.names |= found
                self.pids.add(pid)
        if self.names or now >= self._eager_until:
            self._next_scan = now + _SLOW_SCAN

    def cleanup(self, wait: float = 10.0) -> list[str]:
        """Remove the noted files that the ended job left; return the paths removed.

        Waits up to ``wait`` seconds for the processes seen mapping them to be gone (the
        launcher may exit a moment before its ranks have), then removes each noted file that
        is still there, is owned by this user, and that no live process maps or holds open.
        """
        if not self.names:
            return []
        deadline = time.monotonic() + wait
        while any(_alive(pid) for pid in self.pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        paths = [os.path.join(self.shm_dir, name) for name in sorted(self.names)]
        paths = [p for p in paths if _owned(p)]
        if not paths:
            return []
        in_use = mapped_by(paths)
        removed = []
        for path in paths:
            if in_use.get(path):
                continue
            # Gone already, or not ours to remove after all: the launcher must not fail for it.
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
        return removed


def mapped_by(paths: Iterable[str]) -> dict[str, list[int]]:
    """The live processes that map or hold open each of ``paths`` (those this user may see).

    A file of this user with mode 0600 can be opened only by this user and root; processes
    whose maps cannot be read (another user's) are skipped.
    """
    wanted = set(paths)
    users: dict[str, list[int]] = {p: [] for p in wanted}
    for pid in _pids():
        hits = _mapped_paths(pid) & wanted
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"{_PROC}/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"{_PROC}/{pid}/fd/{fd}")
                    if target in wanted:
                        hits.add(target)
        for path in hits:
            users[path].append(pid)
    return users


def _pids() -> Iterator[int]:
    with contextlib.suppress(OSError):
        for entry in os.listdir(_PROC):
            if entry.isdigit():
                yield int(entry)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid in _pids():
        ppid = _parent(pid)
        if ppid is not None:
            children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def _parent(pid: int) -> int | None:
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def _mapped_paths(pid: int) -> set[str]:
    try:
        with open(f"{_PROC}/{pid}/maps", encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return set()
    paths = set()
    for line in lines:
        parts = line.split(maxsplit=5)
        path = parts[5].rstrip("\n") if len(parts) == 6 else ""
        if path.startswith("/") and not path.endswith(" (deleted)"):
            paths.add(path)
    return paths


def _mapped_names(pid: int, shm_dir: str) -> set[str]:
    head = shm_dir.rstrip("/") + "/"
    return {
        path[len(head) :]
        for path in _mapped_paths(pid)
        if path.startswith(head + _PREFIX) and "/" not in path[len(head) :]
    }


def _alive(pid: int) -> bool:
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")  # a zombie maps nothing


def _owned(path: str) -> bool:
    try:
        return os.stat(path).st_uid == os.getuid()
    except OSError:
        return False
