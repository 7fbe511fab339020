"""Parsers for the torchrun flags ``meshrun`` accepts beyond its own (see docs/launch.md).

Each parser takes the raw command-line text and returns a value, or raises
:class:`FlagError` whose message names the flag and the value; :mod:`meshcomm.run` turns it
into a usage error (exit status 2). The formats are torchrun 2.13's:

- ``-r/--redirects`` and ``-t/--tee``: ``0`` none, ``1`` stdout, ``2`` stderr, ``3`` both,
  for every local rank, or a per-rank map ``0:1,1:2`` (ranks not named get 0);
- ``--local-ranks-filter``: ``0,1,2``;
- ``--rdzv-endpoint``: ``HOST:PORT`` (``[v6addr]:PORT`` for IPv6), or ``HOST`` alone;
- ``--rdzv-conf``: ``key=value,key=value``;
- ``--signals-to-handle``: ``SIGTERM,SIGINT,...``.

Example:
    >>> parse_std_map("0:1,1:2", "--redirects", 3)
    {0: 1, 1: 2, 2: 0}
    >>> parse_endpoint("node0:29400", "--rdzv-endpoint")
    ('node0', 29400)
    >>> parse_rdzv_conf("join_timeout=60,is_host=true")
    {'join_timeout': '60', 'is_host': 'true'}
"""

from __future__ import annotations

import re
import signal

__all__ = [
    "STD_ERR",
    "STD_OUT",
    "FlagError",
    "parse_bool",
    "parse_endpoint",
    "parse_local_ranks",
    "parse_rdzv_conf",
    "parse_seconds",
    "parse_signals",
    "parse_std_map",
]

#: Bits of a ``--redirects``/``--tee`` value (torchrun's ``Std``).
STD_OUT = 1
STD_ERR = 2

_STD_VALUE = re.compile(r"^[0-3]$")
_STD_MAP = re.compile(r"^(\d+:[0-3],)*(\d+:[0-3])$")


class FlagError(ValueError):
    """A flag's value is malformed; the message names the flag and the value."""


def parse_std_map(raw: str, flag: str, nproc: int) -> dict[int, int]:
    """Parse a ``--redirects``/``--tee`` value into ``{local_rank: bits}`` for every rank.

    Args:
        raw: ``"0"``..``"3"`` for every rank, or ``"0:1,1:2"`` per local rank.
        flag: the flag's name, for the error message.
        nproc: ranks on this node; a map naming a rank outside ``[0, nproc)`` is an error.

    Raises:
        FlagError: for anything else.

    Example:
        >>> parse_std_map("3", "--tee", 2)
        {0: 3, 1: 3}
    """
    text = raw.strip()
    if _STD_VALUE.match(text):
        return dict.fromkeys(range(nproc), int(text))
    if not _STD_MAP.match(text):
        raise FlagError(
            f"{flag} {raw!r}: expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), or a "
            "per-local-rank map such as 0:1,1:2"
        )
    bits = dict.fromkeys(range(nproc), 0)
    for item in text.split(","):
        rank, value = (int(part) for part in item.split(":"))
        if rank >= nproc:
            raise FlagError(f"{flag} {raw!r}: local rank {rank} is not in [0, {nproc})")
        bits[rank] = value
    return bits


def parse_local_ranks(raw: str, flag: str, nproc: int) -> frozenset[int] | None:
    """Parse ``--local-ranks-filter`` (``"0,2"``); None (show all) for an empty value.

    Example:
        >>> sorted(parse_local_ranks("0,2", "--local-ranks-filter", 4))
        [0, 2]
    """
    if not raw.strip():
        return None
    ranks = set()
    for item in raw.split(","):
        try:
            rank = int(item)
        except ValueError:
            raise FlagError(
                f"{flag} {raw!r}: expected comma-separated local ranks, such as 0,1,2"
            ) from None
        if not 0 <= rank < nproc:
            raise FlagError(f"{flag} {raw!r}: local rank {rank} is not in [0, {nproc})")
        ranks.add(rank)
    return frozenset(ranks)


def parse_endpoint(raw: str, flag: str, default_port: int | None = None) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (``[::1]:PORT`` for IPv6) or ``HOST`` with ``default_port``.

    Raises:
        FlagError: no host, no port where ``default_port`` is None, or a port out of range.
    """
    text = raw.strip()
    if text.startswith("["):  # [v6]:port
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if sep and rest.startswith(":") else ""
        if not sep or (rest and not rest.startswith(":")):
            raise FlagError(f"{flag} {raw!r}: expected [IPv6]:PORT")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not host:
        raise FlagError(f"{flag} {raw!r}: expected HOST:PORT")
    if not port_text:
        if default_port is None:
            raise FlagError(f"{flag} {raw!r}: expected HOST:PORT (no port given)")
        return host, default_port
    try:
        port = int(port_text)
    except ValueError:
        raise FlagError(f"{flag} {raw!r}: the port {port_text!r} is not a number") from None
    if not 0 < port <= 65535:
        raise FlagError(f"{flag} {raw!r}: the port must be in [1, 65535]")
    return host, port


def parse_rdzv_conf(raw: str) -> dict[str, str]:
    """Parse ``--rdzv-conf`` (``key=value,key=value``) into a dict of strings.

    Raises:
        FlagError: an item without ``=`` or with an empty key.
    """
    conf: dict[str, str] = {}
    for item in (part for part in raw.split(",") if part.strip()):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FlagError(f"--rdzv-conf {raw!r}: expected key=value pairs, got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def parse_seconds(raw: str, what: str) -> float:
    """Parse a positive number of seconds; ``what`` names it in the error.

    Example:
        >>> parse_seconds("1.5", "--rdzv-conf join_timeout")
        1.5
    """
    try:
        seconds = float(raw)
    except ValueError:
        raise FlagError(f"{what} {raw!r}: expected a number of seconds") from None
    if not seconds > 0 or seconds == float("inf"):
        raise FlagError(f"{what} {raw!r}: expected a positive number of seconds")
    return seconds


def parse_bool(raw: str, what: str) -> bool:
    """Parse torchrun's booleans (``1/0``, ``true/false``, ``yes/no``, ``on/off``)."""
    value = raw.strip().lower()
    if value in ("1", "true", "t", "yes", "y", "on"):
        return True
    if value in ("0", "false", "f", "no", "n", "off"):
        return False
    raise FlagError(f"{what} {raw!r}: expected true or false")


def parse_signals(raw: str, flag: str) -> tuple[int, ...]:
    """Parse ``SIGTERM,SIGINT,...`` (the ``SIG`` may be left out) into signal numbers.

    SIGKILL and SIGSTOP cannot be handled, so naming them is an error.

    Example:
        >>> parse_signals("SIGTERM,usr1", "--signals-to-handle") == (
        ...     signal.SIGTERM, signal.SIGUSR1)
        True
    """
    numbers: list[int] = []
    for item in (part.strip() for part in raw.split(",") if part.strip()):
        name = item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()
        number = getattr(signal.Signals, name, None) if name.isidentifier() else None
        if number is None or number in (signal.SIGKILL, signal.SIGSTOP):
            raise FlagError(f"{flag} {raw!r}: {item!r} is not a signal meshrun can handle")
        if int(number) not in numbers:
            numbers.append(int(number))
    if not numbers:
        raise FlagError(f"{flag} {raw!r}: name at least one signal")
    return tuple(numbers)
