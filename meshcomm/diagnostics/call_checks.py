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
import json
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from meshcomm import trace as _trace
from meshcomm.backends.base import Communicator
from meshcomm.diagnostics import fingerprint as _fingerprint
from meshcomm.diagnostics import hang_verdict as _verdict
from meshcomm.diagnostics import ledger as _ledger
from meshcomm.diagnostics import responder as _responder
from meshcomm.diagnostics import signal_report as _report
from meshcomm.errors import CommError, CommTimeout, MismatchError, MismatchTimeout

if TYPE_CHECKING:
    from meshcomm.diagnostics.group_view import GroupView

__all__ = [
    "booked",
    "called",
    "checked_first",
    "differing",
    "judged",
    "mismatch_words",
    "render",
    "stamped",
    "traced",
]

#: How long a rank that saw a mismatch waits for the peer's record of its call (its
#: responder answers in milliseconds; the others' abort checks come every second).
_ASK_WAIT = 1.0


def called(
    rank: int,
    record: dict[str, Any] | None,
    op: str | None,
    seq: int,
    show: Collection[str] = (),
    over: bool = True,
    label: str | None = None,
) -> str:
    """``rank 1 called psum(float32[4], sum) at train.py:12 (op #3)`` from a ledger record
    (None: only what is known: the op, or nothing).

    ``show``: the names of the other arguments to show (``tiled``, ``perm``: those in
    which two calls differ); ``over``: show the mesh axes the user named, unless ``label``
    (the group's) names them already.

    Example:
        >>> called(1, None, "all_reduce", 3)
        'rank 1 called all_reduce(...) (op #3)'
        >>> rec = {"name": "ppermute", "dtype": "float32", "shape": (4,), "site": "t.py:9",
        ...        "args": {"perm": "[(0, 1), (1, 0)]"}, "over": "'tp'"}
        >>> called(1, rec, None, 3, show=["perm"], label="over 'tp'")
        'rank 1 called ppermute(float32[4], perm=[(0, 1), (1, 0)]) at t.py:9 (op #3)'
        >>> called(1, rec, None, 3, label="on group 'world'")
        "rank 1 called ppermute(float32[4]) over 'tp' at t.py:9 (op #3)"
    """
    if record is None:
        what = f"{op}(...)" if op else "another collective"
        return f"rank {rank} called {what} (op #{seq})"
    return f"rank {rank} called {_call(record, show, over, label)} (op #{seq})"


def _call(record: dict[str, Any], show: Collection[str], over: bool, label: str | None) -> str:
    """A record's call and site in words (:func:`called` without the rank)."""
    args = record.get("args") or {}
    axes = record.get("over") if over else None
    if axes is not None and label == f"over {axes}":
        axes = None  # the group's words name them already
    call = _fingerprint.describe_call(
        record["name"],
        record.get("dtype"),
        record.get("shape"),
        record.get("reduce"),
        record.get("root"),
        bool(record.get("device")),
        tree=record.get("tree"),
        args=[f"{k}={v}" for k, v in args.items() if k in show],
        over=axes,
    )
    return f"{call} at {record.get('site', '?')}"


def differing(records: Sequence[dict[str, Any] | None]) -> tuple[set[str], bool]:
    """What to show of calls that disagree: the names of the other arguments whose values
    differ among ``records``, and whether to show the axes the user named (unless every
    record names the same). Records whose words would read alike even so show every
    argument (they differ where words do not look: a hash).

    Example:
        >>> a = {"name": "all_gather", "args": {"axis": "0", "tiled": "False"}, "over": "'x'"}
        >>> differing([a, {**a, "args": {"axis": "0", "tiled": "True"}}])
        ({'tiled'}, True)
    """
    known = [r for r in records if r is not None]
    if len(known) < 2:
        return set(), True
    names = {k for r in known for k in (r.get("args") or {})}
    show = {k for k in names if len({(r.get("args") or {}).get(k) for r in known}) > 1}
    if len({r.get("name") for r in known}) > 1:
        show = set()  # other collectives: their names say it
    if len({_call(r, show, True, None) for r in known}) == 1:
        show = names
    return show, True


