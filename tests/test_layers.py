"""The layers of the house stay honest: no import circles, a small top level, short modules.

The test reads ``meshcomm/`` with :mod:`ast` (nothing is imported) and builds the graph of
imports between its modules:

- a **module-level** import is one that runs when the module is imported: at the top, in a
  module-level ``if``/``try``/``with`` or in a class body. Imports under ``if TYPE_CHECKING:``
  are type-only and never run, so they are not edges.
- a **lazy** import is one inside a function body; it runs on first call.

``import a.b`` is an edge to ``a.b``; ``from a import b`` is an edge to ``a.b`` when that is a
module, else to ``a``, or to the module ``a`` re-exports ``b`` from lazily (a package whose
``__init__`` names ``b`` only under ``TYPE_CHECKING`` or in a ``_LAZY`` table and resolves it
in ``__getattr__``). The parent packages Python initialises on the way are not edges, as in
import-linter and pydeps: every module would otherwise depend on ``meshcomm/__init__``.

Run it as a script for the report (strongly connected components, lazy back-edges, layers);
``--lazy`` also lists every function-level import::

    python tests/test_layers.py [--lazy]
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

__all__ = [
    "KNOWN_LAZY_BACK_EDGES",
    "KNOWN_TYPE_ONLY_UPWARD",
    "LAYERS",
    "Edge",
    "import_graph",
    "layer_of",
    "lazy_back_edges",
    "module_lines",
    "strongly_connected",
    "type_only_circles",
    "type_only_edges",
]

PACKAGE = Path(__file__).resolve().parent.parent / "meshcomm"

MAX_TOP_LEVEL_MODULES = 15
MAX_MODULE_LINES = 800

# Bottom to top. A module may import, at module level, only modules of its own layer or of a
# lower one. The longest prefix that matches a module's dotted name gives its layer: a few
# leaf modules filed under a higher folder (their readers live there) serve the layers below.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "base",
        (
            "meshcomm.errors",
            "meshcomm.common",
            "meshcomm.reduction",
            "meshcomm.group.arrays",  # array kinds and dtypes, read by every backend
        ),
    ),
    ("store", ("meshcomm.store",)),
    (
        "launch",  # what a launcher tells its ranks: the environment, and notes on each rank
        (
            "meshcomm.launch",
            "meshcomm.topology",  # this host's GPU links, read with the launch's local ranks
            "meshcomm.launcher.exit_notes",  # read by the tcp backend's blame
            "meshcomm.launcher.processes",
        ),
    ),
    ("backends", ("meshcomm.backends",)),
    ("rendezvous", ("meshcomm.rendezvous",)),
    ("diagnostics", ("meshcomm.diagnostics", "meshcomm.trace")),
    ("group", ("meshcomm.group", "meshcomm.work")),
    # The default world: its group, made from the rendezvous (the mesh's default group).
    ("world", ("meshcomm.world",)),
    ("mesh", ("meshcomm.mesh",)),
    (
        "api",
        (
            "meshcomm.ops",
            "meshcomm.distributed",
            "meshcomm.c10d",
            "meshcomm.elastic",  # re-forms the world and the mesh after a loss
            "meshcomm.backends.conformance",  # the conformance suite drives a ProcessGroup
            # torch's entry point for the c10d backend: imports nothing, makes c10d on use.
            "meshcomm.common.torch_autoload",
        ),
    ),
    (
        "tools",
        (
            "meshcomm",
            "meshcomm.launcher",
            "meshcomm.info",
            "meshcomm.spawn",
            "meshcomm.run",
            "meshcomm.run_mpi",
            "meshcomm.bench",
            "meshcomm.testing",
            "meshcomm.jupyter",
        ),
    ),
)

# Lazy imports that close a circle, left on purpose or owned by work in progress:
KNOWN_LAZY_BACK_EDGES: tuple[tuple[str, str], ...] = (
    # DeviceMesh.to_torch is a convenience for meshcomm.c10d.to_torch_mesh (the mesh layer
    # does not need torch; the call does).
    ("meshcomm.mesh", "meshcomm.c10d"),
)

# Type-only imports of a higher layer, still to be cut by a Protocol:
KNOWN_TYPE_ONLY_UPWARD: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Edge:
    """One import of one meshcomm module by another.

    Attributes:
        source: Dotted name of the importing module.
        target: Dotted name of the imported module.
        line: Line of the import statement in ``source``.
        lazy: True when the import sits in a function body (runs on first call).
    """

    source: str
    target: str
    line: int
    lazy: bool


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" not in path.parts:
            found[_module_name(path)] = path
    return found


@cache
def _tree(name: str) -> ast.Module:
    path = _modules()[name]
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _imports(
    body: Iterable[ast.stmt], *, lazy: bool, type_only: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool, bool]]:
    """Yields (statement, lazy, type_only) for every import below ``body``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy, type_only
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _imports(node.body, lazy=True, type_only=type_only)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.body, lazy=lazy, type_only=True)
            yield from _imports(node.orelse, lazy=lazy, type_only=type_only)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    stmts = [c for c in children if isinstance(c, ast.stmt)]
                    nested = [c for c in children if not isinstance(c, ast.stmt)]
                    yield from _imports(stmts, lazy=lazy, type_only=type_only)
                    for child in nested:  # except handlers, match cases
                        yield from _imports(child.body, lazy=lazy, type_only=type_only)


