"""Rendezvous: how the processes of a job find the store they share and agree on ranks.

1. :func:`parse_init_method` validates an ``env://``, ``tcp://host:port`` or ``file:///path``
   URL. ``env://`` takes rank, size and the store address from the launcher's environment
   (:func:`meshcomm.launch.detect_launch`).
2. :func:`rendezvous` opens the store: rank 0 hosts a TCPStore server, unless a launcher
   serves one (meshrun and spawn a meshcomm store; torchrun's agent its own torch TCPStore,
   joined through :class:`~meshcomm.store.torch_adapter.TorchStore`). Under MPI with no
   master address, rank 0 starts the server on a free port and MPI carries its address.
3. It then runs the agreement protocol: every rank checks the world size, claims its rank
   with ``compare_set`` and waits at an arrival barrier. A rank that finds a problem writes an
   abort record, so the others fail at once with the same reason instead of at their timeout.

The URLs are parsed in :mod:`meshcomm.rendezvous.init_method`, the store is found in
:mod:`meshcomm.rendezvous.find_store`, the ranks agree in :mod:`meshcomm.rendezvous.agree`, and
:mod:`meshcomm.rendezvous.arrival` names the ranks still missing while the world assembles; this
module holds the entry points and who this process is.

Every key lives under ``meshcomm/`` (``meshcomm/rdzv/...`` for the protocol,
``meshcomm/world/...`` for the world's store view), so a store shared with torch, such as
torchrun's agent store, never sees meshcomm clash with torch's own keys.

Example:
    >>> parse_init_method("tcp://127.0.0.1:29500").port
    29500
    >>> from meshcomm.store import HashStore
    >>> rdzv = rendezvous(rank=0, world_size=1, store=HashStore(), timeout=5)
    >>> rdzv.rank, rdzv.world_size, rdzv.launcher
    (0, 1, 'explicit')
    >>> rdzv.close()
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshcomm.common.timeout import Timeout, to_seconds
from meshcomm.errors import InvalidArgument, RendezvousError, StoreError
from meshcomm.launch import (
    LaunchInfo,
    check_rank_size,
    detect_ipyparallel,
    detect_launch,
    running_engine_id,
)
from meshcomm.rendezvous.agree import agree, poll_counter
from meshcomm.rendezvous.find_store import forget_store, open_fresh_store, warn_if_unauthenticated
from meshcomm.rendezvous.init_method import InitMethod, parse_init_method

if TYPE_CHECKING:
    from meshcomm.store.base import Store

__all__ = [
    "InitMethod",
    "Rendezvous",
    "parse_init_method",
    "rendezvous",
    "storeless_rendezvous",
]


@dataclass
class Rendezvous:
    """The outcome of :func:`rendezvous`: who this process is and the store the world shares.

    Attributes:
        rank: world rank.
        world_size: world size.
        local_rank: rank on this host, None if unknown.
        local_world_size: processes on this host, None if unknown.
        launcher: the detected launcher ("explicit" when rank and size were arguments).
        store: a view of the shared store scoped to this world (give it to the backend);
            None for a world without a store (the mpi backend's, see
            :func:`storeless_rendezvous`).
        raw_store: the store itself (None without a store).
        address: where the store lives, for messages ("tcp://127.0.0.1:29500", ...).
        timeout: seconds that blocking calls wait.
        owns_store: whether :meth:`close` closes the store (False for a caller's store).
        hosts_server: whether this process runs the TCPStore server.
        namespace: the store prefix of this rendezvous's own keys.
        store_id: the random id of a store that a rank hosts ("" otherwise).
    """

    rank: int
    world_size: int
    local_rank: int | None
    local_world_size: int | None
    launcher: str
    store: Store | None
    raw_store: Store | None
    address: str
    timeout: float
    owns_store: bool
    hosts_server: bool
    namespace: str
    store_id: str = ""
    _closed: bool = False

    def stop_reconnecting(self) -> None:
        """Leaving starts: a lost connection to the store is not re-made, so leaving never
        waits out the timeout on a store whose host died (:meth:`Store.stop_reconnecting`).

        Only a store this process opened; a store the caller passed in is left as it is.
        """
        if self.owns_store and self.raw_store is not None:
            self.raw_store.stop_reconnecting()

    def close(self, wait: float | None = None) -> None:
        """Leave the world: mark this rank gone and close the store if this process opened it.

        The rank hosting the store server first waits until every rank has left, because
        closing the server earlier would cut off ranks still using the store. Idempotent;
        never raises for a store that is already gone.

        Args:
            wait: most seconds the hosting rank waits for the others; None means the timeout.
        """
        if self._closed:
            return
        self._closed = True
        forget_store(self.store_id)
        if self.raw_store is None:
            return
        self.stop_reconnecting()
        try:
            left = self.raw_store.add(f"{self.namespace}/exit", 1)
            if self.hosts_server and left < self.world_size:
                seconds = self.timeout if wait is None else wait
                poll_counter(self.raw_store, f"{self.namespace}/exit", self.world_size, seconds)
        except StoreError:
            pass
        finally:
            if self.owns_store:
                self.raw_store.close()


def rendezvous(
    init_method: str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    timeout: Timeout | None = None,
    store: Store | None = None,
    *,
    env: Mapping[str, str] | None = None,
    generation: int = 0,
) -> Rendezvous:
    """Find the other processes of the world and agree on ranks; return the shared store.

    Explicit arguments and the URL's query (the two must agree) win over the environment.

    Args:
        init_method: ``env://`` (default), ``tcp://host:port`` or ``file:///path``.
        world_size: number of processes; from the launcher's environment if None.
        rank: this process's rank; from the launcher's environment if None.
        timeout: seconds or ``timedelta`` for the whole rendezvous (default: MESHCOMM_TIMEOUT
            or 300 s); also the timeout of the store.
        store: an existing store shared by all ranks (then ``rank`` and ``world_size`` are
            required and ``init_method`` must be None). It is not closed by this module.
        env: environment to read (default ``os.environ``).
        generation: how many worlds this process created before; keeps the keys of a reused
            store apart (every rank makes the same sequence of worlds).

    Returns:
        The :class:`Rendezvous`; close it to leave.

    Raises:
        InvalidArgument: bad arguments, URL or environment (before any I/O).
        RendezvousError: duplicate rank, disagreeing world sizes, missing ranks after the
            timeout, an unreachable store, or MPI bootstrap without mpi4py.

    Example:
        >>> from meshcomm.store import HashStore
        >>> rdzv = rendezvous(rank=0, world_size=1, store=HashStore(), timeout=5)
        >>> rdzv.rank, rdzv.world_size
        (0, 1)
        >>> rdzv.close()
    """
    env = os.environ if env is None else env
    seconds = to_seconds(timeout)
    info = detect_launch(env)
    method: InitMethod | None = None
    if store is not None:
        _check_given_store(store, init_method, rank, world_size)
    else:
        method = parse_init_method("env://" if init_method is None else init_method)
        world_size = _merge(world_size, method.world_size, "world_size", init_method)
        rank = _merge(rank, method.rank, "rank", init_method)
    if info.launcher == "single" and rank is None and world_size is None:
        _refuse_bare_engine(env)
    me = _identity(rank, world_size, info)
    deadline = time.monotonic() + seconds
    store_id = ""
    if method is None:
        assert store is not None  # method is None only for a given store
        raw, address, owns, hosts = store, f"the given {type(store).__name__}", False, False
    else:
        raw, address, hosts, store_id = open_fresh_store(method, info, me, seconds, deadline)
        owns = True
        warn_if_unauthenticated(raw, address)
    # A launcher that restarts workers keeps its store: the restart count keeps rounds apart.
    tag = f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}.{generation}"
    namespace = f"meshcomm/rdzv/{tag}"
    try:
        agree(raw, namespace, me.rank, me.world_size, seconds, deadline, hosts, address)
        from meshcomm.store import PrefixStore

        view = PrefixStore(f"meshcomm/world/{tag}", raw)
    except BaseException:
        if owns:
            raw.close()
        raise
    return Rendezvous(
        rank=me.rank,
        world_size=me.world_size,
        local_rank=me.local_rank,
        local_world_size=me.local_world_size,
        launcher=me.launcher,
        store=view,
        raw_store=raw,
        address=address,
        timeout=seconds,
        owns_store=owns,
        hosts_server=hosts,
        namespace=namespace,
        store_id=store_id,
    )


def storeless_rendezvous(
    world_size: int | None = None,
    rank: int | None = None,
    timeout: Timeout | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> Rendezvous:
    """Say who this process is, from the launcher's environment, without any store.

    For a backend whose world needs no store (the mpi backend: its world is
    ``MPI_COMM_WORLD``). Explicit ``rank``/``world_size`` win over the launcher's; with
    neither and no launcher, this is rank 0 of 1. The backend checks these against its own
    view (MPI's rank and size). Does no I/O.

    Raises:
        InvalidArgument: bad arguments or launcher environment.

    Example:
        >>> rdzv = storeless_rendezvous(env={"PMI_RANK": "1", "PMI_SIZE": "4"}, timeout=5)
        >>> rdzv.rank, rdzv.world_size, rdzv.launcher, rdzv.store
        (1, 4, 'mpich', None)
        >>> rdzv.close()
    """
    env = os.environ if env is None else env
    me = _identity(rank, world_size, detect_launch(env))
    return Rendezvous(
        rank=me.rank,
        world_size=me.world_size,
        local_rank=me.local_rank,
        local_world_size=me.local_world_size,
        launcher=me.launcher,
        store=None,
        raw_store=None,
        address="no store",
        timeout=to_seconds(timeout),
        owns_store=False,
        hosts_server=False,
        namespace="",
    )


def _check_given_store(
    store: Store, init_method: str | None, rank: int | None, world_size: int | None
) -> None:
    from meshcomm.store.base import Store

    if not isinstance(store, Store):
        raise TypeError(f"store must be a meshcomm Store, got {type(store).__name__}")
    if init_method is not None:
        raise InvalidArgument(
            f"pass either init_method or store, not both (got init_method={init_method!r})"
        )
    if rank is None or world_size is None:
        raise InvalidArgument(
            f"with an explicit store, rank and world_size are required "
            f"(got rank={rank!r}, world_size={world_size!r})"
        )


def _refuse_bare_engine(env: Mapping[str, str]) -> None:
    """An ipyparallel engine with no rank is one of many: a world of one would be wrong."""
    engine = detect_ipyparallel(env, running_engine_id())
    if engine is None:
        return
    raise RendezvousError(
        f"meshcomm.init() runs in an {engine}, but nothing gave this engine a rank and a world "
        "size, so it cannot tell which rank it is. Start the engines with "
        "meshcomm.jupyter.start_cluster(n=...), which gives every engine its rank and the "
        "rendezvous address and calls meshcomm.init() on each; or set MESHCOMM_RANK, "
        "MESHCOMM_WORLD_SIZE, MESHCOMM_MASTER_ADDR and MESHCOMM_MASTER_PORT on every engine "
        "(or pass rank=, world_size= and init_method='tcp://HOST:PORT' to meshcomm.init())"
    )


def _identity(rank: int | None, world_size: int | None, info: LaunchInfo) -> LaunchInfo:
    """Merge explicit rank/world size with the launcher's; validate; return who we are."""
    for value, name in ((rank, "rank"), (world_size, "world_size")):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if world_size is not None and world_size <= 0:
        raise InvalidArgument(f"world size must be >= 1, got {world_size}")
    if rank is not None and rank < 0:
        raise InvalidArgument(f"rank must be >= 0, got {rank}")
    launcher = info.launcher
    if rank is not None and world_size is not None:
        launcher = "explicit"
    elif info.launcher != "single":
        rank = info.rank if rank is None else rank
        world_size = info.world_size if world_size is None else world_size
    elif rank is None and world_size in (None, 1):
        rank, world_size = 0, 1
    else:
        given, missing = ("rank", "world_size") if rank is not None else ("world_size", "rank")
        raise InvalidArgument(
            f"{given} was given but {missing} was not, and no launcher environment provides "
            "it; pass both"
        )
    assert rank is not None and world_size is not None  # every branch above set both
    check_rank_size(rank, world_size, f"rank {rank}, world size {world_size}")
    if (rank, world_size) == (info.rank, info.world_size):
        local: tuple[int | None, int | None] = (info.local_rank, info.local_world_size)
    else:
        local = (0, 1) if world_size == 1 else (None, None)
    addr, port = info.master_addr, info.master_port
    return LaunchInfo(launcher, rank, world_size, *local, addr, port, info.store_host)


def _merge(explicit: int | None, from_url: int | None, name: str, url: str | None) -> int | None:
    if explicit is not None and from_url is not None and explicit != from_url:
        raise InvalidArgument(
            f"{name}={explicit} disagrees with {name}={from_url} in init_method {url!r}"
        )
    return explicit if explicit is not None else from_url
