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

import errno
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, unquote, urlsplit

from meshcomm._secret import SECRET_ENV
from meshcomm._timeout import Timeout, to_seconds
from meshcomm.errors import InvalidArgument, RendezvousError, StoreError, StoreTimeout
from meshcomm.launch import (
    LaunchInfo,
    check_port,
    check_rank_size,
    detect_ipyparallel,
    detect_launch,
    mpi_share_store_address,
    running_engine_id,
)

if TYPE_CHECKING:
    from meshcomm.store import TCPStore
    from meshcomm.store.base import Store

__all__ = [
    "InitMethod",
    "Rendezvous",
    "parse_init_method",
    "rendezvous",
    "storeless_rendezvous",
]

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
# After an abort, the rank that hosts the store server keeps it up this long (at most) so the
# other ranks can read the reason instead of seeing a dropped connection.
_ABORT_LINGER = 2.0
# Rank 0 says who is missing this often while the world assembles.
_REPORT_EVERY = 10.0
# Seconds a rank 0 whose port is taken tries that port's server as a client (see _tcp_store).
_JOIN_TAKEN_PORT = 5.0


@dataclass(frozen=True)
class InitMethod:
    """A parsed ``init_method`` URL.

    Attributes:
        scheme: "env", "tcp" or "file".
        host: store host (tcp only).
        port: store port (tcp only).
        path: store file (file only).
        rank: ``?rank=`` from the query, if given.
        world_size: ``?world_size=`` from the query, if given.
    """

    scheme: str
    host: str | None = None
    port: int | None = None
    path: str | None = None
    rank: int | None = None
    world_size: int | None = None


# -- init_method URLs -----------------------------------------------------------------------


def parse_init_method(url: str) -> InitMethod:
    """Validate and parse an ``init_method`` URL.

    Accepted forms: ``env://``, ``tcp://HOST:PORT`` (IPv6 as ``tcp://[::1]:PORT``) and
    ``file:///ABSOLUTE/PATH``; tcp and file URLs may add ``?rank=R&world_size=N``.

    Raises:
        InvalidArgument: anything else, with the reason.

    Example:
        >>> parse_init_method("file:///tmp/rdzv?world_size=2")
        InitMethod(scheme='file', host=None, port=None, path='/tmp/rdzv', rank=None, world_size=2)
        >>> parse_init_method("env://").scheme
        'env'
    """
    if not isinstance(url, str):
        raise TypeError(f"init_method must be a str URL, got {type(url).__name__} {url!r}")
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme == "env":
        if parts.netloc or parts.path or parts.query or parts.fragment:
            raise InvalidArgument(f"init_method {url!r}: env:// takes nothing after '//'")
        return InitMethod("env")
    if scheme not in ("tcp", "file"):
        raise InvalidArgument(
            f"init_method {url!r}: unsupported scheme {parts.scheme!r}; "
            "use env://, tcp://HOST:PORT or file:///PATH"
        )
    if parts.fragment:
        raise InvalidArgument(f"init_method {url!r}: a fragment ('#...') is not allowed")
    rank, world_size = _parse_query(url, parts.query)
    if scheme == "tcp":
        try:
            port = parts.port
        except ValueError:
            port = -1
        if not parts.hostname or port is None:
            raise InvalidArgument(f"init_method {url!r}: tcp:// needs HOST:PORT")
        if port == -1:
            raise InvalidArgument(f"init_method {url!r}: the port must be in [1, 65535]")
        if parts.path not in ("", "/") or parts.username or parts.password:
            raise InvalidArgument(f"init_method {url!r}: tcp:// takes only HOST:PORT")
        check_port(port, f"init_method {url!r}: the port")
        return InitMethod("tcp", host=parts.hostname, port=port, rank=rank, world_size=world_size)
    if parts.netloc not in ("", "localhost"):
        raise InvalidArgument(
            f"init_method {url!r}: file:// takes a local absolute path (file:///path), "
            f"not the host {parts.netloc!r}"
        )
    path = unquote(parts.path)
    if not path.startswith("/") or path.endswith("/"):
        raise InvalidArgument(f"init_method {url!r}: file:// needs an absolute file path")
    return InitMethod("file", path=path, rank=rank, world_size=world_size)


