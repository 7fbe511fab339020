"""The tcp backend's same-host fast path: shared-memory rings, futex doorbells, lifecycle.

In-process tests pair two doorbells of one process (hypothesis drives the byte stream across
wrap-around). Cross-process tests run real processes (spawn start method), exchange handshake
messages over multiprocessing queues (standing in for the transport's socket) and are bounded by
timeouts: a 64 MiB stream checked by hash, doorbell wake-ups, no names left in /dev/shm after a
normal exit or a SIGKILL of either side, and four ranks on two cores passing a token while
sleeping, not spinning.

Run as a script for the micro-benchmark (shm vs loopback TCP, same run)::

    .venv/bin/python tests/test_tcp_shm.py
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshcomm.backends.tcp.same_host import rings as shm
from meshcomm.backends.tcp.same_host.rings import Doorbell, ShmHandshake, ShmPair
from meshcomm.errors import CommError, CommTimeout, InvalidArgument, PeerError, ProtocolError

pytestmark = pytest.mark.skipif(not shm.shm_supported(), reason="no shared-memory fast path here")

CTX = mp.get_context("spawn")
JOIN_TIMEOUT = 90.0  # seconds a test waits for its processes before killing them
STEP_TIMEOUT = 60.0  # seconds a child waits for any one step


# -- helpers (module level: spawned children import them) ----------------------------------


def _new_job() -> str:
    return "t" + secrets.token_hex(6)


def _leftovers(job: str) -> list[str]:
    return sorted(name for name in os.listdir(shm.SHM_DIR) if f".{job}." in name)


@pytest.fixture
def job() -> Iterator[str]:
    """A fresh job token; the test fails if it leaves a name in /dev/shm."""
    token = _new_job()
    yield token
    left = _leftovers(token)
    for name in left:
        os.unlink(os.path.join(shm.SHM_DIR, name))
    assert left == []


def _local_pair(
    job: str, capacity: int | None = None
) -> tuple[Doorbell, Doorbell, ShmPair, ShmPair]:
    """Ranks 0 and 1 in this process, paired through the real handshake."""
    a, b = Doorbell(job, 0, expected_peers=1), Doorbell(job, 1, expected_peers=1)
    ha, hb = ShmHandshake(a, 1, capacity=capacity), ShmHandshake(b, 0, capacity=capacity)
    ha.accept(hb.offer())
    hb.accept(ha.offer())
    ack_a, ack_b = ha.ack(), hb.ack()
    return a, b, ha.complete(ack_b), hb.complete(ack_a)


def _close(*things: Any) -> None:
    for thing in things:
        thing.close()


def _handshake_all(
    bell: Doorbell, links: dict[int, tuple[Any, Any]], capacity: int | None = None
) -> dict[int, ShmPair]:
    """Pair with every peer in ``links`` ({peer: (inbox, outbox)}), all steps interleaved."""
    shakes = {peer: ShmHandshake(bell, peer, capacity=capacity) for peer in links}
    try:
        for peer, (_, outbox) in links.items():
            outbox.put(shakes[peer].offer())
        for peer, (inbox, outbox) in links.items():
            try:
                shakes[peer].accept(inbox.get(timeout=STEP_TIMEOUT))
                outbox.put(shakes[peer].ack())
            except CommError as exc:
                outbox.put(shakes[peer].nack(str(exc)))
        return {
            peer: shakes[peer].complete(inbox.get(timeout=STEP_TIMEOUT))
            for peer, (inbox, _) in links.items()
        }
    except BaseException:
        for hs in shakes.values():
            hs.close()
        raise


def _idle(
    bell: Doorbell,
    pairs: list[ShmPair],
    ready: Callable[[], bool],
    deadline: float,
    slice_s: float = 0.2,
) -> bool:
    """Sleep on the doorbell until ``ready()``; PeerError if a peer died, CommTimeout late.

    Returns:
        True if the wait slice expired without a ring.
    """
    bell.arm()
    if ready():
        bell.disarm()
        return False
    if bell.wait(slice_s):
        return False
    for pair in pairs:
        if not pair.peer_alive():
            raise PeerError(f"rank {bell.rank}: rank {pair.peer} died", rank=pair.peer)
    if time.monotonic() > deadline:
        raise CommTimeout(f"rank {bell.rank}: no progress for {STEP_TIMEOUT} s")
    return True


def _send_all(
    bell: Doorbell, pair: ShmPair, data: memoryview, timeout: float = STEP_TIMEOUT
) -> None:
    deadline, off = time.monotonic() + timeout, 0
    while off < len(data):
        sent = pair.tx.send_some(data[off:])
        if sent:
            off += sent
        else:
            _idle(bell, [pair], lambda: pair.tx.writable_bytes() > 0, deadline)


def _recv_exact(
    bell: Doorbell, pair: ShmPair, buf: memoryview, timeout: float = STEP_TIMEOUT
) -> None:
    deadline, off = time.monotonic() + timeout, 0
    while off < len(buf):
        got = pair.rx.recv_into_some(buf[off:])
        if got:
            off += got
        else:
            _idle(bell, [pair], lambda: pair.rx.readable_bytes() > 0, deadline)


def _random_bytes(nbytes: int, seed: int) -> memoryview:
    return memoryview(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


def _child(fn: Callable[..., Any], results: Any, *args: Any) -> None:
    """Run ``fn`` in a child; report its return value or its exception on ``results``."""
    try:
        results.put(("ok", fn(*args)))
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _start(fn: Callable[..., Any], results: Any, *args: Any) -> Any:
    proc = CTX.Process(target=_child, args=(fn, results, *args), daemon=True)
    proc.start()
    return proc


def _join(procs: list[Any], timeout: float = JOIN_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
    stuck = [proc for proc in procs if proc.is_alive()]
    for proc in stuck:
        proc.kill()
        proc.join(10)
    assert not stuck, f"{len(stuck)} process(es) did not finish within {timeout} s"


def _results(results: Any, count: int) -> list[Any]:
    out = []
    for _ in range(count):
        status, value = results.get(timeout=JOIN_TIMEOUT)
        assert status == "ok", value
        out.append(value)
    return out


def _queues(ranks: list[int]) -> dict[tuple[int, int], Any]:
    return {(i, j): CTX.Queue() for i in ranks for j in ranks if i != j}


def _links(rank: int, peers: list[int], queues: dict[tuple[int, int], Any]) -> dict[int, Any]:
    return {peer: (queues[(peer, rank)], queues[(rank, peer)]) for peer in peers}


# -- configuration and validation ----------------------------------------------------------


def test_transport_switch_and_capacity_env(job: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHCOMM_TRANSPORT", "tcp")
    assert shm.shm_enabled() is False
    for value in ("", "auto", " AUTO "):
        monkeypatch.setenv("MESHCOMM_TRANSPORT", value)
        assert shm.shm_enabled() is True
    for value in ("shm", "carrier-pigeon"):
        monkeypatch.setenv("MESHCOMM_TRANSPORT", value)
        with pytest.raises(InvalidArgument, match=value):
            shm.shm_enabled()
    monkeypatch.delenv("MESHCOMM_SHM_BYTES", raising=False)
    assert shm.default_capacity() == shm.DEFAULT_CAPACITY == 4 << 20
    monkeypatch.setenv("MESHCOMM_SHM_BYTES", "65536")
    assert shm.default_capacity() == 65536
    for bad in ("0", "-5", "4MiB", str(shm.MAX_CAPACITY + 1)):
        monkeypatch.setenv("MESHCOMM_SHM_BYTES", bad)
        with pytest.raises(InvalidArgument, match="MESHCOMM_SHM_BYTES"):
            shm.default_capacity()
    monkeypatch.setenv("MESHCOMM_SHM_SPIN_US", "fast")
    with pytest.raises(InvalidArgument, match="MESHCOMM_SHM_SPIN_US"):
        Doorbell(job, 0, local_size=1)


def test_bad_arguments_raise_before_creating_anything(job: str) -> None:
    for bad_job in ("", "a/b", "x" * 65, 7):
        with pytest.raises(InvalidArgument, match="job token"):
            Doorbell(bad_job, 0)  # type: ignore[arg-type]
    for bad_rank in (-1, True, 1.0):
        with pytest.raises(InvalidArgument, match="rank"):
            Doorbell(job, bad_rank)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="expected_peers"):
        Doorbell(job, 0, expected_peers=-1)
    assert _leftovers(job) == []
    with Doorbell(job, 0, expected_peers=1) as bell:
        with pytest.raises(InvalidArgument, match="itself"):
            ShmHandshake(bell, 0)
        with pytest.raises(InvalidArgument, match="capacity"):
            ShmHandshake(bell, 1, capacity=0)
        with pytest.raises(InvalidArgument, match="no shared-memory peer 5"):
            bell.ring(5)
        bell.arm()
        with pytest.raises(InvalidArgument, match="timeout"):
            bell.wait(-1)
    with Doorbell(b"\x01\x02" * 8, 3, expected_peers=0) as bell:
        assert bell.job == "0102" * 8


def test_names_are_gone_before_any_byte_moves(job: str) -> None:
    a, b = Doorbell(job, 0, expected_peers=1), Doorbell(job, 1, expected_peers=1)
    ha, hb = ShmHandshake(a, 1, capacity=1024), ShmHandshake(b, 0, capacity=1024)
    assert len(_leftovers(job)) == 4  # two doorbells, two rings
    ha.accept(hb.offer())  # rank 0 maps rank 1's ring and unlinks its name
    hb.accept(ha.offer())
    assert [n.split(".")[2] for n in _leftovers(job)] == ["bell", "bell"]
    pa, pb = ha.complete(hb.ack()), hb.complete(ha.ack())
    assert _leftovers(job) == []  # both doorbells had their one expected peer
    assert pa.tx.send_some(b"ping") == 4 and pb.rx.readable_bytes() == 4
    assert (pa.peer, pb.peer, pa.peer_pid) == (1, 0, os.getpid())
    assert pa.peer_alive() and pb.rx.peer_alive()
    _close(pa, pb, a, b)


def test_doorbell_is_shared_through_proc_and_falls_back_to_its_name(job: str) -> None:
    a, b = Doorbell(job, 0), Doorbell(job, 1)  # no expected_peers: only /proc unlinks
    ha, hb = ShmHandshake(a, 1, capacity=64), ShmHandshake(b, 0, capacity=64)
    offer_b = hb.offer().replace(b'"bell_fd":', b'"bell_fd":9999')  # an fd rank 1 lacks
    ha.accept(offer_b)  # /proc/<pid>/fd/9999... fails: rank 0 maps b's doorbell by name
    hb.accept(ha.offer())  # through /proc
    pa, pb = ha.complete(hb.ack()), hb.complete(ha.ack())
    assert _leftovers(job) == [b.name]  # b's peer needed the name; a's did not
    assert pa.tx.send_some(b"x") == 1 and pb.tx.send_some(b"y") == 1
    b.arm()
    a.ring(1)
    assert b.wait(5) is True  # the by-name mapping is the same doorbell
    b.seal()
    _close(pa, pb, a, b)


def test_offers_and_acks_are_validated(job: str) -> None:
    a, b = Doorbell(job, 0, expected_peers=1), Doorbell(job, 1, expected_peers=1)
    ha, hb = ShmHandshake(a, 1, capacity=64), ShmHandshake(b, 0, capacity=64)
    good = hb.offer()
    for bad, match in [
        (b"\xff" * 10, "not ASCII JSON"),
        (b"[1, 2]", "must have fields"),
        (b"{}" + b" " * 5000, "too long"),
        (good.replace(b'"kind":"offer"', b'"kind":"ack"'), "kind"),
        (good.replace(job.encode(), b"otherjob"), "job"),
        (good.replace(b'"rank":1', b'"rank":2'), "rank"),
        (good.replace(b'"cap":64', b'"cap":-64'), "cap"),
        (good.replace(b'"cap":64', b'"cap":true'), "cap"),
        (good.replace(b'"cap":64', b'"cap":65'), "the offer said 4161"),
        (good.replace(b'"v":2', b'"v":9'), "version 9"),
        (good.replace(b".ring.1.0.", b".ring.1.1."), "names"),
    ]:
        with pytest.raises(ProtocolError, match=match):
            ha.accept(bad)
    assert len(_leftovers(job)) == 4  # failed accepts leave rank 1's ring in place
    with pytest.raises(CommError, match="another host"):
        ha.accept(good.replace(shm.host_key().encode(), b"elsewhere"))
    with pytest.raises(TypeError):
        ha.accept("text")  # type: ignore[arg-type]
    with pytest.raises(CommError, match="ack before"):
        ha.ack()
    # A peer that failed to accept sends a nack: both sides release everything.
    ha.accept(good)
    with pytest.raises(CommError, match="rank 1 could not map shared memory: no room"):
        ha.complete(hb.nack("no room"))
    forged = (
        b'{"v":2,"kind":"ack","rank":7,"peer":1,"ok":true,"proc":false,"cma":false,"reason":""}'
    )
    with pytest.raises(ProtocolError, match="expected ack from rank 0"):
        hb.complete(forged)
    assert _leftovers(job) == []  # each doorbell counted its (failed) handshake
    _close(ha, hb, a, b)


def test_channel_ends_close_and_refuse_wrong_use(job: str) -> None:
    a, b, pa, pb = _local_pair(job, capacity=16)
    with pytest.raises(InvalidArgument, match="receiving end"):
        pb.rx.send_some(b"x")
    with pytest.raises(InvalidArgument, match="sending end"):
        pa.tx.recv_into_some(bytearray(1))
    with pytest.raises(InvalidArgument, match="writable"):
        pb.rx.recv_into_some(b"read-only")
    with pytest.raises(InvalidArgument, match="contiguous"):
        pa.tx.send_some(np.arange(10, dtype=np.uint8)[::2])
    with pytest.raises(TypeError, match="buffer protocol"):
        pa.tx.send_some(12)  # type: ignore[arg-type]
    # Arrays of any dtype go as their bytes (ml_dtypes' bfloat16 has no buffer format).
    import ml_dtypes

    halves = np.arange(4, dtype=ml_dtypes.bfloat16)
    assert pa.tx.send_some(halves) == 8 and pa.tx.send_some(b"0123456789") == 8
    assert (pa.tx.writable_bytes(), pb.rx.readable_bytes()) == (0, 16)
    assert pa.tx.send_some(b"more") == 0  # full
    out = np.empty(4, dtype=ml_dtypes.bfloat16)
    assert pb.rx.recv_into_some(out) == 8 and np.array_equal(out, halves)
    pa.tx.close()
    assert pb.rx.peer_closed() and pb.rx.readable_bytes() == 8  # the rest still drains
    assert pb.rx.recv_into_some(bytearray(100)) == 8 and pb.rx.recv_into_some(bytearray(1)) == 0
    pa.rx.close()
    with pytest.raises(PeerError, match="closed its shared-memory channel") as info:
        pb.tx.send_some(b"x")
    assert info.value.rank == 0
    with pytest.raises(CommError, match="closed channel"):
        pa.tx.send_some(b"x")
    _close(pa, pb, pa, a, b, a)  # closing twice is fine


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.integers(1, 97),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 300)), max_size=60),
    notify=st.booleans(),
)
def test_byte_stream_survives_wrap_around(
    capacity: int, ops: list[tuple[bool, int]], notify: bool
) -> None:
    job = _new_job()
    a, b, pa, pb = _local_pair(job, capacity)
    rng = np.random.default_rng(capacity)
    sent, received = bytearray(), bytearray()
    try:
        for is_send, size in ops:
            if is_send:
                chunk = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
                free = pa.tx.writable_bytes()
                count = pa.tx.send_some(memoryview(chunk), notify=notify)
                assert count == min(size, free)
                sent += chunk[:count]
            else:
                avail = pb.rx.readable_bytes()
                buf = bytearray(size)
                count = pb.rx.recv_into_some(memoryview(buf), notify=notify)
                assert count == min(size, avail)
                received += buf[:count]
            assert pb.rx.readable_bytes() == len(sent) - len(received)
            assert pa.tx.writable_bytes() == capacity - (len(sent) - len(received))
        rest = bytearray(capacity)
        received += rest[: pb.rx.recv_into_some(rest)]
        assert received == sent
    finally:
        _close(pa, pb, a, b)
    assert _leftovers(job) == []


def test_wait_times_out_when_nobody_rings(job: str) -> None:
    with Doorbell(job, 0, expected_peers=0, spin_us=0) as bell:
        bell.arm()
        start = time.monotonic()
        assert bell.wait(0.3) is False
        assert 0.25 <= time.monotonic() - start < 10
        assert bell.wait(5) is True  # not armed: returns at once for the caller to arm
        bell.arm()
        assert bell.wait(0) is False
        bell.arm()
        bell.wake()  # a ring between arm and wait is not lost
        assert bell.wait(5) is True


# -- real processes ------------------------------------------------------------------------


def _stream_rank(job: str, rank: int, links: dict[int, Any], nbytes: int, seed: int) -> str:
    """Rank 0 streams random bytes in random chunks; rank 1 hashes and answers the digest."""
    bell = Doorbell(job, rank, local_size=2, expected_peers=1)
    pair = _handshake_all(bell, links)[1 - rank]
    rng = np.random.default_rng(seed + rank)
    try:
        if rank == 0:
            data, off = _random_bytes(nbytes, seed), 0
            while off < nbytes:
                size = int(rng.integers(1, 3 << 20))
                _send_all(bell, pair, data[off : off + size])
                off += size
            digest = bytearray(32)
            _recv_exact(bell, pair, memoryview(digest))
            return digest.hex()
        sha, buf, got = hashlib.sha256(), bytearray(3 << 20), 0
        while got < nbytes:
            view = memoryview(buf)[: min(int(rng.integers(1, 3 << 20)), nbytes - got)]
            _recv_exact(bell, pair, view)
            sha.update(view)
            got += len(view)
        _send_all(bell, pair, memoryview(sha.digest()))
        return sha.hexdigest()
    finally:
        _close(pair, bell)


@pytest.mark.parametrize(
    ("atomics", "nbytes"), [("", 64 << 20), ("libatomic", 8 << 20), ("nofence", 8 << 20)]
)
def test_two_processes_stream_random_bytes(
    job: str, atomics: str, nbytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 MiB through a 4 MiB ring, plus the weak-memory and always-ring code paths."""
    monkeypatch.setenv("MESHCOMM_SHM_ATOMICS", atomics)  # read by the children at import
    seed = int.from_bytes(secrets.token_bytes(4), "little")
    queues, results = _queues([0, 1]), CTX.Queue()
    procs = [
        _start(_stream_rank, results, job, r, _links(r, [1 - r], queues), nbytes, seed)
        for r in (0, 1)
    ]
    digests = _results(results, 2)
    _join(procs)
    expected = hashlib.sha256(_random_bytes(nbytes, seed)).hexdigest()
    assert digests == [expected, expected]
    assert [p.exitcode for p in procs] == [0, 0]


