"""A group fails for good only after a collective started I/O (issue 32, item 3).

Real ranks over real sockets, no mocks:

- The report: a function calling ``meshcomm.distributed.all_reduce`` (and a group, and
  ``meshcomm.ops.psum``) on torch tensors, compiled with ``torch.compile`` (the ``eager``
  backend and the default one) and explained with ``torch._dynamo.explain``, gives eager's
  numbers; each meshcomm call outside ``meshcomm.ops`` is one graph break, none of meshcomm's
  frames is compiled, and eager collectives on the same group work afterwards.
- Failures before I/O (a FakeTensor made under ``FakeTensorMode``, an object that is no
  array; sync, async, in place, point to point, through ``meshcomm.distributed``) raise
  TypeError and leave the group working.
- A failure after I/O started (the peer SIGKILLed while this rank waits in an all_reduce)
  still fails the group: every later call raises "the group failed earlier".
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import signal
import time
import traceback
from typing import Any

import numpy as np
import pytest

from meshcomm.testing import run_ranks

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch is not installed (the test extra)")


def _check(problems: list[str], label: str, got: Any, want: Any) -> None:
    if not np.array_equal(np.asarray(got), np.asarray(want)):
        problems.append(f"{label}: got {got}, want {want}")


def _still_works(group: Any, problems: list[str], label: str) -> None:
    """An eager all_reduce on ``group`` gives the right sum (raises nothing)."""
    try:
        _check(problems, f"{label}: eager all_reduce", group.all_reduce(np.ones(2)), [2.0, 2.0])
    except Exception as exc:
        problems.append(f"{label}: the group no longer works: {type(exc).__name__}: {exc}")


# -- the report: compiled code calling meshcomm on torch tensors -----------------------------
def compiled_rank(group: Any) -> list[str]:
    import torch

    import meshcomm.distributed as dist
    from meshcomm import ops
    from meshcomm.mesh import init_device_mesh

    dist.init_process_group("gloo")  # adopts the world run_ranks made
    problems: list[str] = []
    r = group.rank
    x = torch.arange(4.0) + r
    want = torch.tensor([3.0, 7.0, 11.0, 15.0])  # 2 * (x0 + x1) + 1
    mixed_want = 4 * (2 * torch.arange(4.0) + 1)  # 2 * 2 * (x0 + x1)

    def in_place(x: Any) -> Any:
        y = x * 2
        dist.all_reduce(y)  # the torch.distributed-style in-place API
        return y + 1

    def on_group(x: Any) -> Any:
        y = x * 2
        return torch.from_numpy(group.all_reduce(y.numpy())) + 1

    def mixed(x: Any) -> Any:
        y = ops.psum(x, "tp")  # a torch operator: traced, no graph break
        dist.all_reduce(y)  # a graph break
        return y * 2

    with init_device_mesh((group.size,), ("tp",)):
        cases = [
            ("in place, eager backend", torch.compile(in_place, backend="eager"), want),
            ("in place, default backend", torch.compile(in_place), want),
            ("on the group, eager backend", torch.compile(on_group, backend="eager"), want),
            ("ops and in place", torch.compile(mixed, backend="eager"), mixed_want),
        ]
        for label, fn, expect in cases:
            try:
                _check(problems, label, fn(x), expect)
            except Exception as exc:
                problems.append(f"{label}: {type(exc).__name__}: {exc}")
            _still_works(group, problems, label)
        for label, fn in (("explain in place", in_place), ("explain mixed", mixed)):
            try:
                explained = torch._dynamo.explain(fn)(x)
                if explained.graph_break_count != 1:  # only at the meshcomm call
                    problems.append(f"{label}: {explained.break_reasons}")
            except Exception as exc:
                problems.append(f"{label}: {type(exc).__name__}: {exc}")
            _still_works(group, problems, label)
    t = torch.ones(3) * (r + 1)
    dist.all_reduce(t)  # the in-place API, eagerly, after all of it
    _check(problems, "eager dist.all_reduce afterwards", t, [3.0, 3.0, 3.0])
    dist.destroy_process_group()
    return problems


@needs_torch
@pytest.mark.timeout(200)
def test_compiled_calls_give_eager_numbers_and_leave_the_group_working() -> None:
    problems = [p for rank in run_ranks(compiled_rank, 2, timeout=180) for p in rank]
    assert not problems, "\n".join(problems)


# -- failures before I/O ---------------------------------------------------------------------
def pre_io_rank(group: Any) -> list[str]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import meshcomm.distributed as dist

    dist.init_process_group("gloo")
    with FakeTensorMode():
        fake = torch.ones(4)
    peer = 1 - group.rank
    calls = {
        "all_reduce(fake)": lambda: group.all_reduce(fake),
        "all_reduce(fake, async_op=True)": lambda: group.all_reduce(fake, async_op=True),
        "all_reduce(object())": lambda: group.all_reduce(object()),
        "all_gather(fake)": lambda: group.all_gather(fake),
        "broadcast(fake)": lambda: group.broadcast(fake),
        "reduce_scatter(fake)": lambda: group.reduce_scatter(fake),
        "send(fake)": lambda: group.send(fake, peer),
        "dist.all_reduce(fake)": lambda: dist.all_reduce(fake),
        "dist.all_reduce(object())": lambda: dist.all_reduce(object()),
    }
    problems: list[str] = []
    for label, call in calls.items():
        try:
            call()
            problems.append(f"{label}: no error")
        except TypeError as exc:
            if "fake" in label and "FakeTensor holds no values" not in str(exc):
                problems.append(f"{label}: unclear words: {exc}")
        except Exception as exc:
            problems.append(f"{label}: {type(exc).__name__} rather than TypeError: {exc}")
        _still_works(group, problems, label)
    dist.destroy_process_group()
    return problems


@needs_torch
@pytest.mark.timeout(120)
def test_failures_before_io_leave_the_group_working() -> None:
    problems = [p for rank in run_ranks(pre_io_rank, 2, timeout=100) for p in rank]
    assert not problems, "\n".join(problems)


# -- a failure after I/O started -------------------------------------------------------------
TIMEOUT = 5.0


def _killed_peer_child(rank: int, port: int, out: Any) -> None:
    from meshcomm.backends.tcp import TcpCommunicator
    from meshcomm.group import ProcessGroup
    from meshcomm.store import TCPStore

    store = TCPStore("127.0.0.1", port, timeout=30)
    group = ProcessGroup(TcpCommunicator.create_world(rank, 2, store, TIMEOUT), store)
    try:
        group.all_reduce(np.ones(2))  # connected, and the signature checked
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        buf = np.ones(1 << 20, np.float32)
        try:
            group.all_reduce(buf)  # rank 0 sends its part and waits for the dead peer's
            out.put(("no error", ""))
            return
        except Exception as exc:
            first = f"{type(exc).__name__}: {exc}"
        try:
            group.all_reduce(np.ones(2))
            out.put(("not poisoned", first))
        except Exception as again:
            out.put(("poisoned", f"{first}\n{type(again).__name__}: {again}"))
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        group.close()
        store.close()


@pytest.mark.timeout(90)
def test_a_failure_after_io_started_still_fails_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from meshcomm.store import StoreServer

    monkeypatch.setenv("MESHCOMM_TRANSPORT", "tcp")  # sockets: the spawned ranks inherit it
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with StoreServer("127.0.0.1", 0) as server:
        procs = [ctx.Process(target=_killed_peer_child, args=(r, server.port, out)) for r in (0, 1)]
        for p in procs:
            p.start()
        try:
            status, words = out.get(timeout=60 + TIMEOUT)
        finally:
            deadline = time.monotonic() + 15
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
    assert status == "poisoned", words
    assert "the group failed earlier" in words.splitlines()[-1], words
