"""The store server's memory budget: its size, and the bytes counted against it.

Keys and values (each with :data:`ENTRY_OVERHEAD`), parked requests (each with
:data:`WAITER_OVERHEAD`), unsent replies and frames being received all count; the server
refuses what would go over, naming the budget and the sizes (:meth:`MemoryBudget.usage`).

Example:
    >>> budget = MemoryBudget(parse_memory_limit("1M"))
    >>> budget.stored += len(b"key") + len(b"value") + ENTRY_OVERHEAD
    >>> budget.used, budget.usage()
    (136, '136 in keys and values, 0 in connection buffers, 0 in parked requests')
"""

from __future__ import annotations

import os
import re

from meshcomm.errors import InvalidArgument

__all__ = [
    "DEFAULT_MEMORY_LIMIT",
    "ENTRY_OVERHEAD",
    "MEMORY_ENV",
    "WAITER_OVERHEAD",
    "MemoryBudget",
    "parse_memory_limit",
]

#: The store's total memory budget in bytes unless ``memory_limit=`` or ``MESHCOMM_STORE_MEMORY``
#: says otherwise: keys and values, parked requests, unsent replies and frames being received.
DEFAULT_MEMORY_LIMIT = 256 * 1024 * 1024
#: The environment variable that sets the budget (bytes, or a number with K, M or G: MiB...).
MEMORY_ENV = "MESHCOMM_STORE_MEMORY"
# Smallest budget accepted: below it even bootstrap traffic would be refused.
_MIN_MEMORY_LIMIT = 1024 * 1024
# What a key/value pair costs beyond its bytes (two bytes objects and a dict slot), and a
# parked request beyond its keys; rough, so that a flood of tiny keys is counted too.
ENTRY_OVERHEAD = 128
WAITER_OVERHEAD = 256
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_memory_limit(value: int | str | None = None) -> int:
    """The store's memory budget in bytes: ``value``, else ``MESHCOMM_STORE_MEMORY``, else 256 MiB.

    A str may carry a binary unit: ``"512M"``, ``"2G"`` (``"MiB"``, ``"GB"`` spellings too).

    Raises:
        InvalidArgument: not a whole number of bytes, or under 1 MiB; names the value.

    Example:
        >>> parse_memory_limit("512M"), parse_memory_limit(2**30)
        (536870912, 1073741824)
    """
    source = "memory_limit"
    if value is None:
        value = os.environ.get(MEMORY_ENV) or DEFAULT_MEMORY_LIMIT
        source = MEMORY_ENV
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+)\s*([KMGT]?)(?:I?B)?\s*", value.upper())
        if match is None:
            raise InvalidArgument(
                f"{source} must be a number of bytes, optionally with K, M, G or T, got {value!r}"
            )
        limit = int(match.group(1)) * _UNITS[match.group(2)]
    elif isinstance(value, int) and not isinstance(value, bool):
        limit = value
    else:
        raise InvalidArgument(f"{source} must be an int or a str, got {type(value).__name__}")
    if limit < _MIN_MEMORY_LIMIT:
        raise InvalidArgument(
            f"{source} must be at least {_MIN_MEMORY_LIMIT} bytes (1 MiB), got {value!r}"
        )
    return limit


class MemoryBudget:
    """What the store holds against its ``limit``, in bytes, by kind.

    Attributes:
        limit: the budget (:func:`parse_memory_limit`).
        stored: keys and values, with :data:`ENTRY_OVERHEAD` each.
        io: the sum of every connection's ``held`` (unsent replies, input, admitted frames),
            kept by :meth:`~meshcomm.store._conn.Conn.recount`.
        parked: parked requests, with :data:`WAITER_OVERHEAD` each.
    """

    __slots__ = ("io", "limit", "parked", "stored")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stored = 0
        self.io = 0
        self.parked = 0

    @property
    def used(self) -> int:
        """Bytes counted against the budget now."""
        return self.stored + self.io + self.parked

    def usage(self) -> str:
        """The bytes in use by kind, for a refusal's message."""
        return (
            f"{self.stored} in keys and values, {self.io} in connection buffers, "
            f"{self.parked} in parked requests"
        )
