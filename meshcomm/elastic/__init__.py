"""A mesh that survives a lost rank: shrink, restore the last committed step, go on.

:class:`ElasticMesh` re-forms the world and the N-D mesh among the survivors when a rank
dies; :class:`Manager` turns that into one call around a training loop (commit after each
good step, on a failure shrink, restore and retry). Run under ``meshrun --elastic``. See
docs/elastic.md.
"""

from __future__ import annotations

from meshcomm.elastic.elastic_mesh import ElasticMesh
from meshcomm.elastic.manager import Manager

__all__ = ["ElasticMesh", "Manager"]
