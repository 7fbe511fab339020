"""Messages over 2 GiB, over shared memory (the default) and over sockets.

One 2.1 GiB message through the Link (byte counts past 2**31 in headers, partial writes at
the kernel's 2 GiB limit per call, single-copy reads in pieces) and one 2.1 GiB all_reduce
(thousands of ring chunks), checked byte for byte in pieces so that no second 2.1 GiB buffer
is ever made. Two processes hold one 2.1 GiB buffer each.

    .venv/bin/python -m pytest tests/test_tcp_large.py -m slow -q
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import numpy as np
import pytest
from spawned import run_spawned

from meshcomm.backends.tcp import TcpCommunicator
from meshcomm.reduction import ReduceOp
from meshcomm.store import StoreServer, TCPStore

pytestmark = pytest.mark.slow

NBYTES = int(2.1 * (1 << 30))
PIECE = 251 << 16  # a multiple of the pattern's period, about 16 MiB


def _pattern() -> np.ndarray:
    return (np.arange(PIECE) % 251).astype(np.uint8)


def _pieces() -> list[tuple[int, int]]:
    return [(lo, min(lo + PIECE, NBYTES)) for lo in range(0, NBYTES, PIECE)]


def big_messages(comm: TcpCommunicator) -> dict[str, Any]:
    pattern = _pattern()
    buf = np.zeros(NBYTES, np.uint8)
    if comm.rank == 0:
        for lo, hi in _pieces():
            buf[lo:hi] = pattern[: hi - lo]
    t0 = time.monotonic()
    if comm.rank == 0:
        comm.link.exchange([(1, buf)], [])  # one message of 2.1 GiB
    else:
        comm.link.exchange([], [(0, buf)])
    t1 = time.monotonic()
    message_ok = all(np.array_equal(buf[lo:hi], pattern[: hi - lo]) for lo, hi in _pieces())
    t2 = time.monotonic()
    comm.all_reduce(buf, ReduceOp.SUM)  # 2 * pattern, modulo 256
    t3 = time.monotonic()
    twice = pattern * np.uint8(2)
    reduce_ok = all(np.array_equal(buf[lo:hi], twice[: hi - lo]) for lo, hi in _pieces())
    return {
        "message": message_ok,
        "all_reduce": reduce_ok,
        "seconds": (round(t1 - t0, 2), round(t3 - t2, 2)),
        "channels": comm.transport.channels,
    }


def _child(rank: int, port: int, out: Any) -> None:
    store = TCPStore("127.0.0.1", port, timeout=60)
    comm = TcpCommunicator.create_world(rank, 2, store, 120.0)
    try:
        out.put((rank, "ok", big_messages(comm)))
    except BaseException as exc:
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        comm.close()
        store.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_messages_over_2_gib(transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHCOMM_TRANSPORT", transport)
    with StoreServer("127.0.0.1", 0) as server:
        port = server.port
        answers = run_spawned(_child, 2, lambda r, out: (r, port, out), seconds=600, join=60)
    results: dict[int, Any] = {}
    for rank, (status, value) in answers.items():
        assert status == "ok", f"rank {rank}: {value}"
        results[rank] = value
    kind = "shm" if transport == "auto" else "tcp"
    for rank, result in results.items():
        assert result["message"] and result["all_reduce"], (rank, result)
        assert result["channels"] == {1 - rank: kind}, result
