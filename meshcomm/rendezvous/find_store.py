"""Finding the rendezvous store: open the store an init method names (rank 0 hosts it, a
launcher serves it, a file holds it, or MPI carries its address), and never join the
still-open store of a world this process has left (issue 17).

Example:
    >>> from meshcomm.rendezvous.init_method import parse_init_method
    >>> from meshcomm.launch import detect_launch
    >>> me = detect_launch({})
    >>> store, address, hosts, store_id = open_fresh_store(
    ...     parse_init_method("env://"), me, me, 5.0, float("inf"))
    >>> address, hosts, store_id
    ('an in-process HashStore', False, '')
    >>> store.close()
"""

from __future__ import annotations

import errno
import logging
import time
import uuid
from typing import TYPE_CHECKING

from meshcomm.common.secret import SECRET_ENV
from meshcomm.errors import InvalidArgument, RendezvousError, StoreError, StoreTimeout
from meshcomm.launch import LaunchInfo, mpi_share_store_address
from meshcomm.rendezvous.init_method import InitMethod

if TYPE_CHECKING:
    from meshcomm.store import TCPStore
    from meshcomm.store.base import Store

__all__ = ["forget_store", "open_fresh_store", "warn_if_unauthenticated"]

# One logger for every part of the rendezvous, by the name docs/security.md gives users.
_log = logging.getLogger("meshcomm.rendezvous")
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# Said once per process: a job that re-initialises in a loop must not repeat it.
_warned_unauthenticated = False
# A store that a rank hosts is named by a random id under this key; the ids of the stores of
# worlds this process has left are kept, so that a re-initialising rank that reaches its old
# world's store (its host has not closed it yet) lets go and tries again (issue 17).
_STORE_ID_KEY = "meshcomm/store_id"
_left_stores: set[str] = set()
_REJOIN_BACKOFF_MAX = 0.1
# Seconds a rank 0 whose port is taken tries that port's server as a client (see _tcp_store).
_JOIN_TAKEN_PORT = 5.0


def forget_store(store_id: str) -> None:
    """This process left the world whose store has ``store_id``: never join that store again."""
    if store_id:
        _left_stores.add(store_id)


def open_fresh_store(
    method: InitMethod, info: LaunchInfo, me: LaunchInfo, seconds: float, deadline: float
) -> tuple[Store, str, bool, str]:
    """Open the store, but never the still-open store of a world this process has left.

    A rank hosting the store names it with a random id. When a world is re-made on a fixed
    port, the faster rank can reach the previous world's store before its host has closed
    it; joining it would fail the new rendezvous when that store closes under it. Its id
    gives it away: let go, and retry until the host serves the new store.

    Returns:
        (store, address, hosts_server, store id or "").
    """
    from meshcomm.store import TCPStore

    delay = 0.005
    while True:
        raw, address, hosts = _open_store(method, info, me.rank, me.world_size, seconds, deadline)
        rank0_hosted = isinstance(raw, TCPStore) and (
            method.scheme == "tcp" or info.store_host == "rank0"
        )
        # A rank 0 that found its port taken joined as a client to report the clash: no id.
        if not rank0_hosted or (me.rank == 0 and not hosts):
            return raw, address, hosts, ""
        try:
            if hosts:
                store_id = uuid.uuid4().hex
                raw.set(_STORE_ID_KEY, store_id)
                return raw, address, hosts, store_id
            raw.wait([_STORE_ID_KEY], timeout=max(deadline - time.monotonic(), 1e-3))
            store_id = raw.get(_STORE_ID_KEY).decode(errors="replace")
        except StoreTimeout as exc:
            raw.close()
            raise RendezvousError(
                f"rank {me.rank}: the store at {address} did not say which store it is: {exc}"
            ) from exc
        except StoreError:
            store_id = ""  # closed under us: the old world's store, going away; try again
        else:
            if store_id not in _left_stores:
                return raw, address, hosts, store_id
        raw.close()
        if time.monotonic() + delay >= deadline:
            raise RendezvousError(
                f"rank {me.rank}: the store at {address} is still the one of a world this "
                f"process has left, after {seconds:g} s: its host (rank 0) has not started "
                "the new one"
            )
        time.sleep(delay)
        delay = min(delay * 2, _REJOIN_BACKOFF_MAX)


def warn_if_unauthenticated(store: Store, address: str) -> None:
    """Say once per process that the job's network store admits anyone who can reach it."""
    global _warned_unauthenticated
    # Stores that never cross the network (HashStore, FileStore) have no such attribute.
    if _warned_unauthenticated or getattr(store, "authenticated", True):
        return
    _warned_unauthenticated = True
    _log.warning(
        "meshcomm: this job is unauthenticated: its store at %s has no secret (%s is not "
        "set), so any process that can reach that port can read and change the job's keys "
        "(its ranks' addresses, the tcp backend's token, aborts). meshrun, meshcomm.spawn and "
        "jupyter.start_cluster set a secret per job; see docs/security.md",
        address,
        SECRET_ENV,
    )


