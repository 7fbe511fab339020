"""Waiting in tests for something another thread or process makes true."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_until"]


def wait_until(predicate: Callable[[], bool], within: float = 3.0) -> bool:
    """Poll ``predicate`` every 10 ms for ``within`` seconds; return its last answer."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