def _ping_pong(job: str, rank: int, links: dict[int, Any], rounds: int, seed: int) -> Any:
    """Exchange messages of 1-64 bytes through 16-byte rings; count waits that timed out."""
    bell = Doorbell(job, rank, expected_peers=1, spin_us=0)
    pair = _handshake_all(bell, links, capacity=16)[1 - rank]
    rng, timeouts = np.random.default_rng(seed), 0
    sizes = rng.integers(1, 65, rounds)
    deadline = time.monotonic() + STEP_TIMEOUT
    try:
        for r, size in enumerate(sizes):
            message = memoryview(bytes([r % 251]) * int(size))
            buf = memoryview(bytearray(int(size)))
            for sending in (True, False) if (r + rank) % 2 == 0 else (False, True):
                done = 0
                while done < size:
                    if sending:
                        done += pair.tx.send_some(message[done:])
                        ready = lambda: pair.tx.writable_bytes() > 0  # noqa: E731
                    else:
                        done += pair.rx.recv_into_some(buf[done:])
                        ready = lambda: pair.rx.readable_bytes() > 0  # noqa: E731
                    if done < size:
                        timeouts += _idle(bell, [pair], ready, deadline, slice_s=20.0)
            if bytes(buf) != bytes(message):
                raise AssertionError(f"rank {rank} round {r}: got {bytes(buf)!r}")
        return timeouts
    finally:
        _close(pair, bell)


