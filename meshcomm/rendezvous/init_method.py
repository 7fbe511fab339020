"""``init_method`` URLs: ``env://``, ``tcp://HOST:PORT`` and ``file:///PATH``, validated before
any I/O into an :class:`InitMethod`.

Example:
    >>> parse_init_method("tcp://[::1]:29500?rank=1&world_size=2")
    InitMethod(scheme='tcp', host='::1', port=29500, path=None, rank=1, world_size=2)
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

from meshcomm.errors import InvalidArgument
from meshcomm.launch import check_port

__all__ = ["InitMethod", "parse_init_method"]


@dataclass(frozen=True)
class InitMethod:
    """A parsed ``init_method`` URL.

    Attributes:
        scheme: "env", "tcp" or "file".
        host: store host (tcp only).
        port: store port (tcp only).
        path: store file (file only).
        rank: ``?rank=`` from the query, if given.
        world_size: ``?world_size=`` from the query, if given.
    """

    scheme: str
    host: str | None = None
    port: int | None = None
    path: str | None = None
    rank: int | None = None
    world_size: int | None = None


def parse_init_method(url: str) -> InitMethod:
    """Validate and parse an ``init_method`` URL.

    Accepted forms: ``env://``, ``tcp://HOST:PORT`` (IPv6 as ``tcp://[::1]:PORT``) and
    ``file:///ABSOLUTE/PATH``; tcp and file URLs may add ``?rank=R&world_size=N``.

    Raises:
        InvalidArgument: anything else, with the reason.

    Example:
        >>> parse_init_method("file:///tmp/rdzv?world_size=2")
        InitMethod(scheme='file', host=None, port=None, path='/tmp/rdzv', rank=None, world_size=2)
        >>> parse_init_method("env://").scheme
        'env'
    """
    if not isinstance(url, str):
        raise TypeError(f"init_method must be a str URL, got {type(url).__name__} {url!r}")
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme == "env":
        if parts.netloc or parts.path or parts.query or parts.fragment:
            raise InvalidArgument(f"init_method {url!r}: env:// takes nothing after '//'")
        return InitMethod("env")
    if scheme not in ("tcp", "file"):
        raise InvalidArgument(
            f"init_method {url!r}: unsupported scheme {parts.scheme!r}; "
            "use env://, tcp://HOST:PORT or file:///PATH"
        )
    if parts.fragment:
        raise InvalidArgument(f"init_method {url!r}: a fragment ('#...') is not allowed")
    rank, world_size = _parse_query(url, parts.query)
    if scheme == "tcp":
        try:
            port = parts.port
        except ValueError:
            port = -1
        if not parts.hostname or port is None:
            raise InvalidArgument(f"init_method {url!r}: tcp:// needs HOST:PORT")
        if port == -1:
            raise InvalidArgument(f"init_method {url!r}: the port must be in [1, 65535]")
        if parts.path not in ("", "/") or parts.username or parts.password:
            raise InvalidArgument(f"init_method {url!r}: tcp:// takes only HOST:PORT")
        check_port(port, f"init_method {url!r}: the port")
        return InitMethod("tcp", host=parts.hostname, port=port, rank=rank, world_size=world_size)
    if parts.netloc not in ("", "localhost"):
        raise InvalidArgument(
            f"init_method {url!r}: file:// takes a local absolute path (file:///path), "
            f"not the host {parts.netloc!r}"
        )
    path = unquote(parts.path)
    if not path.startswith("/") or path.endswith("/"):
        raise InvalidArgument(f"init_method {url!r}: file:// needs an absolute file path")
    return InitMethod("file", path=path, rank=rank, world_size=world_size)


def _parse_query(url: str, query: str) -> tuple[int | None, int | None]:
    values: dict[str, int] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise InvalidArgument(f"init_method {url!r}: malformed query {query!r}") from None
    for key, raw in pairs:
        if key not in ("rank", "world_size"):
            raise InvalidArgument(
                f"init_method {url!r}: unknown query parameter {key!r} (known: rank, world_size)"
            )
        if key in values:
            raise InvalidArgument(f"init_method {url!r}: {key} is given twice")
        try:
            values[key] = int(raw)
        except ValueError:
            raise InvalidArgument(
                f"init_method {url!r}: {key} must be an integer, got {raw!r}"
            ) from None
    return values.get("rank"), values.get("world_size")
