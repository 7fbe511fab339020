"""The tcp backend: pure Python + numpy collectives over sockets and same-host shared memory.

- :mod:`~meshcomm.backends.tcp.wire`: the wire protocol (handshake, frames), no I/O.
- :mod:`~meshcomm.backends.tcp.transport`: channels to every peer and the progress engine,
  over the parts it holds (matching, the socket and ring carriers, the board, peer memory,
  faults, and the one wait loop of :mod:`~meshcomm.backends.tcp.waiting`).
- :mod:`~meshcomm.backends.tcp.same_host.rings`: shared-memory rings and futex doorbells for
same-host peers.
- :mod:`~meshcomm.backends.tcp.communicator`: :class:`TcpCommunicator`.

See ``docs/backends/tcp.md``.
"""

from __future__ import annotations

from meshcomm.backends.tcp.communicator import TcpCommunicator

__all__ = ["TcpCommunicator"]
