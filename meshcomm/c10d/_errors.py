"""meshcomm's errors as torch's ``DistError`` family, keeping meshcomm's class and words.

torch's classes catch errors by their own hierarchy (``except dist.DistBackendError``; the
DDP reducer and torchelastic look for these), and meshcomm code catches its own
(``except meshcomm.MismatchError``). An error that leaves the ``"meshcomm"`` backend is an
instance of both: a class made once per meshcomm class, deriving from the torch class that
matches it and from the meshcomm class itself, with the message unchanged::

    PeerError      -> torch.distributed.DistNetworkError
    StoreError     -> torch.distributed.DistStoreError
    other meshcomm -> torch.distributed.DistBackendError   (mismatch, verdicts, timeouts)

Errors that are not meshcomm's (``ValueError``, ``TypeError``: bad arguments) pass unchanged.

Example:
    >>> import torch.distributed as dist
    >>> from meshcomm.errors import MismatchError
    >>> exc = as_torch_error(MismatchError("rank 1 called all_gather"))
    >>> isinstance(exc, dist.DistBackendError), isinstance(exc, MismatchError), str(exc)
    (True, True, 'rank 1 called all_gather')
"""

from __future__ import annotations

import torch.distributed as dist

from meshcomm.errors import MeshCommError, PeerError, StoreError

__all__ = ["as_torch_error", "torch_class_for"]


_CLASSES: dict[type[MeshCommError], type[BaseException]] = {}


def torch_class_for(cls: type[MeshCommError]) -> type[BaseException]:
    """Return the class that is both torch's matching ``Dist*`` class and ``cls``.

    Example:
        >>> from meshcomm.errors import PeerError
        >>> torch_class_for(PeerError).__mro__[1].__name__
        'DistNetworkError'
    """
    base: type[BaseException]
    if issubclass(cls, PeerError):
        base = dist.DistNetworkError
    elif issubclass(cls, StoreError):
        base = dist.DistStoreError
    else:
        base = dist.DistBackendError
    if issubclass(cls, base):
        return cls
    made = _CLASSES.get(cls)
    if made is None:
        made = _CLASSES.setdefault(
            cls, type(cls.__name__, (base, cls), {"__module__": cls.__module__})
        )
    return made


def as_torch_error(exc: BaseException) -> BaseException:
    """Return ``exc`` as an instance of torch's family too (same message, traceback, cause).

    Errors outside meshcomm's tree come back unchanged.
    """
    if not isinstance(exc, MeshCommError):
        return exc
    cls = torch_class_for(type(exc))
    if cls is type(exc):
        return exc
    new = cls(*exc.args)
    new.__dict__.update(exc.__dict__)  # PeerError.rank and kin
    new.__cause__ = exc.__cause__
    new.__suppress_context__ = True
    return new.with_traceback(exc.__traceback__)
