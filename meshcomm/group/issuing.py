"""How a group's calls run: argument checks first, then the progress engine, in issue order.

An :class:`Issuer` belongs to one :class:`~meshcomm.group.ProcessGroup` and holds what its
calls share: the engine, the sequence number, the ledger, the mismatch checks' state, the
lowering contexts, and the group's one plan cache. Every collective comes through one of
two doors: :meth:`Issuer.issue` for a lowered call (a body and its fingerprint fields from
:mod:`meshcomm.group.lower`), and :meth:`Issuer.run_plan` for a call that found (or made, with
:meth:`Issuer.plan`) the plan of its signature, whose fast case runs the plan's runner
inline on the claimed engine and whose other cases hand the same runner to
:meth:`Issuer.issue`. A closed group's engine refuses both.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> g = ProcessGroup(SelfCommunicator())
    >>> issuer = g._issuer
    >>> plan = issuer.plan(("all_reduce",), _plans.plan_all_reduce, np.ones(2), "sum")
    >>> issuer.run_plan(plan, np.ones(2)), issuer.seq
    (array([1., 1.]), 1)
    >>> g.close()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

import numpy as np

from meshcomm import trace as _trace
from meshcomm.backends.base import Communicator, Runner
from meshcomm.diagnostics import call_checks as _call_checks
from meshcomm.diagnostics import fingerprint as _fingerprint
from meshcomm.diagnostics import ledger as _ledger
from meshcomm.diagnostics import mpi_history as _mpi_history
from meshcomm.errors import CommError, CommTimeout, MismatchError
from meshcomm.group import device_lower as _device_lower
from meshcomm.group import lower as _lower
from meshcomm.group import plans as _plans
from meshcomm.group import staging as _staging
from meshcomm.group.arrays import ResultPool
from meshcomm.work import ProgressEngine, Work

if TYPE_CHECKING:
    from meshcomm.group import ProcessGroup

__all__ = ["Issuer"]

#: A plan of a host call or of a device call (both kept in one cache per group).
_AnyPlan = TypeVar("_AnyPlan", _plans.Plan, _device_lower.DevicePlan)

#: At most this many plans per group (a loop calls a few signatures; the oldest goes first).
_PLANS = 256

#: Results at least this large come from the world's ResultPool (recycled, no fresh pages).
_POOLED = ResultPool.MIN_BYTES

# _fingerprint's stamp layout: a plan's call stamps ``plan.stamp_base | (seq & _SEQ_MASK)``.
_SEQ_MASK = (1 << _fingerprint.SEQ_BITS) - 1
# Call ``seq`` steps the comparison of the running hash (_mpi_history) when
# ``not seq & _HISTORY``.
_HISTORY = _mpi_history.MASK
#: Collectives whose fingerprints leave out where the caller's array lives.
_LOCATION_FREE = frozenset({"broadcast", "scatter"})


class Issuer:
    """Runs one group's calls (see the module docstring).

    Args:
        group: the group (its public attributes name it in mismatch words and verdicts).
        comm: the group's communicator.
        engine: the group's progress engine.
        where: names this rank and group in messages (``"rank 0 in group 'world' (size 2)"``).
        debug: check every call's full fingerprint first (``DETAIL``).
        checks: the default mismatch checks are on (not ``OFF``).
        device: the group's device communicator, or None.

    Attributes:
        engine: the progress engine.
        book: the group's ledger.
        plans: the plan of each call signature seen, by key (the collective's name first).
        seq: the number of collectives issued so far.
        history: where the backend carries no stamps, the running hash of the calls'
            signatures (:mod:`meshcomm.diagnostics.mpi_history`); else None.
        debug: as given.
        checks: as given.
    """

    def __init__(
        self,
        group: ProcessGroup,
        comm: Communicator,
        engine: ProgressEngine,
        where: str,
        debug: bool,
        checks: bool,
        device: Communicator | None = None,
    ) -> None:
        self._group = group
        self._comm = comm
        self._device = device
        self.engine = engine
        self._where = where
        self.debug = debug
        self.checks = checks
        # Default checks (not DETAIL, not OFF): the communicator carries each call's stamp
        # (its holder's ``stamp``) where it can; see _fingerprint and _call_checks.
        checked = checks and not debug and comm.size > 1  # one rank agrees
        holder = comm.stamp_holder() if checked else None
        self._stamper: Any = holder
        # Backends without stamps (mpi): the signatures checked once (_fingerprint.check_first);
        # None: no such checks (stamps, DETAIL, OFF, or a group of one).
        self._seen: set[int] | None = None
        if checked and holder is None:
            self._seen = set()
        # The signatures checked once for calls on the device communicator: they carry no
        # stamp (stamps ride on host messages), so where the host's calls are stamped they
        # get a set of their own; otherwise they share the host's (mpi; None: no checks).
        self._device_seen: set[int] | None = set() if holder is not None else self._seen
        # Backends without stamps: the running hash of every call's signature (None: not
        # kept), and its comparison in flight (_mpi_history.step).
        self.history: int | None = None if self._seen is None else 0
        self._pending: _mpi_history.Pending | None = None
        self.seq = 0
        self.book = _ledger.Ledger(_ledger.ledger_length())
        self._closed = False
        # One lowering context per operation name, made on first use: the per-call path
        # then does no string formatting and no allocation for it.
        self._calls: dict[str, _lower.Call] = {}
        # One plan per call signature (_plans.Plan), made on first use, dropped by close().
        self.plans: dict[tuple[Any, ...], _plans.Plan | _device_lower.DevicePlan] = {}

    def relabel(self, where: str) -> None:
        """Name this rank and group ``where`` in messages from now on."""
        self._where = where
        self._calls.clear()  # their messages were made with the old words

    def close(self, reason: str, timeout: float) -> None:
        """Refuse every call from now on (a plan's too: its claim fails, and its queued
        route raises), let queued operations finish (up to ``timeout``), drop the plans."""
        self._closed = True
        self.engine.close(reason, timeout)
        if self.engine.failure is None:  # the others start it too: let it end first
            _mpi_history.wait_quietly(self._pending, timeout)
        self._pending = None
        self.plans.clear()

    # -- lowered calls -------------------------------------------------------------------
    def enter(self, op: str) -> _lower.Call:
        """Refuse a closed or failed group; return the call context for lowering ``op``."""
        if self._closed or not self.engine.healthy:
            if self._closed:
                raise CommError(f"{op}: {self._where}: the group was closed")
            self.engine.check(f"{op} on {self._where}")
        call = self._calls.get(op)
        if call is None:
            engine = self.engine
            where = f"{op}: {self._where}"
            call = self._calls[op] = _lower.Call(self._comm, engine.pool, where, engine.results)
        return call

    def issue(
        self,
        op: str,
        lowered: _lower.Lowered,
        async_op: bool,
        device: ModuleType | None = None,
        over_device: bool = False,
    ) -> Any:
        """Run a lowered call in the group's order (after a fingerprint check in debug mode).

        ``device``: the array module (cupy) the input came from; the result goes back to it.
        ``over_device``: the call runs on the group's device communicator, not the host's.
        """
        body, fields = lowered
        if device is not None:
            on_host = body

            def body() -> Any:
                return _staging.to_device(device, on_host())

        if fields is None:  # point to point: no sequence number, no fingerprint
            return self.engine.submit(body, f"{op} on {self._where}", bool(async_op))
        on_device = device is not None or over_device  # the input lives on a GPU
        if self._device is None and op in _LOCATION_FREE:
            # Through host memory, ranks off the root may pass None to broadcast and
            # scatter, and where each result lives is each rank's own choice: no location
            # is compared (read as the host's, as the planned calls do). A group with a
            # device backend compares it: a device call runs on another communicator.
            on_device = False
        self.seq = seq = self.seq + 1
        label = f"{op} (op #{seq}) on {self._where}"
        group = self._group
        if self.debug:
            row = _fingerprint.encode(op, seq, on_device=on_device, **fields)
            comm, ranks, unchecked = self._comm, group.ranks, body

            def body() -> Any:
                _fingerprint.check(comm, row, ranks, label)
                return unchecked()

        recorder = _trace.active
        if recorder is not None:
            body = _call_checks.traced(recorder, body, group.name, op, seq, fields)
        book = self.book
        lowered_fields = fields
        if on_device:
            fields = {**fields, "device": True}  # for the ledger
        entry = book.add(seq, op, fields.get("dtype"), fields.get("shape"), fields)
        if self._stamper is not None and not over_device:
            sig = _fingerprint.signature_of(op, fields, on_device)
            stamp = _fingerprint.stamp(sig, seq)
            words = self._words(op, seq, entry)
            body = _call_checks.stamped(body, self._stamper, stamp, words)
        seen = self._device_seen if over_device else self._seen
        history = self.history
        if seen is not None or history is not None:
            sig = _fingerprint.signature_of(op, fields, on_device)
            if seen is not None and sig not in seen:
                row = _fingerprint.encode(op, seq, on_device=on_device, **lowered_fields)
                body = _call_checks.checked_first(
                    group, self._comm, body, row, sig, seen, op, seq, label, entry
                )
            if history is not None:
                if not seq & _HISTORY:  # before the first-call check, on every rank
                    body = self._stepped(body, history, op, seq, label, entry)
                self.history = hash((history, sig))  # _mpi_history.fold
        if entry is not None and async_op:
            body = _call_checks.booked(entry, body)  # it ends on the engine's thread
        try:
            result = self.engine.submit(body, label, bool(async_op))
        except BaseException as exc:
            # In flight while judged: the others' verdicts find this rank in it meanwhile.
            self._raise_judged(exc, op, seq, entry)
        if not async_op:
            book.end(entry, False)
        elif isinstance(result, Work):
            # Its own timeout, raised on the engine's thread, gets the verdict in wait().
            result._judge = lambda exc: _call_checks.judged(group, exc, op, seq, entry)
        return result

    def issue_on_device(self, op: str, lowered: _lower.Lowered, async_op: bool) -> Any:
        """Run a call lowered by :mod:`meshcomm.group.device_lower` on the caller's thread.

        Its body only queues device work, ordered on the caller's current CUDA stream, so
        it runs at once even when ``async_op`` (on the engine's thread the current stream
        would be another); the Work returned then is complete, its result safe to use on
        the caller's stream (torch's ``wait_tensor`` contract).
        """
        result = self.issue(op, lowered, False, over_device=True)
        if not async_op:
            return result
        return self._device_work(op, result)

    def _device_work(self, op: str, result: Any) -> Work[Any]:
        """The Work of an async device call: complete, ``is_completed`` asking the GPU."""
        device = self._device
        probe = None if device is None else device.completion_probe()
        return Work.completed(f"{op} on {self._where}", result, probe)

    def run_device_plan(self, plan: _device_lower.DevicePlan, x: Any, async_op: bool) -> Any:
        """Run a device call's ``plan`` on ``x`` (a C-contiguous device array of its
        signature) on the caller's thread, as :meth:`issue_on_device` runs a lowered one.

        The fast case takes the claimed engine with only the sequence number and the
        ledger entry around the runner (no stamp: device calls carry none). A call that
        needs more (a ``DETAIL`` or first-call check, a trace) or finds the engine taken
        goes through :meth:`issue_on_device` with the same runner.
        """
        engine = self.engine
        seen = self._device_seen
        history = self.history
        if (
            self.debug
            or _trace.active is not None
            or (seen is not None and plan.sig not in seen)
            or not engine.claim()
        ):
            run = plan.run

            def body() -> Any:
                return run(x)

            return self.issue_on_device(plan.collective, (body, plan.fields), async_op)
        self.seq = seq = self.seq + 1
        name, book = plan.collective, self.book
        entry = book.add(seq, name, plan.dtype, plan.in_shape, plan.ledger_fields)
        try:
            if history is not None:
                if not seq & _HISTORY:  # nothing in flight: the engine is claimed
                    self._step(history, name, seq)
                self.history = hash((history, plan.sig))  # _mpi_history.fold, inline
            result = plan.run(x)
            book.end(entry, False)
        except BaseException as exc:
            engine.poison(exc, f"{name} (op #{seq}) on {self._where}")
            self._raise_judged(exc, name, seq, entry)
        finally:
            engine.release()
        if async_op:
            return self._device_work(name, result)
        return result

    # -- planned calls -------------------------------------------------------------------
    def plan(self, key: tuple[Any, ...], make: Callable[..., _AnyPlan], *args: Any) -> _AnyPlan:
        """The plan of the call signature ``key`` (its first item the collective's name):
        the group's cached one, else a new one, ``make(call, *args)`` (every check of the
        lowering, so every error is raised here, before any I/O), kept under ``key``."""
        try:
            return cast(_AnyPlan, self.plans[key])
        except (KeyError, TypeError):  # a new signature (or an unhashable argument)
            pass
        # Made outside the handler: its errors come without a KeyError as their context.
        return self._new_plan(key, make, *args)

    def _new_plan(
        self, key: tuple[Any, ...], make: Callable[..., _AnyPlan], *args: Any
    ) -> _AnyPlan:
        plan = make(self.enter(key[0]), *args)
        plans = self.plans
        if len(plans) >= _PLANS:
            # Another thread may evict at the same time: then one plan fewer, no harm.
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                del plans[next(iter(plans))]
        with contextlib.suppress(TypeError):  # an unhashable argument the checks accept
            plans[key] = plan
        return plan

    def run_plan(
        self,
        plan: _plans.Plan,
        x: np.ndarray,
        async_op: bool = False,
        out: np.ndarray | None = None,
    ) -> Any:
        """Run ``plan`` on ``x`` (a numpy array of the plan's signature): a fresh result
        filled by ``plan.run(x, result)``; with ``async_op``, a Work for it.

        ``out`` (checked by :func:`meshcomm.group.lower.check_out`): the result goes there, and
        ``x`` is read where it lies, no copy, also by an asynchronous call; ``out`` is ``x``:
        reduced in place (``plan.run_in_place``).

        The runner reads a C-contiguous array: a strided ``x`` is copied first, and an
        asynchronous call reads its own copy (the caller may change ``x`` meanwhile); both
        go through :meth:`_run_plan_on_copy`.

        The fast case runs it here, on the claimed engine, with only the ledger entry and
        the stamp around it, or where the backend has no stamps the running hash of the
        signatures (:mod:`meshcomm.diagnostics.mpi_history`; both computed inline: a function call
        is
        a tenth of what this costs; at 8 bytes MPI takes about 1 us, and with more ranks
        than cores every layer here costs several times its own time). A call that needs
        more (a ``DETAIL`` or first-call check, a trace) or finds the engine taken (queued
        work, another thread, a failed or closed group) hands the same runner to
        :meth:`issue`; every 128th call first steps the comparison of the running hash
        (:meth:`_step`; the claimed engine has nothing in flight).
        """
        engine, dtype, run = self.engine, plan.dtype, plan.run
        if out is not None:
            run = _into(plan, x, out)
            if async_op:
                into, result = run, out

                def fill() -> np.ndarray:
                    into(x, result)
                    return result

                return self.issue(plan.collective, (fill, plan.fields), True)
        elif async_op or not x.flags.c_contiguous:
            return self._run_plan_on_copy(plan, x, async_op)
        elif plan.nbytes < _POOLED:
            out = np.empty(plan.shape, dtype)
        else:
            out = engine.results.take(dtype, plan.count).reshape(plan.shape)
        seen, history = self._seen, self.history
        if (
            self.debug
            or _trace.active is not None
            or (seen is not None and plan.sig not in seen)
            or not engine.claim()
        ):

            def body() -> np.ndarray:
                run(x, out)
                return out

            return self.issue(plan.collective, (body, plan.fields), False)
        self.seq = seq = self.seq + 1
        name, book = plan.collective, self.book
        entry = book.add(seq, name, dtype, plan.in_shape, plan.fields)
        stamper = self._stamper
        if stamper is not None:
            stamper.stamp = plan.stamp_base | (seq & _SEQ_MASK)
        try:
            if history is not None:
                if not seq & _HISTORY:  # nothing in flight: the engine is claimed
                    self._step(history, name, seq)
                self.history = hash((history, plan.sig))  # _mpi_history.fold, inline
            run(x, out)
            book.end(entry, False)
        except BaseException as exc:
            label = f"{name} (op #{seq}) on {self._where}"
            if isinstance(exc, MismatchError):
                # In words, for this rank and (through the sticky failure) later calls.
                worded = self._words(name, seq, entry)(exc)
                engine.poison(worded, label)
                book.end(entry, True)
                raise worded from None
            engine.poison(exc, label)
            self._raise_judged(exc, name, seq, entry)
        finally:
            engine.release()
        return out

    def _run_plan_on_copy(self, plan: _plans.Plan, x: np.ndarray, async_op: bool) -> Any:
        """:meth:`run_plan` for an asynchronous call or a strided input: the runner reads a
        copy of ``x`` in the engine's scratch memory (reused from call to call, so a large
        input costs no fresh pages), through the engine's queue."""
        engine, dtype, run = self.engine, plan.dtype, plan.run
        if plan.nbytes < _POOLED:
            out = np.empty(plan.shape, dtype)
        else:
            out = engine.results.take(dtype, plan.count).reshape(plan.shape)
        in_place = plan.run_in_place
        if in_place is not None:
            np.copyto(out, x)  # the copy is the result, reduced where it lies

            def reduce_copy() -> np.ndarray:
                in_place(out)
                return out

            return self.issue(plan.collective, (reduce_copy, plan.fields), async_op)
        pool = engine.pool
        base, snapshot = pool.take(dtype, x.shape)
        np.copyto(snapshot, x)

        def body() -> np.ndarray:
            run(snapshot, out)
            pool.give(base)  # not after a failure: the transport may still read it
            return out

        return self.issue(plan.collective, (body, plan.fields), async_op)

    def _stepped(
        self,
        body: Callable[[], Any],
        history: int,
        op: str,
        seq: int,
        label: str,
        entry: _ledger.Entry | None,
    ) -> Callable[[], Any]:
        """``body`` of call ``seq`` after :meth:`_step`, with none of the group's earlier
        calls in flight: here, after waiting (up to the group's timeout) for its queued ones.

        A call issued on the progress thread (a Future callback) cannot wait for the queue it
        runs in: its step runs first in its body, on that thread, once the calls queued
        before it have finished (the same point in the stream as the other ranks').
        """
        engine = self.engine
        if engine.on_progress_thread():

            def run_stepped() -> Any:
                self._step(history, op, seq)
                return body()

            return run_stepped
        try:
            timeout = self._group.timeout
            if not engine.drain(timeout):
                raise CommTimeout(
                    f"{label}: the group's earlier calls did not finish within {timeout:g} s "
                    "(waited for before comparing the calls before it)"
                )
            engine.check(label)  # an earlier asynchronous call failed
            self._step(history, op, seq)
        except BaseException as exc:
            engine.poison(exc, label)
            self._raise_judged(exc, op, seq, entry)
        return body

    def _step(self, history: int, op: str, seq: int) -> None:
        """:func:`meshcomm.diagnostics.mpi_history.step` before call ``seq`` (``op``;
        ``history``: the hash of the calls before it), none of the group's earlier calls in
        flight; a timeout names the call."""
        pending = self._pending
        try:
            self._pending = _mpi_history.step(
                self._group, self._comm, self.book, pending, history, seq
            )
        except CommTimeout as exc:  # name the user's call, not the check's all_gather
            upto = "?" if pending is None else pending.upto
            raise CommTimeout(
                f"{op} (op #{seq}) on {self._where}, comparing the calls before op #{upto}: {exc}"
            ) from exc

    # -- failures ------------------------------------------------------------------------
    def _raise_judged(
        self, exc: BaseException, op: str, seq: int, entry: _ledger.Entry | None
    ) -> NoReturn:
        """Raise ``exc`` of call ``seq``, a timeout with the hang verdict added."""
        judged = exc
        if isinstance(exc, CommTimeout):
            judged = _call_checks.judged(self._group, exc, op, seq, entry)
        self.book.end(entry, True)
        if judged is exc:
            raise exc
        if self.debug:
            raise judged from exc
        # The verdict says in words what the waiting path's frames would: a newcomer's
        # report fits a screen without them (MESHCOMM_DEBUG=DETAIL keeps the chain).
        raise judged.with_traceback(None) from None

    def _words(
        self, op: str, seq: int, entry: _ledger.Entry | None
    ) -> Callable[[MismatchError], MismatchError]:
        """What puts a mismatch in call ``seq`` in words (:func:`_call_checks.mismatch_words`)."""
        group, comm = self._group, self._comm

        def words(exc: MismatchError) -> MismatchError:
            return _call_checks.mismatch_words(group, comm, exc, op, seq, entry)

        return words


def _into(plan: _plans.Plan, x: np.ndarray, out: np.ndarray) -> Runner:
    """The runner that fills a caller's ``out`` from ``x``: in place where ``out`` is ``x``'s
    memory, the plan's own where ``x`` is C-contiguous, else ``x`` copied into ``out`` and
    reduced there."""
    in_place, plain = plan.run_in_place, plan.run
    if x is out and in_place is not None:  # the common in-place call: no address to compare

        def run_here(x: np.ndarray, out: np.ndarray) -> None:
            in_place(out)

        return run_here
    if x.flags.c_contiguous and x.ctypes.data != out.ctypes.data:
        return plain
    if in_place is None:  # a plan without an in-place runner reads a C-contiguous copy

        def run_on_copy(x: np.ndarray, out: np.ndarray) -> None:
            plain(np.ascontiguousarray(x), out)

        return run_on_copy
    reduce_in_place = in_place

    def run(x: np.ndarray, out: np.ndarray) -> None:
        if x.ctypes.data != out.ctypes.data:
            np.copyto(out, x)
        reduce_in_place(out)

    return run
