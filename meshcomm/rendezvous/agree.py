"""Agreeing on ranks: every rank checks the world size, claims its rank with ``compare_set``
and waits at an arrival barrier; a rank that finds a problem writes an abort record, so the
others fail at once with the same reason instead of at their timeout.

Example:
    >>> from meshcomm.store import HashStore
    >>> store = HashStore()
    >>> agree(store, "ns", 0, 1, 5.0, time.monotonic() + 5, False, "a HashStore")
    >>> store.get("ns/done")
    b'ok'
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from typing import TYPE_CHECKING

from meshcomm.errors import RendezvousError, StoreError, StoreTimeout
from meshcomm.rendezvous.arrival import local_world_size_hint, missing_ranks, wait_for_all

if TYPE_CHECKING:
    from meshcomm.store.base import Store

__all__ = ["agree", "poll_counter"]

# After an abort, the rank that hosts the store server keeps it up this long (at most) so the
# other ranks can read the reason instead of seeing a dropped connection.
_ABORT_LINGER = 2.0


def poll_counter(store: Store, key: str, target: int, seconds: float) -> bool:
    """Wait until the counter ``key`` reaches ``target``; False if ``seconds`` pass first."""
    deadline = time.monotonic() + seconds
    delay = 0.002
    while store.add(key, 0) < target:
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    return True


def agree(
    store: Store,
    ns: str,
    rank: int,
    world_size: int,
    seconds: float,
    deadline: float,
    hosts: bool,
    address: str,
) -> None:
    """Check world size, claim the rank, wait for everyone; abort the world on any problem."""
    token = f"host {socket.gethostname()} pid {os.getpid()} id {uuid.uuid4().hex[:12]}"
    abort_key, done_key = f"{ns}/abort", f"{ns}/done"
    try:
        store.add(f"{ns}/entered", 1)
        if store.check([abort_key]):
            raise _aborted(store, ns, rank, hosts)
        local = local_world_size_hint()
        mine = f"{world_size} {rank} {local}"
        first = store.compare_set(f"{ns}/world_size", "", mine).decode()
        first_size, first_rank, first_local = [*first.split(), "0", "0"][:3]
        if first_size != str(world_size):
            per_node = ""
            if local and first_local not in ("0", str(local)):
                per_node = (
                    f" ({local} vs {first_local} ranks per node: is --nproc-per-node the "
                    "same on every node?)"
                )
            raise _abort(
                store,
                ns,
                rank,
                hosts,
                f"ranks disagree on the world size: rank {rank} has world size {world_size} "
                f"but rank {first_rank} has world size {first_size}{per_node}",
            )
        owner = store.compare_set(f"{ns}/rank/{rank}", "", token).decode()
        if owner != token:
            raise _abort(
                store,
                ns,
                rank,
                hosts,
                f"two processes claim rank {rank}: {owner} and {token} (a stale store from an "
                "earlier run can cause this too)",
            )
        if store.add(f"{ns}/arrived", 1) == world_size:
            store.set(done_key, "ok")
        try:
            wait_for_all(store, ns, rank, world_size, seconds, deadline)
        except StoreTimeout:
            missing = missing_ranks(store, ns, world_size)
            arrived = world_size - len(missing)
            raise _abort(
                store,
                ns,
                rank,
                hosts,
                f"rendezvous timed out after {seconds:g} s: rank(s) {missing} never arrived "
                f"({arrived} of {world_size} arrived at {address})",
            ) from None
        if store.check([abort_key]):
            raise _aborted(store, ns, rank, hosts)
        # The server host waits until every rank has seen "done": closing it sooner (say,
        # an immediate shutdown) would cut off ranks still polling.
        store.add(f"{ns}/departed", 1)
        if hosts and not poll_counter(
            store, f"{ns}/departed", world_size, max(deadline - time.monotonic(), 1e-3)
        ):
            raise RendezvousError(
                f"rank {rank}: not every rank confirmed the end of the rendezvous at {address} "
                f"within {seconds:g} s"
            )
    except StoreError as exc:
        raise RendezvousError(
            f"rank {rank}: lost the rendezvous store at {address}: {exc} (the rank hosting it "
            "may have failed)"
        ) from exc


def _abort(store: Store, ns: str, rank: int, hosts: bool, reason: str) -> RendezvousError:
    """Publish ``reason`` as the world's abort record (first one wins) and return the error."""
    try:
        store.compare_set(f"{ns}/abort", "", reason)
        store.set(f"{ns}/done", "abort")
        store.add(f"{ns}/abort_seen", 1)
        if hosts:
            entered = store.add(f"{ns}/entered", 0)
            poll_counter(store, f"{ns}/abort_seen", entered, _ABORT_LINGER)
    except StoreError:
        pass  # the store is gone; the local error still carries the reason
    return RendezvousError(f"rank {rank}: {reason}")


def _aborted(store: Store, ns: str, rank: int, hosts: bool) -> RendezvousError:
    """The error of a rank that found the abort record another rank wrote."""
    reason = store.get(f"{ns}/abort").decode(errors="replace")
    store.add(f"{ns}/abort_seen", 1)
    if hosts:
        poll_counter(store, f"{ns}/abort_seen", store.add(f"{ns}/entered", 0), _ABORT_LINGER)
    return RendezvousError(f"rank {rank}: rendezvous aborted: {reason}")
