"""Debug levels: ``TORCH_DISTRIBUTED_DEBUG``, ``set_debug_level``, ``get_debug_level``.

At ``DETAIL``, meshcomm groups check before each collective that every rank calls the same
collective with the same shapes, dtypes and roots (see :mod:`meshcomm.group`), and raise
on every rank with both calls named. Groups read the level when they are made, so set it
before ``init_process_group``/``new_group`` (or in the environment).

Example:
    >>> before = get_debug_level()
    >>> set_debug_level(DebugLevel.INFO); get_debug_level()
    <DebugLevel.INFO: 1>
    >>> set_debug_level(before)
"""

from __future__ import annotations

import enum
import os

__all__ = ["DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env"]

_VAR = "TORCH_DISTRIBUTED_DEBUG"


class DebugLevel(enum.IntEnum):
    """``OFF``, ``INFO`` or ``DETAIL`` (fingerprint checks before collectives)."""

    OFF = 0
    INFO = 1
    DETAIL = 2


def _from_env() -> DebugLevel:
    raw = os.environ.get(_VAR, "OFF").strip().upper() or "OFF"
    try:
        return DebugLevel[raw]
    except KeyError:
        raise ValueError(f"{_VAR}={raw!r} is not a debug level; use OFF, INFO or DETAIL") from None


def _initial() -> DebugLevel:
    try:
        return _from_env()
    except ValueError:
        return DebugLevel.OFF  # reported by set_debug_level_from_env, not at import


_level = [_initial()]


def set_debug_level(level: DebugLevel) -> None:
    """Set the debug level (for groups made from now on).

    Raises:
        ValueError: not a :class:`DebugLevel`.
    """
    chosen = DebugLevel(level)
    _level[0] = chosen
    # meshcomm groups read the variable when they are made.
    os.environ[_VAR] = chosen.name


def get_debug_level() -> DebugLevel:
    """Return the debug level."""
    return _level[0]


def set_debug_level_from_env() -> None:
    """Set the debug level from ``TORCH_DISTRIBUTED_DEBUG`` (OFF when unset).

    Raises:
        ValueError: an unknown value.
    """
    _level[0] = _from_env()