def _open_store(
    method: InitMethod,
    info: LaunchInfo,
    rank: int,
    world_size: int,
    seconds: float,
    deadline: float,
) -> tuple[Store, str, bool]:
    """Open the store an init method names; return (store, address, hosts_server)."""
    from meshcomm.store import FileStore, HashStore

    if method.scheme == "file":
        assert method.path is not None  # parse_init_method guarantees it
        try:
            file_store = FileStore(method.path, world_size, timeout=seconds)
        except (StoreError, OSError) as exc:
            raise RendezvousError(
                f"rank {rank}: cannot open the FileStore at {method.path!r}: {exc}"
            ) from exc
        return file_store, f"file://{method.path}", False
    host, port, store_host = method.host, method.port, "rank0"
    if method.scheme == "env":
        host, port, store_host = info.master_addr, info.master_port, info.store_host
        # A lone process outside any launcher keeps its store in memory: a MASTER_ADDR left
        # over in the shell must not make `python script.py` bind (or wait on) a port.
        if world_size == 1 and (info.launcher == "single" or (host is None and port is None)):
            return HashStore(seconds), "an in-process HashStore", False
        if host is None and port is None and info.is_mpi:
            return _mpi_bootstrap(rank, world_size, seconds, deadline)
    if host is None or port is None:
        missing = "MASTER_ADDR" if host is None else "MASTER_PORT"
        raise InvalidArgument(
            f"rank {rank}: env:// needs MASTER_ADDR and MASTER_PORT (or MESHCOMM_MASTER_ADDR "
            f"and MESHCOMM_MASTER_PORT) for a world of {world_size}; {missing} is not set"
        )
    if store_host == "torchelastic":
        return _agent_store(host, port, rank, seconds), f"tcp://{host}:{port} (torchrun)", False
    store = _tcp_store(host, port, rank, world_size, rank == 0 and store_host == "rank0", seconds)
    return store, f"tcp://{store.address}", store.server is not None


def _agent_store(host: str, port: int, rank: int, seconds: float) -> Store:
    """Join the torch TCPStore that torchrun's agent serves (it binds MASTER_PORT itself)."""
    from meshcomm.store.torch_adapter import TorchStore

    try:
        return TorchStore.connect(host, port, timeout=seconds)
    except StoreError as exc:
        raise RendezvousError(
            f"rank {rank}: TORCHELASTIC_USE_AGENT_STORE says torchrun's agent serves the store "
            f"at {host}:{port}, but joining it failed: {exc} (set MESHCOMM_MASTER_ADDR and "
            "MESHCOMM_MASTER_PORT to use a meshcomm store that rank 0 hosts instead)"
        ) from exc


def _mpi_bootstrap(
    rank: int, world_size: int, seconds: float, deadline: float
) -> tuple[Store, str, bool]:
    """Rank 0 hosts the store on a free port; MPI carries its address to the others."""
    hosted: list[TCPStore] = []

    def start(host: str) -> int:
        hosted.append(_tcp_store(host, 0, 0, world_size, True, seconds))
        return int(hosted[0].port)

    try:
        host, port = mpi_share_store_address(rank, world_size, deadline, start)
    except BaseException:
        for store in hosted:
            store.close()
        raise
    store = hosted[0] if hosted else _tcp_store(host, port, rank, world_size, False, seconds)
    return store, f"tcp://{store.address}", bool(hosted)


def _tcp_store(
    host: str, port: int, rank: int, world_size: int, is_master: bool, seconds: float
) -> TCPStore:
    """Open a TCPStore; a master whose port is taken joins as a client instead.

    Joining lets the agreement protocol report "two processes claim rank 0" to every rank
    (through the store) when the port's owner is another rank 0; anything else listening
    there fails the store's handshake and the bind error stands.
    """
    from meshcomm.store import TCPStore

    if host.lower() in _LOOPBACK_NAMES and host != "::1":
        host = "127.0.0.1"
    start = time.monotonic()
    try:
        return TCPStore(
            host, port, world_size, is_master=is_master, timeout=seconds, wait_for_workers=False
        )
    except (StoreError, OSError) as exc:
        if not is_master:
            if isinstance(exc, StoreTimeout):
                raise RendezvousError(
                    f"rank {rank} could not reach the store at {host}:{port} within "
                    f"{seconds:g} s: {exc} (is rank 0 running, and the address right?)"
                ) from exc
            # Reached, and refused at once (an impostor, another job's secret, not a store):
            # the timeout has nothing to do with it.
            raise RendezvousError(
                f"rank {rank} cannot use the store at {host}:{port} (it answered, after "
                f"{time.monotonic() - start:.1f} s): {exc}"
            ) from exc
        failure = RendezvousError(
            f"rank 0 could not start the store server on {host}:{port}: {exc} (is another "
            "process already rank 0, or the port taken?)"
        )
        failure.__cause__ = exc
        if not isinstance(exc.__cause__, OSError) or exc.__cause__.errno != errno.EADDRINUSE:
            raise failure from exc
    try:
        return TCPStore(host, port, world_size, timeout=min(seconds, _JOIN_TAKEN_PORT))
    except (StoreError, OSError):
        raise failure from failure.__cause__
