"""Same-host fast path of the tcp backend: byte rings in shared memory, woken by futexes.

Two ranks on one host exchange bytes through two :class:`ShmChannel` rings (one each way)
instead of a loopback socket. A channel is a non-blocking byte stream shaped like a socket
(``send_some`` / ``recv_into_some`` copy what fits or what is there, 0 when they can't), so the
transport's progress engine treats channels and sockets alike. Waiting never spins for long: each
process owns one :class:`Doorbell`, a 32-bit futex word in shared memory that every same-host
peer rings when it makes data (or ring space) available. The doorbell's file also carries
the owner's board for small all_reduces (:mod:`~meshcomm.backends.tcp.same_host.board`).

Ring layout (one file per direction, created by the receiver)::

    header, 4096 bytes of u64 words, each written by exactly one side:
        0 magic "MCSHMRNG", 1 version, 2 capacity, 3 receiver rank, 4 sender rank, 5 nonce
        8 head (bytes ever written), 9 closed, 10 blocked      (sender's cache line)
        16 tail (bytes ever read), 17 closed, 18 blocked       (receiver's cache line)
    data, ``capacity`` bytes; byte ``i`` of the stream lives at ``i % capacity``

Head and tail are monotonically increasing 64-bit counts, each written by a single process, so
no read-modify-write atomics are needed, only ordering:

* **Memory ordering.** The sender copies bytes, *then* stores head; the receiver loads head,
  *then* copies bytes, *then* stores tail; the sender loads tail before overwriting. On x86-64
  (TSO) plain aligned 8-byte loads and stores give exactly this: stores are not reordered with
  stores, loads not with loads, and a load not with a later store; the copy and the counter store
  happen in separate C calls through pointers, so no compiler may reorder them either. Other
  architectures (aarch64) need release stores and acquire loads: there the counters go through
  libatomic's ``__atomic_store_8(RELEASE)`` / ``__atomic_load_8(ACQUIRE)``; without libatomic,
  :func:`shm_supported` is False and the transport uses sockets.

* **Who rings.** A futex wake is a syscall (and wakes a process that may not care), so a
  publication rings the peer only if the peer both *came up short on this ring at the current
  position* (its "blocked" word, set by a ``send_some`` / ``recv_into_some`` that moved fewer
  bytes than offered) and *may be asleep* (the may-be-asleep flag ``S`` in its doorbell, set by
  :meth:`Doorbell.arm`, cleared when :meth:`Doorbell.wait` returns). Both are Dekker pairs with
  sequentially consistent fences (libatomic's ``atomic_thread_fence``): the short side stores
  its mark (or ``S``), fences, and looks at the ring (the channels) again; the publishing side
  stores its counter, fences, and loads the mark and ``S``. So either the waiter sees the
  publication or the publisher sees both flags and rings. Without that fence (no libatomic)
  every publication rings: correct, one syscall more each. Contract for the engine: before it
  waits for a channel, its last operation on that channel must have come up short (attempt
  the operation; do not pre-filter with :meth:`ShmChannel.readable_bytes`).

* **No lost wake-up.** A waiter (1) arms: sets ``S``, fences, snapshots its doorbell ``v``;
  (2) checks its channels; (3) futex-waits while the word still equals ``v``. A ringer (a)
  publishes, (b) decides to ring as above, (c) rings with ``FUTEX_WAKE_OP``, which increments the
  word atomically and wakes its waiters under the kernel's futex bucket lock; the kernel's
  compare-and-enqueue in (3) takes the same lock. If (c) is ordered before the load of ``v``, (a)
  is visible to (2) (the atomic op orders a before c; TSO or acquire orders the load before 2).
  If (c) comes later, either its locked section runs first and (3) sees a value other than ``v``
  and returns at once, or (3) runs first and is queued when (c) wakes it. A plain
  ``word = word + 1`` from user space would not do: two ringers could both write ``v+1``, the
  later one's publication still in a store buffer while the waiter checks, and the waiter would
  sleep on a word that no longer changes. A lost wake-up needs exactly 2**32 rings between (1)
  and (3), and every wait has a timeout besides.

* **Lifecycle.** Names in ``/dev/shm`` live only while set-up is in flight. The receiver
  creates its ring (``posix_fallocate`` first, so a full ``/dev/shm`` is an error now, not a
  SIGBUS later) and offers its name with its doorbell's; the peer opens the ring, *unlinks the
  name itself* before it moves any byte, and acknowledges; the creator unlinks again after the
  ack (a no-op unless the peer failed halfway). A doorbell is shared with every same-host peer,
  so its owner keeps its descriptor open and peers open ``/proc/<pid>/fd/<n>`` (same user,
  no name needed); the first ack that says so unlinks the doorbell's name. Where ``/proc``
  refuses, peers open it by name, unlinked once ``expected_peers`` handshakes ended (or at
  :meth:`Doorbell.seal` / close). Mappings outlive names, so nothing is left on exit or on
  SIGKILL of either side once set-up is done; a process killed *during* set-up can leave a
  name, which :func:`sweep` removes (names carry the creator's pid). No
  ``multiprocessing.shared_memory``, so no resource tracker is involved.

* **Peer death.** A ring cannot see EOF; :meth:`ShmChannel.peer_alive` checks the peer's pid and
  start time in ``/proc`` (a reused pid or a zombie counts as dead), for the engine to call when a
  wait slice expires. A graceful :meth:`ShmChannel.close` sets the closed word and rings the peer.

* **Single copy for large messages.** The offer carries the address of an 8-byte probe word
  holding the ring's nonce; the peer tries to read it with ``process_vm_readv``
  (:mod:`~meshcomm.backends.tcp.same_host.cma`) and says in its ack whether that worked
  (:attr:`ShmPair.peer_reads_us`). The transport then sends large payloads as an address
  (RTS frame) that the receiver copies from directly, instead of through the ring.

Modules: :mod:`~meshcomm.backends.tcp.same_host.platform` (platform, names, mappings, sweep),
:mod:`~meshcomm.backends.tcp.same_host.doorbell` (futex doorbells), this one (rings, pairs,
handshake).

A progress engine waits like this (check, arm, check again, then sleep)::

    while pending:
        if step_all_channels():                # send_some / recv_into_some, non-blocking
            continue
        bell.arm()
        if step_all_channels():
            bell.disarm()
            continue
        if not bell.wait(0.1) and not all(pair.peer_alive() for pair in pairs):
            raise PeerError(...)

Channels are not thread-safe; one thread drives all channels of a process (another thread may
call :meth:`Doorbell.wake` to interrupt its wait, e.g. when a socket became readable).

Example:
    >>> a, b = Doorbell("doc", 0, expected_peers=1), Doorbell("doc", 1, expected_peers=1)
    >>> ha, hb = ShmHandshake(a, peer=1, capacity=64), ShmHandshake(b, peer=0, capacity=64)
    >>> ha.accept(hb.offer()); hb.accept(ha.offer())
    >>> pa, pb = ha.complete(hb.ack()), hb.complete(ha.ack())
    >>> pa.tx.send_some(memoryview(b"hello")), pb.rx.readable_bytes()
    (5, 5)
    >>> buf = bytearray(8); pb.rx.recv_into_some(memoryview(buf)), bytes(buf[:5])
    (5, b'hello')
    >>> for thing in (pa, pb, a, b): thing.close()
"""

from __future__ import annotations

from meshcomm.backends.tcp.same_host.doorbell import DEFAULT_SPIN_US, Doorbell
from meshcomm.backends.tcp.same_host.handshake import ShmHandshake
from meshcomm.backends.tcp.same_host.platform import (
    DEFAULT_CAPACITY,
    MAX_CAPACITY,
    SHM_DIR,
    default_capacity,
    host_key,
    shm_enabled,
    shm_supported,
    sweep,
)
from meshcomm.backends.tcp.same_host.ring_channel import ShmChannel, ShmPair

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_SPIN_US",
    "MAX_CAPACITY",
    "SHM_DIR",
    "Doorbell",
    "ShmChannel",
    "ShmHandshake",
    "ShmPair",
    "default_capacity",
    "host_key",
    "shm_enabled",
    "shm_supported",
    "sweep",
]
