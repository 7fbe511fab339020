"""TcpCommunicator: the Communicator interface over the tcp transport.

Collectives run the shared algorithms (:mod:`meshcomm.backends.algorithms`) over a
per-communicator :class:`~meshcomm.backends.tcp.transport.TcpLink`. Point-to-point
``send``/``recv`` carry dtype and shape in the frame header (never pickle). ``sub`` makes a
child communicator with a transport of its own (its own listener, connections and
shared-memory rings, opened on first use), so that operations of different groups never
wait for each other: its id is computed identically on every member from the parent's id,
the member list and a per-parent counter, and its transport's keys live in the store under
that id (two store round trips per group).

Example:
    >>> import numpy as np
    >>> from meshcomm.store import HashStore
    >>> comm = TcpCommunicator.create_world(0, 1, HashStore(timeout=5), timeout=5.0)
    >>> comm.send(np.arange(3), dst=0, tag=7)
    >>> comm.recv(src=None, tag=7)
    (array([0, 1, 2]), 0)
    >>> comm.close()
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections.abc import Sequence

import numpy as np

from meshcomm.backends import algorithms
from meshcomm.backends.algorithms import hierarchical
from meshcomm.backends.algorithms.hierarchical import Layout
from meshcomm.backends.base import Communicator, Runner
from meshcomm.backends.tcp import wire
from meshcomm.backends.tcp.hosts import HostView
from meshcomm.backends.tcp.link import TcpLink
from meshcomm.backends.tcp.same_host.board import board_max
from meshcomm.backends.tcp.same_host.cma_collectives import CmaCollectives, flat_vector, op_allowed
from meshcomm.backends.tcp.transport import ANY_SOURCE, Transport
from meshcomm.errors import CommError, InvalidArgument, ProtocolError
from meshcomm.reduction import ReduceOp
from meshcomm.store.base import Store
from meshcomm.store.prefix import PrefixStore

__all__ = ["WORLD_ID", "TcpCommunicator", "sub_id"]

#: Communicator id of the world.
WORLD_ID = 0
_MAX_TAG = 2**63 - 1


def sub_id(parent_id: int, members: Sequence[int], count: int) -> int:
    """Return the id of the ``count``-th sub-communicator of ``members`` (global ranks).

    Example:
        >>> sub_id(0, [0, 2], 0) == sub_id(0, [0, 2], 0) != sub_id(0, [0, 2], 1)
        True
    """
    raw = struct.pack(f"<QQ{len(members)}Q", parent_id, count, *members)
    value = int.from_bytes(
        hashlib.blake2b(raw, digest_size=8, person=b"meshcomm-sub").digest(), "little"
    )
    return value or 1  # never the world's id


def _nbytes(arr: object) -> int:
    return arr.nbytes if isinstance(arr, np.ndarray) else 0


def _root_ok(root: object, size: int) -> bool:
    return isinstance(root, int) and not isinstance(root, bool) and 0 <= root < size


class TcpCommunicator(Communicator):
    """A communicator over the tcp transport (shared memory between same-host ranks, sockets
    between hosts; one transport per communicator, one channel per pair of its ranks).

    Use :meth:`create_world` for the world; :meth:`sub` for groups.

    Attributes:
        comm_id: this communicator's id on the wire.
        link: the :class:`~meshcomm.backends.link.Link` the collectives run over.
    """

    backend_name = "tcp"

    def __init__(
        self,
        transport: Transport,
        comm_id: int,
        rank: int,
        global_ranks: Sequence[int],
        timeout: float,
        *,
        owns_transport: bool = False,
        store: Store | None = None,
    ) -> None:
        super().__init__(rank, global_ranks, timeout)
        # The job's store, unprefixed: sub-communicators keep their transports' keys in it.
        self._store = store
        self.comm_id = comm_id
        self.link = TcpLink(transport, comm_id, self.global_ranks, rank)
        self._cma = CmaCollectives(self.link)
        self._hosts = HostView(self.link)
        self._transport = transport
        self._alarm = transport.alarm  # read in the first line of every call
        self._owns = owns_transport
        self._group_rank = {g: r for r, g in enumerate(self.global_ranks)}
        self._subs: dict[tuple[int, ...], int] = {}
        self._closed = False
        # The board (meshcomm.backends.tcp.same_host.board) serves the world only; None: not agreed
        # yet.
        self._board_max = board_max() if comm_id == WORLD_ID and self.size > 1 else 0
        self._board: bool | None = None if self._board_max else False
        transport.labels[comm_id] = self.label

    def describe_as(self, label: str) -> None:
        super().describe_as(label)
        self._transport.labels[self.comm_id] = label  # its errors name the group so too

    @classmethod
    def create_world(
        cls,
        rank: int,
        size: int,
        store: Store,
        timeout: float,
        *,
        secret: str | bytes | None = None,
    ) -> TcpCommunicator:
        """Start this process's transport and return the world communicator.

        Publishes this rank's listening address in ``store``; connections open on first use.

        Args:
            rank: this process's world rank.
            size: the world size.
            store: the job's store (one per world: keys live under ``meshcomm/tcp/``).
            timeout: seconds without progress before a blocking call raises ``CommTimeout``.
            secret: the job's secret: every link is mutually authenticated with it (see
                :mod:`~meshcomm.backends.tcp.link_auth`). None (default) reads
                ``MESHCOMM_SECRET``; ``""`` means none. Every rank must agree.

        Raises:
            InvalidArgument: bad rank, size, timeout or secret.
        """
        transport = Transport.start(rank, size, store, float(timeout), secret=secret)
        return cls(
            transport, WORLD_ID, rank, range(size), float(timeout), owns_transport=True, store=store
        )

    @property
    def transport(self) -> Transport:
        """This communicator's transport (the world's for the world communicator)."""
        return self._transport

    @property
    def failure(self) -> CommError | None:
        """The error that broke this communicator's transport (every later call fails fast),
        or None."""
        return self._transport.failure

    def _check(self, what: str) -> None:
        if self._closed:
            raise CommError(
                f"rank {self.global_ranks[self.rank]}: {what} {self.label}: the tcp "
                "communicator is closed"
            )
        if self._alarm.reason is not None and what != "sub":
            # The ranks disagreed on a call of some group of the world, maybe one this rank
            # left as a root before anyone compared: its next call says so. (Not in making a
            # group: that is no call of the others, and a failure there would fail the parent.)
            self._alarm.check()

    def notice_mismatch(self, group: str, reason: str) -> None:
        """Another rank announced a mismatch on ``group``: this rank's next call on any group
        raises it, unless this rank raised it already."""
        self._alarm.sound(group, reason)

    def _peer(self, peer: object, what: str) -> int:
        if isinstance(peer, bool):
            peer = None
        try:
            value = operator.index(peer)  # type: ignore[arg-type]
        except TypeError:
            value = -1
        if not 0 <= value < self.size:
            raise InvalidArgument(
                f"rank {self.global_ranks[self.rank]}: {what} rank must be in "
                f"[0, {self.size}), got {peer!r}"
            )
        return value

    def _tag(self, tag: object, what: str) -> int:
        try:
            value = operator.index(tag)  # type: ignore[arg-type]
        except TypeError:
            value = -1
        if isinstance(tag, bool) or not 0 <= value <= _MAX_TAG:
            raise InvalidArgument(
                f"rank {self.global_ranks[self.rank]}: {what} tag must be an int in "
                f"[0, 2**63), got {tag!r} (negative tags are reserved)"
            )
        return value

    # -- collectives ---------------------------------------------------------------------
    # Large collectives of a group that spans hosts run hierarchically (shared memory inside
    # each host, sockets across: meshcomm.backends.tcp.hosts); large collectives between
    # ranks that can all read each other's memory take the CMA collectives
    # (meshcomm.backends.tcp.same_host.cma_collectives); the rest run the algorithms over the link.
    def _layout(
        self, send: object, recv: object, nbytes: int, op: ReduceOp | None
    ) -> Layout | None:
        """The host layout when this call runs hierarchically (the same on every rank: the
        size and a layout agreed once), else None. Malformed calls stay flat, where the
        algorithms raise the error."""
        if self._hosts.min_bytes < 0 or nbytes < self._hosts.min_bytes:
            return None
        if not (
            flat_vector(recv, True)
            and flat_vector(send, False)
            and send.dtype == recv.dtype  # type: ignore[attr-defined]
            and (op is None or op_allowed(op, recv.dtype))  # type: ignore[attr-defined]
        ):
            return None
        return self._hosts.layout(nbytes)

    def _on_board(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> bool:
        """Whether this all_reduce takes the board: small, well formed, below the CMA
        collectives' size, and every member agreed once that it can (the same on every rank)."""
        if self._board is False:
            return False
        nbytes = recv.nbytes if isinstance(recv, np.ndarray) else 0
        cma_min = self._cma.min_bytes
        if not (
            0 < nbytes <= self._board_max
            and (cma_min < 0 or nbytes < cma_min)
            and flat_vector(recv, True)
            and flat_vector(send, False)
            and send.dtype == recv.dtype
            and send.size == recv.size
            and op_allowed(op, recv.dtype)
        ):
            return False
        if self._board is None:
            self._board = self._board_agree()
        return self._board

    # -- mismatch checks -----------------------------------------------------------------
    def stamp_holder(self) -> TcpLink:
        """The link: its ``stamp`` rides in the tag of every link frame (sockets and rings),
        and in the board's stamp word."""
        return self.link

    def publish_mismatch(self, reason: str) -> str:
        """The transport's abort record, as a mismatch: every member blocked in a call of
        this group raises it within about a second."""
        return self._transport.publish_mismatch(reason)

    def _board_agree(self) -> bool:
        # The first round opens every pair's channel (shared memory is set up, or not, before
        # a pair's first message moves); then every rank says whether it can use the board.
        n, r = self.size, self.rank
        order = [(r + k) % n for k in range(1, n)]
        seen = np.zeros(n, np.uint8)
        hello = np.ones(1, np.uint8)
        self.link.exchange([(j, hello) for j in order], [(j, seen[j : j + 1]) for j in order])
        seen[r] = self._transport.board_local_ok(self.global_ranks)
        mine = seen[r : r + 1].copy()
        self.link.exchange([(j, mine) for j in order], [(j, seen[j : j + 1]) for j in order])
        if not seen.all():
            return False
        self._transport.board_open(self.global_ranks, r)
        return True

    def all_reduce(self, buf: np.ndarray, op: ReduceOp) -> None:
        self._check("all_reduce")
        if self._on_board(buf, buf, op):
            self._transport.board_all_reduce(buf, buf, op, self.link.stamp)
        elif (hosts := self._layout(buf, buf, _nbytes(buf), op)) is not None:
            hierarchical.all_reduce(self.link, buf, op, hosts)
        elif not self._cma.all_reduce(buf, buf, op):
            algorithms.all_reduce(self.link, buf, op)

    def all_reduce_out(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
        """Reduce ``send`` across ranks into ``recv``, leaving ``send`` untouched.

        The group layer hands a synchronous call's input over as ``send``, so the result is
        written without copying the input first.
        """
        self._check("all_reduce")
        if self._on_board(send, recv, op):
            self._transport.board_all_reduce(send, recv, op, self.link.stamp)
        elif (hosts := self._layout(send, recv, _nbytes(recv), op)) is not None:
            hierarchical.all_reduce(self.link, recv, op, hosts, send=send)
        elif not self._cma.all_reduce(send, recv, op):
            algorithms.all_reduce(self.link, recv, op, send=send)

    def runner(self, collective: str, dtype: np.dtype, arg: ReduceOp | int | None) -> Runner | None:
        """The world's all_reduce runner where the board may serve it: a call of at most the
        board's size goes to the board with no check (the plan checked its signature, and the
        group layer hands C-contiguous arrays of one shape); every other call, and the
        first, which agrees on the board, is :meth:`all_reduce_out` on flat views.

        Example:
            >>> TcpCommunicator.runner.__name__
            'runner'
        """
        if (
            collective != "all_reduce"
            or not self._board_max
            or not isinstance(arg, ReduceOp)
            or not op_allowed(arg, dtype)
        ):
            return None
        op: ReduceOp = arg
        cma_min = self._cma.min_bytes
        small = self._board_max if cma_min < 0 else min(self._board_max, cma_min - 1)
        board_all_reduce, link, alarm = self._transport.board_all_reduce, self.link, self._alarm
        flat = self.all_reduce_out

        def run(send: np.ndarray, recv: np.ndarray) -> None:
            nbytes = recv.nbytes
            # _check's two conditions, then _on_board's verdict and size.
            if self._board and 0 < nbytes <= small and alarm.reason is None and not self._closed:
                board_all_reduce(send, recv, op, link.stamp)
            else:
                flat(send.reshape(-1), recv.reshape(-1), op)

        return run

    def all_gather(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._check("all_gather")
        if (hosts := self._layout(send, recv, _nbytes(recv), None)) is not None:
            hierarchical.all_gather(self.link, send, recv, hosts)
        elif not self._cma.all_gather(send, recv):
            algorithms.all_gather(self.link, send, recv)

    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> None:
        self._check("reduce_scatter")
        if (hosts := self._layout(send, recv, _nbytes(send), op)) is not None:
            hierarchical.reduce_scatter(self.link, send, recv, op, hosts)
        elif not self._cma.reduce_scatter(send, recv, op):
            algorithms.reduce_scatter(self.link, send, recv, op)

    def all_to_all(self, send: np.ndarray, recv: np.ndarray) -> None:
        self._check("all_to_all")
        algorithms.all_to_all(self.link, send, recv)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        self._check("broadcast")
        if (
            _root_ok(root, self.size)
            and (hosts := self._layout(buf, buf, _nbytes(buf), None)) is not None
        ):
            hierarchical.broadcast(self.link, buf, root, hosts)
        elif not self._cma.broadcast(buf, root):
            algorithms.broadcast(self.link, buf, root)

    def broadcast_out(self, send: np.ndarray | None, recv: np.ndarray, root: int) -> None:
        """Root's ``send`` into every rank's ``recv`` (root's too); ``send`` is read only on
        root, where peers may read it while root copies it into its own ``recv``."""
        self._check("broadcast")
        if self.rank != root:
            send = None
        elif send is not None and not (
            isinstance(send, np.ndarray)
            and isinstance(recv, np.ndarray)
            and send.ndim == 1
            and send.flags.c_contiguous
            and send.dtype == recv.dtype
            and send.size == recv.size
        ):
            raise InvalidArgument(
                f"rank {self.global_ranks[self.rank]}: broadcast_out send must be a flat "
                f"C-contiguous array like recv, got {getattr(send, 'dtype', type(send))} "
                f"{getattr(send, 'shape', '')} and {getattr(recv, 'dtype', type(recv))} "
                f"{getattr(recv, 'shape', '')}"
            )
        # Every rank makes the same choice: the hierarchical and CMA routes look at the sizes
        # and the communicator's verdicts, never at whether this rank has a send buffer.
        if (
            _root_ok(root, self.size)
            and (hosts := self._layout(recv, recv, _nbytes(recv), None)) is not None
        ):
            if send is not None:
                np.copyto(recv, send)
            hierarchical.broadcast(self.link, recv, root, hosts)
        elif not self._cma.broadcast(recv, root, send=send):
            if send is not None:
                np.copyto(recv, send)
            algorithms.broadcast(self.link, recv, root)

    def reduce(self, buf: np.ndarray, root: int, op: ReduceOp) -> None:
        self._check("reduce")
        algorithms.reduce(self.link, buf, root, op)

    def gather(self, send: np.ndarray, recv: np.ndarray | None, root: int) -> None:
        self._check("gather")
        algorithms.gather(self.link, send, recv, root)

    def scatter(self, send: np.ndarray | None, recv: np.ndarray, root: int) -> None:
        self._check("scatter")
        algorithms.scatter(self.link, send, recv, root)

    def barrier(self) -> None:
        self._check("barrier")
        algorithms.barrier(self.link)

    # -- point to point ------------------------------------------------------------------
    def send(self, array: np.ndarray, dst: int, tag: int) -> None:
        """Send an array of any shape; dtype and shape travel in the frame header.

        Raises:
            InvalidArgument: bad ``dst`` or ``tag`` (negative tags are reserved).
            TypeError: not a numpy array, or a dtype that cannot travel (object, structured).
        """
        self._check("send")
        peer = self._peer(dst, "send")
        t = self._tag(tag, "send")
        if not isinstance(array, np.ndarray):
            raise TypeError(f"send needs a numpy array, got {type(array).__name__}")
        wire.dtype_to_wire(array.dtype)  # TypeError before any I/O
        if not array.flags.c_contiguous:
            array = array.copy(order="C")  # (ascontiguousarray would turn 0-d into 1-d)
        self._transport.send_array(self.comm_id, t, self.global_ranks[peer], array)

    def recv(self, src: int | None, tag: int) -> tuple[np.ndarray, int]:
        """Receive an array sent with ``tag`` from ``src`` (None: any rank) and its sender."""
        self._check("recv")
        peer = ANY_SOURCE if src is None else self.global_ranks[self._peer(src, "recv")]
        t = self._tag(tag, "recv")
        array, source = self._transport.recv_array(self.comm_id, t, peer)
        group_rank = self._group_rank.get(source)
        if group_rank is None:
            raise ProtocolError(
                f"rank {self.global_ranks[self.rank]}: a message {self.label} came from "
                f"global rank {source}, not a member"
            )
        return array, group_rank

    def permute(self, send: np.ndarray, dst: int | None, recv: np.ndarray, src: int | None) -> None:
        self._check("permute")
        sends = [] if dst is None else [(self._peer(dst, "permute dst"), send)]
        recvs = [] if src is None else [(self._peer(src, "permute src"), recv)]
        if sends or recvs:
            self.link.exchange(sends, recvs)

    # -- groups and lifetime -------------------------------------------------------------
    def sub(self, ranks: Sequence[int], *, own_transport: bool = True) -> TcpCommunicator:
        """Return a communicator over ``ranks`` with a transport of its own.

        Members must call ``sub`` with the same list, in the same order relative to their
        other ``sub`` calls with that list; no message is exchanged between ranks (each
        member proposes the transport's token and publishes its address in the store).

        Args:
            ranks: the members, as ranks of this communicator.
            own_transport: False shares this communicator's transport instead: no new
                socket or ring, but an operation of one then waits for the other's.

        Raises:
            InvalidArgument: duplicate or out-of-range ranks, or this rank is not a member.
        """
        self._check("sub")
        # A group made after a failure would find a dead peer only by waiting for it; it
        # fails fast with the parent's error instead, as the parent does.
        self._transport.raise_failure()
        members = [self._peer(r, "sub") for r in ranks]
        me = self.global_ranks[self.rank]
        if len(set(members)) != len(members):
            raise InvalidArgument(f"rank {me}: sub ranks must be distinct, got {list(ranks)}")
        if self.rank not in members:
            raise InvalidArgument(
                f"rank {me}: sub is called by members only; rank {self.rank} is not in {members}"
            )
        key = tuple(members)
        count = self._subs.get(key, 0)
        self._subs[key] = count + 1
        global_members = [self.global_ranks[r] for r in members]
        comm_id = sub_id(self.comm_id, global_members, count)
        if self._store is None or not own_transport:
            transport, owns = self._transport, False
        else:
            # World ranks inside: the group's transport talks to its members only, and its
            # errors name ranks as the world knows them.
            keys = PrefixStore(f"meshcomm/group/{comm_id:016x}/", self._store)
            transport, owns = self._transport.sibling(keys), True
        return TcpCommunicator(
            transport,
            comm_id,
            members.index(self.rank),
            global_members,
            self.timeout,
            owns_transport=owns,
            store=self._store,
        )

    def announce_abort(self, reason: str) -> None:
        """Abort the world of this communicator's transport (if it owns one) on purpose:
        the peers' calls in flight end with :class:`~meshcomm.errors.PeerClosed` and
        ``reason`` instead of waiting or calling the goodbye a death."""
        if self._owns and not self._closed:
            self._transport.announce_abort(reason)

    def close(self) -> None:
        """Release this communicator; the world's close also closes every socket."""
        if self._closed:
            return
        self._closed = True
        if self._owns:
            self._transport.close()
        else:
            self._transport.forget(self.comm_id)

    def __repr__(self) -> str:
        return (
            f"TcpCommunicator(rank={self.rank}, size={self.size}, id={self.comm_id:#x}, "
            f"global_ranks={self.global_ranks})"
        )
