"""An N-D mesh that shrinks when a rank is lost, without restarting any process.

:class:`ElasticMesh` forms the world and the mesh through the job's store (the one
``meshrun`` serves, which outlives every rank). When a collective fails because a rank
died (a ``PeerError`` naming it, or a timeout), every survivor calls :meth:`shrink`: the
survivors agree on who is alive (:mod:`meshcomm.elastic.membership`), every *unit* that
lost a member leaves (the slice of the mesh at the dead rank's coordinate on the unit
axis: for ``("dp", "tp")`` with ``unit="dp"``, the whole data-parallel replica), and the
others form a new world and the same mesh with that axis shorter. A rank of a unit that
left raises :class:`~meshcomm.errors.LeftTheMesh`; when no unit remains, every survivor
raises :class:`~meshcomm.errors.NoValidMesh`. A survivor's collective in flight when
another survivor leaves the failed world ends with :class:`~meshcomm.errors.PeerClosed`,
saying that the mesh is being re-formed (or with a ``PeerError`` naming the dead rank,
whichever it met first); a later call on the old mesh says so too.

Run it under ``meshrun --elastic`` (the launcher then lets the others go on when a rank
fails); the tcp backend, with nccl for GPU arrays (its communicators are aborted and made
again with each world); not mpi (MPICH has no ULFM: an mpi job restarts whole).

Example:
    A sketch (needs ``meshrun --elastic --nproc-per-node 8``)::

        elastic = ElasticMesh((4, 2), ("dp", "tp"), unit="dp")
        try:
            out = ops.psum(x, "dp", mesh=elastic.mesh)
        except CommError as exc:
            elastic.shrink(exc)  # now a (3, 2) mesh, or LeftTheMesh here
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from meshcomm import world
from meshcomm.backends.spec import parse_backend
from meshcomm.common.secret import job_secret
from meshcomm.common.timeout import Timeout, to_seconds
from meshcomm.elastic.joining import admit, announce_done, pending, wait_for_admission, waiting
from meshcomm.elastic.membership import agree
from meshcomm.errors import InvalidArgument, LeftTheMesh, NoValidMesh, PeerClosed, PeerError
from meshcomm.launch import ELASTIC_ENV, JOIN_ENV, detect_launch
from meshcomm.mesh import DeviceMesh, init_device_mesh

if TYPE_CHECKING:
    from meshcomm.store.base import Store

__all__ = ["ElasticMesh"]

# Stands for "a store will be given" when asking which backend init would choose.
_NO_STORE: Any = object()
# Seconds a rank waits to be let (back) into the mesh.
_JOIN_SECONDS = 300.0
# Seconds the survivors wait for a rank that has not said it is alive (at most the timeout).
_AGREE_SECONDS = 2.0


def _job_store(seconds: float) -> Store:
    """A connection of our own to the store the launcher serves (``meshrun``)."""
    from meshcomm.store import TCPStore

    info = detect_launch(os.environ)
    host, port = info.master_addr, info.master_port
    elastic = os.environ.get(ELASTIC_ENV) == "1"
    if host is None or port is None or info.store_host != "launcher" or not elastic:
        raise InvalidArgument(
            "ElasticMesh needs the store of a launcher that outlives the ranks: run under "
            "`meshrun --elastic` (or pass store=, rank= and world_size=)"
        )
    return TCPStore(host, port, timeout=seconds, secret=job_secret())


class ElasticMesh:
    """A world and a row-major N-D mesh over it that survive the loss of ranks.

    Args:
        mesh_shape: the size of each axis (as :func:`~meshcomm.init_device_mesh`).
        mesh_dim_names: one name per axis.
        unit: the axis whose slices leave together: a rank lost at coordinate ``i`` on
            this axis takes every rank at ``i`` with it. Default: the first axis.
        timeout: each world's timeout (seconds or ``timedelta``; default
            ``MESHCOMM_TIMEOUT``, else 300 s).
        agree_seconds: how long the survivors wait for a rank that says nothing before
            counting it gone (at most ``timeout``).
        store, rank, world_size: a store every rank shares and that outlives them, with
            this process's rank; default: ``meshrun --elastic``'s store and environment.
        join_seconds: how long a rank waits to be let (back) into the mesh (:meth:`join`).

    Attributes:
        members: the ranks of the first world that are in the current one, in rank order.
        rounds: how many times the mesh was re-formed (shrunk or grown).
        joined: the ranks (first-world) let in when the mesh last grew, this one among them
            when it joined then; () after a shrink.
        finished: a replacement that came after the others finished (it has no ``mesh``;
            :class:`Manager` returns None at once).

    Raises:
        InvalidArgument: a shape that is not the world's size, an unknown ``unit``, or no
            launcher store.
    """

    def __init__(
        self,
        mesh_shape: Sequence[int],
        mesh_dim_names: Sequence[str],
        *,
        unit: str | None = None,
        timeout: Timeout | None = None,
        agree_seconds: float = _AGREE_SECONDS,
        store: Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        join_seconds: float = _JOIN_SECONDS,
    ) -> None:
        shape = tuple(int(n) for n in mesh_shape)
        names = tuple(mesh_dim_names)
        if len(names) != len(shape) or any(n < 1 for n in shape):
            raise InvalidArgument(
                f"ElasticMesh: mesh_shape {shape} and mesh_dim_names {names} must pair up, "
                "every size at least 1"
            )
        unit = names[0] if unit is None else unit
        if unit not in names:
            raise InvalidArgument(f"ElasticMesh: unit {unit!r} is not one of the axes {names}")
        seconds = to_seconds(timeout)
        backend = world.choose_backend(None, store=store or _NO_STORE)
        if parse_backend(backend)[0] != "tcp":
            raise InvalidArgument(
                f"ElasticMesh needs the tcp backend (alone or with nccl for GPU arrays), got "
                f"{backend!r} (MESHCOMM_BACKEND): MPICH's wheel has no ULFM "
                "(MPIX_Comm_shrink), so an mpi world cannot go on without a rank; restart the "
                "job whole (meshrun --max-restarts)"
            )
        rank = int(os.environ.get("RANK", "0")) if rank is None else int(rank)
        size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        if int(np.prod(shape)) != size:
            raise InvalidArgument(
                f"rank {rank}: ElasticMesh shape {shape} has {int(np.prod(shape))} ranks, "
                f"the world {size}"
            )
        self._store = _job_store(seconds) if store is None else store
        self._owns_store = store is None
        self._seconds = seconds
        self._agree = min(float(agree_seconds), seconds)
        self._names, self._shape, self._axis = names, shape, names.index(unit)
        self._origin = rank
        self._first_shape = shape
        self._join_seconds = float(join_seconds)
        self.members: tuple[int, ...] = tuple(range(size))
        self.rounds = 0
        self.joined: tuple[int, ...] = ()
        self.finished = False
        self._mesh: DeviceMesh | None = None
        if os.environ.get(JOIN_ENV) == "1":  # a replacement meshrun started for a lost rank
            try:
                self.join()
            except LeftTheMesh:  # the others finished before it could join: nothing to do
                self.finished = True
        else:
            self._mesh = self._form()

    @property
    def rank(self) -> int:
        """This process's rank in the current world."""
        return self.members.index(self._origin)

    @property
    def mesh(self) -> DeviceMesh:
        """The current :class:`~meshcomm.mesh.DeviceMesh`.

        Raises:
            LeftTheMesh: a replacement that came after the others finished has none.
        """
        if self._mesh is None:
            raise LeftTheMesh(f"rank {self._origin}: the mesh finished before this rank joined")
        return self._mesh

    @property
    def unit(self) -> str:
        """The axis whose slices leave and join together."""
        return self._names[self._axis]

    @property
    def shape(self) -> tuple[int, ...]:
        """The current mesh's shape."""
        return self._shape

    def _form(self) -> DeviceMesh:
        from meshcomm.store import PrefixStore

        store = PrefixStore(f"meshcomm/elastic/world/{self.rounds}/", self._store)
        self._grow_calls = 0
        world.init(
            store=store,
            rank=self.rank,
            world_size=len(self.members),
            timeout=self._seconds,
            generation=self.rounds,
        )
        return init_device_mesh(self._shape, self._names)

    def shrink(self, error: BaseException | None = None) -> None:
        """Leave the failed world, agree with the survivors on who is alive, and form the
        smaller world and mesh. Every survivor calls it after the failure.

        Args:
            error: what the failed call raised (a ``PeerError`` names the dead rank, which
                lets the survivors decide without waiting for it).

        Raises:
            LeftTheMesh: this rank's unit lost a member (or it spoke too late).
            NoValidMesh: no unit is left whole.
        """
        me, old = self.rank, len(self.members)
        # A peer that closed to re-form the mesh (PeerClosed) is a survivor, not a death.
        seen = []
        if (
            isinstance(error, PeerError)
            and not isinstance(error, PeerClosed)
            and error.rank is not None
        ):
            seen = [error.rank]
        world.shutdown(  # device communicators abort: a collective may wait on the dead
            f"the mesh is being re-formed after a loss (round {self.rounds + 1}); go on "
            "with the ElasticMesh's mesh",
            abort=True,
        )
        alive = agree(self._store, self.rounds, me, old, seen, self._agree)
        coords = np.unravel_index(np.arange(old), self._shape)[self._axis]
        lost_units = {int(coords[r]) for r in range(old) if r not in alive}
        keep = [r for r in range(old) if int(coords[r]) not in lost_units]
        self.rounds += 1
        if not keep:
            axes = dict(zip(self._names, self._shape, strict=True))
            raise NoValidMesh(
                f"rank {me}: after round {self.rounds} no {self._names[self._axis]!r} unit of "
                f"the mesh {axes} is whole (alive: {list(alive)})"
            )
        if me not in keep:
            raise LeftTheMesh(
                f"rank {me}: its {self._names[self._axis]!r} unit {int(coords[me])} lost a "
                f"member (alive: {list(alive)} of {old}); the others go on without it"
            )
        shape = list(self._shape)
        shape[self._axis] -= len(lost_units)
        self._shape = tuple(shape)
        self.members = tuple(self.members[r] for r in keep)
        self.joined = ()
        self._mesh = self._form()

    def join(self) -> None:
        """Wait (up to ``join_seconds``) until the mesh lets this rank (back) in, then form
        the world and mesh with its members: a replacement for a lost rank, or a rank whose
        unit left, once its unit is whole again (see :mod:`meshcomm.elastic.joining`).

        Raises:
            LeftTheMesh: the mesh finished first.
            CommTimeout: not let in within ``join_seconds``.
        """
        record = wait_for_admission(self._store, self._origin, self._join_seconds)
        self.rounds = int(record["round"])
        self.members = tuple(int(r) for r in record["members"])
        self._shape = tuple(int(n) for n in record["shape"])
        self.joined = tuple(int(r) for r in record["joined"])
        self._mesh = self._form()

    def grow(self) -> tuple[int, ...]:
        """Let in every whole unit of the ranks waiting to join; every member calls it at
        the same step boundary. The current world's rank 0 decides.

        Returns:
            The first-world ranks let in (then the world and mesh are re-formed with them),
            or () when no unit is whole yet.
        """
        # A decision per call: the members call it at the same boundaries of this world.
        self._grow_calls += 1
        key = f"meshcomm/elastic/grow/{self.rounds}/{self._grow_calls}"
        if self.rank == 0:
            self._store.set(key, json.dumps(self._admissible()))
        else:
            self._store.wait([key], timeout=self._seconds)
        record = json.loads(self._store.get(key))
        if not record["joined"]:
            return ()
        world.shutdown(
            f"the mesh is being re-formed: ranks {record['joined']} join (round "
            f"{self.rounds + 1}); go on with the ElasticMesh's mesh"
        )
        self.rounds += 1
        self.members = tuple(record["members"])
        self._shape = tuple(record["shape"])
        self.joined = tuple(record["joined"])
        self._mesh = self._form()
        return self.joined

    def _admissible(self) -> dict[str, Any]:
        """Rank 0's decision: the whole units among the ranks waiting (let in at once)."""
        asked = {r for r in waiting(self._store) if r not in self.members}
        coords = np.unravel_index(np.arange(int(np.prod(self._first_shape))), self._first_shape)
        unit_of = coords[self._axis]
        units = sorted({int(unit_of[r]) for r in asked})
        whole = [u for u in units if all(r in asked for r in np.flatnonzero(unit_of == u))]
        joined = sorted(int(r) for u in whole for r in np.flatnonzero(unit_of == u))
        members = tuple(sorted((*self.members, *joined)))
        shape = list(self._shape)
        shape[self._axis] += len(whole)
        record = {"members": list(members), "shape": shape, "joined": joined}
        if joined:
            admit(self._store, self.rounds + 1, joined, members, tuple(shape))
        return record

    def waiting(self) -> int:
        """How many ranks wait to join (a store round trip)."""
        return pending(self._store)

    def finish(self) -> None:
        """Say the mesh finished (rank 0): ranks still waiting to join go home."""
        if self.rank == 0:
            announce_done(self._store)

    def close(self) -> None:
        """Leave the world (and close the store connection this object opened)."""
        world.shutdown()
        if self._owns_store:
            self._store.close()
