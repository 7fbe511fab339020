"""Notebook runs under nbmake: kernels (and their ipyparallel clusters) get a temporary
IPYTHONDIR, so profiles and cluster files never land in the user's ~/.ipython."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_STATE: dict[str, str | None] = {}


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "dir" not in _STATE:
        _STATE["old"] = os.environ.get("IPYTHONDIR")
        _STATE["dir"] = tempfile.mkdtemp(prefix="meshcomm-ipython-")
        os.environ["IPYTHONDIR"] = _STATE["dir"]


def pytest_unconfigure(config: pytest.Config) -> None:
    path = _STATE.pop("dir", None)
    if path is None:
        return
    old = _STATE.pop("old", None)
    if old is None:
        os.environ.pop("IPYTHONDIR", None)
    else:
        os.environ["IPYTHONDIR"] = old
    shutil.rmtree(path, ignore_errors=True)
