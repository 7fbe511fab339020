"""A training loop that survives lost ranks in one call: commit, shrink, restore, retry.

:class:`Manager` runs ``step(mesh, state, i)`` for ``i = 0, 1, ...``. After each step every
rank votes (one all_reduce over the world): a rank whose vote completed knows every rank
finished the step, and commits the new state. On a failure the survivors shrink the mesh
(:class:`~meshcomm.elastic.ElasticMesh`), agree on the last step *every* survivor
committed (a rank whose vote completed may be one step ahead of one whose vote failed;
never more, since the next vote needs them all), go back to it, and run the next step
again on the smaller mesh. So no step is lost and none is applied twice. The step reads
the replica count from the mesh it is given (``mesh.size("dp")``), so averages follow it.

Example:
    A sketch (needs ``meshrun --elastic --nproc-per-node 4``)::

        def step(mesh, state, i):
            grad = local_gradient(state["w"], i, mesh)
            avg = ops.psum(grad, "dp", mesh=mesh) / mesh.size("dp")
            return {"w": state["w"] - 0.1 * avg}

        manager = Manager(ElasticMesh((4,), ("dp",)), {"w": np.zeros(8)})
        final = manager.run(step, steps=100)  # None on a rank that left the mesh
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from meshcomm import world
from meshcomm.elastic.elastic_mesh import ElasticMesh
from meshcomm.errors import CommError, LeftTheMesh
from meshcomm.mesh import DeviceMesh

__all__ = ["Manager"]

State = dict[str, Any]
# Seconds between looks at the store for ranks waiting to join.
_LOOK = 0.5
Step = Callable[[DeviceMesh, State, int], Mapping[str, Any]]


def _copy(state: Mapping[str, Any]) -> State:
    """A copy of every array, in its own kind (numpy, cupy: ``copy``; torch: ``clone``)."""
    out: State = {}
    for k, v in state.items():
        if hasattr(v, "clone"):
            out[k] = v.clone()
        elif hasattr(v, "copy"):
            out[k] = v.copy()
        else:
            out[k] = np.array(v, copy=True)
    return out


class Manager:
    """Runs a step function over an :class:`ElasticMesh`, surviving lost ranks.

    Args:
        elastic: the mesh.
        state: the starting state (a dict of arrays; on a rank that joins a running mesh,
            of the same keys, shapes and dtypes: it receives the members' values); copied.
        step: the number of the first step.
        rejoin: a rank whose unit left waits to come back when its unit is whole again (a
            replacement started by ``meshrun --elastic --max-restarts``) instead of
            returning None at once.
        look: seconds between looks at the store for ranks waiting to join (each look is a
            store round trip on every rank, at a step boundary).

    Attributes:
        elastic: the mesh.
        step: the next step to run (= the steps committed).
        history: ``(step, members)`` of each committed step: the ranks (of the first
            world) that ran it, for checking a run against a reference.
        recoveries: how many times the mesh shrank.
        growths: how many times ranks were let (back) in.
    """

    def __init__(
        self,
        elastic: ElasticMesh,
        state: Mapping[str, Any],
        step: int = 0,
        *,
        rejoin: bool = True,
        look: float = _LOOK,
    ) -> None:
        self.elastic = elastic
        self.step = step
        self._state = _copy(state)
        self._previous: tuple[int, State] | None = None
        self._rejoin = rejoin
        self._look = look
        self._looked = time.monotonic()
        self.history: list[tuple[int, tuple[int, ...]]] = []
        self.recoveries = 0
        self.growths = 0

    @property
    def state(self) -> State:
        """The last committed state (a copy)."""
        return _copy(self._state)

    def run(self, step: Step, steps: int) -> State | None:
        """Run ``step`` until ``steps`` steps are committed.

        Returns:
            The final state, or None on a rank that left the mesh (its unit lost a member)
            and was not let back in before the others finished.

        Raises:
            NoValidMesh: no unit of the mesh remains whole.
            Exception: whatever ``step`` raises other than a ``CommError``.
        """
        if self.elastic.finished:  # a replacement that came too late
            return None
        if self._origin() in self.elastic.joined:
            self._receive_state()
        while self.step < steps:
            try:
                new = _copy(step(self.elastic.mesh, _copy(self._state), self.step))
                vote = world.get_world().all_reduce(np.array([self._someone_waits()]), "max")
            except CommError as exc:
                if not self._recover(exc):
                    return None
                continue
            self._previous = (self.step, self._state)
            self._state = new
            self.history.append((self.step, self.elastic.members))
            self.step += 1
            if vote[0] and self.elastic.grow():
                self.growths += 1
                self._receive_state()
        self.elastic.finish()
        return self.state

    def _origin(self) -> int:
        return self.elastic.members[self.elastic.rank]

    def _someone_waits(self) -> int:
        """1 when the store says a rank waits to join (looked at every ``look`` seconds)."""
        now = time.monotonic()
        if now - self._looked < self._look:
            return 0
        self._looked = now
        return int(self.elastic.waiting() > 0)

    def _recover(self, error: BaseException) -> bool:
        """Shrink, then go back to the last step every survivor committed; False when this
        rank left the mesh for good."""
        try:
            self.elastic.shrink(error)
        except LeftTheMesh:
            if not self._rejoin:
                return False
            try:
                self.elastic.join()
            except LeftTheMesh:  # the others finished first
                return False
            self._receive_state()
            return True
        self.recoveries += 1
        agreed = int(world.get_world().all_reduce(np.array([self.step], np.int64), "min")[0])
        if agreed == self.step:
            return True
        if self._previous is None or agreed != self.step - 1:  # pragma: no cover - by the vote
            raise CommError(
                f"rank {self.elastic.rank}: the survivors committed step {agreed}, this rank "
                f"{self.step}: more than one apart"
            )
        self.step, self._state = self._previous
        self._previous = None
        self.history.pop()
        return True

    def _receive_state(self) -> None:
        """After ranks joined: the step and the state from the members that were there (each
        array along the unit axis, from a member of this rank's unit group)."""
        elastic, joined = self.elastic, set(self.elastic.joined)
        group = world.get_world()
        source = next(i for i, r in enumerate(elastic.members) if r not in joined)
        self.step = int(group.broadcast(np.array([self.step], np.int64), source)[0])
        axis = elastic.mesh.get_group(elastic.unit)
        root = next(i for i, g in enumerate(axis.ranks) if elastic.members[g] not in joined)
        self._state = {k: axis.broadcast(v, root) for k, v in sorted(self._state.items())}
        self._previous = None
        self.growths += self._origin() in joined
