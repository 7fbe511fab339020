"""A store for every mpi world: the launcher's, else rank 0 serves one over MPI.

MPI brings the ranks of an mpi world together by itself, so that world needs no store to
form. It needs one to explain a hang: the hang verdicts (:mod:`meshcomm.diagnostics.hang_verdict`),
the
responders that answer them (:mod:`meshcomm.diagnostics.responder`) and the early hang warning
(:mod:`meshcomm.diagnostics.hang_warning`) all go through the job's store. So when
``meshcomm.init()``
makes an mpi world without a store or store URL:

- under ``meshrun --backend mpi``, the ranks join the store meshrun serves for the job
  (``MESHCOMM_STORE_HOSTED=1`` with ``MESHCOMM_MASTER_ADDR``/``MESHCOMM_MASTER_PORT`` and
  the job's ``MESHCOMM_SECRET``, as for a tcp job), with no MPI step: no rank holds the
  store, so a verdict still names rank 0 when rank 0 is the one stuck (even where Python
  cannot run, as in a C call that holds the GIL);
- otherwise (``mpiexec``, ``srun``), rank 0 starts a :class:`~meshcomm.store.TCPStore`
  server on a free port, with a fresh secret, and broadcasts the address and the secret
  over ``MPI_COMM_WORLD`` (:func:`meshcomm.launch.mpi_share_store_address`, then one more
  broadcast); the others join it. The secret never enters an environment, so no other job
  can read it, and the server admits only the ranks that MPI told it to. It stops at
  ``meshcomm.shutdown()``, when every rank has left, as a tcp world's does. While rank 0
  cannot run Python (a C call holding the GIL, a debugger), its store cannot answer either,
  and the others' timeouts carry no verdict.

Every MPI step is non-blocking and polled until the world's timeout. If the store cannot be
made (rank 0 cannot bind, a rank cannot reach it), every rank learns it through one more
MPI reduction, warns once, and the world forms without a store, as it did before: its
timeouts then carry no verdict. ``MESHCOMM_MPI_STORE=0`` skips the store altogether.

Example:
    >>> wants_store({"MESHCOMM_MPI_STORE": "0"}, 4)
    False
    >>> wants_store({}, 1)  # a world of one has nobody to ask
    False
    >>> launcher_serves({"MESHCOMM_STORE_HOSTED": "1", "MESHCOMM_MASTER_ADDR": "127.0.0.1",
    ...                  "MESHCOMM_MASTER_PORT": "40001", "PMI_RANK": "0", "PMI_SIZE": "2"})
    True
"""

from __future__ import annotations

import array
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from meshcomm.common.secret import new_secret
from meshcomm.errors import MeshCommError
from meshcomm.launch import _mpi_wait, detect_launch
from meshcomm.rendezvous import Rendezvous, rendezvous, storeless_rendezvous

__all__ = ["MPI_STORE_ENV", "launcher_serves", "mpi_rendezvous", "wants_store"]

#: ``0`` leaves an mpi world without a store (no hang verdicts, no early hang warning).
MPI_STORE_ENV = "MESHCOMM_MPI_STORE"

_log = logging.getLogger("meshcomm.rendezvous")
_SECRET_BYTES = 128  # the broadcast buffer: a 64-hex-character secret and JSON around it


def wants_store(env: Mapping[str, str], world_size: int) -> bool:
    """Whether an mpi world of ``world_size`` ranks gets a store of its own."""
    off = env.get(MPI_STORE_ENV, "").strip().lower() in ("0", "off", "false", "no")
    return world_size > 1 and not off


def launcher_serves(env: Mapping[str, str]) -> bool:
    """Whether the launcher serves the job's store and names it (``meshrun --backend mpi``)."""
    info = detect_launch(env)
    return info.store_host == "launcher" and None not in (info.master_addr, info.master_port)


