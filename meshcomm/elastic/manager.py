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

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from meshcomm import world
from meshcomm.elastic.elastic_mesh import ElasticMesh
from meshcomm.errors import CommError, LeftTheMesh
from meshcomm.mesh import DeviceMesh

__all__ = ["Manager"]

State = dict[str, Any]
Step = Callable[[DeviceMesh, State, int], Mapping[str, Any]]


def _copy(state: Mapping[str, Any]) -> State:
    return {k: np.array(v, copy=True) for k, v in state.items()}


class Manager:
    """Runs a step function over an :class:`ElasticMesh`, surviving lost ranks.

    Args:
        elastic: the mesh.
        state: the starting state (a dict of arrays); copied.
        step: the number of the first step.

    Attributes:
        elastic: the mesh.
        step: the next step to run (= the steps committed).
        history: ``(step, members)`` of each committed step: the ranks (of the first
            world) that ran it, for checking a run against a reference.
        recoveries: how many times the mesh shrank.
    """

    def __init__(self, elastic: ElasticMesh, state: Mapping[str, Any], step: int = 0) -> None:
        self.elastic = elastic
        self.step = step
        self._state = _copy(state)
        self._previous: tuple[int, State] | None = None
        self.history: list[tuple[int, tuple[int, ...]]] = []
        self.recoveries = 0

    @property
    def state(self) -> State:
        """The last committed state (a copy)."""
        return _copy(self._state)

    def run(self, step: Step, steps: int) -> State | None:
        """Run ``step`` until ``steps`` steps are committed.

        Returns:
            The final state, or None on a rank that left the mesh (its unit lost a member).

        Raises:
            NoValidMesh: no unit of the mesh remains whole.
            Exception: whatever ``step`` raises other than a ``CommError``.
        """
        while self.step < steps:
            try:
                new = _copy(step(self.elastic.mesh, _copy(self._state), self.step))
                world.get_world().all_reduce(np.ones(1, np.int8))  # the vote
            except CommError as exc:
                try:
                    self._recover(exc)
                except LeftTheMesh:
                    return None
                continue
            self._previous = (self.step, self._state)
            self._state = new
            self.history.append((self.step, self.elastic.members))
            self.step += 1
        return self.state

    def _recover(self, error: BaseException) -> None:
        """Shrink, then go back to the last step every survivor committed."""
        self.elastic.shrink(error)
        self.recoveries += 1
        agreed = int(world.get_world().all_reduce(np.array([self.step], np.int64), "min")[0])
        if agreed == self.step:
            return
        if self._previous is None or agreed != self.step - 1:  # pragma: no cover - by the vote
            raise CommError(
                f"rank {self.elastic.rank}: the survivors committed step {agreed}, this rank "
                f"{self.step}: more than one apart"
            )
        self.step, self._state = self._previous
        self._previous = None
        self.history.pop()
