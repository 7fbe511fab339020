"""Waiting for MPI requests with a timeout, and :class:`MpiRequest`, a started operation.

MPI's blocking calls cannot time out, so the mpi backend starts every operation with its
nonblocking form (``MPI_Iallreduce`` ...) and polls ``MPI_Test`` until it completes or the
communicator's timeout passes. Each ``MPI_Test`` drives MPI's progress engine, which is what
moves a nonblocking collective forward. How the poll waits between tests:

1. **spin**: ``Patience.spins`` tests back to back (default 50, about 15 us): small
   operations finish here when every rank has a core. A crowded host (more ranks of the
   job than this process has cores) does not spin at all;
2. **yield**: ``sched_yield`` after every three tests, for the first second of the wait: a
   large transfer is still polled continuously, and a rank sharing the core runs at once
   (MPICH's own blocking calls also poll and yield);
3. after a second, **sleep** 1 ms between tests: a straggling peer does not cost a core.

(Sleeping between tests from the start, to free the core for a peer, was measured too: on
a shared 2-core machine it won under heavy outside load but lost several-fold to yielding
otherwise, and lost bandwidth on large transfers, which need continuous polling.)

Example:
    >>> poll(lambda: True, timeout=1.0, patience=Patience(0, False), describe=lambda: "never")
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from meshcomm.errors import CommTimeout

__all__ = ["SPIN_ENV", "MpiRequest", "Patience", "default_patience", "poll"]

#: Number of back-to-back MPI_Test calls before polling yields (default 50, or 0 on a host
#: that runs more ranks than it has cores).
SPIN_ENV = "MESHCOMM_MPI_SPIN"

_WAKEFUL = 1.0  # seconds into a wait after which tests are 1 ms apart
_SLEEP = 0.001
_SPINS = 50

_sched_yield: Callable[[], None] = getattr(os, "sched_yield", lambda: time.sleep(0))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_CORES = _cores()


class Patience(NamedTuple):
    """How :func:`poll` waits: ``spins`` back-to-back tests, then yields (see the module).

    ``crowded``: the host runs more ranks of the job than this process has cores.
    """

    spins: int
    crowded: bool


def default_patience(ranks_on_host: int) -> Patience:
    """Return how to wait on a host running ``ranks_on_host`` ranks of this job.

    ``MESHCOMM_MPI_SPIN`` overrides the spin count.

    Example:
        >>> default_patience(10**6)  # oversubscribed: yield from the first test on
        Patience(spins=0, crowded=True)
    """
    crowded = ranks_on_host > _CORES
    spins = 0 if crowded else _SPINS
    raw = os.environ.get(SPIN_ENV, "").strip()
    if raw.isdigit():
        spins = int(raw)
    return Patience(spins, crowded)


def poll(
    test: Callable[[], bool], timeout: float, patience: Patience, describe: Callable[[], str]
) -> None:
    """Call ``test`` until it returns True; raise CommTimeout after ``timeout`` seconds.

    Args:
        test: one nonblocking completion check (``MPI_Test``); it must drive progress.
        timeout: seconds to wait.
        patience: how to wait between checks (see the module docstring).
        describe: builds the timeout's message (only called on timeout).

    Raises:
        CommTimeout: ``test`` was still False after ``timeout`` seconds.
    """
    for _ in range(patience.spins + 1):
        if test():
            return
    now = time.monotonic()
    deadline = now + timeout
    wakeful = now + _WAKEFUL
    # Three tests per yield: with one, MPI made too little progress per time slice with 4
    # ranks on 2 cores (8 B took 1.5x MPICH's blocking Allreduce); three matched it, two and
    # five came close, ten and more lost again.
    while not (test() or test() or test()):
        now = time.monotonic()
        if now >= deadline:
            raise CommTimeout(describe())
        if now < wakeful:
            _sched_yield()
        else:
            time.sleep(_SLEEP)


class MpiRequest:
    """An operation started with one of ``MpiCommunicator``'s ``i*`` methods.

    Its buffers belong to MPI until it completes: do not read or write them before
    :meth:`wait` returns or :meth:`test` returns True.

    Example:
        A sketch (needs an MPI world)::

            req = comm.iall_reduce(buf, ReduceOp.SUM)
            ...  # compute while MPI works
            req.wait()  # buf now holds the sum
    """

    def __init__(
        self,
        requests: Sequence[Any],
        what: str,
        timeout: float,
        patience: Patience,
        finish: Callable[[], None] | None,
        keep: tuple[Any, ...],
        on_error: Callable[[BaseException, Sequence[Any]], BaseException],
        statuses: Sequence[Any] = (),
        late: Callable[[], str] | None = None,
    ) -> None:
        self._requests = list(requests)
        self._what = what
        self._timeout = timeout
        self._patience = patience
        self._finish = finish
        self._keep: tuple[Any, ...] | None = keep  # buffers MPI uses until completion
        self._on_error = on_error
        self._done = not self._requests
        self._statuses = list(statuses)  # MPI_Status per request, for Testall's errors
        self._describe_late = late  # the timeout's words at the default timeout

    @property
    def what(self) -> str:
        """The operation, rank and communicator, as error messages name them."""
        return self._what

    def _test(self) -> bool:
        requests = self._requests
        if len(requests) == 1:
            return bool(requests[0].Test())
        return bool(type(requests[0]).Testall(requests, self._statuses or None))

    def test(self) -> bool:
        """Drive MPI's progress once; return True (and finish the operation) if it is done.

        Raises:
            CommError: MPI reported an error.
        """
        if not self._done:
            try:
                if not self._test():
                    return False
            except Exception as exc:
                raise self._on_error(exc, self._statuses) from exc
            self._complete()
        return True

    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation completes.

        Args:
            timeout: seconds (default: the communicator's timeout).

        Raises:
            CommTimeout: not complete in time. The operation stays pending (MPI cannot cancel
                a collective): the communicator keeps its buffers alive, and the world should
                be treated as broken.
            CommError: MPI reported an error.
        """
        if self._done:
            return
        seconds = self._timeout if timeout is None else float(timeout)
        late = self._describe_late
        if late is None or timeout is not None:
            late = functools.partial(self._late, seconds)
        try:
            poll(self._test, seconds, self._patience, late)
        except CommTimeout:
            raise
        except Exception as exc:
            raise self._on_error(exc, self._statuses) from exc
        self._complete()

    def _late(self, seconds: float) -> str:
        return (
            f"{self._what}: not complete after {seconds:g} s; a peer may be stopped, "
            "slow or in a different operation (MPI cannot cancel it: the world is unusable)"
        )

    def _complete(self) -> None:
        self._done = True
        self._keep = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def is_completed(self) -> bool:
        """True once :meth:`test` or :meth:`wait` saw the operation complete."""
        return self._done

    def __repr__(self) -> str:
        return f"<MpiRequest {self._what} {'completed' if self._done else 'pending'}>"
