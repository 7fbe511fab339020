"""Point to point for device arrays in a group with a device backend (nccl).

NCCL has no tags and no receive from any source, and a receiver cannot know where the
sender's array lives. So a device array's ``send`` goes two ways: a small header over the
group's host communicator, with the caller's tag (this message's number between the two
ranks, the dtype and the shape), then the bytes over the device communicator
(:meth:`~meshcomm.backends.base.Communicator.send_payload`). ``recv`` takes the next host
message for its source and tag as always; when that is such a header, it receives the bytes
into a new device array (or the caller's ``out``) from the rank the header came from. Tags
and any-source receives keep working, and a plain ``recv`` returns what was sent: a device
array for a device array. A header travels in a dtype no caller can send
(:data:`HEADER_DTYPE`, refused by every collective's dtype check), so it is never taken for
data.

NCCL matches the payloads of two ranks in the order they were sent; each header carries
its message number, and a receive that takes them out of order (a later tag first) raises
:class:`~meshcomm.errors.ProtocolError` instead of reading another message's bytes. A rank's
message to itself never touches NCCL: it is a copy kept until its receive.

Every function here takes its array module (``xp``: cupy, or numpy where the tests stand a
host communicator in for the device one, as :mod:`meshcomm.group.device_lower` does).

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group.arrays import ScratchPool
    >>> from meshcomm.group.lower import Call
    >>> comm = SelfCommunicator()
    >>> p2p, call = DeviceP2P(comm, comm, np), Call(comm, ScratchPool(), "rank 0")
    >>> send_body, _ = p2p.send(call, np.arange(3.0), 0, 5, False)
    >>> send_body()
    >>> recv_body, _ = p2p.recv(call, 0, 5, None, False)
    >>> recv_body()
    array([0., 1., 2.])
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

from meshcomm.backends.base import Communicator
from meshcomm.errors import InvalidArgument, ProtocolError
from meshcomm.group import routes
from meshcomm.group.arrays import SUPPORTED_DTYPES, check_dtype, dtype_name
from meshcomm.group.lower import Call, Lowered, rank_arg, tag_arg

__all__ = ["HEADER_DTYPE", "DeviceP2P", "for_communicators", "is_header"]

#: The dtype headers travel in: one the collectives refuse, so no caller's array has it.
HEADER_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
_MAGIC = 0x6D73_6864_7631_0001  # "mshdv1", version 1
_FIXED = 4  # header words before the shape: magic, message number, dtype index, ndim


def is_header(arr: np.ndarray) -> bool:
    """Whether a received host message is a device array's header.

    Example:
        >>> is_header(np.zeros(3))
        False
    """
    return arr.dtype == HEADER_DTYPE


class DeviceP2P:
    """One group's device point to point: its two communicators and the message numbers.

    Args:
        host: the group's host communicator (headers).
        dev: the group's device communicator (payloads).
        xp: the device array module (cupy), for receives that allocate.

    The group runs every body in its issue order (its progress engine), so the counters
    need no lock.
    """

    def __init__(self, host: Communicator, dev: Communicator, xp: ModuleType) -> None:
        self._host, self._dev, self._xp = host, dev, xp
        # Bodies may run on the group's progress thread, whose current GPU is cupy's
        # default: they allocate and make events on this one, the caller's at creation.
        self._on_device: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
        if xp is not np:
            device_id = xp.cuda.Device().id
            self._on_device = lambda: xp.cuda.Device(device_id)
        self._sent: dict[int, int] = {}  # peer -> messages sent to it
        self._received: dict[int, int] = {}  # peer -> messages received from it
        self._to_self: dict[int, Any] = {}  # message number -> the copy kept for this rank

    def send(self, c: Call, x: Any, dst: Any, tag: Any, snapshot: bool) -> Lowered:
        """Lower ``send`` of device array ``x`` (checks first: dst, tag, dtype).

        ``snapshot``: copy ``x`` now (an async send: the caller may reuse ``x`` at once).
        """
        d = rank_arg(c, dst, "dst")
        t = tag_arg(c.where, tag)
        dt = check_dtype(x.dtype, c.where)
        xp, host, dev = self._xp, self._host, self._dev
        me = host.rank
        # The bytes sent are a C-contiguous copy where the caller may change x meanwhile
        # (async) or it is strided, or where it is kept for this rank's own receive.
        if snapshot or d == me or not x.flags.c_contiguous:
            payload = xp.array(x, copy=True, order="C")
        else:
            payload = x
        after = None if d == me else dev.ready_token()
        shape = tuple(int(n) for n in x.shape)
        index = SUPPORTED_DTYPES.index(dt)

        def body() -> None:
            number = self._sent.get(d, 0) + 1
            head = np.array([_MAGIC, number, index, len(shape), *shape], np.int64)
            host.send(head.view(HEADER_DTYPE), d, t)
            self._sent[d] = number
            if d == me:
                self._to_self[number] = payload
            else:
                with self._on_device():
                    dev.send_payload(payload, d, after)

        return body, None

    def recv(self, c: Call, src: Any, tag: Any, out: Any, return_source: bool) -> Lowered:
        """Lower ``recv`` in a group with a device backend: a host message as always, or a
        device array's header and then its bytes (into ``out`` when given)."""
        s = None if src is None else rank_arg(c, src, "src")
        t = tag_arg(c.where, tag)
        if out is not None:
            check_out_buffer(c, out)
        host, dev, where = self._host, self._dev, c.where
        after = dev.ready_token()

        def body() -> Any:
            arr, source = host.recv(s, t)
            if is_header(arr):
                with self._on_device():
                    got = self._payload(where, arr, source, out, after)
            else:
                got = arr if out is None else fill(where, out, arr, source)
            return (got, source) if return_source else got

        return body, None

    def _payload(self, where: str, header: np.ndarray, source: int, out: Any, after: Any) -> Any:
        head = header.view(np.int64)
        if (
            head.size < _FIXED
            or int(head[0]) != _MAGIC
            or head.size != _FIXED + int(head[3])
            or not 0 <= int(head[2]) < len(SUPPORTED_DTYPES)
            or any(int(n) < 0 for n in head[_FIXED:])
        ):
            raise ProtocolError(f"{where}: a malformed device header came from rank {source}")
        number, index, shape = int(head[1]), int(head[2]), tuple(int(n) for n in head[_FIXED:])
        expected = self._received.get(source, 0) + 1
        if number != expected:
            raise ProtocolError(
                f"{where}: device arrays from rank {source} are received in the order they "
                f"were sent (NCCL matches them by order, not by tag): this receive got its "
                f"message #{number}, and #{expected} was not received yet"
            )
        self._received[source] = number
        dtype = SUPPORTED_DTYPES[index]
        if source == self._host.rank:
            kept = self._to_self.pop(number)
            return kept if out is None else fill(where, out, kept, source)
        xp = self._xp
        direct = out is not None and _device_buffer_like(out, xp, shape, dtype)
        target = out if direct else xp.empty(shape, dtype=dtype)
        self._dev.recv_payload(target, source, after)
        if out is None or direct:
            return target
        return fill(where, out, target, source)


