"""Which members of a tcp communicator share a host, agreed once, for the host-aware path.

Collectives over a group that spans hosts, with more than one rank on some host, run
hierarchically (:mod:`meshcomm.backends.algorithms.hierarchical`) at or above
:func:`hier_min` bytes. Every member must make the same choice for the same call, so the
choice depends only on the size and on a layout that every member computes from the same
data: the first call that could use it sends every member an 8-byte digest of this
process's host key (:func:`~meshcomm.backends.tcp.same_host.rings.host_key`: boot id, ``/dev/shm``
device and pid namespace, plus ``MESHCOMM_HOST_KEY``), one round, and every rank groups
the digests alike.

Knob: ``MESHCOMM_HIER_MIN`` (bytes; the smallest size that runs hierarchically; ``0`` or
negative: never, every collective stays flat), read once at import.

Example:
    >>> hier_min() > 0
    True
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from meshcomm.backends.algorithms.hierarchical import Layout, host_layout, worth_it
from meshcomm.backends.tcp.same_host.rings import host_key
from meshcomm.backends.tcp.thresholds import size_threshold

if TYPE_CHECKING:
    from meshcomm.backends.tcp.link import TcpLink

__all__ = ["HIER_MIN_BYTES", "HostView", "hier_min"]

#: The smallest buffer (all_reduce, broadcast), result (all_gather) or input
#: (reduce_scatter) that runs hierarchically on a group spanning hosts. Below it the flat
#: algorithms' fewer steps win or come close: psums on 1 Gbit/s simulated hosts
#: (``bench/hierarchy.py --hier-min 1``), flat against hierarchical, 0.3 against 0.8 ms at
#: 64 KiB on 2 x 2 and 2.3 against 4.5 on 4 x 2; at 256 KiB 1.8 against 0.9 and 7.2 against
#: 4.3 (docs/benchmarks.md).
HIER_MIN_BYTES = 256 << 10


# Read once: every rank must choose the same path for the same call.
_MIN = size_threshold("MESHCOMM_HIER_MIN", HIER_MIN_BYTES)


def hier_min() -> int:
    """The smallest size (bytes) that runs hierarchically; -1: never.

    Example:
        >>> hier_min() != 0  # a size, or -1 for never
        True
    """
    return _MIN


def _digest() -> int:
    raw = hashlib.blake2b(host_key().encode(), digest_size=8, person=b"meshcomm-host").digest()
    return int.from_bytes(raw, "little")


class HostView:
    """The host layout of one communicator, for choosing the hierarchical path.

    Args:
        link: the communicator's link.
    """

    def __init__(self, link: TcpLink) -> None:
        self.link = link
        self.min_bytes = hier_min() if link.size > 2 else -1
        self._layout: Layout | None = None
        self._agreed = False

    def layout(self, nbytes: int) -> Layout | None:
        """The layout to run a collective of ``nbytes`` hierarchically on, or None (flat).

        The first call at or above the size agrees the layout with every member (one round
        of 8-byte messages); every member calls it with the same ``nbytes``.
        """
        if self.min_bytes < 0 or nbytes < self.min_bytes:
            return None
        if not self._agreed:
            self._layout = self._agree()
            self._agreed = True
        return self._layout

    def _agree(self) -> Layout | None:
        link = self.link
        n, r = link.size, link.rank
        order = [(r + k) % n for k in range(1, n)]
        keys = np.empty((n, 1), np.uint64)
        keys[r] = _digest()
        link.exchange([(j, keys[r]) for j in order], [(j, keys[j]) for j in order])
        layout = host_layout(keys[:, 0].tolist())
        return layout if worth_it(layout) else None