def _mine(record: dict[str, Any] | None, op: str, seq: int) -> str:
    """This rank's call for :func:`~meshcomm.diagnostics.fingerprint.check_first`'s words round: the
    record as JSON (a pytree's words cut to fit), rendered by :func:`render`."""
    if record is None:
        return json.dumps({"op": op, "seq": seq})
    fields = {k: record.get(k) for k in _SHOWN}
    if isinstance(fields["tree"], str) and len(fields["tree"]) > 400:
        fields["tree"] = fields["tree"][:400] + "..."
    return json.dumps({"op": op, "seq": seq, "record": fields})


#: The fields of a record that its words use.
_SHOWN = ("name", "dtype", "shape", "reduce", "root", "device", "args", "over", "tree", "site")


def render(texts: list[str], label: str) -> list[str]:
    """Every rank's :func:`_mine` in words, showing the arguments in which they differ
    (a text that is not such JSON, as it is)."""
    parsed: list[tuple[dict[str, Any] | None, str, int] | None] = []
    for text in texts:
        try:
            value = json.loads(text)
            record = value.get("record")
            parsed.append(
                (record if isinstance(record, dict) else None, str(value["op"]), int(value["seq"]))
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            parsed.append(None)
    show, over = differing([None if p is None else p[0] for p in parsed])
    out = []
    for text, p in zip(texts, parsed, strict=True):
        if p is None:
            out.append(text)
        else:
            out.append(called(0, p[0], p[1], p[2], show, over, label).split(" called ", 1)[1])
    return out


def mismatch_words(
    group: GroupView,
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
    if pseq != seq:
        # The peer's frame is of an earlier call, left unreceived: this rank finished that
        # call without it (ranks that each took themselves for a broadcast's root). The
        # words compare this rank's record of that call, not of the call it is in now.
        earlier = group._book.find(pseq)
        if earlier is not None:
            mine, op, seq = earlier, earlier["op"], pseq
    other = None
    if group.store is not None:
        other = _responder.ask_call(group.store, peer, group.name, pseq, _ASK_WAIT)
    show, over = differing([mine, other])
    label = group.label
    text = (
        f"ranks disagree on the collective {label}: "
        f"{called(me, mine, op, seq, show, over, label)}; "
        f"{called(peer, other, None, pseq, show, over, label)}"
    )
    if peer not in group.ranks or other is None:
        text += f" (rank {peer}'s record of it could not be read)"
    with contextlib.suppress(CommError):  # no store: this rank raises its own words
        text = comm.publish_mismatch(text)
    return MismatchError(text, peer, theirs)


def judged(
    group: GroupView, exc: CommTimeout, op: str, seq: int, entry: _ledger.Entry | None = None
) -> CommTimeout:
    """``exc`` with the hang verdict added: which members waited in op ``seq``, and where
    the others are (:mod:`meshcomm.diagnostics.hang_verdict`); ``exc`` itself without a store.
    ``entry``:
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
    if not text:
        _report.timed_out(str(exc))
        return exc
    # The verdict first, in the user's words; what this rank's transport waited for after.
    _report.timed_out(f"{text}\n  timed out: {exc}")
    return CommTimeout(f"{text}\n  timed out: {exc}")


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
    group: GroupView,
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
    (:func:`~meshcomm.diagnostics.fingerprint.check_first`, on ``comm.check_all_gather``; backends
    without stamps); ``seen`` collects the signatures checked. ``op``, ``seq``: the call;
    ``what``: it in the group's words (``"all_reduce (op #3) on rank 0 in group 'world'
    (size 2)"``)."""
    ranks, label = group.ranks, group.label

    def mine() -> str:
        return _mine(None if entry is None else _ledger.record(entry, time.monotonic()), op, seq)

    def shown(texts: list[str]) -> list[str]:
        return render(texts, label)

    def run_checked() -> Any:
        if sig not in seen:
            try:
                _fingerprint.check_first(
                    comm, row, ranks, label, mine, comm.check_all_gather, shown
                )
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
