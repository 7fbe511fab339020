"""Who failed, in words every rank agrees on: the tcp transport's failure path.

One :class:`Faults` per transport holds the peers whose connection ended between frames,
and the store keys every rank of the transport reads when something goes wrong:

* the abort record (:data:`ABORT_KEY`, :class:`~meshcomm.backends.tcp.abort.AbortRecord`):
  the first failure seen, written once (the first writer wins); every rank blocked in a call
  reads it about once a second (:meth:`Faults.check_abort`), so ranks with no connection to
  the failed one fail too;
* a note per rank (:data:`LEFT_KEY`): why that rank gave up (its first error), written before
  it can close its channels, so a peer that sees it leave names the first failure instead of
  calling it dead (:meth:`Faults.blame`);
* why the world is being aborted on purpose (:data:`CLOSING_KEY`, the first writer wins),
  written with an abort record by a rank that leaves a failed world to re-form it
  (:meth:`Faults.abort_world`): every call that then fails on this transport ends with
  :class:`~meshcomm.errors.PeerClosed` and those words (the elastic mesh is being
  re-formed), not as a death;
* the launcher's note on each rank's exit (:mod:`meshcomm.launcher.exit_notes`, under ``meshrun``
and
  :func:`meshcomm.spawn`): its exit status, or that the launcher stopped it after another
  rank failed.

Before it blames a peer it saw go, a rank waits up to :data:`BLAME_GRACE` for the first
failure's record (or the launcher's note on that peer): the rank that failed first may
still be writing it, and a peer stopped or failed because of that failure is no culprit.

The store may be gone with its host; that must not mask the error, so after one failed store
operation of this path the others are skipped.

Example:
    >>> ABORT_KEY
    'meshcomm/tcp/abort'
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from meshcomm.backends.tcp.abort import AbortRecord
from meshcomm.errors import (
    CommError,
    MeshCommError,
    MismatchError,
    PeerClosed,
    PeerError,
    ProtocolError,
    StoreError,
)
from meshcomm.launcher.exit_notes import ExitNote, launcher_rank, read_note
from meshcomm.store.base import Store

__all__ = [
    "ABORT_KEY",
    "BLAME_GRACE",
    "CLOSING_KEY",
    "GOODBYE",
    "LEFT_KEY",
    "NOTE_GRACE",
    "NO_GOODBYE",
    "Faults",
]

ABORT_KEY = "meshcomm/tcp/abort"
#: + the rank: why a rank gave up (its first error), written before it can leave.
LEFT_KEY = "meshcomm/tcp/left/"
CLOSING_KEY = "meshcomm/tcp/closing"
#: How a peer that said GOODBYE went.
GOODBYE = "closed its communicator"
#: How a peer whose socket ended between frames without a GOODBYE went.
NO_GOODBYE = "its connection closed (EOF) without a goodbye"
_NOTE_MAX = 1000
#: Seconds a rank that saw a peer go waits at most for the first failure's abort record (or
#: the launcher's note on that peer) before it blames the peer.
BLAME_GRACE = 0.5
#: Seconds it waits at most for the launcher's note on that peer, where its launcher writes
#: them (the note comes within milliseconds of the peer's exit unless the launcher is slow).
NOTE_GRACE = 2.0
_GRACE_POLL = 0.02
_T = TypeVar("_T")


class Faults:
    """The failure path of one transport (see the module docstring).

    Args:
        rank: this process's global rank.
        size: the world size.
        store: the job's store (the transport's keys).

    Attributes:
        gone: peers whose connection ended between frames, and how (``GOODBYE`` or
            ``NO_GOODBYE``).

    Example:
        >>> from meshcomm.store import HashStore
        >>> faults = Faults(0, 2, HashStore())
        >>> faults.check_abort()  # no record: nothing to raise
    """

    def __init__(self, rank: int, size: int, store: Store) -> None:
        self.rank = rank
        self.size = size
        self.gone: dict[int, str] = {}
        self._store = store
        self._store_lost = False  # a store operation of the failure path failed
        # The launcher's exit notes speak of its ranks: only where they are ours.
        self._notes = launcher_rank(rank, size)

    @property
    def store_lost(self) -> bool:
        """Whether a store operation of the failure path failed (the others are skipped)."""
        return self._store_lost

    # -- errors ----------------------------------------------------------------------------
    def gone_error(self, peer: int, action: str) -> PeerError:
        """The error for a call that needs ``peer``, gone between frames."""
        how = self.gone[peer]
        closed = self._closed_on_purpose(peer, f"{how}, and this rank had to {action} it")
        if closed is not None:  # a rank aborted the world on purpose: nobody's failure
            return closed
        if how is GOODBYE:
            # A goodbye comes only from a healthy rank that closed on purpose: its own doing.
            reason = f"rank {peer} {how} (seen by rank {self.rank})"
            current = self._swap_abort(AbortRecord(peer, reason))
            if current is not None and current.mismatch:
                raise MismatchError(current.reason)  # it left after the ranks disagreed
            blamed = peer
        else:
            reason, blamed = self.blame(peer, how)
        return PeerError(f"rank {self.rank}: cannot {action} rank {peer}: {reason}", blamed)

    def lost(self, peer: int, address: str, exc: BaseException) -> PeerError:
        """The error for ``peer``'s broken connection (published if it is the first)."""
        closed = self._closed_on_purpose(peer, f"its connection to {address}: {exc}")
        if closed is not None:
            return closed
        reason, blamed = self.blame(peer, str(exc), f"connection to {address}, ")
        return PeerError(f"rank {self.rank}: peer {reason}", blamed)

    def _closed_on_purpose(self, peer: int, how: str) -> PeerClosed | None:
        """The error for a call that lost ``peer`` after a rank aborted the world on purpose
        (:meth:`abort_world`): the reason it gave, then how ``peer`` was seen to go."""
        closing = self.closing_reason()
        if closing is None:
            return None
        return PeerClosed(f"rank {self.rank}: {closing} (then rank {peer} went: {how})", peer)

    def peer_died(self, peer: int, how: str) -> PeerError:
        """The error for a same-host peer whose process is gone (``how`` says how we saw it)."""
        reason, blamed = self.blame(peer, how)
        return PeerError(f"rank {self.rank}: peer {reason}", blamed)

    def copy_failed(
        self, peer: int, what: str, nbytes: int, remote: int, exc: OSError, dead: bool
    ) -> CommError:
        """The error for a ``process_vm_readv/writev`` of same-host ``peer`` that failed.

        Args:
            peer: the peer's global rank.
            what: ``"read"`` or ``"write"``.
            nbytes: the bytes of the copy.
            remote: the address in the peer.
            exc: the kernel's error.
            dead: the peer's process is gone (``ESRCH``).
        """
        if dead:
            return self.peer_died(peer, "its process is gone")
        how = f"cannot {what} {nbytes} bytes of it at {remote:#x}: {exc}"
        return self.left_after_failure(peer, how) or ProtocolError(
            f"rank {self.rank}: cannot {what} {nbytes} bytes of rank {peer} at {remote:#x}: {exc}"
        )

    def blame(self, peer: int, how: str, where: str = "") -> tuple[str, int]:
        """Say who failed when ``peer`` went away without a goodbye, and publish it if first.

        A rank that fails publishes its abort record (or finds one) and notes why it gives
        up (:data:`LEFT_KEY`) before it raises, so before it can close its channels. So a
        record that names another rank is the failure ``peer`` left after: ``peer`` is a
        survivor, and the report names the rank that really failed. That record may still
        be on its way (its writer saw the failure at the same time as ``peer`` did), so
        unless it is there or the launcher's note on ``peer`` settles the matter, this
        waits up to :data:`BLAME_GRACE` for it. The launcher's note names the first
        failure when the launcher stopped ``peer`` because of it, and says how ``peer``
        went otherwise: a peer that exited normally or with an error status is blamed but
        not called dead. A note of ``peer``'s own without such a record says it left after
        its own error (a timeout): it is blamed, but not called dead, and no record is
        written (timeouts write none). Only with none of these is ``peer`` taken for dead.

        Returns:
            The reason to report and the global rank to blame.
        """
        seen = f"{where}seen by rank {self.rank}"
        why = self._store_op(lambda: self._read_key(LEFT_KEY + str(peer)))
        record, note = self._settle(peer, left=why is not None)
        if record is not None and record.mismatch:
            # It left after the ranks disagreed on a call: that is the error, in words.
            raise MismatchError(record.reason)
        found = self._after(record, peer, how, seen) or self._stopped_after(note, peer, how, seen)
        if found is not None:
            return found
        if why is not None:
            # It failed and left: not a death, and (as for timeouts) no abort record.
            return f"rank {peer} left after its own error ({why}; {seen})", peer
        if note is not None and (note.code is None or note.code >= 0):
            # It exited on its own (normally, or with an error status), or its launcher
            # stopped it: not a death.
            reason = f"rank {peer} {note.words()} ({how}, {seen})"
        elif note is not None:
            reason = f"rank {peer} died: {how} ({seen}; its launcher says it {note.words()})"
        else:
            reason = f"rank {peer} died: {how} ({seen})"
        record = self._swap_abort(AbortRecord(peer, reason))
        if record is None:
            # No store (it may have died with its host): a death this rank saw itself earlier
            # stands in for the abort record.
            earlier = [g for g, went in self.gone.items() if went is NO_GOODBYE and g != peer]
            if earlier:
                why = f"rank {earlier[0]} died: {NO_GOODBYE} (seen by rank {self.rank} earlier)"
                record = AbortRecord(earlier[0], why)
        return self._after(record, peer, how, seen) or (reason, peer)

    def _settle(self, peer: int, left: bool) -> tuple[AbortRecord | None, ExitNote | None]:
        """The abort record and the launcher's note on ``peer``, once they say who failed.

        Waits up to :data:`BLAME_GRACE` while there is no record, and no note on ``peer``
        that says more than its own error (``left``: ``peer`` noted an error of its own,
        which may have come from a failure whose record is still on its way); under a
        launcher that writes notes, up to :data:`NOTE_GRACE` for the note on ``peer`` (a
        process's sockets close a moment before its launcher can reap it, and a loaded
        launcher may take a while longer).
        """
        start = time.monotonic()
        while True:
            record = self.read_abort()
            note = self._read_note(peer)
            if record is not None or self._store_lost:
                return record, note
            if note is not None and (not left or note.stopped_after is not None):
                return record, note
            if self.size <= 2 and not self._notes:
                return record, note  # nobody else could write a record
            waited = time.monotonic() - start
            if waited >= BLAME_GRACE and (note is not None or not self._notes):
                return record, note
            if waited >= NOTE_GRACE:
                return record, note
            time.sleep(_GRACE_POLL)

    def _read_note(self, peer: int) -> ExitNote | None:
        """The launcher's note on ``peer``, if it is the launcher's rank and left one."""
        if not self._notes:
            return None
        return self._store_op(lambda: read_note(self._store, peer))

    def _stopped_after(
        self, note: ExitNote | None, peer: int, how: str, seen: str
    ) -> tuple[str, int] | None:
        """When the launcher stopped ``peer`` after another rank failed: that failure as the
        abort record (published if first), and the report that ``peer`` left after it."""
        first = note.stopped_after if note is not None else None
        if first is None or first in (peer, self.rank):
            return None
        first_note = self._read_note(first)
        said = f"its launcher says so; seen by rank {self.rank}"
        if first_note is None:
            reason = f"rank {first} failed (its launcher stopped the others; {said})"
        elif first_note.code is not None and first_note.code < 0:
            reason = f"rank {first} died: it {first_note.words()} ({said})"
        else:
            reason = f"rank {first} {first_note.words()} ({said})"
        record = self._swap_abort(AbortRecord(first, reason))
        if record is not None and record.mismatch:
            raise MismatchError(record.reason)
        how = f"{note.words() if note is not None else how}: {how}"
        return self._after(record or AbortRecord(first, reason), peer, how, seen)

    def note_leaving(self, exc: CommError) -> None:
        """Say in the store why this rank is giving up, before it can close its channels, so
        that a peer that sees it go does not take it for dead."""
        note = f"{type(exc).__name__}: {exc}"[:_NOTE_MAX]
        self._store_op(lambda: self._store.set(LEFT_KEY + str(self.rank), note))

    def abort_world(self, reason: str) -> None:
        """Abort this transport's world on purpose, saying why, before this rank's GOODBYE:
        the reason first (:data:`CLOSING_KEY`), then an abort record if there is none yet,
        so that every rank blocked in a call wakes within a second and says ``reason``."""
        words = f"rank {self.rank} left the world: {reason}"[:_NOTE_MAX]
        self._store_op(lambda: self._store.compare_set(CLOSING_KEY, b"", words.encode()))
        self._swap_abort(AbortRecord(None, words))

    def closing_reason(self) -> str | None:
        """Why a rank aborted this world on purpose (:meth:`abort_world`), if one did."""
        return self._store_op(lambda: self._read_key(CLOSING_KEY))

    def left_after_failure(self, peer: int, how: str) -> PeerError | None:
        """The error for a same-host peer whose buffer went away under a copy, if it failed or
        left after a failure the abort record names (it stopped waiting for us and freed
        the buffer), or after an error of its own (its note); None with neither (the ranks
        disagree: a protocol error). Waits for the record as :meth:`blame` does."""
        closed = self._closed_on_purpose(peer, how)
        if closed is not None:  # the world is being closed on purpose: no failure
            return closed
        why = self._store_op(lambda: self._read_key(LEFT_KEY + str(peer)))
        record, note = self._settle(peer, left=why is not None)
        seen = f"seen by rank {self.rank}"
        if record is not None and record.rank == peer:
            return PeerError(f"rank {self.rank}: peer {record} (then: {how}, {seen})", peer)
        found = self._after(record, peer, how, seen) or self._stopped_after(note, peer, how, seen)
        if found is not None:
            return PeerError(f"rank {self.rank}: {found[0]}", found[1])
        if why is not None:
            reason = f"rank {peer} left after its own error ({why}; then: {how}, {seen})"
            return PeerError(f"rank {self.rank}: {reason}", peer)
        return None

    def _after(
        self, record: AbortRecord | None, peer: int, how: str, seen: str
    ) -> tuple[str, int] | None:
        """When ``record`` names a failure of another rank than ``peer`` and this one: the
        report that ``peer`` left after it, and that rank."""
        first = record.rank if record is not None else None
        if first is None or first in (peer, self.rank):
            return None
        return f"{record}; rank {peer} left after that failure ({how}, {seen})", first

    # -- the abort record --------------------------------------------------------------------
    def publish_abort(self, record: AbortRecord) -> None:
        """Publish ``record`` unless a record exists already."""
        self._swap_abort(record)

    def publish_mismatch(self, reason: str) -> str:
        """Publish a mismatch (both calls in words) as the abort record; return the first one
        published (another rank may have seen the same mismatch first)."""
        current = self._swap_abort(AbortRecord(None, reason, mismatch=True))
        return current.reason if current is not None and current.mismatch else reason

    def _swap_abort(self, record: AbortRecord) -> AbortRecord | None:
        """Publish ``record`` unless a record exists; return the one in the store (None: the
        store did not answer)."""
        current = self._store_op(lambda: self._store.compare_set(ABORT_KEY, b"", record.encode()))
        return None if current is None else AbortRecord.decode(bytes(current), self.size)

    def read_abort(self) -> AbortRecord | None:
        """The abort record in the store, if any (None too when the store does not answer)."""
        raw = self._store_op(lambda: self._read_raw(ABORT_KEY))
        return None if raw is None else AbortRecord.decode(raw, self.size)

    def check_abort(self) -> None:
        """Raise the failure another rank published, if one did.

        Raises:
            MismatchError: the ranks called different collectives (the same words on all).
            PeerError: another rank reported a failure (names the rank it blames).
            PeerClosed: a rank aborted the world on purpose (:meth:`abort_world`).
        """
        try:
            raw = self._read_raw(ABORT_KEY)
        except (StoreError, OSError):
            return  # an unreachable store is not a verdict; the timeout still bounds us
        if raw is None:
            return
        record = AbortRecord.decode(raw, self.size)
        if record.mismatch:
            raise MismatchError(record.reason)  # every rank raises the same words
        closing = self.closing_reason()
        if closing is not None:
            after = "" if closing == record.reason else f" (after: {record})"
            raise PeerClosed(f"rank {self.rank}: {closing}{after}", record.rank)
        raise PeerError(f"rank {self.rank}: aborting, another rank reported: {record}", record.rank)

    # -- the store -------------------------------------------------------------------------
    def _store_op(self, op: Callable[[], _T]) -> _T | None:
        """Run a store operation of the failure path; None if the store did not answer.

        The store may be gone with its host, which must not mask the error; after one failed
        operation the others are skipped: each could spend the store's whole timeout trying
        to reconnect.
        """
        if self._store_lost:
            return None
        try:
            return op()
        except (MeshCommError, OSError):
            self._store_lost = True
            return None

    def _read_key(self, key: str) -> str | None:
        raw = self._read_raw(key)
        return None if raw is None else raw.decode(errors="replace")

    def _read_raw(self, key: str) -> bytes | None:
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key))
