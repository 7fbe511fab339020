"""Pytrees for ``meshcomm.ops``: map a collective over the leaves of dicts, lists and tuples,
coalescing leaves of one dtype into one transfer.

A *pytree* is a leaf (an array, or anything ``np.asarray`` accepts: a scalar), or a dict,
list, tuple or namedtuple of pytrees, or None (no leaves). As in JAX, lists and tuples are
containers, not arrays: ``psum([1.0, 2.0], "x")`` returns a list of two 0-d arrays; pass
``np.asarray([1.0, 2.0])`` for one array. Dict leaves are visited in sorted key order, so
ranks that built their dicts in different orders still agree on what each transfer holds.

Coalescing: an op over a tree issues **one transfer per dtype**: the leaves of that dtype
are packed into one contiguous buffer (rank-major blocks where the op needs them), moved
by one group collective, and cut back into the leaves. A dtype with a single leaf is
passed to the group as is (no packing copy).

Array kinds: each leaf comes back as the kind it went in as (numpy, cupy, torch tensors
on CPU or CUDA, jax arrays; mixed kinds in one tree allowed), on its device, through
:mod:`meshcomm.ops._native`. :func:`array_namespace` names the library packing uses: cupy
arrays (and CUDA tensors and jax GPU arrays, seen as cupy) are packed with cupy and handed
to the group as they are, for a backend that takes them, such as nccl.

Example:
    >>> leaves, treedef = tree_flatten({"b": [1, 2], "a": None, "c": (3,)})
    >>> leaves
    [1, 2, 3]
    >>> tree_unflatten(treedef, [10, 20, 30])
    {'b': [10, 20], 'a': None, 'c': (30,)}
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from meshcomm.group.arrays import as_array, check_dtype
from meshcomm.ops._calls import Collectives, NotedGroup, tree_words
from meshcomm.ops._native import Rewrap, unwrap
from meshcomm.work import Work

__all__ = [
    "Kernel",
    "TreeDef",
    "array_namespace",
    "as_leaf",
    "run",
    "then",
    "tree_flatten",
    "tree_leaves",
    "tree_unflatten",
]


@dataclass(frozen=True, eq=False)
class TreeDef:
    """The structure of a pytree without its leaves.

    :func:`tree_flatten` makes each structure once and hands out the same object for it
    afterwards (training code passes the same few trees on every step), so comparing and
    hashing a structure seen before costs one look-up, not a walk over it; two structures
    are equal when they have the same form, made by :func:`tree_flatten` or not.

    Attributes:
        kind: "leaf", "none", "dict", "list", "tuple" or "namedtuple".
        children: the sub-structures, in flattening order.
        keys: dict keys in flattening order (sorted when sortable); original key order in
            ``order`` so the rebuilt dict looks like the input.
        node_type: the namedtuple class, for "namedtuple".

    Example:
        >>> tree_flatten({"a": 1, "b": [2]})[1] is tree_flatten({"a": 5, "b": [6]})[1]
        True
        >>> tree_flatten([1])[1] == TreeDef("list", (TreeDef("leaf"),))
        True
    """

    kind: str
    children: tuple[TreeDef, ...] = ()
    keys: tuple[Any, ...] = ()
    order: tuple[Any, ...] = ()
    node_type: type | None = None
    _hash: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        form = (self.kind, self.children, self.keys, self.order, self.node_type)
        object.__setattr__(self, "_hash", hash(form))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:  # made again: a str's hash differs per process
        return (TreeDef, (self.kind, self.children, self.keys, self.order, self.node_type))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, TreeDef):
            return NotImplemented
        return self._hash == other._hash and (
            self.kind,
            self.children,
            self.keys,
            self.order,
            self.node_type,
        ) == (other.kind, other.children, other.keys, other.order, other.node_type)

    @property
    def num_leaves(self) -> int:
        """How many leaves the structure holds."""
        if self.kind == "leaf":
            return 1
        return sum(c.num_leaves for c in self.children)


_LEAF = TreeDef("leaf")
_NONE = TreeDef("none")
_CONTAINERS = (dict, list, tuple)
# The structures made so far, by their kind, keys and the identities of their children (a
# key's children are alive as long as the structure holding them is kept here). Bounded: a
# program whose trees never repeat gets new structures once this is full, equal but not the
# same objects.
_TREES: dict[tuple[Any, ...], TreeDef] = {}
# A dict's keys in flattening order, by their order in the dict.
_SORTED: dict[tuple[Any, ...], tuple[Any, ...]] = {}
_MAX = 4096


def _node(
    kind: str,
    kids: list[TreeDef],
    keys: tuple[Any, ...] = (),
    order: tuple[Any, ...] = (),
    node_type: type | None = None,
) -> TreeDef:
    """The structure of one container, the same object each time it is seen (if it fits)."""
    key = (kind, keys, order, node_type, *map(id, kids))
    found = _TREES.get(key)
    if found is None:
        found = TreeDef(kind, tuple(kids), keys, order, node_type)
        if len(_TREES) < _MAX:
            _TREES[key] = found
    return found


def _sorted_keys(order: tuple[Any, ...]) -> tuple[Any, ...]:
    keys = _SORTED.get(order)
    if keys is None:
        try:
            keys = tuple(sorted(order))
        except TypeError:
            keys = order
        if len(_SORTED) < _MAX:
            _SORTED[order] = keys
    return keys


def tree_flatten(tree: Any) -> tuple[list[Any], TreeDef]:
    """Return the leaves of ``tree`` (depth first) and its structure.

    Example:
        >>> tree_flatten((1, [2, {"y": 3, "x": 4}]))[0]
        [1, 2, 4, 3]
    """
    leaves: list[Any] = []
    return leaves, _flatten(tree, leaves)


def _flatten(tree: Any, leaves: list[Any]) -> TreeDef:
    if tree is None:
        return _NONE
    keys: tuple[Any, ...] = ()
    order: tuple[Any, ...] = ()
    node_type: type | None = None
    values: Any
    if isinstance(tree, dict):
        kind = "dict"
        order = tuple(tree)
        keys = _sorted_keys(order)
        values = [tree[k] for k in keys]
    elif isinstance(tree, tuple) and hasattr(type(tree), "_fields"):
        kind, node_type, values = "namedtuple", type(tree), tree
    elif isinstance(tree, (list, tuple)):
        kind, values = ("list" if isinstance(tree, list) else "tuple"), tree
    else:
        leaves.append(tree)
        return _LEAF
    kids: list[TreeDef] = []
    for value in values:  # leaves inline: most children are leaves
        if value is None:
            kids.append(_NONE)
        elif isinstance(value, _CONTAINERS):
            kids.append(_flatten(value, leaves))
        else:
            leaves.append(value)
            kids.append(_LEAF)
    return _node(kind, kids, keys, order, node_type)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` alone, depth first (no structure made).

    Example:
        >>> tree_leaves({"b": [1, None], "a": (2,)})
        [2, 1]
    """
    leaves: list[Any] = []
    _leaves(tree, leaves)
    return leaves


