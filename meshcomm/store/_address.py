"""Where a store server listens: the address checks made before any I/O, and the socket.

Example:
    >>> format_address("127.0.0.1", 29500), format_address("::1", 80)
    ('127.0.0.1:29500', '[::1]:80')
    >>> sock = bind_listener("127.0.0.1", 0, DEFAULT_BACKLOG)
    >>> sock.getsockname()[1] > 0
    True
    >>> sock.close()
"""

from __future__ import annotations

import errno
import socket

from meshcomm.errors import InvalidArgument, StoreError

__all__ = ["DEFAULT_BACKLOG", "bind_listener", "check_host_port", "format_address"]

#: ``listen()`` backlog: large so that hundreds of ranks can connect at once without resets.
DEFAULT_BACKLOG = 2048


def format_address(host: str, port: int) -> str:
    """Return ``host:port``, with brackets around an IPv6 literal.

    Example:
        >>> format_address("127.0.0.1", 29500), format_address("::1", 80)
        ('127.0.0.1:29500', '[::1]:80')
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_host_port(host: str, port: int) -> None:
    """Validate a store address before any I/O.

    Raises:
        InvalidArgument: ``host`` is not a non-empty str or ``port`` not an int in [0, 65535].
    """
    if not isinstance(host, str) or not host:
        # An empty host would bind every interface; the store binds only what it is given.
        raise InvalidArgument(f"store host must be a non-empty str, got {host!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise InvalidArgument(f"store port must be an int in [0, 65535], got {port!r}")


def bind_listener(host: str, port: int, backlog: int) -> socket.socket:
    """A non-blocking socket listening on ``host:port``.

    Raises:
        StoreError: the address cannot be bound (port in use, unknown host); names host:port.
    """
    address = format_address(host, port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise StoreError(f"cannot start the store server on {address}: {exc}") from exc
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # Lets a restarted server rebind over TIME_WAIT leftovers; never a live listener's port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StoreError(
                f"cannot start the store server on {address}: the port is already in use"
            ) from exc
        raise StoreError(f"cannot start the store server on {address}: {exc}") from exc
    return sock
