"""Group calls that carry what the user wrote: the mesh axes named, a packed pytree's form.

The ops layer hands the group one buffer per transfer; what the user passed (the axis names,
the pytree packed into that buffer, the op's own arguments where packing hides them) is not
in the buffer. :class:`NotedGroup` adds it, as a *note*, to the fingerprint fields of each
call: the ledger keeps it (so a mismatch or a hang report names ``psum({'b': float32[2],
'w': float32[3]}, sum) over 'tp'``, not the packed ``float32[5]``), and the parts that decide
what the bytes mean (``tree``: the structure and each leaf's dtype and shape; ``uargs``: a
packed op's own arguments) join the call's signature, so ranks that packed different trees
raise :class:`~meshcomm.errors.MismatchError` instead of reading each other's bytes wrongly.
The axes alone (``over``) are words only: the group itself is what they decide.

A note rides on the group's one route (:meth:`~meshcomm.group.issuing.Issuer.call_noted`):
on its plans (a plan per call signature and note, so a call costs what a group method's
call does) and on its host lowerings; a device call (a device backend's route) carries
none.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> g = ProcessGroup(SelfCommunicator())
    >>> noted = NotedGroup(g, (("over", "'x'"),))
    >>> noted.all_reduce(np.ones(2), "sum")
    array([1., 1.])
    >>> g.ledger()[-1]["over"]
    "'x'"
    >>> g.close()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from meshcomm.group.arrays import dtype_name
from meshcomm.group.collectives import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BROADCAST,
    PERMUTE,
    REDUCE_SCATTER,
    Collective,
)

if TYPE_CHECKING:
    from meshcomm.group import ProcessGroup

__all__ = ["Collectives", "Note", "NotedGroup", "all_reduce", "describe_tree", "tree_words"]

#: Fingerprint fields to add to a call: ``(("over", "'tp'"), ("tree", "..."), ...)``.
Note = tuple[tuple[str, Any], ...]

#: What a kernel calls its collectives on: a group, or one whose calls carry a note.
Collectives = Union["ProcessGroup", "NotedGroup"]


def all_reduce(group: ProcessGroup, x: Any, op: Any, note: Note) -> Any:
    """``group.all_reduce(x, op)`` of a numpy array with ``note`` (the ops' direct path:
    the group's one route, under a key with the note)."""
    return group._issuer.call_noted(ALL_REDUCE, note, x, False, op, None)


class NotedGroup:
    """The collectives a :class:`~meshcomm.ops.pytree.Kernel` calls, on ``group``, each
    call with ``note`` in its fingerprint fields (see the module docstring).

    Args:
        group: the axis's group.
        note: the fields to add.
    """

    __slots__ = ("group", "note")

    def __init__(self, group: ProcessGroup, note: Note) -> None:
        self.group, self.note = group, note

    def all_reduce(
        self, x: Any, op: Any = "sum", *, factor: Any = None, async_op: bool = False
    ) -> Any:
        return self._call(ALL_REDUCE, x, async_op, op, factor)

    def all_gather(
        self, x: Any, axis: int = 0, tiled: bool = False, *, async_op: bool = False
    ) -> Any:
        return self._call(ALL_GATHER, x, async_op, axis, tiled)

    def reduce_scatter(
        self, x: Any, op: Any = "sum", axis: int = 0, tiled: bool = False, *, async_op: bool = False
    ) -> Any:
        return self._call(REDUCE_SCATTER, x, async_op, op, axis, tiled, None)

    def all_to_all(
        self,
        x: Any,
        split_axis: int = 0,
        concat_axis: int = 0,
        tiled: bool = False,
        *,
        async_op: bool = False,
    ) -> Any:
        return self._call(ALL_TO_ALL, x, async_op, split_axis, concat_axis, tiled)

    def broadcast(self, x: Any, root: int = 0, *, async_op: bool = False) -> Any:
        return self._call(BROADCAST, x, async_op, root, None, None)

    def permute(self, x: Any, perm: Sequence[tuple[int, int]], *, async_op: bool = False) -> Any:
        return self._call(PERMUTE, x, async_op, perm)

    def _call(self, coll: Collective, x: Any, async_op: bool, *args: Any) -> Any:
        return self.group._issuer.call_noted(coll, self.note, x, async_op, *args)


#: Words of the trees seen, by structure and leaf dtypes and shapes (training code passes the
#: same few trees on every step; formatting one costs 5 us a leaf, its key 0.3).
_WORDS: dict[tuple[Any, ...], str] = {}
_WORDS_MAX = 1024


def tree_words(treedef: Any, leaves: Sequence[Any]) -> str:
    """:func:`describe_tree`, remembered per structure and leaf dtypes and shapes.

    Example:
        >>> from meshcomm.ops.pytree import tree_flatten
        >>> leaves, treedef = tree_flatten([np.ones(2), np.int8(1)])
        >>> tree_words(treedef, leaves) is tree_words(treedef, leaves)
        True
    """
    key = (treedef, *[(leaf.dtype, leaf.shape) for leaf in leaves])
    words = _WORDS.get(key)
    if words is None:
        words = describe_tree(treedef, leaves)
        if len(_WORDS) < _WORDS_MAX:
            _WORDS[key] = words
    return words


def describe_tree(treedef: Any, leaves: Sequence[Any]) -> str:
    """A pytree in the user's form, each leaf as its dtype and shape (dict keys sorted, as
    they are flattened: ranks that built a dict in another order agree).

    Example:
        >>> from meshcomm.ops.pytree import tree_flatten
        >>> leaves, treedef = tree_flatten({"w": np.ones((2, 3)), "b": [np.int32(1), None]})
        >>> describe_tree(treedef, leaves)
        "{'b': [int32[], None], 'w': float64[2, 3]}"
    """
    it = iter(leaves)
    return _describe(treedef, it)


def _describe(treedef: Any, it: Any) -> str:
    kind = treedef.kind
    if kind == "leaf":
        leaf = next(it)
        dims = ", ".join(str(int(d)) for d in leaf.shape)
        return f"{dtype_name(np.dtype(leaf.dtype))}[{dims}]"
    if kind == "none":
        return "None"
    kids = [_describe(c, it) for c in treedef.children]
    if kind == "dict":
        return "{" + ", ".join(f"{k!r}: {v}" for k, v in zip(treedef.keys, kids, strict=True)) + "}"
    if kind == "namedtuple":
        fields = getattr(treedef.node_type, "_fields", ())
        inner = ", ".join(f"{f}={v}" for f, v in zip(fields, kids, strict=True))
        return f"{getattr(treedef.node_type, '__name__', 'namedtuple')}({inner})"
    if kind == "list":
        return "[" + ", ".join(kids) + "]"
    return "(" + ", ".join(kids) + ("," if len(kids) == 1 else "") + ")"
