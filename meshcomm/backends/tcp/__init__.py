"""The tcp backend: pure Python + numpy collectives over TCP sockets.

- :mod:`~meshcomm.backends.tcp.wire`: the wire protocol (handshake, frames), no I/O.
- :mod:`~meshcomm.backends.tcp.transport`: the only socket code (connections, progress engine).
- :mod:`~meshcomm.backends.tcp.communicator`: :class:`TcpCommunicator`.

See ``docs/backends/tcp.md``.
"""

from __future__ import annotations

from meshcomm.backends.tcp.communicator import TcpCommunicator

__all__ = ["TcpCommunicator"]
