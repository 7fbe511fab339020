"""``meshrun --rdzv-backend c10d``: nodes take their node rank in the order they join.

Every node's ``meshrun`` is started the same way (``--nnodes M --rdzv-backend c10d
--rdzv-endpoint HOST:PORT``, no ``--node-rank``). The first launcher on the machine HOST
names (an address of that machine can be bound there) hosts the store on PORT, on every
interface as torchrun's does; ``--rdzv-conf is_host=true/false`` decides explicitly. Every
launcher then adds itself to a counter in that store: the n-th to join is node n - 1. All
wait until M nodes have joined (``--rdzv-conf join_timeout``, default 600 s), then start
their ranks, which meet in the same store. Restarts are single-node only, so the node
ranks are fixed for the run.
"""

from __future__ import annotations

import dataclasses
import random
import socket
import time
from typing import TYPE_CHECKING

from meshcomm.errors import InvalidArgument, MeshCommError

if TYPE_CHECKING:
    from meshcomm.run import LaunchConfig
    from meshcomm.store.server import StoreServer

__all__ = ["NodeJoinError", "join_nodes"]


#: How long a launcher on the endpoint's machine keeps trying to host while the port is in
#: use and nothing listens there (another launcher binding at the same moment).
_HOST_RACE_SECONDS = 5.0


class NodeJoinError(MeshCommError):
    """This node could not join the job's c10d rendezvous (timeout, job full, no store)."""


def join_nodes(config: LaunchConfig) -> tuple[LaunchConfig, StoreServer | None]:
    """Host the store if this node owns the endpoint, join, and learn this node's rank.

    Returns:
        The configuration with this node's ``node_rank``, and the store this launcher hosts
        (already serving; the caller closes it) or None.

    Raises:
        NodeJoinError: no store at the endpoint, the job already has every node, or the
            other nodes did not join within the join timeout.
    """
    from meshcomm.store import TCPStore

    opts = config.torchrun
    server = _host(config) if opts.is_host is not False else None
    key = f"meshrun/c10d/{config.run_id}"
    try:
        client = TCPStore(
            config.master_addr,
            config.master_port,
            timeout=opts.join_timeout,
            secret=config.secret or "",
        )
    except MeshCommError as exc:
        _close(server)
        raise NodeJoinError(f"--rdzv-endpoint {_where(config)}: cannot join: {exc}") from exc
    try:
        joined = client.add(f"{key}/joined", 1)
        if joined > config.nnodes:
            raise NodeJoinError(
                f"--rdzv-endpoint {_where(config)}: the job (--rdzv-id {config.run_id}) already "
                f"has its {config.nnodes} nodes; give this run another --rdzv-id"
            )
        if joined == config.nnodes:
            client.set(f"{key}/complete", "1")
        client.wait([f"{key}/complete"], timeout=opts.join_timeout)
    except NodeJoinError:
        _close(server)
        raise
    except MeshCommError as exc:
        _close(server)
        raise NodeJoinError(
            f"--rdzv-endpoint {_where(config)}: not every one of {config.nnodes} nodes joined "
            f"within {opts.join_timeout:g} s (--rdzv-conf join_timeout): {exc}"
        ) from exc
    finally:
        client.close()
    return dataclasses.replace(config, node_rank=joined - 1), server


def _host(config: LaunchConfig) -> StoreServer | None:
    """The store, if this machine owns the endpoint and no other launcher here hosts it."""
    from meshcomm.store.server import StoreServer

    family = _local_family(config.master_addr)
    if family is None and not config.torchrun.is_host:
        return None  # the endpoint names another machine
    # Every interface, as torchrun's store: a name that resolves to 127.0.1.1 here (a common
    # /etc/hosts line) must still be reachable from the other nodes.
    bind = "::" if family == socket.AF_INET6 else "0.0.0.0"
    give_up = time.monotonic() + _HOST_RACE_SECONDS
    while True:
        try:
            server = StoreServer(bind, config.master_port, secret=config.secret or "")
        except (MeshCommError, OSError) as exc:
            if isinstance(exc, InvalidArgument) or config.torchrun.is_host:
                raise NodeJoinError(
                    f"--rdzv-endpoint {_where(config)}: cannot host: {exc}"
                ) from exc
            # Two launchers that bind at the same moment can both be refused (each one's
            # listen() sees the other's bound socket), so "in use" proves nothing until a
            # store answers there.
            if _someone_listens(config) or time.monotonic() > give_up:
                return None
            time.sleep(random.uniform(0.005, 0.05))
            continue
        server.start()
        return server


def _someone_listens(config: LaunchConfig) -> bool:
    """Whether a socket accepts connections at the endpoint (not a connection to itself)."""
    try:
        with socket.create_connection((config.master_addr, config.master_port), 1.0) as probe:
            # Connecting to a free port can, rarely, pick that same port as its own
            # ephemeral one and connect to itself; that is nobody listening.
            return bool(probe.getsockname() != probe.getpeername())
    except OSError:
        return False


def _local_family(host: str) -> int | None:
    """The address family of ``host`` if it is an address of this machine, else None."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(sockaddr)  # only an address of this machine can be bound
    except OSError:  # socket.gaierror included: an unknown name is not this machine
        return None
    return int(family)


def _close(server: StoreServer | None) -> None:
    if server is not None:
        server.close()


def _where(config: LaunchConfig) -> str:
    return f"{config.master_addr}:{config.master_port}"
