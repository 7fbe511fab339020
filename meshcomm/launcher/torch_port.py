"""The address meshrun gives torch's own ``init_process_group``: ``MASTER_ADDR``/``MASTER_PORT``.

meshrun hosts a meshcomm store, which torch cannot speak to, and torchrun's trick (the agent
serves torch's TCPStore and sets ``TORCHELASTIC_USE_AGENT_STORE=True``) would need torch in
the launcher. So meshrun leaves torch to itself, as torch does without an agent: rank 0
serves torch's TCPStore on ``MASTER_PORT``, and meshcomm finds meshrun's store through its own
``MESHCOMM_MASTER_ADDR``/``MESHCOMM_MASTER_PORT``. Both work in one program, in either order.

The port torch's rank 0 will bind is a free one that node 0's meshrun keeps reserved for the
whole run (:class:`PortReservation`): bound with ``SO_REUSEADDR`` and never listening, so the
kernel hands it to no other bind or outgoing connection, yet torch's TCPStore (which sets
``SO_REUSEADDR`` too) binds and listens on it, again after a restart while the last
attempt's connections sit in ``TIME_WAIT``. A port probed free and then released could be
taken by anyone before rank 0 binds it.

On several nodes, node 0's meshrun publishes ``{"addr", "port"}`` in meshrun's store under
:func:`endpoint_key` once its ranks run; the other nodes' meshruns read it before starting
theirs (:func:`fetch_endpoint`). With ``--rdzv-backend c10d`` node 0 is whichever node joined
first, not necessarily the machine of the endpoint, so it publishes its own address.

Example:
    >>> reservation = PortReservation()
    >>> 0 < reservation.port < 65536
    True
    >>> reservation.close()
"""

from __future__ import annotations

import json
import socket
from typing import TYPE_CHECKING

from meshcomm.errors import MeshCommError

if TYPE_CHECKING:
    from meshcomm.launcher.config import LaunchConfig

__all__ = [
    "PortReservation",
    "TorchEndpointError",
    "endpoint_key",
    "fetch_endpoint",
    "node0_address",
    "publish_endpoint",
]


class TorchEndpointError(MeshCommError):
    """A node could not learn (or tell) where torch's rank 0 serves torch's store."""


class PortReservation:
    """A free port kept for torch's rank 0: bound on every interface, never listening.

    Raises:
        OSError: no port could be bound.
    """

    def __init__(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            # Both sides need SO_REUSEADDR to share the port; torch's TCPStore sets it, and no
            # listener here means every connection reaches rank 0's.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("0.0.0.0", 0))
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.port: int = int(sock.getsockname()[1])

    def close(self) -> None:
        """Release the port (at the end of the run)."""
        self._sock.close()

    def __repr__(self) -> str:
        return f"PortReservation(port={self.port})"


def endpoint_key(run_id: str) -> str:
    """The store key under which node 0 publishes torch's endpoint.

    Example:
        >>> endpoint_key("job7")
        'meshrun/torch-endpoint/job7'
    """
    return f"meshrun/torch-endpoint/{run_id}"


def node0_address(config: LaunchConfig, hosts_store: bool) -> str:
    """The address of node 0 that the other nodes' ranks reach torch's rank 0 at.

    ``--local-addr`` when given; else the store's address when this node hosts the store
    (static rendezvous, or the c10d node that owns the endpoint); else this machine's address
    on the route to the store, which the other nodes reach too.

    Example:
        >>> from meshcomm.launcher.config import LaunchConfig
        >>> cfg = LaunchConfig(nproc_per_node=1, nnodes=2, node_rank=0, master_addr="h0",
        ...                    master_port=29500, bind_addr="0.0.0.0", command=("x",))
        >>> node0_address(cfg, hosts_store=True)
        'h0'
    """
    if config.torchrun.local_addr:
        return config.torchrun.local_addr
    if hosts_store or config.nnodes == 1:
        return config.master_addr
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            config.master_addr, config.master_port, type=socket.SOCK_DGRAM
        )[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)  # sends nothing: it only picks the outgoing interface
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise TorchEndpointError(
            f"cannot tell the address of this node (node 0) on the route to the store at "
            f"{config.master_addr}:{config.master_port}: {exc}; pass --local-addr"
        ) from exc


def publish_endpoint(config: LaunchConfig, store_port: int, addr: str, port: int) -> None:
    """Node 0: put torch's endpoint in meshrun's store for the other nodes.

    Raises:
        TorchEndpointError: the store could not be reached.
    """
    from meshcomm.store import TCPStore

    value = json.dumps({"addr": addr, "port": port})
    try:
        client = TCPStore(
            config.master_addr,
            store_port,
            timeout=config.torchrun.join_timeout,
            secret=config.secret or "",
        )
        try:
            client.set(endpoint_key(config.run_id), value)
        finally:
            client.close()
    except MeshCommError as exc:
        raise TorchEndpointError(
            f"cannot publish torch's MASTER_ADDR/MASTER_PORT in the store at "
            f"{config.master_addr}:{store_port}: {exc}"
        ) from exc


def fetch_endpoint(config: LaunchConfig, store_port: int) -> tuple[str, int]:
    """Nodes other than 0: wait (up to ``join_timeout``) for node 0's torch endpoint.

    Raises:
        TorchEndpointError: no store, node 0 did not publish in time, or a malformed value.
    """
    from meshcomm.store import TCPStore

    key = endpoint_key(config.run_id)
    where = f"{config.master_addr}:{store_port}"
    timeout = config.torchrun.join_timeout
    try:
        client = TCPStore(
            config.master_addr, store_port, timeout=timeout, secret=config.secret or ""
        )
        try:
            client.wait([key], timeout=timeout)
            raw = client.get(key)
        finally:
            client.close()
    except MeshCommError as exc:
        raise TorchEndpointError(
            f"node {config.node_rank}: node 0 did not say where torch's rank 0 serves "
            f"(key {key!r} in the store at {where}) within {timeout:g} s "
            f"(--rdzv-conf join_timeout): {exc}"
        ) from exc
    try:
        record = json.loads(raw)
        addr, port = str(record["addr"]), int(record["port"])
    except (ValueError, KeyError, TypeError) as exc:
        raise TorchEndpointError(
            f"node 0 published a malformed torch endpoint in the store at {where}: {raw!r}"
        ) from exc
    if not addr or not 1 <= port <= 65535:
        raise TorchEndpointError(
            f"node 0 published a malformed torch endpoint in the store at {where}: {raw!r}"
        )
    return addr, port