def for_communicators(host: Communicator, dev: Communicator) -> DeviceP2P | None:
    """A group's device point to point over ``host`` and ``dev``; None (the group stages
    device arrays through its host route) where the host backend cannot carry the headers'
    dtype (mpi: it moves the collectives' dtypes only), or where the device communicator
    would move the payloads through host memory anyway (cuda_ipc): the host route matches
    receives by tag and takes any source, which payloads matched by order cannot."""
    if host.backend_name == "mpi" or dev.backend_name == "cuda_ipc":
        return None
    return DeviceP2P(host, dev, importlib.import_module(dev.array_module))


def _device_buffer_like(out: Any, xp: ModuleType, shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether ``out`` can take a payload directly: an array of ``xp`` (the device module),
    C-contiguous, of that shape and dtype."""
    return (
        routes.array_module(out) is xp
        and out.flags.c_contiguous
        and tuple(out.shape) == shape
        and np.dtype(out.dtype) == dtype
    )


def check_out_buffer(c: Call, out: Any) -> None:
    """Raise InvalidArgument (before any I/O) unless ``out`` is a writeable array (numpy, or
    a device array) of a supported dtype."""
    flags = getattr(out, "flags", None)
    if flags is None or not hasattr(out, "shape") or not hasattr(out, "dtype"):
        raise InvalidArgument(f"{c.where}: out must be an array, got {type(out).__name__}")
    if not getattr(flags, "writeable", True):
        raise InvalidArgument(f"{c.where}: out is read-only")
    if isinstance(out, np.ma.MaskedArray):  # the values would land under a stale mask
        raise InvalidArgument(f"{c.where}: out is a masked array; pass a plain numpy array")
    check_dtype(out.dtype, c.where)


def fill(where: str, out: Any, got: Any, source: int) -> Any:
    """Copy a received array ``got`` (host or device) into ``out`` (host or device).

    Raises:
        InvalidArgument: shapes or dtypes differ, naming both (the message is consumed,
            and the group fails: the error is raised on its engine).
    """
    if tuple(out.shape) != tuple(got.shape) or np.dtype(out.dtype) != np.dtype(got.dtype):
        raise InvalidArgument(
            f"{where}: out has shape {tuple(out.shape)} and dtype {dtype_name(out.dtype)}; "
            f"rank {source} sent shape {tuple(got.shape)} and dtype {dtype_name(got.dtype)} "
            "(the message was consumed)"
        )
    if isinstance(out, np.ndarray):
        np.copyto(out, got if isinstance(got, np.ndarray) else got.get())
    elif isinstance(got, np.ndarray) and (xp := routes.device_module(out)) is not None:
        out[...] = xp.asarray(got)
    else:
        out[...] = got
    return out