def mpi_rendezvous(
    world_size: int | None,
    rank: int | None,
    seconds: float,
    env: Mapping[str, str],
    generation: int,
) -> Rendezvous:
    """Who this process is in an mpi world, with the store rank 0 serves (see the module).

    Collective over ``MPI_COMM_WORLD`` when a store is made: every rank must call it.

    Args:
        world_size: the world size given to ``init`` (None: the launcher's).
        rank: the rank given to ``init`` (None: the launcher's).
        seconds: the world's timeout; no MPI step and no store call waits longer.
        env: the environment to read.
        generation: how many worlds this process made before (keeps store keys apart).

    Returns:
        The rendezvous: with a store (``owns_store``; rank 0 ``hosts_server`` when no
        launcher serves it), or without one when it is not wanted, MPI's view differs from
        the launcher's (the backend then says so), or rank 0's store could not be made.

    Raises:
        RendezvousError: the ranks could not agree through the store (e.g. a rank missing),
            or the store the launcher names could not be reached.
    """
    bare = storeless_rendezvous(world_size, rank, seconds, env=env)
    if not wants_store(env, bare.world_size):
        return bare
    try:
        from meshcomm.backends.mpi._lib import load

        mpi = load()
    except ImportError:
        return bare  # the backend raises its own words for a missing mpi4py
    comm = mpi.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (bare.rank, bare.world_size):
        return bare  # not one MPI job: the backend refuses with both views named
    if launcher_serves(env):
        agreed = rendezvous(
            None, bare.world_size, bare.rank, seconds, env=env, generation=generation
        )
        return _as_mpi(agreed, bare, f"{agreed.address} (the launcher's)")
    deadline = time.monotonic() + seconds
    store, why = _open(mpi, comm, bare.rank, bare.world_size, seconds, deadline)
    if store is None:
        if bare.rank == 0:
            _log.warning(
                "meshcomm: this mpi world has no store (%s), so a collective that times out "
                "cannot say which rank is behind; set %s=0 to skip trying",
                why,
                MPI_STORE_ENV,
            )
        return bare
    try:
        agreed = rendezvous(
            None, bare.world_size, bare.rank, seconds, store, env=env, generation=generation
        )
    except BaseException:
        store.close()
        raise
    # Closed at shutdown; rank 0's server waits for every rank first.
    agreed = dataclasses.replace(agreed, owns_store=True, hosts_server=store.server is not None)
    return _as_mpi(agreed, bare, f"tcp://{store.address} (rank 0's, over MPI)")


def _as_mpi(agreed: Rendezvous, bare: Rendezvous, address: str) -> Rendezvous:
    """The store's rendezvous, with who this process is as the MPI launcher says."""
    return dataclasses.replace(
        agreed,
        local_rank=bare.local_rank,
        local_world_size=bare.local_world_size,
        launcher=bare.launcher,
        address=address,
    )


def _open(
    mpi: Any, comm: Any, rank: int, size: int, seconds: float, deadline: float
) -> tuple[Any, str]:
    """Rank 0's store, joined by every rank; (None, why) on every rank if any failed."""
    from meshcomm.launch import mpi_share_store_address
    from meshcomm.store import TCPStore

    secret = new_secret() if rank == 0 else ""
    hosted: list[TCPStore] = []

    def start(host: str) -> int:
        server = TCPStore(
            host, 0, size, is_master=True, timeout=seconds, wait_for_workers=False, secret=secret
        )
        hosted.append(server)
        return int(server.port)

    store: TCPStore | None = None
    why = ""
    try:
        host, port = mpi_share_store_address(rank, size, deadline, start)
        secret = _bcast_secret(mpi, comm, secret, deadline)
        store = hosted[0] if hosted else TCPStore(host, port, size, timeout=seconds, secret=secret)
    except (MeshCommError, OSError) as exc:
        why = f"rank {rank}: {exc}"
    # Every rank must learn whether every other one joined, or a rank with a store would
    # wait in the rendezvous for one without until the timeout.
    joined = _all_joined(mpi, comm, store is not None, deadline)
    if store is not None and not joined:
        store.close()
        store = None
    for server in hosted:
        if server is not store:
            server.close()
    return store, why or "a rank could not join rank 0's store"


def _bcast_secret(mpi: Any, comm: Any, secret: str, deadline: float) -> str:
    buf = bytearray(_SECRET_BYTES)
    raw = secret.encode()
    buf[: len(raw)] = raw
    _mpi_wait(comm.Ibcast([buf, mpi.BYTE], root=0), deadline, "store secret broadcast")
    return bytes(buf).rstrip(b"\0").decode()


def _all_joined(mpi: Any, comm: Any, mine: bool, deadline: float) -> bool:
    send = array.array("i", [1 if mine else 0])
    recv = array.array("i", [0])
    _mpi_wait(comm.Iallreduce([send, mpi.INT], [recv, mpi.INT], op=mpi.MIN), deadline, "join check")
    return recv[0] == 1