def _parse_query(url: str, query: str) -> tuple[int | None, int | None]:
    values: dict[str, int] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise InvalidArgument(f"init_method {url!r}: malformed query {query!r}") from None
    for key, raw in pairs:
        if key not in ("rank", "world_size"):
            raise InvalidArgument(
                f"init_method {url!r}: unknown query parameter {key!r} (known: rank, world_size)"
            )
        if key in values:
            raise InvalidArgument(f"init_method {url!r}: {key} is given twice")
        try:
            values[key] = int(raw)
        except ValueError:
            raise InvalidArgument(
                f"init_method {url!r}: {key} must be an integer, got {raw!r}"
            ) from None
    return values.get("rank"), values.get("world_size")


# -- the rendezvous itself ------------------------------------------------------------------


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
        if self.store_id:
            _left_stores.add(self.store_id)
        if self.raw_store is None:
            return
        try:
            left = self.raw_store.add(f"{self.namespace}/exit", 1)
            if self.hosts_server and left < self.world_size:
                seconds = self.timeout if wait is None else wait
                _poll_counter(self.raw_store, f"{self.namespace}/exit", self.world_size, seconds)
        except StoreError:
            pass
        finally:
            if self.owns_store:
                self.raw_store.close()


def _poll_counter(store: Store, key: str, target: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    delay = 0.002
    while store.add(key, 0) < target:
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    return True


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
        raw, address, hosts, store_id = _open_fresh_store(method, info, me, seconds, deadline)
        owns = True
        _warn_if_unauthenticated(raw, address)
    # A launcher that restarts workers keeps its store: the restart count keeps rounds apart.
    tag = f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}.{generation}"
    namespace = f"meshcomm/rdzv/{tag}"
    try:
        _agree(raw, namespace, me.rank, me.world_size, seconds, deadline, hosts, address)
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


