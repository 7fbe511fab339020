"""meshcomm: JAX-style functional collectives over device meshes.

Example:
    >>> import meshcomm
    >>> meshcomm.__version__
    '0.1.0'
"""

from __future__ import annotations

from meshcomm.errors import (
    CommError,
    CommTimeout,
    InvalidArgument,
    MeshCommError,
    PeerError,
    ProtocolError,
    RendezvousError,
    StoreError,
    StoreTimeout,
)

__version__ = "0.1.0"

__all__ = [
    "CommError",
    "CommTimeout",
    "InvalidArgument",
    "MeshCommError",
    "PeerError",
    "ProtocolError",
    "RendezvousError",
    "StoreError",
    "StoreTimeout",
    "__version__",
]
