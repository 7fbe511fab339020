"""The one exception tree of meshcomm.

Every error meshcomm raises on purpose is a :class:`MeshCommError`, so ``except
MeshCommError`` catches them all. The tree::

    MeshCommError
    ├── StoreError              the key-value store failed (connection, protocol, closed)
    │   ├── StoreTimeout        a get/wait did not see its keys in time (also a TimeoutError)
    │   └── StoreAuthError      the store and this client do not share the job's secret
    ├── RendezvousError         ranks could not agree on who they are (duplicate rank, world size)
    ├── CommError               a collective or point-to-point operation failed
    │   ├── CommTimeout         a peer stayed silent past the timeout (also a TimeoutError)
    │   ├── PeerError           a peer went away (its process died, its connection closed)
    │   │   └── PeerClosed      a peer closed its communicator on purpose, saying why
    │   ├── MismatchError       ranks called different collectives (op, dtype, shape, root...)
    │   ├── LeftTheMesh         this rank left the mesh when it shrank (its replica lost one)
    │   ├── NoValidMesh         no mesh of the required shape remains among the survivors
    │   └── ProtocolError       bytes on the wire were not what the protocol allows
    │       └── LinkAuthError   a peer link failed authentication (secret, relay, replay)
    ├── SpawnError              a process started by meshcomm.spawn failed; the others were stopped
    │   ├── ProcessRaisedException  its function raised (carries the child's traceback text)
    │   ├── ProcessExitedException  it exited non-zero or died from a signal
    │   └── SpawnTimeout        still running when spawn's timeout expired (also a TimeoutError)
    └── InvalidArgument         bad input, raised before any I/O (also a ValueError)

Messages name the rank, the address or key, and both values where two disagree.

Example:
    >>> from meshcomm.errors import InvalidArgument, MeshCommError
    >>> try:
    ...     raise InvalidArgument("rank 3: root must be in [0, 2), got 5")
    ... except MeshCommError as exc:
    ...     print(type(exc).__name__, isinstance(exc, ValueError))
    InvalidArgument True
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

__all__ = [
    "CommError",
    "CommTimeout",
    "InvalidArgument",
    "LeftTheMesh",
    "LinkAuthError",
    "MeshCommError",
    "MismatchError",
    "MismatchTimeout",
    "NoValidMesh",
    "PeerClosed",
    "PeerError",
    "ProcessExitedException",
    "ProcessRaisedException",
    "ProtocolError",
    "RendezvousError",
    "SpawnError",
    "SpawnTimeout",
    "StoreAuthError",
    "StoreError",
    "StoreTimeout",
]


class MeshCommError(Exception):
    """Base class of every error meshcomm raises on purpose."""


class StoreError(MeshCommError):
    """The key-value store failed: unreachable server, closed store, protocol violation."""


class StoreTimeout(StoreError, TimeoutError):
    """A store ``get``/``wait`` did not see its keys within the timeout."""


class StoreAuthError(StoreError):
    """The store handshake failed authentication: a wrong secret on either side, or one side
    has a secret (``MESHCOMM_SECRET``) and the other none. Not retried: it will not heal."""


class RendezvousError(MeshCommError):
    """Ranks could not agree on the world: duplicate rank, differing world sizes, bad rank."""


class CommError(MeshCommError):
    """A collective or point-to-point operation failed."""


class CommTimeout(CommError, TimeoutError):
    """A peer stayed silent past the timeout (it may be stopped, slow, or deadlocked)."""


class PeerError(CommError):
    """A peer went away: its process died or its connection closed.

    Attributes:
        rank: the global rank of the peer that failed, when known.
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class PeerClosed(PeerError):
    """A peer closed its communicator on purpose while this rank's call needed it, and said
    why (``ProcessGroup.close(reason)``): e.g. a survivor re-forming an elastic mesh
    (:mod:`meshcomm.elastic`). The peer did not fail; ``rank`` names it."""


class LeftTheMesh(CommError):
    """This rank is alive but left the mesh when it shrank: it was in the unit (a 'dp'
    replica) that lost a member, or it reached the agreement too late."""


class NoValidMesh(CommError):
    """After a loss no mesh of the required shape remains among the survivors."""


class MismatchError(CommError):
    """The ranks of a group called different collectives (or the same one with different
    dtype, shape, reduce op, root or device): every rank raises it, naming both calls.

    Attributes:
        peer: the global rank whose call differed from this rank's (None: not known here).
        theirs: that rank's fingerprint stamp as it arrived (None: not known here).
    """

    def __init__(self, message: str, peer: int | None = None, theirs: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.theirs = theirs


class MismatchTimeout(MismatchError, CommTimeout):
    """A mismatch found when a collective timed out: the hang verdict found the ranks in
    the same call with different arguments (on mpi, a call whose signature one rank had
    checked before and another had not). A :class:`MismatchError` naming every call, and a
    :class:`CommTimeout` too, because it ended a wait that timed out."""


class ProtocolError(CommError):
    """Bytes received were not what the protocol allows (foreign or corrupt peer)."""


class SpawnError(MeshCommError):
    """A process started by :func:`spawn` failed; the others were stopped.

    Attributes:
        rank: the rank of the process that failed first (None for a timeout).
        pid: its process id (None for a timeout).
    """

    def __init__(self, message: str, rank: int | None = None, pid: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.pid = pid


class ProcessRaisedException(SpawnError):
    """``fn`` raised an exception in one process.

    Attributes:
        traceback: the child's formatted traceback (the exception itself stays in the child:
            it may not be picklable, and its traceback is what you need).
    """

    def __init__(self, message: str, rank: int, pid: int, traceback_text: str) -> None:
        super().__init__(message, rank, pid)
        self.traceback = traceback_text


class ProcessExitedException(SpawnError):
    """A process exited with a non-zero code or died from a signal without raising.

    Attributes:
        exit_code: the process's exit code, or minus the signal number that killed it.
        signal_name: the name of that signal ("SIGKILL"), None for a plain exit.
    """

    def __init__(self, message: str, rank: int, pid: int, exit_code: int) -> None:
        super().__init__(message, rank, pid)
        self.exit_code = exit_code
        self.signal_name = _signal_name(-exit_code) if exit_code < 0 else None


class SpawnTimeout(SpawnError, TimeoutError):
    """The processes were still running when the timeout of :func:`spawn` expired.

    Attributes:
        running: ranks that had not finished (they were stopped).
    """

    def __init__(self, message: str, running: Sequence[int]) -> None:
        super().__init__(message)
        self.running = list(running)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class InvalidArgument(MeshCommError, ValueError):
    """Bad input, detected before any byte left this process."""


# -- link authentication (the tcp backend's peer links) ----------------------------------------


class LinkAuthError(ProtocolError):
    """A peer link failed authentication: the other end did not prove it holds this job's
    secret (a different ``MESHCOMM_SECRET``, a secret on one side only, or another process
    answering at the peer's address, e.g. a relay).

    Attributes:
        rank: the global rank the link was meant to reach, when known.
        address: the ``host:port`` of the other end, when known.
    """

    def __init__(self, message: str, rank: int | None = None, address: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.address = address
