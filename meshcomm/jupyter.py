"""Meshes in Jupyter: an ipyparallel cluster whose engines are the ranks of one meshcomm world.

:func:`start_cluster` starts an ipyparallel controller and ``n`` engines, hosts the rendezvous
store in the notebook's own process (on a free port), gives every engine its rank, world size
and the store's address, runs ``meshcomm.init()`` (and optionally ``init_device_mesh``) on all
of them at once, and activates ``%px``/``%%px`` when it runs inside IPython. Engine ``i`` is
rank ``i``, so ipyparallel's ``[stdout:3]`` and ``[3:execute]`` prefixes name the rank.

Each engine's namespace then holds ``meshcomm``, ``ops``, ``np``, ``rank``, ``world_size``,
``world`` (the world group) and, with a mesh shape, ``mesh``, which is also the engine's
ambient mesh (``ops.psum(x, "tp")`` needs no ``with mesh:``). Exceptions raised in ``%px``
cells carry a note naming the rank.

Needs the ``jupyter`` extra (``pip install 'meshcomm[jupyter]'``); ipyparallel is imported
only when a cluster starts.

Example:
    In a notebook (8 engines, a 2 x 4 mesh)::

        from meshcomm.jupyter import start_cluster
        cluster = start_cluster(8, mesh_shape=(2, 4), mesh_dim_names=("dp", "tp"))

        %%px
        y = ops.psum(np.full(2, rank), "tp")

        cluster.gather("y")      # one array per rank, in rank order
        cluster.stop()

    or ``with start_cluster(4) as cluster: ...`` to stop it even when a cell fails.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from meshcomm.backends import BACKENDS
from meshcomm.common.secret import SECRET_ENV
from meshcomm.common.timeout import Timeout, to_seconds
from meshcomm.errors import InvalidArgument, MeshCommError

if TYPE_CHECKING:
    from types import TracebackType

    from meshcomm.store.server import StoreServer

__all__ = [
    "DEFAULT_HEARTBEAT_MS",
    "MeshCluster",
    "start_cluster",
]

#: Heartbeat period of the controller (ms). An engine's registration completes at the first
#: heartbeat after it connects, so ipyparallel's default of 3000 ms adds up to 3 s per start.
DEFAULT_HEARTBEAT_MS = 200
# Missed heartbeats before the controller drops an engine: ~30 s at the period above, so a
# busy 2-core machine does not lose engines (ipyparallel's default of 10 assumes 3 s beats).
_HEARTBEAT_MISSES = 150
_ENGINE_BACKENDS = {"tcp": "local", "mpi": "mpi"}


def _require_ipyparallel() -> Any:
    try:
        import ipyparallel
    except ImportError as exc:
        raise ImportError(
            "meshcomm.jupyter needs ipyparallel: pip install 'meshcomm[jupyter]'"
        ) from exc
    return ipyparallel


class MeshCluster:
    """A running ipyparallel cluster whose engines form one meshcomm world.

    Made by :func:`start_cluster`; stop it with :meth:`stop` or a ``with`` block.

    Attributes:
        cluster: the ``ipyparallel.Cluster`` (controller and engines).
        client: the connected ``ipyparallel.Client``.
        view: a blocking ``DirectView`` on every engine, its targets in rank order.
        n: the number of engines, which is the world size.
        backend: the meshcomm backend of the world ("tcp" or "mpi").
        mesh_shape: the mesh built on every engine (``mesh``), or None.
        mesh_dim_names: its axis names, or None.
        master_addr: host of the rendezvous store (served by this process).
        master_port: its port, chosen free when the cluster started.
        engine_ids: the ipyparallel engine id of each rank (rank order).
        pids: each rank's engine process id (rank order).
        startup_seconds: seconds from the call to a ready world (and mesh).
    """

    def __init__(
        self,
        cluster: Any,
        client: Any,
        view: Any,
        *,
        backend: str,
        mesh_shape: tuple[int, ...] | None,
        mesh_dim_names: tuple[str, ...] | None,
        server: StoreServer,
        engine_ids: list[int],
        pids: list[int],
        startup_seconds: float,
    ) -> None:
        self.cluster = cluster
        self.client = client
        self.view = view
        self.n = len(engine_ids)
        self.backend = backend
        self.mesh_shape = mesh_shape
        self.mesh_dim_names = mesh_dim_names
        self.master_addr = "127.0.0.1"
        self.master_port = int(server.port)
        self.engine_ids = engine_ids
        self.pids = pids
        self.startup_seconds = startup_seconds
        self._server: StoreServer | None = server

    def __repr__(self) -> str:
        state = "stopped" if self.stopped else "running"
        mesh = "" if self.mesh_shape is None else f", mesh {self.mesh_shape} {self.mesh_dim_names}"
        return f"<MeshCluster {state}: {self.n} engines, backend {self.backend!r}{mesh}>"

    @property
    def stopped(self) -> bool:
        """True once :meth:`stop` ran."""
        return self._server is None

    def gather(self, name: str, timeout: Timeout = 60.0) -> list[Any]:
        """Return the engine variable ``name`` from every rank, in rank order.

        Raises:
            MeshCommError: the cluster is stopped.
            TimeoutError: an engine did not answer within ``timeout``.
        """
        self._check_running()
        result = self.view.pull(name, block=False)
        return list(result.get(timeout=to_seconds(timeout)))

    def apply(self, fn: Callable[..., Any], *args: Any, timeout: Timeout = 60.0) -> list[Any]:
        """Run ``fn(*args)`` on every rank; return the results in rank order.

        A failure raises ipyparallel's ``CompositeError``; each of its errors names the
        engine, which is the rank, and carries a note "on meshcomm rank R of N".
        """
        self._check_running()
        result = self.view.apply_async(_call_noting_rank, fn, *args)
        return list(result.get(timeout=to_seconds(timeout)))

    def _check_running(self) -> None:
        if self.stopped:
            raise MeshCommError("this MeshCluster was stopped; start a new one")

    def stop(self, timeout: Timeout = 20.0) -> None:
        """Leave the meshcomm world on every engine, stop engines and controller. Idempotent.

        Args:
            timeout: seconds the engines get to call ``meshcomm.shutdown()``. Then the
                cluster is stopped whatever they did (ipyparallel sends SIGTERM, then SIGKILL
                after 5 s) and the store this process served is closed.

        Example:
            ``with start_cluster(2) as cluster: ...`` calls it at the end of the block.
        """
        server, self._server = self._server, None
        if server is None:
            return
        seconds = to_seconds(timeout)
        try:
            with contextlib.suppress(Exception):
                self.view.apply_async(_engine_shutdown).get(timeout=seconds)
            with contextlib.suppress(Exception):
                self.client.close()
            _stop_ipp_cluster(self.cluster)
        finally:
            server.close()

    def __enter__(self) -> MeshCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_cluster(
    n: int = 8,
    backend: str = "tcp",
    mesh_shape: Sequence[int] | None = None,
    mesh_dim_names: Sequence[str] | None = None,
    *,
    timeout: Timeout = 120.0,
    op_timeout: Timeout | None = None,
    heartbeat_ms: int = DEFAULT_HEARTBEAT_MS,
    activate: bool = True,
    profile_dir: str | None = None,
    cluster_kwargs: dict[str, Any] | None = None,
) -> MeshCluster:
    """Start ``n`` ipyparallel engines that form one meshcomm world, optionally with a mesh.

    Starts a controller and ``n`` engines (``engines="mpi"`` under mpiexec when ``backend``
    is "mpi"), serves the rendezvous store from this process on a free port, gives every
    engine its rank (engine ``i`` is rank ``i``), world size and the store's address, and
    runs ``meshcomm.init()`` on all of them (then ``init_device_mesh`` when ``mesh_shape``
    is given). Inside IPython, ``%px`` and ``%%px`` then run on every engine.

    Args:
        n: the number of engines (the world size).
        backend: "tcp" (engines started as local processes) or "mpi" (engines started by
            ``mpiexec``, MPI rank = meshcomm rank; needs mpi4py).
        mesh_shape: the mesh to build on every engine as ``mesh`` (one entry may be -1).
        mesh_dim_names: its axis names.
        timeout: seconds (or ``timedelta``) for the whole start: engines, rendezvous, mesh.
        op_timeout: the engines' world timeout, for every later blocking operation
            (default: ``MESHCOMM_TIMEOUT`` or 300 s, as for ``meshcomm.init()``).
        heartbeat_ms: the controller's heartbeat period; engines register at the first
            beat after they connect, so a short period makes starts quick.
        activate: register ``%px`` magics when running inside IPython.
        profile_dir: the IPython profile directory for the cluster's files (default: the
            current IPython profile, or ``$IPYTHONDIR/profile_default``).
        cluster_kwargs: extra keyword arguments for ``ipyparallel.Cluster``.

    Returns:
        A running :class:`MeshCluster`; stop it with ``.stop()`` or a ``with`` block.

    Raises:
        ImportError: ipyparallel is not installed (install ``meshcomm[jupyter]``).
        InvalidArgument: bad ``n``, backend, mesh shape or names (before anything starts).
        MeshCommError: the engines or the world did not come up; everything started is
            stopped again, and the message names the failing rank.

    Example:
        Start, compute on every rank, and stop, even on failure::

            with start_cluster(4, mesh_shape=(2, 2), mesh_dim_names=("dp", "tp")) as c:
                sums = c.apply(lambda: int(meshcomm.ops.psum(1, "tp")))   # [2, 2, 2, 2]
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"n must be an int, got {type(n).__name__} {n!r}")
    if n < 1:
        raise InvalidArgument(f"n must be >= 1 engines, got {n}")
    if backend not in _ENGINE_BACKENDS:
        known = ", ".join(_ENGINE_BACKENDS)
        other = " (a meshcomm backend, but not one for engines)" if backend in BACKENDS else ""
        raise InvalidArgument(f"backend must be one of {known}, got {backend!r}{other}")
    shape, names = _check_mesh(n, mesh_shape, mesh_dim_names)
    if isinstance(heartbeat_ms, bool) or not isinstance(heartbeat_ms, int) or heartbeat_ms < 10:
        raise InvalidArgument(f"heartbeat_ms must be an int >= 10, got {heartbeat_ms!r}")
    seconds = to_seconds(timeout)
    ipp = _require_ipyparallel()
    from meshcomm.launcher.job_secret import launch_secret
    from meshcomm.store.server import StoreServer

    started = time.perf_counter()
    deadline = time.monotonic() + seconds
    kwargs: dict[str, Any] = {
        "n": n,
        "engines": _ENGINE_BACKENDS[backend],
        # The controller writes its connection info before start returns: no fixed delay.
        "delay": 0,
        "engine_timeout": max(1, int(seconds)),
        "controller_args": [
            f"--HeartMonitor.period={heartbeat_ms}",
            f"--HeartMonitor.max_heartmonitor_misses={_HEARTBEAT_MISSES}",
        ],
        # Stopped engines exit non-zero, which ipyparallel reports at WARNING with their
        # whole log; failures that matter reach the caller as exceptions instead.
        "log_level": logging.ERROR,
    }
    if profile_dir is not None:
        kwargs["profile_dir"] = profile_dir
    kwargs.update(cluster_kwargs or {})
    cluster = ipp.Cluster(**kwargs)
    # The engines' world admits only them: the notebook's own secret if it has one.
    secret = launch_secret()
    server = StoreServer("127.0.0.1", 0, secret=secret)
    server.start()
    client = None
    try:
        cluster.start_cluster_sync(n)
        client = cluster.connect_client_sync()
        # interactive=False: no progress bar in the notebook for a start of a few seconds.
        client.wait_for_engines(n, timeout=_remaining(deadline), interactive=False)
        engine_ids = _rank_order(client, backend, deadline)
        view = client[engine_ids]
        view.block = True
        pids = _setup_engines(
            client, engine_ids, backend, server.port, shape, names, op_timeout, deadline, secret
        )
    except BaseException:
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        _stop_ipp_cluster(cluster)
        server.close()
        raise
    mc = MeshCluster(
        cluster,
        client,
        view,
        backend=backend,
        mesh_shape=shape,
        mesh_dim_names=names,
        server=server,
        engine_ids=engine_ids,
        pids=pids,
        startup_seconds=time.perf_counter() - started,
    )
    # A kernel that exits (a failed notebook in CI included) stops its clusters.
    atexit.register(_stop_at_exit, weakref.ref(mc))
    if activate:
        _activate(view)
    return mc


