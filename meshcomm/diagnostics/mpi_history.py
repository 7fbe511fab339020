"""The calls before a check, compared: ranks whose earlier calls differed, caught late (mpi).

MPI compares no types: two signatures that every rank has checked before, called against
each other (rank A ``psum(int32[4])`` while rank B ``psum(float32[4])``), are paired by MPI
and both return, with wrong values. A backend without stamps carries no word per call, and
an exchange per call would double an 8-byte all_reduce. So each such group folds every
call's signature into a running hash (:func:`fold`: one ``hash`` of a pair per call, inline
in the group's issuer), and before every :data:`EVERY`-th call (:func:`due`), with none of
the group's earlier calls in flight, :func:`step` finishes the comparison started at the
previous such call and starts the next: an all_gather of the hash (8 bytes) on the check
communicator, started there and finished :data:`EVERY` calls later, so that it never waits
for the other ranks unless they are that far behind. When the hashes differ, the ranks find
the first call that differed from their ledgers and every rank raises the same
:class:`~meshcomm.errors.MismatchError`, naming both calls; the wrong results were returned
already, up to ``2 * EVERY`` calls earlier.

Example:
    >>> fold(fold(0, 1), 2) == fold(fold(0, 1), 2) != fold(fold(0, 2), 1)
    True
    >>> due(128), due(129), due(256)
    (True, False, True)
"""

from __future__ import annotations

import contextlib
import json
import zlib
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from meshcomm.diagnostics import call_checks as _call_checks
from meshcomm.diagnostics import fingerprint as _fingerprint
from meshcomm.diagnostics import ledger as _ledger
from meshcomm.diagnostics.hang_verdict import DISAGREE
from meshcomm.errors import CommError, MismatchError

if TYPE_CHECKING:
    from meshcomm.backends.base import Communicator
    from meshcomm.diagnostics.group_view import GroupView

__all__ = ["EVERY", "MASK", "Pending", "due", "fold", "step", "wait_quietly"]

#: The calls between two comparisons (a power of two: call ``seq`` compares when
#: ``seq & MASK == 0``).
EVERY = 128
MASK = EVERY - 1
# The record fields that tell two calls apart (a word per call, made only on a mismatch).
_FIELDS = ("name", "dtype", "shape", "reduce", "root", "device", "args", "tree")


class Pending:
    """A comparison started before call ``upto``: the hash of the calls before it, every
    rank's arriving in ``recv``, complete once ``wait`` returns."""

    __slots__ = ("recv", "send", "upto", "wait")

    def __init__(self, comm: Communicator, history: int, upto: int) -> None:
        self.upto = upto
        self.send = np.array([history], np.int64)
        self.recv = np.empty(comm.size, np.int64)
        self.wait = comm.start_check_all_gather(self.send, self.recv)


def fold(history: int, sig: int) -> int:
    """The running hash after a call of signature ``sig`` (ints only: ``hash`` is the same in
    every process; the issuer writes it inline)."""
    return hash((history, sig))


def due(seq: int) -> bool:
    """Whether call ``seq`` first finishes a comparison and starts the next (:func:`step`)."""
    return not seq & MASK


def step(
    group: GroupView,
    comm: Communicator,
    book: _ledger.Ledger,
    pending: Pending | None,
    history: int,
    seq: int,
) -> Pending:
    """Before call ``seq`` (:func:`due`; none of the group's earlier calls in flight, on
    every rank at the same call): finish ``pending`` (waiting at most the timeout), then
    start the comparison of ``history``, the hash of calls 1 to ``seq - 1``.

    Raises:
        MismatchError: the ranks' calls before ``pending.upto`` differed (every rank raises
            the same words).
        CommTimeout: a rank did not start ``pending`` within the timeout.
    """
    if pending is not None:
        pending.wait(None)
        if len(set(pending.recv.tolist())) > 1:
            _raise_first_difference(group, comm, book, pending.upto, seq)
    return Pending(comm, history, seq)


def wait_quietly(pending: Pending | None, timeout: float) -> None:
    """Let ``pending`` complete (at most ``timeout`` seconds) before the communicator goes;
    a failure is the group's last call's to report, not this."""
    if pending is not None:
        with contextlib.suppress(CommError):
            pending.wait(timeout)


def _raise_first_difference(
    group: GroupView, comm: Communicator, book: _ledger.Ledger, upto: int, seq: int
) -> NoReturn:
    """Every rank's word for each call the comparison before ``upto`` did not cover, from
    its ledger; the first that differs, in words, as every rank's MismatchError."""
    gather = comm.check_all_gather
    since = max(0, upto - EVERY - 1)  # the comparison started before call since + 1 agreed
    count = upto - 1 - since
    mine = np.full(count, -1, np.int64)
    records = {r["seq"]: r for r in book.records() if since < r["seq"] < upto}
    for s, each in records.items():
        mine[s - since - 1] = zlib.crc32(repr([each.get(k) for k in _FIELDS]).encode())
    words = np.empty(comm.size * count, np.int64)
    gather(mine, words)
    table = words.reshape(comm.size, count)
    differ = np.flatnonzero((table != table[0]).any(axis=0))
    label = group.label
    late = (
        "; each returned, with wrong results: MPI paired the calls without comparing their "
        f"types (found at op #{seq}, comparing the calls before op #{upto})"
    )
    if not len(differ):  # the ledgers no longer hold them (MESHCOMM_LEDGER)
        raise MismatchError(
            f"{DISAGREE} {label}: the ranks' calls between op #{since + 1} and "
            f"op #{upto - 1} differ, but their ledgers do not hold them{late}"
        )
    first = since + 1 + int(differ[0])
    row = np.full(_fingerprint.LENGTH, -1, np.int64)
    row[1], row[-2] = first, mine[differ[0]]  # rows that differ where the calls do
    record = records.get(first)

    def called() -> str:
        fields = None if record is None else {k: record.get(k) for k in (*_FIELDS, "over", "site")}
        return json.dumps({"op": "?", "seq": first, "record": fields}, default=str)

    def render(texts: list[str]) -> list[str]:
        return _call_checks.render(texts, label)

    try:
        _fingerprint.check_first(comm, row, group.ranks, label, called, gather, render)
    except MismatchError as exc:
        raise MismatchError(f"{exc}{late}") from None
    raise MismatchError(f"{DISAGREE} {label} at op #{first}{late}")  # pragma: no cover
