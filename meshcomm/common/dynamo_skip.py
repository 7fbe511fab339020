"""Keep torch's compiler (Dynamo) out of meshcomm's communication code.

A group call or a ``meshcomm.distributed`` call inside a function that ``torch.compile``
compiles (``fullgraph=False``) or ``torch._dynamo.explain`` explains would otherwise be traced
into: Dynamo would turn meshcomm's numpy code into graphs over fake tensors and, at each graph
break, compile the next of meshcomm's own frames while the collective runs for real. A
failure of that compilation (``Dynamo failed to run FX node with fake tensors: ...
np.copyto``) then escaped from the middle of a collective and failed the group for good.

Once ``torch._dynamo`` is loaded, :func:`arm` adds the files of meshcomm's communication code
to Dynamo's skip list. Dynamo then breaks the graph where compiled code calls into them, and
the call runs eagerly, on real tensors, with none of its frames compiled. It never imports
torch: an import hook waits for whoever loads Dynamo, and eager code pays nothing.

What stays traceable: :mod:`meshcomm.ops` (torch operators, traced by design), the mesh
(``with mesh:``, axis lookups), the plain data modules (errors, reduce ops) and the torch
group's names (:mod:`meshcomm.c10d._names`: torch's functional collectives read
``group.group_name`` in compiled code).

Example:
    >>> arm()  # at import of meshcomm.work; idempotent
    >>> skipped_paths()[0].endswith(("/", ".py"))
    True
"""

from __future__ import annotations

import os
import pkgutil
import sys
from typing import Any

from meshcomm.common.after_import import after_import

__all__ = ["arm", "register", "skipped_paths"]

#: The module whose loading arms the skip list: Dynamo's rules, complete once it has run.
_RULES = "torch._dynamo.trace_rules"

#: The modules and packages Dynamo may trace (paths under meshcomm/); everything else is skipped.
TRACEABLE = frozenset(
    {"__init__", "ops", "mesh/__init__", "mesh/drawing", "errors", "reduction", "c10d/_names"}
)

_DONE: list[bool] = []


def skipped_paths() -> list[str]:
    """The files (``.py``) and package folders (ending in ``/``) Dynamo must not trace."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return sorted(_skipped_under(root, ""))


def _skipped_under(folder: str, prefix: str) -> list[str]:
    """The skipped paths of one package folder; ``prefix``: its path under meshcomm."""
    paths = []
    for info in pkgutil.iter_modules([folder]):
        name = prefix + info.name
        path = os.path.join(folder, info.name)
        if name in TRACEABLE:
            continue
        if info.ispkg and any(t.startswith(name + "/") for t in TRACEABLE):
            # partly traceable: decide per module inside
            if name + "/__init__" not in TRACEABLE:
                paths.append(os.path.join(path, "__init__.py"))
            paths += _skipped_under(path, name + "/")
            continue
        paths.append(path + os.sep if info.ispkg else path + ".py")
    return paths


def register() -> None:
    """Add :func:`skipped_paths` to Dynamo's skip list now (Dynamo must be loaded; once).

    A torch whose rules lack the skip list (none known) keeps tracing meshcomm as before.
    """
    if _DONE:
        return
    rules: Any = sys.modules.get(_RULES)
    if rules is None:
        return
    skip_dirs = getattr(rules, "SKIP_DIRS", None)
    recompile = getattr(rules, "_recompile_re", None)
    if not isinstance(skip_dirs, list) or recompile is None:
        return
    _DONE.append(True)
    skip_dirs.extend(p for p in skipped_paths() if p not in skip_dirs)
    recompile()


def arm() -> None:
    """Register now if Dynamo is loaded, else as soon as it is (an import hook)."""
    if not _DONE:
        after_import(_RULES, register)
