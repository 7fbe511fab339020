"""Size thresholds from the environment: the knobs that pick a collective's path by size.

Every member of a communicator must pick the same path for the same call, so each knob is
read once, at import, and must be set alike on every rank (the docs of each knob say so).

Example:
    >>> import os
    >>> os.environ["MESHCOMM_EXAMPLE_MIN"] = "0"
    >>> size_threshold("MESHCOMM_EXAMPLE_MIN", 1 << 18)  # 0 or negative: never
    -1
    >>> del os.environ["MESHCOMM_EXAMPLE_MIN"]
    >>> size_threshold("MESHCOMM_EXAMPLE_MIN", 1 << 18)  # unset: the default
    262144
"""

from __future__ import annotations

import os

from meshcomm.errors import InvalidArgument

__all__ = ["size_threshold"]


def size_threshold(name: str, default: int) -> int:
    """The smallest size (bytes) that takes a path, from environment variable ``name``.

    Args:
        name: the variable (``MESHCOMM_..._MIN``).
        default: the size when the variable is unset or empty.

    Returns:
        The size in bytes, or -1 (never) when the variable is 0 or negative.

    Raises:
        InvalidArgument: the variable is not an integer.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgument(f"{name} must be an integer number of bytes, got {raw!r}") from None
    return value if value > 0 else -1
