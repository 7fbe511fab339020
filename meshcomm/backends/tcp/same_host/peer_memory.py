"""Copies straight between this process's memory and a same-host peer's (CMA).

The transport holds one :class:`PeerMemory`; the same-host collectives of
:mod:`~meshcomm.backends.tcp.same_host.cma_collectives` copy through it with ``process_vm_readv`` /
``process_vm_writev`` (:mod:`~meshcomm.backends.tcp.same_host.cma`) between their rounds of
messages.
A copy that fails breaks the transport, as any failed operation does, and names the peer.

Example:
    >>> PeerMemory.__name__
    'PeerMemory'
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable

from meshcomm.backends.tcp.faults import Faults
from meshcomm.backends.tcp.same_host import cma
from meshcomm.backends.tcp.same_host.engine import ShmEngine
from meshcomm.errors import CommError, ProtocolError

__all__ = ["PeerMemory"]


class PeerMemory:
    """Reads and writes of same-host peers' memory, for one transport.

    Args:
        rank: this process's global rank.
        rings: the transport's ring engine (which peers are same-host, their pids).
        faults: the transport's failure path.
        fail: breaks the transport with an error (before it is raised).
    """

    def __init__(
        self,
        rank: int,
        rings: ShmEngine,
        faults: Faults,
        fail: Callable[[CommError], None],
    ) -> None:
        self.rank = rank
        self._rings = rings
        self._faults = faults
        self._fail = fail

    def reads_all(self, peers: Iterable[int]) -> bool:
        """Whether every peer (global ranks) is a shared-memory peer whose memory this process
        can read and that can read this process's memory (``process_vm_readv`` both ways)."""
        return self._rings.reads_all(peers)

    def read(self, peer: int, local: int, nbytes: int, remote: int) -> None:
        """Copy ``nbytes`` at address ``remote`` of same-host ``peer`` to our address ``local``.

        The caller keeps ``[local, local + nbytes)`` alive and writable, and knows from the
        peer that the remote range is a live buffer (an address it published and has not yet
        released). A failure breaks the transport, as any failed operation does.

        Raises:
            PeerError: the peer's process is gone (names it).
            ProtocolError: the kernel refused (a bad address: the ranks disagree).
        """
        self._copy(False, peer, local, nbytes, remote)

    def write(self, peer: int, remote: int, nbytes: int, local: int) -> None:
        """Copy ``nbytes`` at our address ``local`` to address ``remote`` of same-host ``peer``
        (the peer published the range for this); errors as :meth:`read`."""
        self._copy(True, peer, local, nbytes, remote)

    def writes_to(self, peer: int, remote: int, nbytes: int, local: int) -> bool:
        """Probe :meth:`write` (a range the peer gave for it): False where refused."""
        sp = self._rings.peers.get(peer)
        if sp is None:
            return False
        try:
            cma.write_at(sp.pid, remote, nbytes, local)
        except OSError:
            return False
        return True

    def _copy(self, write: bool, peer: int, local: int, nbytes: int, remote: int) -> None:
        what = "write" if write else "read"
        sp = self._rings.peers.get(peer)
        error: CommError
        if sp is None and peer in self._faults.gone:  # it left between frames; its pair is gone
            error = self._faults.gone_error(peer, what)
        elif sp is None:
            error = ProtocolError(f"rank {self.rank}: rank {peer} is not a shared-memory peer")
        else:
            try:
                if write:
                    cma.write_at(sp.pid, remote, nbytes, local)
                else:
                    cma.read_at(sp.pid, local, nbytes, remote)
                return
            except OSError as exc:
                error = self._faults.copy_failed(
                    peer, what, nbytes, remote, exc, exc.errno == errno.ESRCH
                )
        self._fail(error)
        raise error
