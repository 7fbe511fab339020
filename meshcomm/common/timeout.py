"""Timeouts: every ``timeout`` parameter accepts seconds or a ``datetime.timedelta``."""

from __future__ import annotations

import math
import os
from datetime import timedelta

from meshcomm.errors import InvalidArgument

__all__ = ["DEFAULT_TIMEOUT", "Timeout", "default_timeout", "to_seconds"]

#: Seconds a blocking call waits when no timeout is given (``MESHCOMM_TIMEOUT`` overrides).
DEFAULT_TIMEOUT = 300.0

Timeout = float | int | timedelta


def default_timeout() -> float:
    """Return the default timeout in seconds: ``MESHCOMM_TIMEOUT`` if set, else 300.

    Example:
        >>> default_timeout() > 0
        True
    """
    raw = os.environ.get("MESHCOMM_TIMEOUT")
    if raw is None or raw == "":
        return DEFAULT_TIMEOUT
    try:
        return to_seconds(float(raw))
    except (ValueError, InvalidArgument) as exc:
        raise InvalidArgument(
            f"MESHCOMM_TIMEOUT must be a positive number of seconds, got {raw!r}"
        ) from exc


def to_seconds(timeout: Timeout | None, default: float | None = None) -> float:
    """Convert a timeout given as seconds or a ``timedelta`` into positive float seconds.

    Args:
        timeout: seconds (int or float) or a ``datetime.timedelta``; None means ``default``.
        default: used when ``timeout`` is None; None means :func:`default_timeout`.

    Returns:
        The timeout in seconds, a positive finite float.

    Raises:
        InvalidArgument: the timeout is not a number or timedelta, or is not positive and finite.

    Example:
        >>> from datetime import timedelta
        >>> to_seconds(timedelta(milliseconds=1500))
        1.5
        >>> to_seconds(None, default=2.0)
        2.0
    """
    if timeout is None:
        return default_timeout() if default is None else default
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise InvalidArgument(
            f"timeout must be seconds or a datetime.timedelta, got {type(timeout).__name__} "
            f"{timeout!r}"
        )
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidArgument(f"timeout must be positive and finite, got {seconds!r} seconds")
    return seconds
