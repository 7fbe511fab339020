"""How a group's calls run: argument checks first, then the progress engine, in issue order.

An :class:`Issuer` belongs to one :class:`~meshcomm.group.ProcessGroup` and holds what its
calls share: the engine, the sequence number, the ledger, the mismatch checks' state, the
lowering contexts, and the group's one plan cache.

The main route of a collective is :meth:`Issuer.call`: ``call -> route -> plan -> run``.
The collective's description (:mod:`meshcomm.group.collectives`) gives the call's plan key;
a call with a key runs the cached plan of its signature (made on its first call, with every
check) with :meth:`Issuer.run_plan` (a plan that fills a fresh result) or
:meth:`Issuer.run_returning` (a rooted collective's or a device call's, whose runner returns
the result); a call without one (a ``premul_sum`` factor, a list, ``shape=`` off a root, a
host copy of a device array) is lowered per call, a plan used once, and runs through
:meth:`Issuer.issue`.

Every call is **admitted** in one place (:meth:`Issuer._admit`: its sequence number and its
ledger entry) and a failed one **settled** in one place (:meth:`Issuer._settle_failed`: the
group poisoned, a mismatch in words, a timeout's hang verdict); the inline fast case
(:meth:`Issuer._inline`, and its copy at the end of :meth:`Issuer.run_plan`, the 8-byte
all_reduce's path) writes admission's two lines out: a frame costs the hot path a tenth.
The fast case of a plan runs inline on the claimed engine between the two; every other
case hands the same runner to :meth:`Issuer.issue`, which admits it and queues it with
its checks around it. A closed group's engine refuses both.

Example:
    >>> from meshcomm.backends.local import SelfCommunicator
    >>> from meshcomm.group import ProcessGroup
    >>> from meshcomm.group.collectives import ALL_REDUCE
    >>> g = ProcessGroup(SelfCommunicator())
    >>> issuer = g._issuer
    >>> issuer.call(ALL_REDUCE, np.ones(2), False, "sum", None), issuer.seq
    (array([1., 1.]), 1)
    >>> g.close()
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import time
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
from meshcomm.group import routes
from meshcomm.group.arrays import ResultPool
from meshcomm.group.collectives import Collective
from meshcomm.group.lower import Call
from meshcomm.work import ProgressEngine, Work

if TYPE_CHECKING:
    from meshcomm.group import ProcessGroup

__all__ = ["Issuer"]

#: A plan of a host call or of a device call (both kept in one cache per group).
_AnyPlan = TypeVar("_AnyPlan", _plans.Plan, _plans.ReturningPlan)
_Planned = _plans.Plan | _plans.ReturningPlan

#: At most this many plans per group (a loop calls a few signatures; the oldest goes first).
_PLANS = 256

#: Results at least this large come from the world's ResultPool (recycled, no fresh pages).
_POOLED = ResultPool.MIN_BYTES

# _fingerprint's stamp layout: a plan's call stamps ``plan.stamp_base | (seq & _SEQ_MASK)``.
_SEQ_MASK = (1 << _fingerprint.SEQ_BITS) - 1
# Call ``seq`` steps the comparison of the running hash (_mpi_history) when
# ``not seq & _HISTORY``.
_HISTORY = _mpi_history.MASK
# The inline path's ledger record (see Issuer.run_plan): names bound once, read as globals.
_getframe, _clock = sys._getframe, time.monotonic
_PACKAGE, _ENDED = _ledger.PACKAGE, _ledger.ENDED
# Issuer.last_all_reduce before a first call (no dtype is None).
_NO_LAST: tuple[Any, ...] = (None, None, None, None)
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
        device_plans: the same for calls on the device communicator.
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
        # The device module and its array type (cupy's): such an array takes the device
        # plans' route from call() at once. None without a device communicator; numpy's
        # (the stand-ins') never gets there: numpy arrays take the host plans.
        self._xp: ModuleType | None = None
        self._device_array: type | None = None
        if device is not None:
            self._xp = importlib.import_module(device.array_module)
            self._device_array = getattr(self._xp, "ndarray", None)
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
        self._closed_reason = "the group was closed"
        # One lowering context per operation name, made on first use: the per-call path
        # then does no string formatting and no allocation for it.
        self._calls: dict[str, _lower.Call] = {}
        # One plan per call signature (_plans.Plan), made on first use, dropped by close().
        self.plans: dict[tuple[Any, ...], _Planned] = {}
        # all_reduce's last numpy signature and its plan, (dtype, shape, op, plan), which
        # ProcessGroup.all_reduce compares before building and hashing the plans' key.
        self.last_all_reduce: tuple[Any, ...] = _NO_LAST
        # The device calls' plans, by the same keys (a cupy call's signature reads as a
        # numpy call's).
        self.device_plans: dict[tuple[Any, ...], _Planned] = {}

    def relabel(self, where: str) -> None:
        """Name this rank and group ``where`` in messages from now on."""
        self._where = where
        self._calls.clear()  # their messages were made with the old words

    def close(self, reason: str, timeout: float, said: str | None = None) -> None:
        """Refuse every call from now on (a plan's too: its claim fails, and its queued
        route raises), let queued operations finish (up to ``timeout``), drop the plans.
        ``said``: what a refused call says (default: that the group was closed)."""
        self._closed = True
        if said is not None:
            self._closed_reason = said
        self.engine.close(reason, timeout)
        if self.engine.failure is None:  # the others start it too: let it end first
            _mpi_history.wait_quietly(self._pending, timeout)
        self._pending = None
        self.plans.clear()
        self.last_all_reduce = _NO_LAST
        self.device_plans.clear()

    # -- the main route --------------------------------------------------------------------
    def call(self, coll: Collective, x: Any, async_op: bool, *args: Any) -> Any:
        """Run collective ``coll`` on ``x`` with the method's own ``args`` (in its order):
        the plan of the call's key where it has one, else lowered per call (a plan used
        once) on the route :mod:`meshcomm.group.routes` decides."""
        if type(x) is np.ndarray:
            key = coll.key(x, *args)
            if key is not None:
                try:
                    plan: Any = self.plans[key]
                except (KeyError, TypeError):  # a new signature (or an unhashable argument)
                    plan = self._new_plan(key, coll.plan, x, *args)
                if plan.fills:
                    return self.run_plan(plan, x, async_op)
                return self.run_returning(plan, x, async_op)
        elif type(x) is self._device_array and coll.on_device:
            # What lowered() finds for a cupy array, without asking routes for its kind.
            key = coll.device_key(x, *args)
            if key is not None:
                dev, xp, plans = self._device, self._xp, self.device_plans
                plan = self.plan(key, coll.device_plan, dev, xp, x, *args, cache=plans)
                return self.run_returning(plan, x, async_op)
        return self.lowered(coll, x, async_op, args)

    def call_noted(self, coll: Collective, note: Any, x: Any, async_op: bool, *args: Any) -> Any:
        """:meth:`call` with ``note`` added to the call's fingerprint fields (the ops layer's
        words: :mod:`meshcomm.ops._calls`), on its plan (cached under the key and the note)
        and on a host lowering; a device call carries none."""
        if type(x) is np.ndarray:
            key = coll.key(x, *args)
            if key is not None:
                plan: Any = self.plan((*key, note), _plans.noted, coll.plan, note, x, *args)
                if plan.fills:
                    return self.run_plan(plan, x, async_op)
                return self.run_returning(plan, x, async_op)
        return self.lowered(coll, x, async_op, args, note)

    def lowered(
        self, coll: Collective, x: Any, async_op: bool, args: tuple[Any, ...], note: Any = ()
    ) -> Any:
        """:meth:`call` past the numpy plans: a device array on the group's device
        communicator (its plan where it has a key), else lowered onto host buffers (a device
        array through a host copy, its result handed back to its module)."""
        name = coll.name
        if x is None and name in _LOCATION_FREE:
            on_device = routes.arrival_route(self._device, args[-1])  # (root, shape, dtype)
        else:
            on_device = routes.device_route(self._device, x)
        if on_device is not None and coll.on_device:
            dev, xp = on_device
            key = None if x is None else coll.device_key(x, *args)
            if key is not None:
                plan = self.plan(key, coll.device_plan, dev, xp, x, *args, cache=self.device_plans)
                return self.run_returning(plan, x, async_op)
            c = self.enter(name)
            lowered = coll.lower(c, x, *args, on=_device_lower.DeviceBuffers(dev, xp))
            return self.issue_on_device(name, lowered, async_op)
        c = self.enter(name)
        host, back = routes.host_route(x)
        body, fields = coll.lower(c, host, *args, snapshot=bool(async_op))
        if note:
            fields = {**(fields or {}), **dict(note)}
        return self.issue(name, (body, fields), async_op, back)

    def enter(self, op: str) -> Call:
        """Refuse a closed or failed group; return the call context for lowering ``op``."""
        if self._closed or not self.engine.healthy:
            if self._closed:
                raise CommError(f"{op}: {self._where}: {self._closed_reason}")
            self.engine.check(f"{op} on {self._where}")
        call = self._calls.get(op)
        if call is None:
            engine = self.engine
            where = f"{op}: {self._where}"
            call = self._calls[op] = Call(self._comm, engine.pool, where, engine.results)
        return call

    # -- admitting and settling ------------------------------------------------------------
    def _admit(
        self, op: str, dtype: Any, shape: Any, fields: dict[str, Any]
    ) -> tuple[int, _ledger.Entry | None]:
        """Admit call ``op``: its sequence number and its ledger entry (the one place
        either is made)."""
        self.seq = seq = self.seq + 1
        return seq, self.book.add(seq, op, dtype, shape, fields)

    def _settle_failed(
        self,
        exc: BaseException,
        op: str,
        seq: int,
        entry: _ledger.Entry | None,
        label: str | None = None,
    ) -> NoReturn:
        """Settle call ``seq`` that raised ``exc`` (the one place a failure is settled):
        where it failed on this thread (``label``: the call in words) the group is poisoned
        first, with a mismatch put in words; its ledger entry ends failed; a timeout is
        raised with the hang verdict added."""
        if label is not None:
            if isinstance(exc, MismatchError):
                # In words, for this rank and (through the sticky failure) later calls.
                worded = self._words(op, seq, entry)(exc)
                self.engine.poison(worded, label)
                self.book.end(entry, True)
                raise worded from None
            self.engine.poison(exc, label)
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

    # -- lowered calls ---------------------------------------------------------------------
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
                return routes.give_back(device, on_host())

        if fields is None:  # point to point: no sequence number, no fingerprint
            return self.engine.submit(body, f"{op} on {self._where}", bool(async_op))
        on_device = device is not None or over_device  # the input lives on a GPU
        if self._device is None and op in _LOCATION_FREE:
            # Through host memory, ranks off the root may pass None to broadcast and
            # scatter, and where each result lives is each rank's own choice: no location
            # is compared (read as the host's, as the planned calls do). A group with a
            # device backend compares it: a device call runs on another communicator.
            on_device = False
        booked = {**fields, "device": True} if on_device else fields  # for the ledger
        seq, entry = self._admit(op, fields.get("dtype"), fields.get("shape"), booked)
        label = f"{op} (op #{seq}) on {self._where}"
        body = self._checked(body, op, seq, fields, on_device, over_device, label, entry)
        if entry is not None and async_op:
            body = _call_checks.booked(entry, body)  # it ends on the engine's thread
        try:
            result = self.engine.submit(body, label, bool(async_op))
        except BaseException as exc:
            # In flight while judged: the others' verdicts find this rank in it meanwhile.
            self._settle_failed(exc, op, seq, entry)
        if not async_op:
            self.book.end(entry, False)
        elif isinstance(result, Work):
            # Its own timeout, raised on the engine's thread, gets the verdict in wait().
            group = self._group
            result._judge = lambda exc: _call_checks.judged(group, exc, op, seq, entry)
        return result

    def _checked(
        self,
        body: Callable[[], Any],
        op: str,
        seq: int,
        fields: dict[str, Any],
        on_device: bool,
        over_device: bool,
        label: str,
        entry: _ledger.Entry | None,
    ) -> Callable[[], Any]:
        """``body`` of admitted call ``seq`` with the checks it runs with on the engine: the
        ``DETAIL`` fingerprint check, a trace, its stamp, the first-call check and the step
        of the running hash where the backend has no stamps."""
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
        if self._stamper is not None and not over_device:
            sig = _fingerprint.signature_of(op, fields, on_device)
            stamp = _fingerprint.stamp(sig, seq)
            body = _call_checks.stamped(body, self._stamper, stamp, self._words(op, seq, entry))
        seen = self._device_seen if over_device else self._seen
        history = self.history
        if seen is not None or history is not None:
            sig = _fingerprint.signature_of(op, fields, on_device)
            if seen is not None and sig not in seen:
                row = _fingerprint.encode(op, seq, on_device=on_device, **fields)
                body = _call_checks.checked_first(
                    group, self._comm, body, row, sig, seen, op, seq, label, entry
                )
            if history is not None:
                if not seq & _HISTORY:  # before the first-call check, on every rank
                    body = self._stepped(body, history, op, seq, label, entry)
                self.history = hash((history, sig))  # _mpi_history.fold
        return body

    def issue_on_device(self, op: str, lowered: _lower.Lowered, async_op: bool) -> Any:
        """Run a call lowered onto :class:`~meshcomm.group.device_lower.DeviceBuffers` on the
        caller's thread.

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

    # -- planned calls ---------------------------------------------------------------------
    def plan(
        self,
        key: tuple[Any, ...],
        make: Callable[..., _AnyPlan],
        *args: Any,
        cache: dict[tuple[Any, ...], _Planned] | None = None,
    ) -> _AnyPlan:
        """The plan of the call signature ``key`` (its first item the collective's name):
        the group's cached one, else a new one, ``make(call, *args)`` (every check of the
        lowering, so every error is raised here, before any I/O), kept under ``key`` in
        ``cache`` (default :attr:`plans`; device calls: :attr:`device_plans`)."""
        plans = self.plans if cache is None else cache
        try:
            return cast(_AnyPlan, plans[key])
        except (KeyError, TypeError):  # a new signature (or an unhashable argument)
            pass
        # Made outside the handler: its errors come without a KeyError as their context.
        return self._new_plan(key, make, *args, cache=plans)

    def _new_plan(
        self,
        key: tuple[Any, ...],
        make: Callable[..., _AnyPlan],
        *args: Any,
        cache: dict[tuple[Any, ...], _Planned] | None = None,
    ) -> _AnyPlan:
        plan = make(self.enter(key[0]), *args)
        plans = self.plans if cache is None else cache
        if len(plans) >= _PLANS:
            # Another thread may evict at the same time: then one plan fewer, no harm.
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                del plans[next(iter(plans))]
        with contextlib.suppress(TypeError):  # an unhashable argument the checks accept
            plans[key] = plan
        return plan

    def run_returning(self, plan: _plans.ReturningPlan, x: Any, async_op: bool) -> Any:
        """Run a plan whose runner returns the result (:class:`~meshcomm.group.plans.
        ReturningPlan`): a device call's (``x`` a C-contiguous device array of its
        signature, run on the caller's thread as :meth:`issue_on_device` runs a lowered one)
        or a rooted collective's.

        The fast case runs it inline (:meth:`_inline`; a device call carries no stamp). A
        call that needs more (a ``DETAIL`` or first-call check, a trace), an asynchronous
        host call (it reads its own copy of ``x``, through the engine's queue) or one that
        finds the engine taken goes through :meth:`issue` with the same runner.
        """
        on_device = plan.on_device
        seen = self._device_seen if on_device else self._seen
        if not on_device and not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        if (
            self.debug
            or _trace.active is not None
            or (seen is not None and plan.sig not in seen)
            or (async_op and not on_device)
            or not self.engine.claim()
        ):
            run = plan.run
            if async_op and not on_device:
                x = x.copy()  # the caller may change ``x`` once the call is issued

            def body() -> Any:
                return run(x)

            if on_device:
                return self.issue_on_device(plan.collective, (body, plan.fields), async_op)
            return self.issue(plan.collective, (body, plan.fields), async_op)
        result = self._inline(plan, plan.run, x, None)
        if async_op:
            return self._device_work(plan.collective, result)
        return result

    def run_device_plan(self, plan: _plans.ReturningPlan, x: Any, async_op: bool) -> Any:
        """:meth:`run_returning` of a device call's ``plan`` (the name the tests know)."""
        return self.run_returning(plan, x, async_op)

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

        The fast case runs it inline, here (:meth:`_inline`'s work written out: a function
        call is a tenth of what this costs; at 8 bytes MPI takes about 1 us, and with more
        ranks than cores every layer here costs several times its own time). A call that
        needs more (a ``DETAIL`` or first-call check, a trace) or finds the engine taken
        (queued work, another thread, a failed or closed group) hands the same runner to
        :meth:`issue`.
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
        seen = self._seen
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
        # _inline's work, written out here: a frame less, and one less for the ledger's
        # search for the caller's site (the 8-byte call's cost, counted by callgrind).
        name = plan.collective
        self.seq = seq = self.seq + 1
        # The ledger's record (Ledger.add's, written out: its two calls were a fifth of the
        # group layer's instructions at 8 bytes): the caller's site is the first frame
        # outside meshcomm, above this method's caller.
        ring, entry = self.book.ring, None
        if ring is not None:
            frame: Any
            try:
                frame = _getframe(2)
            except ValueError:  # called from a module's top level (a test), not a method
                frame = _getframe(1)
            api = None
            while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
                api, frame = frame, frame.f_back
            site, lasti = (None, 0) if frame is None else (frame.f_code, frame.f_lasti)
            entry = [
                seq, name, dtype, plan.in_shape, site, lasti, _clock(), None, False,
                None if api is None else api.f_code, plan.ledger_fields,
            ]  # fmt: skip
            ring.append(entry)
        stamper, history = self._stamper, self.history
        if stamper is not None:
            stamper.stamp = plan.stamp_base | (seq & _SEQ_MASK)
        try:
            if history is not None:
                if not seq & _HISTORY:
                    self._step(history, name, seq)
                self.history = hash((history, plan.sig))  # _mpi_history.fold, inline
            run(x, out)
            if entry is not None:
                entry[_ENDED] = _clock()
        except BaseException as exc:
            self._settle_failed(exc, name, seq, entry, f"{name} (op #{seq}) on {self._where}")
        finally:
            engine.release()
        return out

    def _inline(self, plan: _Planned, run: Callable[..., Any], x: Any, out: Any) -> Any:
        """Run a planned call here, on the engine this thread claimed: admitted, its stamp
        set (a host plan's, where the backend carries stamps), the running hash of the
        signatures kept inline where it has none (every 128th call first steps its
        comparison, :meth:`_step`: the claimed engine has nothing in flight), then
        ``run(x, out)`` (``out`` None: ``run(x)``, a device plan's, returns the result)."""
        name = plan.collective
        # Admitted as _admit does, written out: the call costs a frame and the ledger's
        # search for the caller's site one frame more (3,000 instructions of ~36,000 at
        # 8 bytes on a group of one, counted by callgrind).
        self.seq = seq = self.seq + 1
        entry = self.book.add(seq, name, plan.dtype, plan.in_shape, plan.ledger_fields)
        stamper, history = self._stamper, self.history
        if stamper is not None and plan.stamp_base is not None:
            stamper.stamp = plan.stamp_base | (seq & _SEQ_MASK)
        try:
            if history is not None:
                if not seq & _HISTORY:
                    self._step(history, name, seq)
                self.history = hash((history, plan.sig))  # _mpi_history.fold, inline
            if out is None:
                out = run(x)
            else:
                run(x, out)
            self.book.end(entry, False)
        except BaseException as exc:
            self._settle_failed(exc, name, seq, entry, f"{name} (op #{seq}) on {self._where}")
        finally:
            self.engine.release()
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
            self._settle_failed(exc, op, seq, entry, label)
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

    # -- words ----------------------------------------------------------------------------
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
