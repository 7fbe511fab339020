"""Run a function once a module has been imported by someone else, without importing it.

meshcomm readies itself for torch's compiler (its operators, Dynamo's skip list) only once
``torch._dynamo`` is loaded: importing it costs 1.5 s that code which never compiles should
not pay, and it must be ready before Dynamo first meets meshcomm's code. :func:`after_import`
runs the function at once if the module is loaded, else right after whoever loads it
finishes loading it, through an import hook on ``sys.meta_path`` that finds nothing itself.

Example:
    >>> seen = []
    >>> after_import("json", lambda: seen.append("json"))
    >>> seen
    ['json']
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["after_import"]


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback`` once module ``name`` is loaded: now, or right after its import.

    ``callback`` must not raise into the importer: an exception it raises is swallowed
    there (the import must not fail because of meshcomm), so it should leave itself able
    to run again later.
    """
    if name in sys.modules:
        callback()
        return
    for finder in sys.meta_path:
        if isinstance(finder, _Waiting) and finder.name == name:
            finder.callbacks.append(callback)
            return
    # First: a finder placed before it that finds this name would keep ours unasked.
    sys.meta_path.insert(0, _Waiting(name, callback))


class _Waiting(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``name`` to call back after it ran."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callbacks = name, [callback]

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _CallAfter(spec.loader, self.callbacks)
        return spec


class _CallAfter(importlib.abc.Loader):
    def __init__(self, inner: Any, callbacks: list[Callable[[], None]]) -> None:
        self._inner, self._callbacks = inner, callbacks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        for callback in self._callbacks:
            try:
                callback()
            except Exception:  # the import must not fail because of us
                continue
