"""The nccl backend: collectives on GPU buffers through NCCL (cupy's binding).

:class:`NcclCommunicator` implements the Communicator interface on device arrays; see
docs/backends/nccl.md for what runs, what is tested where, and what is not done yet.
Nothing here imports cupy until a communicator is made.
"""

from __future__ import annotations

from meshcomm.backends.nccl._lib import load
from meshcomm.backends.nccl.communicator import NcclCommunicator

__all__ = ["NcclCommunicator", "load"]