def _leaves(tree: Any, leaves: list[Any]) -> None:
    values: Any = tree
    if isinstance(tree, dict):
        values = [tree[k] for k in _sorted_keys(tuple(tree))]
    elif tree is None:
        return
    elif not isinstance(tree, (list, tuple)):
        leaves.append(tree)
        return
    for value in values:
        if isinstance(value, _CONTAINERS):
            _leaves(value, leaves)
        elif value is not None:
            leaves.append(value)


def tree_unflatten(treedef: TreeDef, leaves: Sequence[Any]) -> Any:
    """Rebuild a pytree of ``treedef``'s structure from ``leaves``.

    Example:
        >>> _, treedef = tree_flatten([0, (0, 0)])
        >>> tree_unflatten(treedef, "abc")
        ['a', ('b', 'c')]
    """
    it = iter(leaves)
    return _unflatten(treedef, it)


def _unflatten(treedef: TreeDef, it: Any) -> Any:
    kind = treedef.kind
    if kind == "leaf":
        return next(it)
    if kind == "none":
        return None
    kids = [_unflatten(c, it) for c in treedef.children]
    if kind == "dict":
        by_key = dict(zip(treedef.keys, kids, strict=True))
        return {k: by_key[k] for k in treedef.order}
    if kind == "namedtuple":
        assert treedef.node_type is not None
        return treedef.node_type(*kids)
    return kids if kind == "list" else tuple(kids)


def array_namespace(x: Any) -> ModuleType:
    """Return the array module of ``x``: ``cupy`` for cupy arrays, else ``numpy``.

    The hook for GPU arrays: packing and unpacking use this module, so a cupy array is
    never copied to the host here.

    Example:
        >>> array_namespace(np.zeros(2)).__name__
        'numpy'
    """
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy  # only reached with a cupy array in hand

        return cupy
    return np


def as_leaf(x: Any, where: str) -> Any:
    """Return a leaf as an array of its own library, checking the dtype.

    numpy arrays pass through (no copy); scalars and other array-likes become numpy arrays;
    cupy arrays stay cupy arrays.

    Raises:
        TypeError: unsupported dtype, or not an array.

    Example:
        >>> as_leaf(3, "psum").dtype
        dtype('int64')
    """
    if type(x) is np.ndarray:  # the common case, first
        return as_array(x, where)
    if array_namespace(x) is not np:
        check_dtype(x.dtype, where)
        return x
    return as_array(x, where)