def _stop_at_exit(ref: weakref.ref[MeshCluster]) -> None:
    mc = ref()
    if mc is not None:
        with contextlib.suppress(Exception):
            mc.stop(timeout=5.0)


def _check_mesh(
    n: int, mesh_shape: Sequence[int] | None, mesh_dim_names: Sequence[str] | None
) -> tuple[tuple[int, ...] | None, tuple[str, ...] | None]:
    if mesh_shape is None:
        if mesh_dim_names is not None:
            raise InvalidArgument(
                f"mesh_dim_names={mesh_dim_names!r} was given without mesh_shape; pass both"
            )
        return None, None
    from meshcomm.mesh import check_mesh_names, check_mesh_shape, infer_mesh_shape

    shape = infer_mesh_shape(check_mesh_shape(mesh_shape), n)
    names = None if mesh_dim_names is None else check_mesh_names(mesh_dim_names, len(shape))
    return shape, names


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.1)


def _rank_order(client: Any, backend: str, deadline: float) -> list[int]:
    """Engine ids in rank order: sorted ids, or each engine's MPI rank under mpiexec."""
    ids = sorted(client.ids)
    if backend != "mpi":
        return ids
    ranks = client[ids].apply_async(_mpi_rank).get(timeout=_remaining(deadline))
    if sorted(ranks) != list(range(len(ids))):
        raise MeshCommError(f"the MPI engines report ranks {ranks}; expected 0..{len(ids) - 1}")
    by_rank = dict(zip(ranks, ids, strict=True))
    return [by_rank[r] for r in range(len(ids))]


