"""The cuda_ipc device backend: collectives of ranks that share a GPU, through CUDA IPC.

:class:`IpcCommunicator` runs the protocol (:mod:`.communicator`) over a memory mechanism
(:mod:`.memory`: :class:`CudaIpcMemory`, or :class:`SharedMemoryStandIn` on a CPU);
:mod:`.selection` decides when a world takes it. See docs/backends/cuda_ipc.md. Nothing here
imports cupy until a :class:`CudaIpcMemory` is made.
"""

from __future__ import annotations

from meshcomm.backends.cuda_ipc.communicator import IpcCommunicator
from meshcomm.backends.cuda_ipc.memory import CudaIpcMemory, PeerMemory, SharedMemoryStandIn

__all__ = ["CudaIpcMemory", "IpcCommunicator", "PeerMemory", "SharedMemoryStandIn"]
