"""How the tcp transport waits: its timing constants, its spin policy, and the one wait loop.

Every blocking call of the transport (an exchange, a send or receive, a board all_reduce)
ends in :meth:`Waiter.until`: drive the channels until a *done?* predicate holds. In turn:

* poll the shared-memory rings, and return once the call is done;
* no progress for the timeout raises :class:`~meshcomm.errors.CommTimeout`;
* about once a second (``ABORT_CHECK_INTERVAL``) look for another rank's abort record;
* sleep: in ``select`` on the sockets when no ring is attached; in ``select`` slices of
  ``MIXED_MIN`` to ``MIXED_MAX`` (``MIXED_IDLE`` when only sockets have work pending) when some
  pending operation needs a socket, polling the rings between slices; otherwise look at the
  sockets every ``SOCKET_POLL`` (EOF of a dead peer, new connections), poll the rings for the
  spin budget (:class:`Spinner`), then arm the futex doorbell, look once more, and sleep on it.

These are the only timing constants of the transport's waiting (and of its connect attempts);
every call of the engine and the board use this loop, each with its own predicate.

Example:
    >>> spin_policy(1) >= 0
    True
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Protocol

from meshcomm.backends.tcp.same_host.doorbell import Doorbell, spin_us_from_env
from meshcomm.errors import CommTimeout

__all__ = [
    "ABORT_CHECK_INTERVAL",
    "CONNECT_ATTEMPT",
    "MIXED_IDLE",
    "MIXED_MAX",
    "MIXED_MIN",
    "SOCKET_POLL",
    "SPIN_FIT_US",
    "SPIN_MIN_US",
    "SPIN_SHARED_US",
    "Progress",
    "Rings",
    "Spinner",
    "Waiter",
    "shares_cores",
    "spin_policy",
]

#: Seconds between looks at the store's abort record while a call waits (or connects).
ABORT_CHECK_INTERVAL = 1.0
#: Seconds one connect attempt may take (a dead address fails fast; attempts repeat, with
#: a growing pause, until the transport's timeout).
CONNECT_ATTEMPT = 2.0
#: Sleeping on the doorbell, look at the sockets at least this often (seconds).
SOCKET_POLL = 0.01
#: Sleeping in select with shared-memory operations pending: poll the rings this often.
MIXED_MIN, MIXED_MAX = 0.0001, 0.002
#: ... and with only socket operations pending (the rings are drained for others' sake).
MIXED_IDLE = 0.01
#: Microseconds a waiter polls its rings before sleeping, with a core to itself ...
SPIN_FIT_US = 1000.0
#: ... and with more local ranks than cores, or a machine loaded by others.
SPIN_SHARED_US = 200.0
#: The poll shrinks to this after polls that found nothing (the peer is not running).
SPIN_MIN_US = 20.0
# How often the host's load is looked at (os.getloadavg).
_LOAD_CHECK = 1.0


def spin_policy(local_size: int) -> float:
    """Seconds a waiter polls its rings before it sleeps on its doorbell.

    A futex wake-up costs tens of microseconds on a virtual machine, more than a whole
    small exchange, so a waiter polls first, giving its core away between polls
    (``sched_yield``) so that a rank with work runs first: at most ``SPIN_FIT_US`` when every
    local rank has a core, ``SPIN_SHARED_US`` when they share. ``MESHCOMM_SHM_SPIN_US`` sets
    the time (0: sleep at once). The engine adapts below this bound (:class:`Spinner`).

    Raises:
        InvalidArgument: ``MESHCOMM_SHM_SPIN_US`` is not a number in [0, 1e6].

    Example:
        >>> spin_policy(1) >= 0
        True
    """
    value = spin_us_from_env()
    if value is not None:
        return value * 1e-6
    return (SPIN_SHARED_US if shares_cores(local_size) else SPIN_FIT_US) * 1e-6


def shares_cores(local_size: int) -> bool:
    """Whether this host's ranks outnumber this process's cores.

    Example:
        >>> shares_cores(1)
        False
    """
    return local_size > len(os.sched_getaffinity(0))


class Spinner:
    """How long to poll before sleeping: a budget under a fixed bound.

    With a core per local rank the budget adapts: a poll that ends with data doubles it (up
    to the bound), one that finds nothing halves it (down to ``SPIN_MIN_US``), because a
    peer that is not running (its core taken by another process) is only delayed by a
    poller that holds a core; and while the host's load average exceeds its cores, the bound
    drops to ``SPIN_SHARED_US``. When local ranks share cores the budget stays at its bound:
    a poller yields its core between polls, so a rank with work on the same core runs first.

    Example:
        >>> Spinner(0.001, shared=True).limit(0.0)
        0.001
    """

    def __init__(self, bound: float, shared: bool) -> None:
        self.bound = bound
        self.budget = bound
        self._adapt = not shared and bound > SPIN_SHARED_US * 1e-6
        self._cores = len(os.sched_getaffinity(0))
        self._busy = False
        self._checked = 0.0

    def limit(self, now: float) -> float:
        """The bound in force now (lower while the host is loaded by others)."""
        if not self._adapt:
            return self.bound
        if now - self._checked >= _LOAD_CHECK:
            self._checked = now
            try:
                self._busy = os.getloadavg()[0] > self._cores + 0.5
            except OSError:
                self._busy = False
        return SPIN_SHARED_US * 1e-6 if self._busy else self.bound

    def update(self, hit: bool, now: float) -> None:
        """Grow the budget after a poll that found work, shrink it after one that did not."""
        if not self._adapt:
            return
        if hit:
            self.budget = min(self.limit(now), 2 * self.budget)
        else:
            self.budget = max(SPIN_MIN_US * 1e-6, self.budget / 2)


class Progress:
    """What a call in progress has left, shared by the parts of one transport.

    The matching, the socket engine and the ring engine count the call's operations here as
    they post and complete them, and say when bytes moved; the wait loop reads both.

    Attributes:
        pending: operations of the current call not yet complete.
        moved: bytes moved (or a peer arrived) since the wait loop last looked.
        last_abort_check: when the abort record was last read (``time.monotonic``).
        last_socket_poll: when the sockets were last looked at while sleeping on rings.

    Example:
        >>> Progress().pending
        0
    """

    __slots__ = ("last_abort_check", "last_socket_poll", "moved", "pending")

    def __init__(self) -> None:
        self.pending = 0
        self.moved = False
        self.last_abort_check = 0.0
        self.last_socket_poll = 0.0


class Rings(Protocol):
    """What the wait loop needs of the shared-memory ring engine."""

    @property
    def bell(self) -> Doorbell | None:
        """This process's doorbell, when rings are attached; else None."""

    def poll(self) -> None:
        """Read every ring and write what waits for room."""

    def poll_moved(self) -> None:
        """:meth:`poll`, only when a ring's counters moved since the last look."""


