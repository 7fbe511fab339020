"""Backends: each lowers the Communicator interface onto a transport (tcp, mpi, nccl)."""

from __future__ import annotations

from meshcomm.backends.base import Communicator
from meshcomm.errors import InvalidArgument
from meshcomm.store.base import Store

__all__ = ["BACKENDS", "Communicator", "create_world_communicator"]

#: Backend names meshcomm knows; "self" is the single-process world.
BACKENDS = ("tcp", "mpi", "nccl", "self")


def create_world_communicator(
    backend: str,
    rank: int,
    size: int,
    store: Store | None,
    timeout: float,
    *,
    secret: str | bytes | None = None,
) -> Communicator:
    """Create the world communicator of ``backend`` for this process.

    Args:
        backend: one of ``BACKENDS``.
        rank: this process's world rank.
        size: the world size.
        store: the rendezvous store (None only for a world of one).
        timeout: seconds every blocking call waits for a peer.
        secret: the job's secret for the tcp backend's link authentication (None:
            ``MESHCOMM_SECRET``; ``""``: none).

    Raises:
        InvalidArgument: unknown backend name, or a store is missing for a world above one.
    """
    if backend not in BACKENDS:
        raise InvalidArgument(f"unknown backend {backend!r}; known backends: {', '.join(BACKENDS)}")
    if backend == "mpi":  # the world is MPI_COMM_WORLD: no store needed, any size
        from meshcomm.backends.mpi import MpiCommunicator

        return MpiCommunicator.create_world(rank, size, timeout)
    if size == 1 and backend in ("tcp", "self"):
        from meshcomm.backends.local import SelfCommunicator

        return SelfCommunicator(timeout)
    if store is None:
        raise InvalidArgument(f"backend {backend!r} needs a store for a world of {size}")
    if backend == "tcp":
        from meshcomm.backends.tcp import TcpCommunicator

        return TcpCommunicator.create_world(rank, size, store, timeout, secret=secret)
    if backend == "nccl":
        raise InvalidArgument(
            "backend 'nccl' moves device arrays only: meshcomm.init(backend='nccl') (or "
            "'cpu:tcp,cuda:nccl') pairs it with tcp for host arrays, and each group sends "
            "cupy arrays and CUDA tensors over NCCL; this function makes the host "
            "communicator (tcp, mpi or self)"
        )
    raise InvalidArgument(f"backend {backend!r} is not available in this build of meshcomm")