class Kernel:
    """How one op moves one leaf; subclasses fill in the hooks, :func:`run` drives them.

    ``check`` validates (and may convert) a leaf before any I/O and returns
    ``(array, meta)``. A dtype bucket with one leaf goes through ``unpacked`` (the group call
    on the array as is); buckets with several leaves are packed: each leaf becomes a 2-D
    ``(rows, k)`` block (``rows`` is 1, or the axis size for ops that cut a leaf into
    rank blocks), the blocks are concatenated along axis 1, ``call`` moves the buffer, and
    ``unpack`` cuts one leaf's columns out of the result. ``finish`` post-processes each
    leaf's result in both paths.
    """

    def check(self, arr: Any, where: str) -> tuple[Any, Any]:
        return arr, None

    def unpacked(self, group: Collectives, arr: Any, meta: Any, async_op: bool) -> Any:
        raise NotImplementedError

    def pack(self, arr: Any, meta: Any) -> Any:
        return arr.reshape(1, arr.size)

    def call(self, group: Collectives, buf: Any, async_op: bool) -> Any:
        raise NotImplementedError

    def unpack(self, result: Any, cols: slice, meta: Any) -> Any:
        raise NotImplementedError

    def finish(self, out: Any, meta: Any) -> Any:
        return out

    def needs_finish(self, meta: Any) -> bool:
        """False when ``finish`` returns its input (an async result needs no chaining)."""
        return False

    def arg_words(self, metas: list[Any]) -> tuple[tuple[str, str], ...] | None:
        """The op's own arguments that packing hides from the group call (a scatter's
        dimension, ``tiled``), as the leaves' checks resolved them, by name; None where
        the group call's arguments say it all. Part of a packed tree's signature."""
        return None

    def local(self, arr: Any, meta: Any) -> Any:
        """The result over no axes at all (an empty axis tuple): the leaf, copied."""
        return arr.copy()


@dataclass
class _Transfer:
    leaves: tuple[int, ...]
    start: Callable[[bool], Any]
    split: Callable[[Any], list[Any]]


def _unpacked(kernel: Kernel, group: Collectives, arr: Any, meta: Any) -> _Transfer:
    def start(async_op: bool) -> Any:
        return kernel.unpacked(group, arr, meta, async_op)

    def split(result: Any) -> list[Any]:
        return [kernel.finish(result, meta)]

    return _Transfer((), start, split)


def _packed(kernel: Kernel, group: Collectives, arrays: list[Any], metas: list[Any]) -> _Transfer:
    xp = array_namespace(arrays[0])
    blocks = [kernel.pack(a, m) for a, m in zip(arrays, metas, strict=True)]
    buf = xp.concatenate(blocks, axis=1)
    cuts, off = [], 0
    for b in blocks:
        cuts.append(slice(off, off + int(b.shape[1])))
        off += int(b.shape[1])

    def start(async_op: bool) -> Any:
        return kernel.call(group, buf, async_op)

    def split(result: Any) -> list[Any]:
        return [
            kernel.finish(kernel.unpack(result, c, m), m) for c, m in zip(cuts, metas, strict=True)
        ]

    return _Transfer((), start, split)


def _plan(
    kernel: Kernel, group: Collectives, arrays: list[Any], metas: list[Any]
) -> list[_Transfer]:
    """One transfer per (array library, dtype), in order of first appearance."""
    buckets: dict[Any, list[int]] = {}
    for i, arr in enumerate(arrays):
        if type(arr) is np.ndarray:  # numpy's by dtype (byte order included), the others by
            key: Any = arr.dtype  # their library and dtype
        else:
            key = (array_namespace(arr).__name__, np.dtype(arr.dtype).str)
        buckets.setdefault(key, []).append(i)
    transfers = []
    for idx in buckets.values():
        if len(idx) == 1:
            t = _unpacked(kernel, group, arrays[idx[0]], metas[idx[0]])
        else:
            t = _packed(kernel, group, [arrays[i] for i in idx], [metas[i] for i in idx])
        t.leaves = tuple(idx)
        transfers.append(t)
    return transfers


