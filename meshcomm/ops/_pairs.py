"""Permutations as ``(source, destination)`` pairs of axis indices, checked.

``ppermute`` takes its pairs as given and ``pshuffle`` a list of sources; both the eager op
(:mod:`meshcomm.ops.permutes`) and the op staged for ``torch.compile``
(:mod:`meshcomm.ops._torch_stage`) check them here, before any communication.

Example:
    >>> checked_pairs("ppermute over 'tp'", [(0, 1), (1, 0)], 2, "ppermute")
    ((0, 1), (1, 0))
    >>> shuffle_pairs("pshuffle over 'tp'", [1, 2, 0], 3)
    ((1, 0), (2, 1), (0, 2))
"""

from __future__ import annotations

import operator
from typing import Any

from meshcomm.errors import InvalidArgument

__all__ = ["checked_pairs", "shuffle_pairs"]


def checked_pairs(where: str, perm: Any, size: int, name: str) -> tuple[tuple[int, int], ...]:
    """``perm`` as ``(source, destination)`` int pairs, checked against the axis size."""
    try:
        pairs = tuple((operator.index(s), operator.index(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"{where}: perm must be a sequence of (source, destination) int pairs, got {perm!r}"
        ) from None
    for s, d in pairs:
        for role, v in (("source", s), ("destination", d)):
            if not 0 <= v < size:
                raise InvalidArgument(
                    f"{where}: perm {role} {v} is out of range: axis indices are in "
                    f"[0, {size}), perm={list(pairs)}"
                )
    srcs, dsts = [s for s, _ in pairs], [d for _, d in pairs]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise InvalidArgument(
            f"{where}: {name} sources and destinations must be unique, got {list(pairs)}"
        )
    return pairs


def shuffle_pairs(where: str, perm: Any, size: int) -> tuple[tuple[int, int], ...]:
    """``pshuffle``'s ``perm`` (index ``i`` gets the ``x`` of ``perm[i]``) as ppermute pairs."""
    try:
        sources = [operator.index(p) for p in perm]
    except TypeError:
        raise InvalidArgument(f"{where}: perm must be a sequence of ints, got {perm!r}") from None
    if sorted(sources) != list(range(size)):
        raise InvalidArgument(
            f"{where}: `perm` does not represent a permutation of range({size}) "
            f"(the axis size): {list(sources)}"
        )
    return tuple((s, i) for i, s in enumerate(sources))