def _absolute(name: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    is_package = _modules()[name].name == "__init__.py"
    base = name.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def _lazy_exports(package: str) -> Mapping[str, str]:
    """Names a package's ``__init__`` re-exports lazily, with the module defining each."""
    if _modules().get(package) is None or _modules()[package].name != "__init__.py":
        return {}
    tree = _tree(package)
    defined = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    } | {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    exports: dict[str, str] = {}
    for node, _lazy, type_only in _imports(tree.body, lazy=False):
        if type_only and isinstance(node, ast.ImportFrom):
            source = _absolute(package, node)
            for alias in node.names:
                exports.setdefault(alias.asname or alias.name, source)
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
                    exports[str(key.value)] = str(value.value)
    return {k: v for k, v in exports.items() if k not in defined}


def _resolve(module: str, attribute: str) -> str | None:
    """The meshcomm module ``from module import attribute`` runs, or None if outside."""
    modules = _modules()
    if f"{module}.{attribute}" in modules:
        return f"{module}.{attribute}"
    lazy = _lazy_exports(module).get(attribute)
    if lazy is not None and lazy != module:
        return _resolve_module(lazy) or module
    return _resolve_module(module)


def _resolve_module(dotted: str) -> str | None:
    modules = _modules()
    while dotted:
        if dotted in modules:
            return dotted
        dotted = dotted.rpartition(".")[0]
    return None


@cache
def import_graph() -> tuple[Edge, ...]:
    """Every import of a meshcomm module by a meshcomm module, type-only ones left out.

    Returns:
        The edges, module-level and lazy, in module then line order.

    Example:
        >>> any(e.source == "meshcomm.world" for e in import_graph())
        True
    """
    edges: list[Edge] = []
    for name in _modules():
        for node, lazy, type_only in _imports(_tree(name).body, lazy=False):
            if not type_only:
                edges.extend(Edge(name, t, node.lineno, lazy) for t in _targets(name, node))
    return tuple(edges)


def _targets(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        targets = [_resolve_module(alias.name) for alias in node.names]
    else:
        base = _absolute(name, node)
        targets = [_resolve(base, alias.name) for alias in node.names]
    return [t for t in dict.fromkeys(targets) if t is not None and t != name]


def strongly_connected(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit).

    Args:
        nodes: Every vertex.
        edges: (from, to) pairs.

    Returns:
        The components with more than one vertex, each sorted, largest first.

    Example:
        >>> strongly_connected("abc", [("a", "b"), ("b", "a"), ("b", "c")])
        [['a', 'b']]
    """
    successors: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in edges:
        successors.setdefault(a, []).append(b)
        successors.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root, root_children in successors.items():
        if root in index:
            continue
        work = [(root, iter(root_children))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            vertex, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(successors[child])))
                elif child in on_stack:
                    low[vertex] = min(low[vertex], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[vertex])
            if low[vertex] == index[vertex]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == vertex:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components, key=lambda c: (-len(c), c))


def type_only_edges() -> list[Edge]:
    """Module-level imports under ``if TYPE_CHECKING:`` (annotations only; never run).

    Example:
        >>> all(not e.lazy for e in type_only_edges())
        True
    """
    edges = []
    for name in _modules():
        for node, lazy, type_only in _imports(_tree(name).body, lazy=False):
            if type_only and not lazy:
                for target in _targets(name, node):
                    edges.append(Edge(name, target, node.lineno, lazy))
    return edges


def type_only_circles() -> list[list[str]]:
    """Circles that close only through type-only imports: no cost at run time, but a reader
    of the lower module still has to know the upper one (a Protocol in a leaf module cuts them).

    Example:
        >>> isinstance(type_only_circles(), list)
        True
    """
    edges = [(e.source, e.target) for e in import_graph() if not e.lazy]
    edges += [(e.source, e.target) for e in type_only_edges()]
    return strongly_connected(_modules(), edges)


def _module_level_cycles() -> list[list[str]]:
    edges = [(e.source, e.target) for e in import_graph() if not e.lazy]
    return strongly_connected(_modules(), edges)


def _reaches(edges: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    successors: dict[str, set[str]] = {}
    for a, b in edges:
        successors.setdefault(a, set()).add(b)
    reach: dict[str, set[str]] = {}
    for start in _modules():
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in successors.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    return reach


def lazy_back_edges() -> list[Edge]:
    """Lazy imports that close a circle: their target imports their source at module level.

    Such an import is a circle in spirit (the upper module reached from below at run time);
    each is a candidate for a parameter, a callback or a registration instead.

    Returns:
        The lazy edges whose target reaches their source through module-level imports.

    Example:
        >>> all(e.lazy for e in lazy_back_edges())
        True
    """
    reach = _reaches((e.source, e.target) for e in import_graph() if not e.lazy)
    return [e for e in import_graph() if e.lazy and e.source in reach[e.target]]


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of a module's layer (bottom is 0).

    Example:
        >>> LAYERS[layer_of("meshcomm.store.tcp")][0]
        'store'
    """
    best = (-1, -1)
    for position, (_name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            # The package itself is a layer of its own, not a prefix of every module.
            inside = prefix != "meshcomm" and module.startswith(prefix + ".")
            if module == prefix or inside:
                best = max(best, (len(prefix), position))
    if best[1] < 0:
        raise LookupError(f"{module} is in no layer of tests/test_layers.py")
    return best[1]


def module_lines() -> dict[str, int]:
    """Line count of every meshcomm module.

    Example:
        >>> module_lines()["meshcomm.errors"] > 0
        True
    """
    return {
        name: len(path.read_text(encoding="utf-8").splitlines())
        for name, path in _modules().items()
    }


def _upward(edges: Iterable[Edge]) -> list[Edge]:
    return [e for e in edges if layer_of(e.target) > layer_of(e.source)]


def test_no_module_level_import_cycle() -> None:
    cycles = _module_level_cycles()
    assert cycles == [], "import circles among module-level imports:\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_module_level_imports_go_down_the_layers() -> None:
    upward = _upward(e for e in import_graph() if not e.lazy)
    assert upward == [], "module-level imports of a higher layer:\n" + "\n".join(
        f"{e.source}:{e.line} -> {e.target}" for e in upward
    )


def test_every_module_has_a_layer() -> None:
    for name in _modules():
        layer_of(name)


def test_top_level_is_small() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_no_new_lazy_back_edge() -> None:
    # A lazy import that closes a circle is a circle in spirit; these are the known ones.
    found = {(e.source, e.target) for e in lazy_back_edges()}
    new = sorted(found - set(KNOWN_LAZY_BACK_EDGES))
    assert new == [], (
        "lazy imports that close a circle (pass the upper module's function down, or "
        f"register it from above): {new}"
    )


def test_type_only_imports_go_down_the_layers() -> None:
    # A type-only reference to a higher layer goes through a Protocol in a leaf module
    # instead (GroupView, OrderedMesh, StagedCall); within a layer (a mixin naming its
    # class) it may stay.
    upward = {(e.source, e.target) for e in _upward(type_only_edges())}
    new = sorted(upward - set(KNOWN_TYPE_ONLY_UPWARD))
    assert new == [], f"type-only imports of a higher layer (type against a Protocol): {new}"


def _over_limit() -> dict[str, int]:
    return {n: c for n, c in module_lines().items() if c > MAX_MODULE_LINES}


def test_no_module_is_over_800_lines() -> None:
    assert _over_limit() == {}, "split these modules by what they do"


def _report(lazy: bool) -> None:
    graph = import_graph()
    print(f"modules: {len(_modules())}, top level: {len(list(PACKAGE.glob('*.py')))}")
    print(
        f"edges: {sum(not e.lazy for e in graph)} module-level, {sum(e.lazy for e in graph)} lazy"
    )
    cycles = _module_level_cycles()
    print(f"module-level circles: {len(cycles)}")
    for cycle in cycles:
        print(f"  ({len(cycle)}) " + " ".join(cycle))
    everything = strongly_connected(_modules(), [(e.source, e.target) for e in graph])
    print(f"circles counting lazy imports: {len(everything)}")
    for cycle in everything:
        print(f"  ({len(cycle)}) " + " ".join(cycle))
    typed = type_only_circles()
    print(f"circles counting type-only imports: {len(typed)}")
    for cycle in typed:
        print(f"  ({len(cycle)}) " + " ".join(cycle))
    back = lazy_back_edges()
    print(f"lazy back-edges: {len(back)}")
    for e in back:
        print(f"  {e.source}:{e.line} -> {e.target}")
    upward = _upward(e for e in graph if not e.lazy)
    print(f"module-level upward imports: {len(upward)}")
    for e in upward:
        print(f"  {e.source}:{e.line} -> {e.target}")
    typed_up = _upward(type_only_edges())
    print(f"type-only upward imports: {len(typed_up)}")
    for e in typed_up:
        print(f"  {e.source}:{e.line} -> {e.target}")
    lazy_up = _upward(e for e in graph if e.lazy)
    print(f"function-level upward imports: {len(lazy_up)}")
    for e in lazy_up:
        print(f"  {e.source}:{e.line} -> {e.target}")
    print(f"over {MAX_MODULE_LINES} lines: {_over_limit()}")
    if lazy:
        print("function-level imports:")
        for e in graph:
            if e.lazy:
                print(f"  {e.source}:{e.line} -> {e.target}")


if __name__ == "__main__":
    _report(lazy="--lazy" in sys.argv[1:])
    sys.exit(0)