def run(
    kernel: Kernel,
    x: Any,
    where: str,
    group_of: Callable[[], Collectives | None],
    async_op: bool,
) -> Any:
    """Apply ``kernel`` to every leaf of ``x``: check all leaves, then move them.

    Args:
        kernel: the op.
        x: a pytree.
        where: the op, axis and rank, for error messages and Work labels.
        group_of: returns the axis group (None: no axes, each leaf is copied); called after
            every check passed, as it may make the group (I/O).
        async_op: return a :class:`~meshcomm.work.Work` whose ``wait()`` gives the tree.

    Returns:
        A pytree of ``x``'s structure holding the results, or a Work.
    """
    if x is not None and not isinstance(x, (dict, list, tuple)):
        return _run_leaf(kernel, x, where, group_of, async_op)
    leaves, treedef = tree_flatten(x)
    arrays, metas, backs, given = [], [], [], []
    for leaf in leaves:
        host, back = unwrap(leaf, where)
        one = as_leaf(host, where)
        given.append(one)
        arr, meta = kernel.check(one, where)
        arrays.append(arr)
        metas.append(meta)
        backs.append(back)
    rebuild: Callable[[list[Any]], Any]
    if not any(backs):
        rebuild = functools.partial(tree_unflatten, treedef)
    else:

        def rebuild(outs: list[Any]) -> Any:
            kinds = [o if b is None else b(o) for o, b in zip(outs, backs, strict=True)]
            return tree_unflatten(treedef, kinds)

    group = group_of()
    outs: list[Any]
    if group is None:
        outs = [kernel.local(a, m) for a, m in zip(arrays, metas, strict=True)]
        return _done(where, rebuild(outs)) if async_op else rebuild(outs)
    # Every transfer carries the tree as the user passed it: its words, and its structure
    # in the signature (the buffers alone would let ranks with other trees agree).
    note = (*getattr(group, "note", ()), ("tree", tree_words(treedef, given)))
    uargs = kernel.arg_words(metas)
    if uargs is not None:
        note = (*note, ("uargs", uargs))
    group = NotedGroup(group.group if isinstance(group, NotedGroup) else group, note)
    transfers = _plan(kernel, group, arrays, metas)
    if not async_op:
        outs = [None] * len(arrays)
        for t in transfers:
            for i, v in zip(t.leaves, t.split(t.start(False)), strict=True):
                outs[i] = v
        return rebuild(outs)
    works = [t.start(True) for t in transfers]
    return _combine(where, works, transfers, rebuild, len(arrays))


def _run_leaf(
    kernel: Kernel,
    x: Any,
    where: str,
    group_of: Callable[[], Collectives | None],
    async_op: bool,
) -> Any:
    """The common case, one array: no tree, no packing, at most one chained Work."""
    host, back = unwrap(x, where)
    arr, meta = kernel.check(as_leaf(host, where), where)
    group = group_of()
    if group is None:
        out = kernel.local(arr, meta)
        out = out if back is None else back(out)
        return _done(where, out) if async_op else out
    result = kernel.unpacked(group, arr, meta, async_op)
    if not async_op:
        out = kernel.finish(result, meta)
        return out if back is None else back(out)
    if not kernel.needs_finish(meta) and back is None:
        return result
    return then(where, result, _finisher(kernel, meta, back))


def _finisher(kernel: Kernel, meta: Any, back: Rewrap | None) -> Callable[[Any], Any]:
    def finish(value: Any) -> Any:
        out = kernel.finish(value, meta)
        return out if back is None else back(out)

    return finish


def then(where: str, work: Work[Any], fn: Callable[[Any], Any]) -> Work[Any]:
    """A Work that completes with ``fn(work's value)`` (or ``work``'s error) once ``work`` has.

    ``fn`` runs on the thread that completes ``work``: local work only.

    Example:
        >>> w = then("psum", _done("psum", 2), lambda v: v * 10)
        >>> w.wait()
        20
    """
    chained: Work[Any] = Work(where)

    def settle(_f: Any) -> None:
        future = chained.get_future()
        try:
            value = fn(work.get_future().result())
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(value)

    work.get_future().add_done_callback(settle)
    return chained


def _done(where: str, value: Any) -> Work[Any]:
    work: Work[Any] = Work(where)
    work.get_future().set_result(value)
    return work


def _combine(
    where: str,
    works: list[Work[Any]],
    transfers: list[_Transfer],
    rebuild: Callable[[list[Any]], Any],
    n: int,
) -> Work[Any]:
    """One Work that completes when every transfer's Work has, with the rebuilt tree."""
    out: Work[Any] = Work(where)
    if not works:
        out.get_future().set_result(rebuild([]))
        return out
    lock = threading.Lock()
    pending = [len(works)]

    def one_done(_f: Any) -> None:
        with lock:
            pending[0] -= 1
            last = pending[0] == 0
        if last:
            _settle(out, works, transfers, rebuild, n)

    for w in works:
        w.get_future().add_done_callback(one_done)
    return out


def _settle(
    out: Work[Any],
    works: list[Work[Any]],
    transfers: list[_Transfer],
    rebuild: Callable[[list[Any]], Any],
    n: int,
) -> None:
    # Runs on the progress thread (or the caller's, if everything had finished): only
    # local work here, never a wait on another operation.
    future = out.get_future()
    try:
        outs: list[Any] = [None] * n
        for w, t in zip(works, transfers, strict=True):
            for i, v in zip(t.leaves, t.split(w.get_future().result()), strict=True):
                outs[i] = v
        value = rebuild(outs)
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(value)
