"""The mpi backend: meshcomm's communicator interface on mpi4py (any MPI: MPICH, Open MPI).

``meshcomm.init(backend="mpi")`` under ``mpiexec``/``srun`` makes the world from
``MPI.COMM_WORLD``; no store is needed for it. Nothing here imports ``mpi4py.MPI`` (which
initializes MPI) until a communicator is created or MPI is queried.

Contents:
    :class:`MpiCommunicator`  the communicator (blocking primitives + ``i*`` nonblocking twins,
                              ``sub``/``split``/``cart_subs`` for groups and meshes)
    :class:`MpiRequest`       a started nonblocking operation (``test``, ``wait``)
    :func:`cuda_support`      whether the MPI library takes CUDA device buffers
    :func:`available`         whether mpi4py can be imported (without initializing MPI)

Example:
    >>> isinstance(available(), bool)
    True
"""

from __future__ import annotations

import importlib.util

from meshcomm.backends.mpi._lib import cuda_support
from meshcomm.backends.mpi._request import MpiRequest
from meshcomm.backends.mpi.communicator import MpiCommunicator

__all__ = ["MpiCommunicator", "MpiRequest", "available", "cuda_support"]


def available() -> bool:
    """True if mpi4py is installed (checked without importing it, so MPI stays uninitialized).

    Example:
        >>> available() in (True, False)
        True
    """
    try:
        return importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):
        return False
