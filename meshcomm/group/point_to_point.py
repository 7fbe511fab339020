"""Point to point: the part of :class:`~meshcomm.group.ProcessGroup` that sends and receives.

``send`` and ``recv`` match by (source, tag) and carry shape and dtype with each message.
In a group with a device backend, device arrays go as a header over the host communicator
and their bytes over the device one (:mod:`meshcomm.group.device_p2p`). Point to point has no
sequence number and no fingerprint: it runs on the group's engine, in issue order.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> g = ProcessGroup(SelfCommunicator())
    >>> g.send(np.arange(2), dst=0); g.recv(src=0)
    array([0, 1])
    >>> g.close()
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol

import numpy as np  # noqa: F401 - the doctests use it
import numpy.typing as npt

from meshcomm.group import device_p2p as _device_p2p
from meshcomm.group import lower as _lower
from meshcomm.group import routes

__all__ = ["PointToPoint"]

ArrayLike = npt.ArrayLike


class _Group(Protocol):
    """What these methods use of the group they are called on (a ProcessGroup)."""

    _p2p: _device_p2p.DeviceP2P | None

    def _enter(self, op: str) -> _lower.Call: ...

    def _issue(
        self, op: str, lowered: _lower.Lowered, async_op: bool, device: ModuleType | None = None
    ) -> Any: ...


class PointToPoint:
    """Point-to-point methods of :class:`~meshcomm.group.ProcessGroup` (a mixin: each method
    works on the group it is called on, typed as such)."""

    def send(self: _Group, x: ArrayLike, dst: int, tag: int = 0, *, async_op: bool = False) -> Any:
        """Send ``x`` (any shape; shape and dtype travel with it) to group rank ``dst``.

        Args:
            x: an array.
            dst: the receiving group rank.
            tag: a non-negative int matched by :meth:`recv`.
            async_op: return a Work (``x`` is copied now, so it may be reused at once).

        Raises:
            InvalidArgument: dst or tag out of range.
            CommError: communication failed.

        Example:
            >>> from meshcomm.backends.local import SelfCommunicator
            >>> from meshcomm.group import ProcessGroup
            >>> g = ProcessGroup(SelfCommunicator())
            >>> g.send(np.arange(3), dst=0, tag=7); g.recv(src=0, tag=7)
            array([0, 1, 2])
        """
        c = self._enter("send")
        if routes.device_module(x) is not None and (p2p := self._p2p) is not None:
            return self._issue("send", p2p.send(c, x, dst, tag, bool(async_op)), async_op)
        x, back = routes.host_route(x)
        return self._issue("send", _lower.send(c, x, dst, tag, bool(async_op)), async_op, back)

    def recv(
        self: _Group,
        src: int | None = None,
        tag: int = 0,
        *,
        return_source: bool = False,
        async_op: bool = False,
        out: Any = None,
    ) -> Any:
        """Receive an array sent with ``tag`` from group rank ``src`` (None: any rank).

        In a group with a device backend (nccl), a device array sent arrives over it and
        comes back as a device array (into ``out`` where that is one of the same shape and
        dtype): between two ranks such arrays are received in the order they were sent,
        whatever their tags (NCCL matches by order). See docs/backends/nccl.md.

        Args:
            src: the sending group rank, or None for any.
            tag: the tag the sender used.
            return_source: also return the sender's group rank.
            async_op: return a Work.
            out: receive into this array (numpy or device) instead of a new one: it must
                have the sender's shape and dtype.

        Returns:
            The received array (a new one, with the sender's shape and dtype; ``out`` when
            given), or ``(array, src)`` with ``return_source=True``.

        Raises:
            InvalidArgument: src or tag out of range, or ``out`` not a writeable array
                (before any I/O); ``out`` not of the shape and dtype sent (the message is
                consumed then and the group fails, as MPI's truncation error).
            ProtocolError: device arrays from one rank received out of their order.
            CommError: communication failed (CommTimeout when nothing arrives in time).

        Example:
            >>> from meshcomm.backends.local import SelfCommunicator
            >>> from meshcomm.group import ProcessGroup
            >>> g = ProcessGroup(SelfCommunicator())
            >>> g.send(np.float32(2.5), dst=0); g.recv(return_source=True)
            (array(2.5, dtype=float32), 0)
            >>> buf = np.zeros(2)
            >>> g.send(np.ones(2), dst=0); g.recv(out=buf) is buf
            True
        """
        c = self._enter("recv")
        p2p = self._p2p
        if p2p is not None:
            return self._issue("recv", p2p.recv(c, src, tag, out, return_source), async_op)
        if out is None:
            return self._issue("recv", _lower.recv(c, src, tag, return_source), async_op)
        _device_p2p.check_out_buffer(c, out)
        body, fields = _lower.recv(c, src, tag, True)
        where = c.where

        def into_out() -> Any:
            arr, source = body()
            got = _device_p2p.fill(where, out, arr, source)
            return (got, source) if return_source else got

        return self._issue("recv", (into_out, fields), async_op)
