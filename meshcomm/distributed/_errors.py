"""torch.distributed's exception names, mapped onto meshcomm's one exception tree.

torch raises ``DistError`` (a ``RuntimeError``) and its subclasses; meshcomm raises
:class:`~meshcomm.errors.MeshCommError` and its subclasses. Each ``Dist*`` class here derives
from both sides, and every public function of :mod:`meshcomm.distributed` re-raises a meshcomm
error as the matching ``Dist*`` class, so both ``except dist.DistError`` (and ``except
RuntimeError``, as torch code writes it) and ``except meshcomm.CommError`` catch it::

    DistError(MeshCommError, RuntimeError)
    ├── DistBackendError(CommError)          a collective or point-to-point operation failed
    │   ├── (CommTimeout)                    ... because a peer stayed silent (TimeoutError)
    │   └── (ProtocolError)                  ... because the bytes were wrong
    ├── DistNetworkError(PeerError)          a peer went away
    ├── DistStoreError(StoreError)           the key-value store failed
    │   └── (StoreTimeout)                   ... a key did not appear in time (TimeoutError)
    └── (RendezvousError)                    the ranks could not agree on the world

The classes in parentheses are private combinations (``except CommTimeout`` keeps working).
:class:`~meshcomm.errors.InvalidArgument` stays as it is: it is a ``ValueError``, which is
what torch raises for bad arguments.

Example:
    >>> from meshcomm.errors import CommTimeout
    >>> exc = translate(CommTimeout("rank 1: recv from rank 0 timed out"))
    >>> [isinstance(exc, c) for c in (DistBackendError, CommTimeout, RuntimeError)]
    [True, True, True]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from meshcomm.errors import (
    CommError,
    CommTimeout,
    MeshCommError,
    PeerError,
    ProtocolError,
    RendezvousError,
    StoreError,
    StoreTimeout,
)

__all__ = [
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "DistTypeError",
    "QueueEmptyError",
    "public",
    "translate",
]

P = ParamSpec("P")
R = TypeVar("R")


class DistError(MeshCommError, RuntimeError):
    """Base of the torch.distributed-style errors (a RuntimeError, as in torch)."""


class DistBackendError(DistError, CommError):
    """A collective or point-to-point operation failed (torch: backend error)."""


class DistNetworkError(DistError, PeerError):
    """A peer went away: its process died or its connection closed."""


class DistStoreError(DistError, StoreError):
    """The key-value store failed or timed out."""


class QueueEmptyError(DistStoreError):
    """torch's store queue error; meshcomm's stores have no queues, so it is never raised."""


class DistTypeError(DistError, TypeError):
    """A reduce op that is undefined for the dtype: a RuntimeError as torch's backends raise
    it, and a TypeError as meshcomm raises it."""


class _DistTimeout(DistBackendError, CommTimeout):
    pass


class _DistProtocolError(DistBackendError, ProtocolError):
    pass


class _DistStoreTimeout(DistStoreError, StoreTimeout):
    pass


class _DistRendezvousError(DistError, RendezvousError):
    pass


# Most specific first: the first class the error is an instance of picks the translation.
_MAP: tuple[tuple[type[MeshCommError], type[DistError]], ...] = (
    (CommTimeout, _DistTimeout),
    (PeerError, DistNetworkError),
    (ProtocolError, _DistProtocolError),
    (CommError, DistBackendError),
    (StoreTimeout, _DistStoreTimeout),
    (StoreError, DistStoreError),
    (RendezvousError, _DistRendezvousError),
)


def translate(exc: BaseException) -> BaseException:
    """Return ``exc`` as the matching ``Dist*`` error (same message), or ``exc`` itself.

    Errors that already are ``DistError``, and errors outside the mapping (``ValueError``,
    ``TypeError``, ``InvalidArgument``, ...), come back unchanged.

    Example:
        >>> from meshcomm.errors import StoreTimeout
        >>> type(translate(StoreTimeout("key 'x' missing"))).__mro__[1].__name__
        'DistStoreError'
        >>> translate(ValueError("bad")).__class__.__name__
        'ValueError'
    """
    if isinstance(exc, DistError) or not isinstance(exc, MeshCommError):
        return exc
    for source, target in _MAP:
        if isinstance(exc, source):
            new: DistError = target(str(exc))
            if isinstance(exc, PeerError) and isinstance(new, PeerError):
                new.rank = exc.rank
            new.__cause__ = exc.__cause__
            new.__suppress_context__ = True
            return new.with_traceback(exc.__traceback__)
    return exc


def public(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate a public function so meshcomm errors leave it as ``Dist*`` errors.

    Example:
        >>> @public
        ... def boom() -> None:
        ...     raise CommError("rank 0: the world failed")
        >>> try:
        ...     boom()
        ... except DistError as exc:
        ...     print(type(exc).__name__, exc)
        DistBackendError rank 0: the world failed
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except MeshCommError as exc:
            new = translate(exc)
            if new is exc:
                raise
            raise new  # noqa: B904 - translate() kept the cause and hid the context

    return wrapper