@pytest.mark.parametrize("atomics", ["", "libatomic", "nofence"])
def test_ping_pong_never_misses_a_wake_up(
    job: str, atomics: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both sides block for data and for space all the time; no wait may time out."""
    monkeypatch.setenv("MESHCOMM_SHM_ATOMICS", atomics)
    queues, results, seed = _queues([0, 1]), CTX.Queue(), secrets.randbits(32)
    procs = [
        _start(_ping_pong, results, job, r, _links(r, [1 - r], queues), 1000, seed) for r in (0, 1)
    ]
    assert _results(results, 2) == [0, 0]  # a lost wake-up shows as a 20 s timeout
    _join(procs)


def _may_open_fds_of(pid: int) -> bool:
    """True where /proc lets this process open another one's descriptors."""
    try:
        os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    return True


def _ring_on_demand(job: str, links: dict[int, Any], control: Any, rounds: int) -> list[bool]:
    """Rank 1: arm, tell the parent, wait for its ring, ``rounds`` times."""
    bell = Doorbell(job, 1, spin_us=0)
    pair = _handshake_all(bell, links)[0]
    woke = []
    try:
        for _ in range(rounds):
            bell.arm()
            control.put("armed")
            woke.append(bell.wait(STEP_TIMEOUT))
        return woke
    finally:
        _close(pair, bell)


def test_doorbell_wakes_a_sleeping_process(job: str) -> None:
    queues, results, control = _queues([0, 1]), CTX.Queue(), CTX.Queue()
    proc = _start(_ring_on_demand, results, job, _links(1, [0], queues), control, 5)
    bell = Doorbell(job, 0)
    try:
        pair = _handshake_all(bell, _links(0, [1], queues))[1]
        for i in range(5):
            assert control.get(timeout=JOIN_TIMEOUT) == "armed"
            if i == 0 and _may_open_fds_of(proc.pid):
                assert _leftovers(job) == []  # both doorbells were shared through /proc
            time.sleep(0.05)  # let it reach FUTEX_WAIT
            bell.ring(1)
        assert _results(results, 1) == [[True] * 5]
        _join([proc])
        pair.close()
    finally:
        bell.close()


def _stream_until_peer_dies(job: str, rank: int, links: dict[int, Any], control: Any) -> str:
    """Stream forever (rank 0 sends, rank 1 receives) until the peer is found dead."""
    bell = Doorbell(job, rank, local_size=2, expected_peers=1)
    pair = _handshake_all(bell, links)[1 - rank]
    control.put((rank, os.getpid()))
    data, buf = _random_bytes(1 << 20, rank), memoryview(bytearray(1 << 20))
    try:
        while True:
            if rank == 0:
                _send_all(bell, pair, data)
            else:
                _recv_exact(bell, pair, buf)
    except PeerError as exc:
        return f"peer gone: {exc}"
    finally:
        _close(pair, bell)


@pytest.mark.parametrize("victim", [0, 1], ids=["kill-sender", "kill-receiver"])
def test_sigkill_leaves_nothing_and_the_survivor_notices(job: str, victim: int) -> None:
    queues, results, control = _queues([0, 1]), CTX.Queue(), CTX.Queue()
    procs = [
        _start(_stream_until_peer_dies, results, job, r, _links(r, [1 - r], queues), control)
        for r in (0, 1)
    ]
    pids = dict(control.get(timeout=JOIN_TIMEOUT) for _ in range(2))
    assert _leftovers(job) == []  # unlinked at set-up, while both are alive
    time.sleep(0.3)  # mid-stream
    os.kill(pids[victim], signal.SIGKILL)
    procs[victim].join(JOIN_TIMEOUT)
    survivor = _results(results, 1)[0]
    assert survivor.startswith(f"peer gone: rank {1 - victim}: rank {victim} died")
    _join(procs)
    assert procs[victim].exitcode == -signal.SIGKILL and procs[1 - victim].exitcode == 0
    assert _leftovers(job) == []


def _offer_then_hang(job: str, control: Any) -> None:
    """Create a doorbell and a ring, send the offer, and hang (to be killed mid-set-up)."""
    bell = Doorbell(job, 1, expected_peers=1)
    control.put(ShmHandshake(bell, 0, capacity=4096).offer())
    time.sleep(STEP_TIMEOUT)


def test_sweep_removes_names_of_a_process_killed_during_setup(job: str) -> None:
    results, control = CTX.Queue(), CTX.Queue()
    proc = _start(_offer_then_hang, results, job, control)
    offer = control.get(timeout=JOIN_TIMEOUT)
    with Doorbell(job, 2, expected_peers=5) as mine:  # a live process's names stay
        theirs = [name for name in _leftovers(job) if name != mine.name]
        assert len(theirs) == 2  # its doorbell and its ring
        assert shm.sweep(job) == []  # alive: nothing to sweep
        proc.kill()
        proc.join(JOIN_TIMEOUT)
        assert sorted(shm.sweep(job)) == theirs
        assert _leftovers(job) == [mine.name]
        # The offer now names nothing: accepting it fails cleanly.
        with (
            Doorbell(job, 0, expected_peers=1) as bell,
            ShmHandshake(bell, 1) as hs,
            pytest.raises(CommError, match="cannot open shared-memory segment"),
        ):
            hs.accept(offer)
        assert shm.sweep(job) == []


def _ring_member(
    job: str, rank: int, size: int, links: dict[int, Any], control: Any, go: Any, rounds: int
) -> tuple[int, float, float]:
    """Pass a token around the ring; report the CPU and wall time of the first wait."""
    left, right = (rank - 1) % size, (rank + 1) % size
    bell = Doorbell(job, rank, local_size=size, expected_peers=2)
    pairs = _handshake_all(bell, links)
    token = bytearray(8)
    control.put(rank)
    try:
        if rank == 0:
            go.wait(JOIN_TIMEOUT)
        cpu, wall = time.process_time(), time.monotonic()
        for r in range(rounds):
            if rank == 0:
                _send_all(bell, pairs[right], memoryview(r.to_bytes(8, "little")))
            _recv_exact(bell, pairs[left], memoryview(token))
            if r == 0:
                cpu, wall = time.process_time() - cpu, time.monotonic() - wall
            if int.from_bytes(token, "little") != r:
                raise AssertionError(f"rank {rank} round {r}: token {token.hex()}")
            if rank != 0:
                _send_all(bell, pairs[right], memoryview(token))
        return rank, cpu, wall
    finally:
        _close(*pairs.values(), bell)


def test_four_ranks_on_two_cores_sleep_while_waiting(job: str) -> None:
    """Ranks 1-3 wait ~1 s for the first token: they must sleep, not spin."""
    size, rounds = 4, 200
    queues, results, control, go = _queues(list(range(size))), CTX.Queue(), CTX.Queue(), CTX.Event()
    procs = []
    for rank in range(size):
        links = _links(rank, [(rank - 1) % size, (rank + 1) % size], queues)
        procs.append(_start(_ring_member, results, job, rank, size, links, control, go, rounds))
    assert sorted(control.get(timeout=JOIN_TIMEOUT) for _ in range(size)) == list(range(size))
    assert _leftovers(job) == []  # every pair set up, every name gone
    time.sleep(1.0)  # ranks 1-3 are now waiting for the token
    go.set()
    reports = sorted(_results(results, size))
    _join(procs)
    for rank, cpu, wall in reports[1:]:
        assert wall >= 0.8, (rank, wall)
        assert cpu < 0.1, f"rank {rank} used {cpu:.3f} s of CPU while waiting {wall:.2f} s"


# -- micro-benchmark (python tests/test_tcp_shm.py) ----------------------------------------


def _bench_pattern(
    rank: int,
    send_all: Callable[[memoryview], None],
    recv_exact: Callable[[memoryview], None],
    sizes: list[int],
) -> dict[int, float]:
    """Seconds per one-way transfer of each size (then a 1-byte ack), and per 8-byte hop."""
    one, out = memoryview(bytearray(8)), {}
    for size in sizes:
        reps = max(4, min(200, (256 << 20) // size))
        data, sink = _random_bytes(size, 0), memoryview(bytearray(min(size, 4 << 20)))
        start = time.perf_counter()
        for _ in range(reps):
            if rank == 0:
                send_all(data)
                recv_exact(one[:1])
            else:
                for off in range(0, size, len(sink)):
                    recv_exact(sink[: min(len(sink), size - off)])
                send_all(one[:1])
        out[size] = (time.perf_counter() - start) / reps
    iters = 5000
    start = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            send_all(one)
            recv_exact(one)
        else:
            recv_exact(one)
            send_all(one)
    out[8] = (time.perf_counter() - start) / iters / 2
    return out


def _bench_shm(job: str, rank: int, links: dict[int, Any], sizes: list[int], spin: float) -> Any:
    bell = Doorbell(job, rank, local_size=2, expected_peers=1, spin_us=spin)
    pair = _handshake_all(bell, links)[1 - rank]
    try:
        return rank, _bench_pattern(
            rank,
            lambda data: _send_all(bell, pair, data),
            lambda buf: _recv_exact(bell, pair, buf),
            sizes,
        )
    finally:
        _close(pair, bell)


def _bench_tcp(rank: int, ports: Any, sizes: list[int]) -> Any:
    if rank == 1:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            ports.put(listener.getsockname()[1])
            sock, _ = listener.accept()
    else:
        sock = socket.create_connection(("127.0.0.1", ports.get(timeout=STEP_TIMEOUT)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(STEP_TIMEOUT)

    def recv_exact(buf: memoryview) -> None:
        off = 0
        while off < len(buf):
            got = sock.recv_into(buf[off:])
            if got == 0:
                raise PeerError("eof")
            off += got

    with sock:
        return rank, _bench_pattern(rank, sock.sendall, recv_exact, sizes)


def _bench_main(trials: int = 5) -> None:
    """Interleave the three transports ``trials`` times; print the best and median of each."""
    sizes = [1 << 20, 64 << 20]
    runs: dict[str, list[dict[int, float]]] = {}
    for _ in range(trials):
        for label, spin in [("shm, spin 50 us", 50.0), ("shm, spin 0", 0.0)]:
            job, queues, results = _new_job(), _queues([0, 1]), CTX.Queue()
            procs = [
                _start(_bench_shm, results, job, r, _links(r, [1 - r], queues), sizes, spin)
                for r in (0, 1)
            ]
            got = [results.get(timeout=600) for _ in range(2)]
            _join(procs, 600)
            runs.setdefault(label, []).append(dict(v for _, v in got)[0])
            assert _leftovers(job) == []
        results, ports = CTX.Queue(), CTX.Queue()
        procs = [_start(_bench_tcp, results, r, ports, sizes) for r in (1, 0)]
        got = [results.get(timeout=600) for _ in range(2)]
        _join(procs, 600)
        runs.setdefault("tcp loopback", []).append(dict(v for _, v in got)[0])
    print(
        f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}, numpy {np.__version__}, ", end=""
    )
    print(f"load average {os.getloadavg()[0]:.1f}; best (median) of {trials}")
    print(f"{'transport':<17}{'1 MiB GB/s':>16}{'64 MiB GB/s':>16}{'8 B one-way us':>18}")
    for label, trial in runs.items():
        cells = []
        for key in (1 << 20, 64 << 20, 8):
            times = sorted(t[key] for t in trial)
            best, median = times[0], times[len(times) // 2]
            if key == 8:
                cells.append(f"{best * 1e6:.1f} ({median * 1e6:.1f})".rjust(18))
            else:
                cells.append(f"{key / best / 1e9:.2f} ({key / median / 1e9:.2f})".rjust(16))
        print(f"{label:<17}{''.join(cells)}")


if __name__ == "__main__":
    _bench_main()
