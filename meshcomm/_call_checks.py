"""What wraps a group's call besides its communication: mismatch words, hang verdicts,
first-call checks, the ledger's end of an asynchronous call, trace timing.

:class:`~meshcomm.group.ProcessGroup` issues every collective through these: a stamped call
whose peer disagreed comes out as a :class:`~meshcomm.errors.MismatchError` naming both
calls (:func:`mismatch_words`), a timeout with the verdict of who is behind
(:func:`judged`), and a backend without stamps gets each signature's first call checked
(:func:`checked_first`).

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> g = ProcessGroup(SelfCommunicator())
    >>> exc = CommTimeout("late")
    >>> judged(g, exc, "all_reduce", 1) is exc  # no store: nobody to ask
    True
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from meshcomm import _fingerprint, _ledger, _report, _responder, _verdict
from meshcomm import trace as _trace
from meshcomm.backends.base import Communicator
from meshcomm.errors import CommError, CommTimeout, MismatchError, MismatchTimeout

if TYPE_CHECKING:
    from meshcomm.group import ProcessGroup

__all__ = ["booked", "called", "checked_first", "judged", "mismatch_words", "stamped", "traced"]

#: How long a rank that saw a mismatch waits for the peer's record of its call (its
#: responder answers in milliseconds; the others' abort checks come every second).
_ASK_WAIT = 1.0


def called(rank: int, record: dict[str, Any] | None, op: str | None, seq: int) -> str:
    """``rank 1 called psum(float32[4], sum) at train.py:12 (op #3)`` from a ledger record
    (None: only what is known: the op, or nothing).

    Example:
        >>> called(1, None, "all_reduce", 3)
        'rank 1 called all_reduce(...) (op #3)'
    """
    if record is None:
        what = f"{op}(...)" if op else "another collective"
        return f"rank {rank} called {what} (op #{seq})"
    call = _fingerprint.describe_call(
        record["name"],
        record.get("dtype"),
        record.get("shape"),
        record.get("reduce"),
        record.get("root"),
        bool(record.get("device")),
    )
    return f"rank {rank} called {call} at {record.get('site', '?')} (op #{seq})"


def mismatch_words(
    group: ProcessGroup,
    comm: Communicator,
    exc: MismatchError,
    op: str,
    seq: int,
    entry: _ledger.Entry | None,
) -> MismatchError:
    """``exc`` (a peer's stamp differed from ours in call ``seq``) in the user's words:
    this rank's call, the peer's (asked of its responder, from its ledger), the group;
    published through ``comm`` (the group's) so that every member raises the same words. A
    mismatch that came from another rank's record is already in words and comes back as
    it is."""
    peer, theirs = exc.peer, exc.theirs
    if peer is None or theirs is None:
        return exc
    me = group.ranks[group.rank]
    mine = _ledger.record(entry, time.monotonic()) if entry is not None else None
    pseq = _fingerprint.stamp_seq(theirs, seq)
    other = None
    if group.store is not None:
        other = _responder.ask_call(group.store, peer, group.name, pseq, _ASK_WAIT)
    text = (
        f"ranks disagree on the collective {group.label}: "
        f"{called(me, mine, op, seq)}; {called(peer, other, None, pseq)}"
    )
    if peer not in group.ranks or other is None:
        text += f" (rank {peer}'s record of it could not be read)"
    with contextlib.suppress(CommError):  # no store: this rank raises its own words
        text = comm.publish_mismatch(text)
    return MismatchError(text, peer, theirs)


def judged(
    group: ProcessGroup, exc: CommTimeout, op: str, seq: int, entry: _ledger.Entry | None = None
) -> CommTimeout:
    """``exc`` with the hang verdict added: which members waited in op ``seq``, and where
    the others are (:mod:`meshcomm._verdict`); ``exc`` itself without a store. ``entry``:
    the call's ledger record (the name the user called, its site)."""
    if group.store is None or group.size == 1:
        return exc
    name, site = (op, _verdict.call_site()) if entry is None else _ledger.named(entry)
    args = None if entry is None else _ledger.arguments(entry)
    text = _verdict.report(
        group.store,
        group.name,
        group.ranks,
        group.ranks[group.rank],
        name,
        seq,
        site,
        _verdict.grace_seconds(group.timeout),
        group.label,
        args,
    )
    if _verdict.is_mismatch(text):  # the ranks were in different calls: not a hang
        _report.timed_out(text)
        return MismatchTimeout(f"{text}\n  (timed out: {exc})")
    _report.timed_out(f"{exc}\n  verdict: {text}" if text else str(exc))
    return CommTimeout(f"{exc}\n  verdict: {text}") if text else exc


def stamped(
    body: Callable[[], Any],
    holder: Any,
    stamp: int,
    words: Callable[[MismatchError], MismatchError],
) -> Callable[[], Any]:
    """``body`` run with the communicator's stamp ``holder`` carrying ``stamp``; a mismatch
    it raises comes out as ``words(exc)`` (both calls in words)."""

    def run_stamped() -> Any:
        holder.stamp = stamp
        try:
            return body()
        except MismatchError as exc:
            raise words(exc) from None

    return run_stamped


def checked_first(
    group: ProcessGroup,
    comm: Communicator,
    body: Callable[[], Any],
    row: np.ndarray,
    sig: int,
    seen: set[int],
    op: str,
    seq: int,
    what: str,
    entry: _ledger.Entry | None,
) -> Callable[[], Any]:
    """``body`` after the first-call check of its signature ``sig``
    (:func:`~meshcomm._fingerprint.check_first`, on ``comm.check_all_gather``; backends
    without stamps); ``seen`` collects the signatures checked. ``op``, ``seq``: the call;
    ``what``: it in the group's words (``"all_reduce (op #3) on rank 0 in group 'world'
    (size 2)"``)."""
    ranks, label = group.ranks, group.label
    me = ranks[group.rank]

    def mine() -> str:
        record = None if entry is None else _ledger.record(entry, time.monotonic())
        return called(me, record, op, seq).split(" called ", 1)[1]

    def run_checked() -> Any:
        if sig not in seen:
            try:
                _fingerprint.check_first(comm, row, ranks, label, mine, comm.check_all_gather)
            except CommTimeout as exc:  # name the user's call, not the check's all_gather
                raise CommTimeout(f"{what}, checking its first call: {exc}") from exc
            seen.add(sig)
        return body()

    return run_checked


def booked(entry: _ledger.Entry, body: Callable[[], Any]) -> Callable[[], Any]:
    """``body`` that marks its ledger ``entry`` ended when it ends (async operations)."""

    def run_booked() -> Any:
        try:
            result = body()
        except BaseException:
            _ledger.Ledger.end(entry, True)
            raise
        _ledger.Ledger.end(entry, False)
        return result

    return run_booked


def traced(
    recorder: _trace.Recorder,
    body: Callable[[], Any],
    group: str,
    op: str,
    seq: int,
    fields: dict[str, Any],
) -> Callable[[], Any]:
    """``body`` timed into ``recorder``: called now, run and finished when it runs."""
    issued = time.time()
    dtype, shape = fields.get("dtype"), fields.get("shape")
    nbytes = int(np.prod(shape)) * dtype.itemsize if dtype is not None and shape is not None else 0

    def run_timed() -> Any:
        start = time.time()
        try:
            return body()
        finally:
            recorder.add(group, op, seq, nbytes, issued, start, time.time())

    return run_timed
