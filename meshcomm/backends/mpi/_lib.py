"""mpi4py, loaded on first use: the module, error translation, thread level, CUDA awareness.

Importing ``mpi4py.MPI`` initializes MPI, so nothing here imports it at module level:
``import meshcomm`` (and pytest's doctest collection) must never start MPI by accident.

Example:
    >>> thread_level_name(3)
    'multiple'
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
from collections.abc import Sequence
from typing import Any

from meshcomm.errors import CommError, InvalidArgument, PeerError

__all__ = [
    "CUDA_AWARE_ENV",
    "comm_error",
    "cuda_support",
    "load",
    "require_thread_level",
    "thread_level_name",
]

#: Set to 1 or 0 to override what MPIX_Query_cuda_support says (a site whose MPI is
#: CUDA-aware without exporting the query, or to force host staging when debugging).
CUDA_AWARE_ENV = "MESHCOMM_MPI_CUDA_AWARE"

_THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")
_MPI: Any = None
_ERROR_NAMES: dict[int, str] = {}
_CUDA: tuple[bool, str] | None = None


def load() -> Any:
    """Import ``mpi4py.MPI`` (initializing MPI on first import) and return the module.

    Raises:
        ImportError: mpi4py is not installed; the message says how to install it.
    """
    global _MPI
    if _MPI is None:
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise ImportError(
                "the mpi backend needs mpi4py and an MPI library: pip install 'meshcomm[mpi]' "
                f"(mpi4py + MPICH from PyPI), or mpi4py built against your cluster's MPI ({exc})",
                name="mpi4py",
            ) from exc
        _MPI = MPI
    return _MPI


def thread_level_name(level: int) -> str:
    """Return the name of an MPI thread level (0..3), as ``mpi4py.rc.thread_level`` spells it.

    Example:
        >>> thread_level_name(1)
        'funneled'
    """
    return _THREAD_LEVELS[level] if 0 <= level < len(_THREAD_LEVELS) else f"level {level}"


def require_thread_level(rank: int) -> int:
    """Check that MPI runs with ``MPI_THREAD_MULTIPLE``; return the level.

    Every process group has a progress engine of its own, so operations of two groups may
    call MPI from two threads at once (on different communicators): that needs MULTIPLE,
    which mpi4py asks for by default.

    Raises:
        CommError: MPI was initialized below MULTIPLE.
    """
    mpi = load()
    level = int(mpi.Query_thread())
    if level < int(mpi.THREAD_MULTIPLE):
        raise CommError(
            f"rank {rank}: MPI was initialized with thread level "
            f"{thread_level_name(level)!r}, but the mpi backend runs each group's operations "
            "independently, from several threads at once, and needs 'multiple'; leave "
            "mpi4py.rc.thread_level at its default ('multiple')"
        )
    return level


def _error_name(error_class: int) -> str:
    if not _ERROR_NAMES:
        mpi = load()
        for name in dir(mpi):
            if name.startswith("ERR_"):
                value = getattr(mpi, name)
                if isinstance(value, int):
                    _ERROR_NAMES.setdefault(value, "MPI_" + name)
    return _ERROR_NAMES.get(error_class, f"MPI error class {error_class}")


def comm_error(
    exc: BaseException, where: str, peer: int | None = None, statuses: Sequence[Any] = ()
) -> CommError:
    """Translate an ``MPI.Exception`` raised in ``where`` into the meshcomm exception tree.

    Process failures (``MPI_ERR_PROC_FAILED``, ``..._PENDING``, ``MPI_ERR_REVOKED``, seen with
    fault-tolerant MPIs) become :class:`~meshcomm.errors.PeerError`; every other error a
    :class:`~meshcomm.errors.CommError` with MPI's own error class and string (arguments are
    checked before any MPI call, so what MPI refuses is a disagreement between ranks, such
    as a truncated message).

    Args:
        exc: the ``mpi4py.MPI.Exception``.
        where: the operation, rank and communicator, prefixed to the message.
        peer: the global rank of the peer involved, when one is.
        statuses: the statuses of an ``MPI_Testall``; for ``MPI_ERR_IN_STATUS`` the first
            failed request's own error is reported.
    """
    mpi = load()
    try:
        code = int(exc.Get_error_code())  # type: ignore[attr-defined]
        if mpi.Get_error_class(code) == mpi.ERR_IN_STATUS:
            codes = [s.Get_error() for s in statuses]
            code = next((c for c in codes if c not in (mpi.SUCCESS, mpi.ERR_PENDING)), code)
        error_class = int(mpi.Get_error_class(code))
        text = str(mpi.Get_error_string(code)).strip()
    except Exception:
        error_class, text = -1, str(exc)
    text = re.sub(r"\s+", " ", text)
    message = f"{where}: {_error_name(error_class)}: {text}"
    failed = {getattr(mpi, n, None) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING")}
    failed.add(getattr(mpi, "ERR_REVOKED", None))
    failed.discard(None)
    if error_class in failed:
        return PeerError(message, rank=peer)
    return CommError(message)


# -- CUDA awareness ---------------------------------------------------------------------------
def _loaded_mpi_libraries() -> list[str]:
    """Paths of the MPI shared libraries in this process (Linux), else the linker's guess."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                name = os.path.basename(path)
                if re.match(r"lib(mpi|mpich|mpi_ibm|msmpi)[\w.-]*\.so", name) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    if not paths:
        for name in ("mpi", "mpich"):
            found = ctypes.util.find_library(name)
            if found:
                paths.append(found)
    return paths


def cuda_support() -> tuple[bool, str]:
    """Ask the MPI library whether it takes CUDA device buffers; return (answer, how we know).

    ``MESHCOMM_MPI_CUDA_AWARE=1``/``0`` overrides the answer. Otherwise the library's
    ``MPIX_Query_cuda_support()`` (Open MPI, MPICH >= 4, MVAPICH) is called through ctypes on
    the libmpi this process loaded; a library that does not export it is taken as not
    CUDA-aware, so device buffers are staged through host memory. Initializes MPI.

    Example:
        >>> import os
        >>> os.environ[CUDA_AWARE_ENV] = "0"
        >>> cuda_support()
        (False, 'MESHCOMM_MPI_CUDA_AWARE=0')
        >>> del os.environ[CUDA_AWARE_ENV]
    """
    global _CUDA
    forced = os.environ.get(CUDA_AWARE_ENV, "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise InvalidArgument(f"{CUDA_AWARE_ENV} must be 0 or 1, got {forced!r}")
        return forced == "1", f"{CUDA_AWARE_ENV}={forced}"
    if _CUDA is None:
        load()
        _CUDA = _query_cuda()
    return _CUDA


def _query_cuda() -> tuple[bool, str]:
    libraries = _loaded_mpi_libraries()
    for path in libraries:
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
        query = getattr(lib, "MPIX_Query_cuda_support", None)
        if query is None:
            continue
        query.restype, query.argtypes = ctypes.c_int, []
        answer = bool(query())
        return answer, f"MPIX_Query_cuda_support() = {int(answer)} in {path}"
    where = ", ".join(libraries) or "no libmpi found"
    return False, f"MPIX_Query_cuda_support is not exported ({where})"
