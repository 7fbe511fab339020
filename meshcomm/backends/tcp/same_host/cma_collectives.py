"""CMA collectives: same-host collectives in one or two rounds, ranks copying straight between
each other's buffers with ``process_vm_readv`` / ``process_vm_writev``.

When every member of a communicator is a shared-memory peer whose memory this process can
read and write with ``process_vm_readv`` / ``process_vm_writev`` (and that can do the same to
ours), large collectives skip the step-by-step algorithms of
:mod:`meshcomm.backends.algorithms`. Ranks publish the addresses of their buffers to each
other (one round of 8- or 16-byte messages through the rings) and then copy what they need
straight out of (or into) each other's memory:

* ``all_reduce``: rank r owns block r of the result. It reads block r of every peer's input,
  piece by piece (``PIECE_BYTES``), into a scratch piece that stays in the cache,
  folds it into its own result, and writes each finished piece into every peer's result
  while it is still in the cache. A second round says every block has been written (and
  every input read). Two rounds whatever the world size, against ``2(n-1)`` dependent steps
  for the ring: with more ranks than cores, each step of a ring waits for a descheduled
  peer. Per rank, ``(n-1)/n`` of the buffer is read and ``(n-1)/n`` written once, as in the
  ring, but with no copy through the rings and no pipeline to fill.
* ``reduce_scatter``: the first half of that (two rounds).
* ``all_gather``: rank r reads every peer's input into its result (two rounds).
* ``broadcast``: the root publishes its address, every other rank reads the buffer and
  tells the root it is done (one message each way).

Every member must choose this path for the same call, so the choice depends only on the
size (the same on every rank) and on a verdict agreed once per communicator: the first call
that could use it sends a message to every member (which sets up every pair's channel, and
carries the address of a word the peers write to as a probe), then every rank tells every
member whether it could read and write every peer. The path is used only if all could.
Anything else (sockets, a kernel or seccomp filter that refuses either call) keeps the
step-by-step algorithms, on every rank.

Buffers stay alive and unchanged while peers may touch them: a rank returns only after the
last round, which every peer enters after its last copy. Only rank r ever reads or writes
block r of anybody's buffers during an ``all_reduce``, so in-place calls are safe. A peer
that dies makes the next copy fail with ``ESRCH`` or the next round see its EOF:
:class:`~meshcomm.errors.PeerError` naming it. A frozen peer makes a round time out.

Knob: ``MESHCOMM_SHM_DIRECT_MIN`` (bytes; the smallest size that takes this path, see
:func:`min_bytes`; ``0`` or negative: never), read once at import. The variable keeps the
name it had when these were called "the direct path".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from meshcomm.backends.algorithms._common import block_bounds, combine_into
from meshcomm.backends.tcp.thresholds import size_threshold
from meshcomm.reduction import PRIMITIVE_OP_KINDS, ReduceOp

if TYPE_CHECKING:
    from meshcomm.backends.tcp.link import TcpLink

__all__ = ["MIN_BYTES", "PIECE_BYTES", "CmaCollectives", "flat_vector", "min_bytes", "op_allowed"]

#: The smallest buffer (all_reduce, broadcast), result (all_gather) or input (reduce_scatter)
#: that takes the CMA collectives. Below it the step-by-step algorithms win: at 4 ranks on 2 cores
#: an all-to-all round costs about as much as two pairwise steps, and the small algorithms
#: need few steps (measured on the 2-core VM at 2 and 4 ranks: the crossover lies between
#: 128 KiB and 1 MiB for these collectives, noisily).
MIN_BYTES = 256 << 10
#: Reductions read peers' blocks in pieces of this size and fold each into the result while
#: it is still in the cache (1 MiB: the L2 of a core here; 64 and 256 KiB pieces were slower
#: by up to 1.5x at 64 MiB, the per-piece calls dominating, and 4 MiB ones no faster).
PIECE_BYTES = 1 << 20


# Read once: every rank must choose the same path for the same call.
_MIN = size_threshold("MESHCOMM_SHM_DIRECT_MIN", MIN_BYTES)


def min_bytes(size: int) -> int:
    """The smallest size (bytes) that takes the CMA collectives on ``size`` ranks; -1: never.

    Example:
        >>> min_bytes(4) > 0, min_bytes(1)
        (True, -1)
    """
    if size < 2:
        return -1
    return _MIN


def op_allowed(op: object, dtype: np.dtype) -> bool:
    """Whether ``op`` is a primitive reduce op defined for ``dtype``'s kind.

    Example:
        >>> op_allowed(ReduceOp.SUM, np.dtype(np.float32))
        True
        >>> op_allowed(ReduceOp.BAND, np.dtype(float))
        False
    """
    return (op, dtype.kind) in PRIMITIVE_OP_KINDS


def flat_vector(arr: object, writable: bool) -> bool:
    """Whether ``arr`` is a 1-D C-contiguous numpy array (and writable, where asked).

    Example:
        >>> flat_vector(np.zeros(3), True), flat_vector(np.zeros((2, 2)), False)
        (True, False)
    """
    return (
        isinstance(arr, np.ndarray)
        and arr.ndim == 1
        and arr.flags.c_contiguous
        and (arr.flags.writeable or not writable)
    )


class CmaCollectives:
    """The CMA collectives of one communicator (see the module docstring).

    Methods return False, having done nothing, when the call should take the step-by-step
    algorithms instead: a size below :func:`min_bytes`, a world where some pair cannot read
    each other, or arguments that are not well formed (the algorithms then raise the error).

    Args:
        link: the communicator's link.
    """

    def __init__(self, link: TcpLink) -> None:
        self.link = link
        self.rank = link.rank
        self.size = link.size
        self.min_bytes = min_bytes(link.size)
        self._verdict: bool | None = None
        self._order = [(link.rank + k) % link.size for k in range(1, link.size)]
        self._global = link.global_ranks
        self._read = link.transport.memory.read
        self._write = link.transport.memory.write
        self._token = np.zeros(1, np.uint64)
        self._probe = np.zeros(1, np.uint64)  # peers write here to see that they can
        self._scratch = np.empty(0, np.uint8)

    # -- choice ----------------------------------------------------------------------------
    def _wanted(self, nbytes: int) -> bool:
        if self.min_bytes < 0 or nbytes < self.min_bytes or nbytes == 0:
            return False
        if self._verdict is None:
            self._verdict = self._agree()
        return self._verdict

    def _agree(self) -> bool:
        # The first round opens every pair's channel (shared memory is set up, or not, before
        # a pair's first message moves) and tells every rank where to probe writing to us;
        # then every rank says what it found.
        memory = self.link.transport.memory
        probes = self._round(np.array([self._probe.ctypes.data], np.uint64)).tolist()
        ok = memory.reads_all(self._global[j] for j in self._order)
        source = self._token.ctypes.data
        for j in self._order:
            ok = ok and memory.writes_to(self._global[j], probes[j][0], 8, source)
        verdict = bool(self._round(np.array([ok], np.uint64)).all())
        return verdict

    # -- rounds ----------------------------------------------------------------------------
    def _round(self, mine: np.ndarray) -> np.ndarray:
        """Send ``mine`` to every member and return every member's, by rank."""
        out = np.empty((self.size, mine.size), mine.dtype)
        out[self.rank] = mine
        order = self._order
        self.link.exchange([(j, mine) for j in order], [(j, out[j]) for j in order])
        return out

    def _piece(self, dtype: np.dtype) -> tuple[np.ndarray, int]:
        step = max(1, PIECE_BYTES // dtype.itemsize)
        nbytes = step * dtype.itemsize
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        tmp = self._scratch[:nbytes].view(dtype)
        return tmp, step

    def _reduce_block(
        self,
        op: ReduceOp,
        own: np.ndarray,
        out: np.ndarray,
        peer_addrs: Sequence[int],
        offset: int,
        spread: Sequence[int] | None = None,
    ) -> None:
        """``out = op(own, the same elements of every peer)``; the peers' elements start at
        byte ``offset`` of the buffers at ``peer_addrs`` (by rank). With ``spread``, each
        reduced piece is also written at the same offset of the buffers at ``spread`` (by
        rank) while it is still in the cache."""
        count = out.size
        if not count:
            return
        item = out.itemsize
        tmp, step = self._piece(out.dtype)
        tmp_addr = tmp.ctypes.data
        out_addr = out.ctypes.data
        read, write, g, order = self._read, self._write, self._global, self._order
        for lo in range(0, count, step):
            hi = min(count, lo + step)
            m = hi - lo
            t = tmp[:m]
            acc = out[lo:hi]
            first = own[lo:hi]
            at = offset + lo * item
            for j in order:
                read(g[j], tmp_addr, m * item, peer_addrs[j] + at)
                combine_into(op, first, t, acc)
                first = acc
            if spread is not None:
                for j in order:
                    write(g[j], spread[j] + at, m * item, out_addr + lo * item)

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> bool:
        """Reduce ``send`` into ``recv`` (``send`` may be ``recv``); False: not taken."""
        if not (
            flat_vector(recv, True)
            and flat_vector(send, False)
            and send.dtype == recv.dtype
            and send.size == recv.size
            and op_allowed(op, recv.dtype)
            and self._wanted(recv.nbytes)
        ):
            return False
        if send is not recv and np.may_share_memory(send, recv):
            send = send.copy()
        n, r = self.size, self.rank
        addrs = self._round(np.array([send.ctypes.data, recv.ctypes.data], np.uint64)).tolist()
        bounds = block_bounds(recv.size, n)
        lo, hi = bounds[r], bounds[r + 1]
        self._reduce_block(
            op,
            send[lo:hi],
            recv[lo:hi],
            [a[0] for a in addrs],
            lo * recv.itemsize,
            spread=[a[1] for a in addrs],
        )
        # Every peer has written its block into our result and read its block of our input.
        self._round(self._token)
        return True

    def reduce_scatter(self, send: np.ndarray, recv: np.ndarray, op: ReduceOp) -> bool:
        """Block r of the reduction of every ``send`` into rank r's ``recv``; False: not taken."""
        if not (
            flat_vector(recv, True)
            and flat_vector(send, False)
            and send.dtype == recv.dtype
            and send.size == self.size * recv.size
            and op_allowed(op, recv.dtype)
            and self._wanted(send.nbytes)
        ):
            return False
        if np.may_share_memory(send, recv):
            send = send.copy()
        m, r = recv.size, self.rank
        addrs = self._round(np.array([send.ctypes.data], np.uint64)).tolist()
        own = send[r * m : (r + 1) * m]
        self._reduce_block(op, own, recv, [a[0] for a in addrs], r * m * recv.itemsize)
        self._round(self._token)  # nobody reads our input any more
        return True

    def all_gather(self, send: np.ndarray, recv: np.ndarray) -> bool:
        """Every rank's ``send`` into every ``recv``, by rank; False: not taken."""
        if not (
            flat_vector(recv, True)
            and flat_vector(send, False)
            and send.dtype == recv.dtype
            and recv.size == self.size * send.size
            and self._wanted(recv.nbytes)
        ):
            return False
        nbytes = send.nbytes
        recv_addr = recv.ctypes.data
        mine = recv_addr + self.rank * nbytes
        if send.ctypes.data != mine and np.may_share_memory(send, recv):
            send = send.copy()
        addrs = self._round(np.array([send.ctypes.data], np.uint64)).tolist()
        if send.ctypes.data != mine:
            recv[self.rank * send.size : (self.rank + 1) * send.size] = send
        read, g = self._read, self._global
        for j in self._order:
            read(g[j], recv_addr + j * nbytes, nbytes, addrs[j][0])
        self._round(self._token)  # nobody reads our input any more
        return True

    def broadcast(self, buf: np.ndarray, root: int, send: np.ndarray | None = None) -> bool:
        """Root's ``buf`` into every rank's ``buf``; False: not taken.

        With ``send`` on root, peers read ``send`` while root copies it into its ``buf``.
        """
        if not (
            flat_vector(buf, True)
            and isinstance(root, int)
            and not isinstance(root, bool)
            and 0 <= root < self.size
            and (
                send is None
                or self.rank != root
                or (flat_vector(send, False) and send.dtype == buf.dtype and send.size == buf.size)
            )
            and self._wanted(buf.nbytes)
        ):
            return False
        link = self.link
        if self.rank == root:
            others = self._order
            source = buf if send is None else send
            if source is not buf and np.may_share_memory(source, buf):
                np.copyto(buf, source)  # peers must not read what we are overwriting
                source = buf
            address = np.array([source.ctypes.data], np.uint64)
            link.exchange([(j, address) for j in others], [])
            if source is not buf:
                np.copyto(buf, source)
            done = np.empty((self.size, 1), np.uint64)
            link.exchange([], [(j, done[j]) for j in others])
            return True
        address = np.empty(1, np.uint64)
        link.exchange([], [(root, address)])
        self._read(self._global[root], buf.ctypes.data, buf.nbytes, int(address[0]))
        link.exchange([(root, self._token)], [])
        return True
