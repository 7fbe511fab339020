"""What a launcher saw of its ranks' exits, in the job's store, for the survivors' reports.

A rank that sees a peer go can tell how it went only in part: an EOF or a vanished process
looks the same whether the peer was killed, failed or finished. The launcher knows: it
reaps every rank. ``meshrun`` and :func:`meshcomm.spawn` write one note per rank into the
store they host, at the root (``meshcomm/exit/<restart>/<rank>``):

* when they reap a rank: its exit status (``0``: it exited normally);
* before they stop the others after a failure (SIGTERM): that they are stopping it, and
  after which rank's failure; written before the signal, so a survivor that sees a stopped
  rank vanish finds the first failure named.

The tcp transport's failure path (:mod:`meshcomm.backends.tcp.faults`) reads the note of a
peer it saw go before it blames that peer. Notes are words for reports only: nothing else
depends on them, a store that does not answer skips them, and ranks started by another
launcher simply find none.

Example:
    >>> note = ExitNote(2, code=-9)
    >>> note.words()
    'was killed by SIGKILL'
    >>> ExitNote.decode(note.encode(), 2) == note
    True
    >>> ExitNote(0, code=0).words()
    'exited normally (status 0)'
    >>> ExitNote(1, stopped_after=2).words()
    'was stopped by its launcher after rank 2 failed'
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from meshcomm.errors import MeshCommError
from meshcomm.launcher.processes import LAUNCHER_ENV, signal_name
from meshcomm.store.base import Store

__all__ = [
    "EXIT_PREFIX",
    "NOTING_LAUNCHERS",
    "ExitNotary",
    "ExitNote",
    "exit_key",
    "launcher_rank",
    "read_note",
]

#: Where the notes live in the launcher's store (then ``<restart>/<rank>``).
EXIT_PREFIX = "meshcomm/exit/"
#: The launchers that write notes (their name in ``MESHCOMM_LAUNCHER``).
NOTING_LAUNCHERS = ("meshrun", "meshcomm.spawn")
#: Seconds a launcher's store client may take per note before the notes are given up.
_NOTARY_TIMEOUT = 2.0


def exit_key(rank: int, restart: int | str = 0) -> str:
    """The store key of rank ``rank``'s note in attempt ``restart``.

    Example:
        >>> exit_key(3, 1)
        'meshcomm/exit/1/3'
    """
    return f"{EXIT_PREFIX}{restart}/{rank}"


@dataclass(frozen=True)
class ExitNote:
    """What the launcher saw of one rank.

    Attributes:
        rank: the rank (the launcher's numbering: ``RANK``).
        code: its exit status as ``Popen.returncode`` gives it (minus the signal number for
            a signal); None: not reaped yet (it is being stopped).
        stopped_after: the rank whose failure made the launcher stop this one (None: the
            launcher did not stop it).
    """

    rank: int
    code: int | None = None
    stopped_after: int | None = None

    def words(self) -> str:
        """How the rank went, in words for a report."""
        if self.stopped_after is not None:
            return f"was stopped by its launcher after rank {self.stopped_after} failed"
        if self.code is None:
            return "was stopped by its launcher"
        if self.code == 0:
            return "exited normally (status 0)"
        if self.code < 0:
            return f"was killed by {signal_name(-self.code)}"
        return f"exited with status {self.code}"

    def encode(self) -> bytes:
        """The note as the store keeps it."""
        return json.dumps({"code": self.code, "stopped_after": self.stopped_after}).encode()

    @classmethod
    def decode(cls, raw: bytes, rank: int) -> ExitNote | None:
        """Read a stored note; None for anything malformed (a store is shared by the job)."""
        try:
            value = json.loads(raw[:200].decode(errors="replace"))
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        code, after = value.get("code"), value.get("stopped_after")
        if code is not None and (isinstance(code, bool) or not isinstance(code, int)):
            return None
        if after is not None and (isinstance(after, bool) or not isinstance(after, int)):
            return None
        return cls(rank, code, after)


def launcher_rank(rank: int, size: int, env: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started by a launcher that writes notes (``meshrun``,
    :func:`meshcomm.spawn`: ``MESHCOMM_LAUNCHER``) and ``rank`` of a world of ``size`` is
    its numbering (``RANK``, ``WORLD_SIZE``), so that its notes speak of the same ranks.

    Example:
        >>> launcher_rank(1, 4, {"RANK": "1", "WORLD_SIZE": "4", "MESHCOMM_LAUNCHER": "meshrun"})
        True
        >>> launcher_rank(1, 4, {"RANK": "1", "WORLD_SIZE": "4"})  # torchrun: no notes
        False
    """
    env = os.environ if env is None else env
    return (
        env.get(LAUNCHER_ENV) in NOTING_LAUNCHERS
        and env.get("RANK") == str(rank)
        and env.get("WORLD_SIZE") == str(size)
    )


def read_note(store: Store, rank: int, restart: str | None = None) -> ExitNote | None:
    """Rank ``rank``'s note in the launcher's store, if its launcher wrote one.

    Args:
        store: a store of the job (a prefixed view is unwrapped to its root).
        rank: the rank, in the launcher's numbering.
        restart: the attempt (None: this process's ``TORCHELASTIC_RESTART_COUNT``).

    Raises:
        StoreError, OSError: the store did not answer (the caller decides what that means).
    """
    from meshcomm.store.prefix import PrefixStore

    while isinstance(store, PrefixStore):
        store = store.underlying_store
    if restart is None:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = exit_key(rank, restart)
    if not store.check([key]):
        return None
    return ExitNote.decode(bytes(store.get(key)), rank)


class ExitNotary:
    """A launcher's writer of exit notes, through a client of the store it hosts.

    Connects on the first note; after one failed store operation it writes no more (a
    launcher must never wait on notes to stop its ranks).

    Args:
        host: the store's address.
        port: its port.
        secret: the job's secret (None or ``""``: none).
        restart: the attempt the notes belong to.
    """

    def __init__(self, host: str, port: int, secret: str | None, restart: int = 0) -> None:
        self._where = (host, port, secret or "")
        self._restart = restart
        self._store: Store | None = None
        self._lost = False

    def note(self, note: ExitNote) -> None:
        """Write ``note`` (best effort)."""
        if self._lost:
            return
        try:
            if self._store is None:
                from meshcomm.store.tcp import TCPStore

                host, port, secret = self._where
                self._store = TCPStore(host, port, timeout=_NOTARY_TIMEOUT, secret=secret)
            self._store.set(exit_key(note.rank, self._restart), note.encode())
        except (MeshCommError, OSError):
            self._lost = True
            self.close()

    def close(self) -> None:
        """Close the store client, if one was opened."""
        store, self._store = self._store, None
        if store is not None:
            with contextlib.suppress(MeshCommError, OSError):
                store.close()