def _open_fresh_store(
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


def _warn_if_unauthenticated(store: Store, address: str) -> None:
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
    try:
        return TCPStore(
            host, port, world_size, is_master=is_master, timeout=seconds, wait_for_workers=False
        )
    except (StoreError, OSError) as exc:
        if not is_master:
            raise RendezvousError(
                f"rank {rank} could not reach the store at {host}:{port} within {seconds:g} s: "
                f"{exc} (is rank 0 running, and the address right?)"
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


# -- the agreement protocol -----------------------------------------------------------------


def _agree(
    store: Store,
    ns: str,
    rank: int,
    world_size: int,
    seconds: float,
    deadline: float,
    hosts: bool,
    address: str,
) -> None:
    """Check world size, claim the rank, wait for everyone; abort the world on any problem."""
    token = f"host {socket.gethostname()} pid {os.getpid()} id {uuid.uuid4().hex[:12]}"
    abort_key, done_key = f"{ns}/abort", f"{ns}/done"
    try:
        store.add(f"{ns}/entered", 1)
        if store.check([abort_key]):
            raise _aborted(store, ns, rank, hosts)
        local = local_world_size_hint()
        mine = f"{world_size} {rank} {local}"
        first = store.compare_set(f"{ns}/world_size", "", mine).decode()
        first_size, first_rank, first_local = [*first.split(), "0", "0"][:3]
        if first_size != str(world_size):
            per_node = ""
            if local and first_local not in ("0", str(local)):
                per_node = (
                    f" ({local} vs {first_local} ranks per node: is --nproc-per-node the "
                    "same on every node?)"
                )
            raise _abort(
                store,
                ns,
                rank,
                hosts,
                f"ranks disagree on the world size: rank {rank} has world size {world_size} "
                f"but rank {first_rank} has world size {first_size}{per_node}",
            )
        owner = store.compare_set(f"{ns}/rank/{rank}", "", token).decode()
        if owner != token:
            raise _abort(
                store,
                ns,
                rank,
                hosts,
                f"two processes claim rank {rank}: {owner} and {token} (a stale store from an "
                "earlier run can cause this too)",
            )
        if store.add(f"{ns}/arrived", 1) == world_size:
            store.set(done_key, "ok")
        try:
            _wait_for_all(store, ns, rank, world_size, seconds, deadline)
        except StoreTimeout:
            missing = _missing(store, ns, world_size)
            arrived = world_size - len(missing)
            raise _abort(
                store,
                ns,
                rank,
                hosts,
                f"rendezvous timed out after {seconds:g} s: rank(s) {missing} never arrived "
                f"({arrived} of {world_size} arrived at {address})",
            ) from None
        if store.check([abort_key]):
            raise _aborted(store, ns, rank, hosts)
        # The server host waits until every rank has seen "done": closing it sooner (say,
        # an immediate shutdown) would cut off ranks still polling.
        store.add(f"{ns}/departed", 1)
        if hosts and not _poll_counter(
            store, f"{ns}/departed", world_size, max(deadline - time.monotonic(), 1e-3)
        ):
            raise RendezvousError(
                f"rank {rank}: not every rank confirmed the end of the rendezvous at {address} "
                f"within {seconds:g} s"
            )
    except StoreError as exc:
        raise RendezvousError(
            f"rank {rank}: lost the rendezvous store at {address}: {exc} (the rank hosting it "
            "may have failed)"
        ) from exc


def _missing(store: Store, ns: str, world_size: int) -> list[int]:
    return [r for r in range(world_size) if not store.check([f"{ns}/rank/{r}"])]


def _report_every() -> float:
    """Seconds between rank 0's "still waiting" lines (``MESHCOMM_RDZV_REPORT``, default 10)."""
    raw = os.environ.get("MESHCOMM_RDZV_REPORT", "").strip()
    try:
        value = float(raw) if raw else _REPORT_EVERY
    except ValueError:
        value = _REPORT_EVERY
    return value if value > 0 else _REPORT_EVERY


def _wait_for_all(
    store: Store, ns: str, rank: int, world_size: int, seconds: float, deadline: float
) -> None:
    """Wait for the arrival barrier; rank 0 says who is missing every few seconds, so a node
    started late or never is named while the others wait, not only at the timeout.

    Raises:
        StoreTimeout: the deadline passed.
    """
    every = _report_every()
    started = time.monotonic()
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait([f"{ns}/done"], timeout=max(min(left, every), 1e-3))
            return
        except StoreTimeout:
            if time.monotonic() >= deadline - 1e-3:
                raise
        if rank != 0:
            continue
        missing = _missing(store, ns, world_size)
        if not missing:
            continue
        local = local_world_size_hint()
        nodes = sorted({r // local for r in missing}) if local else []
        where = f" (node(s) {nodes} with {local} ranks per node)" if nodes else ""
        _log.warning(
            "meshcomm: waiting for rank(s) %s%s: %d of %d arrived, %.0f s of %g s",
            _span(missing),
            where,
            world_size - len(missing),
            world_size,
            time.monotonic() - started,
            seconds,
        )


def _span(ranks: list[int]) -> str:
    """``[2, 3, 4, 7]`` -> ``"2-4, 7"``: readable at 512 ranks."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def local_world_size_hint() -> int:
    """Ranks per node from the launcher's ``LOCAL_WORLD_SIZE`` (0 when unknown)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else 0


def _abort(store: Store, ns: str, rank: int, hosts: bool, reason: str) -> RendezvousError:
    """Publish ``reason`` as the world's abort record (first one wins) and return the error."""
    try:
        store.compare_set(f"{ns}/abort", "", reason)
        store.set(f"{ns}/done", "abort")
        store.add(f"{ns}/abort_seen", 1)
        if hosts:
            entered = store.add(f"{ns}/entered", 0)
            _poll_counter(store, f"{ns}/abort_seen", entered, _ABORT_LINGER)
    except StoreError:
        pass  # the store is gone; the local error still carries the reason
    return RendezvousError(f"rank {rank}: {reason}")


def _aborted(store: Store, ns: str, rank: int, hosts: bool) -> RendezvousError:
    reason = store.get(f"{ns}/abort").decode(errors="replace")
    store.add(f"{ns}/abort_seen", 1)
    if hosts:
        _poll_counter(store, f"{ns}/abort_seen", store.add(f"{ns}/entered", 0), _ABORT_LINGER)
    return RendezvousError(f"rank {rank}: rendezvous aborted: {reason}")