def _setup_engines(
    client: Any,
    engine_ids: list[int],
    backend: str,
    port: int,
    shape: tuple[int, ...] | None,
    names: tuple[str, ...] | None,
    op_timeout: Timeout | None,
    deadline: float,
    secret: str,
) -> list[int]:
    """Run the rendezvous on every engine at once; return the engines' pids in rank order.

    The start's deadline is kept here, in the notebook: engines that miss it are stopped
    with the cluster, so their world can keep the timeout meant for later operations. The
    job's secret travels with the setup call, over ipyparallel's own (HMAC-signed) channel,
    which already carries the code the engines run.
    """
    world_size = len(engine_ids)
    seconds = None if op_timeout is None else to_seconds(op_timeout)
    pending = [
        client[eid].apply_async(
            _engine_setup,
            rank,
            world_size,
            backend,
            "127.0.0.1",
            port,
            shape,
            names,
            seconds,
            secret,
        )
        for rank, eid in enumerate(engine_ids)
    ]
    pids: list[int] = []
    failures: list[str] = []
    for rank, result in enumerate(pending):
        try:
            pids.append(int(result.get(timeout=_remaining(deadline))))
        except Exception as exc:
            failures.append(f"rank {rank} (engine {engine_ids[rank]}): {_describe(exc)}")
    if failures:
        raise MeshCommError(
            f"meshcomm world of {world_size} engines did not start: " + "; ".join(failures)
        )
    return pids