class Waiter:
    """The one wait loop of a transport (see the module docstring).

    Args:
        rank: this process's global rank (for messages).
        timeout: seconds without progress before ``CommTimeout``.
        progress: the transport's counters.
        spinner: the spin budget.
        rings: the ring engine.
        select: look at the sockets, sleeping up to the given seconds.
        check_abort: raise if another rank published an abort record.

    Example:
        >>> Waiter.__name__
        'Waiter'
    """

    def __init__(
        self,
        rank: int,
        timeout: float,
        progress: Progress,
        spinner: Spinner,
        rings: Rings,
        select: Callable[[float], None],
        check_abort: Callable[[], None],
    ) -> None:
        self.rank = rank
        self.timeout = timeout
        self.spinner = spinner
        self._progress = progress
        self._rings = rings
        self._select = select
        self._check_abort = check_abort

    def until(
        self,
        done: Callable[[], bool],
        stalled: Callable[[], str],
        *,
        poll_always: bool = True,
        respin: bool = True,
        needs_socket: Callable[[], bool] | None = None,
        rings_pending: Callable[[], bool] | None = None,
    ) -> None:
        """Drive the channels until ``done()`` holds.

        Args:
            done: whether the call is complete (it may raise, e.g. for a peer gone).
            stalled: what the call was doing, for the timeout's message.
            poll_always: poll the rings every round (the engine's calls), or only when a
                ring's counters moved (the board, which reads its own words).
            respin: poll again after each progress, and let what polling found adapt the
                spin budget (the engine's calls, made of many frames); False: one spin at
                the budget as it stands, then sleep until done (the board: a single round,
                where a poller that spins again for each member that arrives takes the core
                from the members still to come).
            needs_socket: whether some pending operation waits on a socket (None: never).
            rings_pending: whether some pending operation waits on a ring.

        Raises:
            CommTimeout: no progress for the timeout.
            PeerError: another rank's abort record, or what ``done`` raises.
        """
        progress = self._progress
        rings = self._rings
        select = self._select
        poll = rings.poll if poll_always else rings.poll_moved
        clock = time.monotonic
        timeout = self.timeout
        start = last_progress = clock()
        mixed = MIXED_MIN
        spun = False
        while True:
            bell = rings.bell
            if bell is not None:
                poll()
            if done():
                return
            now = clock()
            if progress.moved:
                progress.moved = False
                last_progress = now
                mixed = MIXED_MIN
                spun = spun and not respin  # poll again before the next sleep
            idle = now - last_progress
            if idle >= timeout:
                raise CommTimeout(f"rank {self.rank}: no progress for {timeout:g} s in {stalled()}")
            since_check = now - max(progress.last_abort_check, start)
            if since_check >= ABORT_CHECK_INTERVAL:
                progress.last_abort_check = now
                self._check_abort()
                since_check = 0.0
            wait = min(timeout - idle, ABORT_CHECK_INTERVAL - since_check)
            if bell is None:
                select(wait)  # sockets only
            elif needs_socket is not None and needs_socket():
                # Some operation waits on a socket: sleep in select, poll the rings between.
                pending = rings_pending is not None and rings_pending()
                select(min(wait, mixed if pending else MIXED_IDLE))
                mixed = min(2 * mixed, MIXED_MAX)
            elif now - progress.last_socket_poll >= SOCKET_POLL:
                progress.last_socket_poll = now
                select(0)
            elif not spun and self.spinner.bound:
                spun = True
                self._spin(now, done, respin)
            else:
                # Everything pending is on shared memory: arm, look once more, sleep.
                bell.arm()
                rings.poll()  # marks the rings we wait on, so that their writers ring us
                if progress.moved or done():
                    bell.disarm()
                    continue
                bell.wait(min(wait, SOCKET_POLL))

    def _spin(self, now: float, done: Callable[[], bool], adapt: bool) -> None:
        """Poll the rings until the call is done or the budget is spent; with ``adapt``,
        also until something moved, and grow or shrink the budget by what the polls found.

        Each round looks at one counter per ring and reads only when one moved, then yields
        the core, so that a round costs a few microseconds and a rank with work on this core
        runs in between.
        """
        spinner = self.spinner
        until = now + min(spinner.budget, spinner.limit(now))
        clock = time.monotonic
        pause = os.sched_yield
        poll_moved = self._rings.poll_moved
        progress = self._progress
        hit = False
        while clock() < until:
            poll_moved()
            if (adapt and progress.moved) or done():
                hit = True
                break
            pause()
        if adapt:
            spinner.update(hit, now)
