"""Where a rank listens and how its sockets are tuned (the tcp backend's addresses).

Each rank listens on port 0 and publishes ``host:port`` under :func:`addr_key` in the store;
:func:`choose_host` decides which host (``MESHCOMM_HOST``, else the local address that
routes to a non-loopback master, else 127.0.0.1).

Example:
    >>> split_address(format_address("::1", 80)), split_address("10.0.0.2:29500")
    (('::1', 80), ('10.0.0.2', 29500))
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket

from meshcomm.errors import RendezvousError
from meshcomm.store.base import Store

__all__ = [
    "SOCKET_BUFFER",
    "addr_key",
    "choose_host",
    "format_address",
    "split_address",
    "tune",
]

# 4 MiB socket buffers: room for a whole ring step of mid-sized messages in the kernel.
SOCKET_BUFFER = 4 * 1024 * 1024


def addr_key(rank: int) -> str:
    """Return the store key under which ``rank`` publishes its ``host:port``.

    Example:
        >>> addr_key(3)
        'meshcomm/tcp/addr/3'
    """
    return f"meshcomm/tcp/addr/{rank}"


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _route_address(target: str) -> str:
    # The local address the kernel would use to reach ``target`` (a UDP connect sends nothing).
    try:
        family = socket.AF_INET6 if ":" in target else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _store_host(store: object) -> str:
    # A PrefixStore wraps the TCPStore that knows the server's host.
    for _ in range(8):
        host = getattr(store, "host", None)
        if isinstance(host, str):
            return host
        store = getattr(store, "underlying_store", None)
        if store is None:
            break
    return ""


def choose_host(store: Store) -> tuple[str, str]:
    """Return (bind host, advertised host) for this rank's listener.

    ``MESHCOMM_HOST`` wins; else a non-loopback ``MESHCOMM_MASTER_ADDR`` / ``MASTER_ADDR``
    (or the TCPStore's host) means several hosts, so we bind and advertise the local address
    that routes to it; else 127.0.0.1.
    """
    host = os.environ.get("MESHCOMM_HOST", "").strip()
    master = (
        os.environ.get("MESHCOMM_MASTER_ADDR", "").strip()
        or os.environ.get("MASTER_ADDR", "").strip()
        or _store_host(store)
    )
    if host:
        if host in ("0.0.0.0", "::"):
            return host, _route_address(master) if master and not _is_loopback(master) else host
        return host, host
    if master and not _is_loopback(master):
        local = _route_address(master)
        return local, local
    return "127.0.0.1", "127.0.0.1"


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise RendezvousError(f"malformed address {address!r} in the store, expected host:port")
    return host.strip("[]"), int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            if sock.getsockopt(socket.SOL_SOCKET, opt) < SOCKET_BUFFER:
                sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