def _describe(exc: BaseException) -> str:
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename is not None:
        return f"{ename}: {evalue}"
    return f"{type(exc).__name__}: {exc}"


def _activate(view: Any) -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    if get_ipython() is not None:
        view.activate()


def _stop_ipp_cluster(cluster: Any) -> None:
    """Stop engines and controller; fall back to killing what is left."""
    try:
        cluster.stop_cluster_sync()
    except Exception:
        with contextlib.suppress(Exception):
            cluster.signal_engines_sync(signal.SIGKILL)
        with contextlib.suppress(Exception):
            cluster.stop_controller_sync()


# -- what runs on the engines (module level: ipyparallel sends them by reference) ------------


def _mpi_rank() -> int:
    from mpi4py import MPI

    return int(MPI.COMM_WORLD.Get_rank())


def _engine_setup(
    rank: int,
    world_size: int,
    backend: str,
    addr: str,
    port: int,
    shape: tuple[int, ...] | None,
    names: tuple[str, ...] | None,
    timeout: float | None,
    secret: str = "",
) -> int:
    """On one engine: set the launcher variables, join the world, fill the namespace."""
    import numpy as np

    import meshcomm
    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    os.environ.update(
        {
            "MESHCOMM_RANK": str(rank),
            "MESHCOMM_WORLD_SIZE": str(world_size),
            "MESHCOMM_LOCAL_RANK": str(rank),
            "MESHCOMM_LOCAL_WORLD_SIZE": str(world_size),
            "MESHCOMM_MASTER_ADDR": addr,
            "MESHCOMM_MASTER_PORT": str(port),
            "MESHCOMM_STORE_HOSTED": "1",
            SECRET_ENV: secret,
        }
    )
    meshcomm.shutdown()  # an engine reused from an earlier cluster leaves its old world
    world = meshcomm.init(backend=backend, timeout=timeout)
    space: dict[str, Any] = {
        "meshcomm": meshcomm,
        "ops": ops,
        "np": np,
        "rank": rank,
        "world_size": world_size,
        "world": world,
    }
    if shape is not None:
        space["mesh"] = mesh = init_device_mesh(shape, names)
        # The engine runs every cell in one context, so this makes the mesh ambient for the
        # whole session, as if each cell were inside `with mesh:` (nested blocks still work).
        mesh.__enter__()
    shell = _engine_shell()
    if shell is not None:
        shell.user_ns.update(space)
        _note_rank_on_errors(shell, rank, world_size)
    return os.getpid()


def _engine_shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _rank_note(rank: int, world_size: int) -> str:
    return f"(raised on meshcomm rank {rank} of {world_size})"


def _add_note(exc: BaseException) -> None:
    """Add the rank note once (an exception re-raised through two cells keeps one)."""
    rank, size = os.environ.get("MESHCOMM_RANK"), os.environ.get("MESHCOMM_WORLD_SIZE")
    if rank is None or size is None:
        return
    note = _rank_note(int(rank), int(size))
    notes = getattr(exc, "__notes__", None)
    if notes is None:
        # What BaseException.add_note does on Python 3.11+; tracebacks print __notes__.
        notes = []
        setattr(exc, "__notes__", notes)  # noqa: B010 - no add_note on Python 3.10
    if note not in notes:
        notes.append(note)


def _note_rank_on_errors(shell: Any, rank: int, world_size: int) -> None:
    """Make every exception of a ``%px`` cell carry the rank in its traceback."""

    def handler(
        self: Any, etype: type[BaseException], value: BaseException, tb: Any, tb_offset: Any = None
    ) -> Any:
        with contextlib.suppress(Exception):
            _add_note(value)
        return self.showtraceback((etype, value, tb), tb_offset=tb_offset)

    shell.set_custom_exc((Exception,), handler)


def _call_noting_rank(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        _add_note(exc)
        raise


def _engine_shutdown() -> None:
    import meshcomm

    meshcomm.shutdown()
