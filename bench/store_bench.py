"""Benchmark the TCPStore: small-op throughput for one client, and a 512-client rendezvous.

Run:  .venv/bin/python bench/store_bench.py [--ops 20000] [--clients 512] [--procs 8]
          [--auth both|on|off] [--connects 2000] [--parts ops,connect,rendezvous,big]
          [--layouts any,pinned,master]

Part 1 starts ``python -m meshcomm.store`` as a separate process and times one client doing
small set/get/add operations over loopback, twice: with the client and server free to run on
any CPU, and with both pinned to one CPU (on small virtual machines a wake-up across CPUs
costs more than the whole request, so pinning shows what the code itself costs). It also
times a master TCPStore, whose server thread shares the client's process and GIL.

Part 2 starts a fresh server and runs ``--clients`` clients (``--procs`` processes with
threads in each) through a rendezvous: every client connects, adds 1 to a counter, the last
one sets "go", and everyone blocks in ``get("go")``. It reports connection errors (resets
included) and how long the rendezvous took.

``--auth`` runs parts 1 and 3 with the store authenticated (a job secret on both sides: the
HMAC-SHA256 challenge-response of the handshake), without, or both side by side; part 2 runs
authenticated unless ``--auth off``. Part 3 times ``--connects`` connections (TCPStore
constructor to ready, then close) against a server in its own process: the handshake's cost.
Part 4 (``big``) times ``set`` and ``get`` of one 64 MiB value against a server in its own
process, and HMAC-SHA256 over 64 MiB in this process: what the frame MAC of an authenticated
connection costs on the largest frame. Part 5 (``wire``) times the protocol code alone,
without sockets: a SET and a GET of 16 bytes framed, parsed and answered in memory by
``wire.ClientConnection`` and ``wire.ServerConnection``, with and without frame MACs, so the
MAC's CPU cost per request shows apart from the kernel's noise. ``--parts`` picks the parts
(default: the first three); ``--layouts`` the layouts of part 1.

The script imports whichever meshcomm ``PYTHONPATH`` names, so one copy of it can time two
checkouts side by side (the server process inherits the environment).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from meshcomm.common.secret import SECRET_ENV, new_secret
from meshcomm.store import TCPStore

HOST = "127.0.0.1"
# One secret for every authenticated case; "" means "no secret" to servers and clients.
SECRET = new_secret()


def start_server(cpu: int | None, secret: str = "") -> tuple[subprocess.Popen[str], int]:
    """Start ``python -m meshcomm.store`` (pinned to ``cpu`` if given); return it and its port."""
    command = [sys.executable, "-m", "meshcomm.store", "--host", HOST, "--port", "0"]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    env = {**os.environ, SECRET_ENV: secret}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"store server did not start: {line!r}")
    return proc, int(line.rsplit(":", 1)[1])


def stop_server(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.wait(timeout=10)


def time_ops(store: TCPStore, ops: int, repeats: int) -> dict[str, float]:
    """Ops per second (median of ``repeats`` runs) for small set, get, add and mixed."""
    store.set("k", b"v" * 16)
    cases: dict[str, Callable[[], object]] = {
        "set": lambda: store.set("k", b"v" * 16),
        "get": lambda: store.get("k"),
        "add": lambda: store.add("n", 1),
    }
    rates: dict[str, float] = {}
    for name, op in cases.items():
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(ops):
                op()
            samples.append(ops / (time.perf_counter() - start))
        rates[name] = statistics.median(samples)
    return rates


def throughput(
    ops: int,
    repeats: int,
    secret: str,
    which: frozenset[str] = frozenset({"any", "pinned", "master"}),
) -> list[tuple[str, dict[str, float]]]:
    rows = []
    can_pin = hasattr(os, "sched_setaffinity") and _has_taskset()
    layouts: list[tuple[str, int | None]] = []
    if "any" in which:
        layouts.append(("server process, any CPU", None))
    if can_pin and "pinned" in which:
        layouts.append(("server process, same CPU", 0))
    original = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    for label, cpu in layouts:
        proc, port = start_server(cpu, secret)
        try:
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})
            store = TCPStore(HOST, port, timeout=30, secret=secret)
            rows.append((label, time_ops(store, ops, repeats)))
            store.close()
        finally:
            if original is not None:
                os.sched_setaffinity(0, original)
            stop_server(proc)
    if "master" in which:
        master = TCPStore(HOST, 0, is_master=True, timeout=30, secret=secret)
        rows.append(("server thread in-process, any CPU", time_ops(master, ops, repeats)))
        master.close()
    return rows


def big_value(repeats: int, secret: str) -> dict[str, float]:
    """Seconds (median of ``repeats``) to set and to get one 64 MiB value."""
    value = os.urandom(64 * 1024 * 1024)
    proc, port = start_server(None, secret)
    try:
        store = TCPStore(HOST, port, timeout=60, secret=secret)
        took: dict[str, list[float]] = {"set": [], "get": []}
        for _ in range(repeats):
            start = time.perf_counter()
            store.set("big", value)
            took["set"].append(time.perf_counter() - start)
            start = time.perf_counter()
            got = store.get("big")
            took["get"].append(time.perf_counter() - start)
            assert len(got) == len(value)
            del got
        store.close()
    finally:
        stop_server(proc)
    return {name: statistics.median(samples) for name, samples in took.items()}


def wire_round_trips(ops: int, repeats: int, mac: bool) -> dict[str, float]:
    """Microseconds per request (best of ``repeats``) for SET and GET through the sans-IO code.

    Each request is framed by the client, parsed by the server, answered, and the answer
    parsed by the client: all the per-request protocol work of both sides, no sockets.
    """
    from meshcomm.common.secret import session_key
    from meshcomm.store import wire

    client, server = wire.ClientConnection(), wire.ServerConnection()
    nonce = b"n" * 32
    server.receive_data(client.hello(0, nonce if mac else None))
    server.next_event()
    if mac:
        key = session_key(b"secret", b"store", nonce, nonce)
        server.expect_proof(key)
        client.receive_data(wire.challenge(nonce, b"p" * 32))
        client.next_event()
        server.receive_data(client.answer(b"p" * 32, key))
        server.next_event()
        client.receive_data(wire.auth_result(True))
    else:
        client.receive_data(wire.hello_reply(True))
    client.next_event()
    value = b"v" * 16
    cases = {
        "set": (wire.OP_SET, wire.body_key_value(b"k", value), (wire.ok(0),)),
        "get": (wire.OP_GET, wire.body_get(1.0, b"k"), (wire.ok_header(0, 16), value)),
    }
    result = {}
    for name, (op, body, answer) in cases.items():
        best = float("inf")
        for _ in range(repeats):
            out = bytearray()
            start = time.perf_counter()
            for _ in range(ops):
                server.receive_data(client.request(op, 0, body))
                server.next_event()
                server.frame(out, *answer)
                client.receive_data(out)
                out.clear()
                client.next_event()
            best = min(best, (time.perf_counter() - start) / ops)
        result[name] = best * 1e6
    return result


def hmac_64mib(repeats: int) -> float:
    """Seconds (median) for HMAC-SHA256 over 64 MiB: one side's MAC work on the largest frame."""
    data = os.urandom(64 * 1024 * 1024)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        hmac.new(b"k" * 32, data, hashlib.sha256).digest()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def handshakes(connects: int, secret: str) -> dict[str, float]:
    """Seconds from ``TCPStore(...)`` to a ready client (connect + handshake), percentiles."""
    proc, port = start_server(None, secret)
    try:
        samples = []
        for _ in range(connects):
            start = time.perf_counter()
            store = TCPStore(HOST, port, timeout=30, secret=secret)
            samples.append(time.perf_counter() - start)
            store.close()
    finally:
        stop_server(proc)
    samples.sort()
    return {
        "p50": samples[len(samples) // 2],
        "p90": samples[int(len(samples) * 0.9)],
        "mean": statistics.fmean(samples),
    }


def _has_taskset() -> bool:
    try:
        subprocess.run(["taskset", "-V"], capture_output=True, check=False)
    except OSError:
        return False
    return True


# --- the rendezvous --------------------------------------------------------------------------


def _rendezvous_process(port: int, threads: int, total: int, secret: str) -> dict[str, Any]:
    """One process of the rendezvous: ``threads`` clients, each in its own thread."""
    errors: list[str] = []
    connect_s: list[float] = []
    lock = threading.Lock()

    def client() -> None:
        try:
            start = time.perf_counter()
            store = TCPStore(HOST, port, timeout=60, secret=secret)
            took = time.perf_counter() - start
            if store.add("arrived", 1) == total:
                store.set("go", b"1")
            store.get("go")
            store.add("left", 1)
            store.close()
            with lock:
                connect_s.append(took)
        except Exception as exc:
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")

    pool = [threading.Thread(target=client) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(120)
    return {"ok": len(connect_s), "errors": errors, "connect_s": connect_s}


def rendezvous(clients: int, procs: int, secret: str) -> dict[str, Any]:
    proc, port = start_server(None, secret)
    try:
        per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
        context = multiprocessing.get_context("spawn")
        start = time.perf_counter()
        with context.Pool(procs) as pool:
            work = [(port, n, clients, secret) for n in per]
            results = pool.starmap(_rendezvous_process, work)
        elapsed = time.perf_counter() - start
        check = TCPStore(HOST, port, timeout=10, secret=secret)
        arrived, left = int(check.get("arrived")), int(check.get("left"))
        check.close()
    finally:
        stop_server(proc)
    errors = [e for r in results for e in r["errors"]]
    connects = sorted(t for r in results for t in r["connect_s"])
    return {
        "clients": clients,
        "procs": procs,
        "ok": sum(r["ok"] for r in results),
        "errors": errors,
        "resets": sum("reset" in e.lower() for e in errors),
        "arrived": arrived,
        "left": left,
        "elapsed_s": elapsed,
        "connect_p50_ms": 1e3 * connects[len(connects) // 2] if connects else float("nan"),
        "connect_max_ms": 1e3 * connects[-1] if connects else float("nan"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20000, help="operations per timed run")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
    parser.add_argument("--clients", type=int, default=512, help="rendezvous clients")
    parser.add_argument("--procs", type=int, default=8, help="processes the clients run in")
    parser.add_argument(
        "--auth", choices=("both", "on", "off"), default="both", help="with a job secret or not"
    )
    parser.add_argument("--connects", type=int, default=2000, help="connections timed in part 3")
    parser.add_argument(
        "--parts",
        default="ops,connect,rendezvous",
        help="comma-separated: ops,connect,rendezvous,big,wire",
    )
    parser.add_argument(
        "--layouts", default="any,pinned,master", help="part 1's layouts: any,pinned,master"
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    modes = {"both": ("off", "on"), "on": ("on",), "off": ("off",)}[args.auth]
    secrets = {"off": "", "on": SECRET}

    if "ops" in parts:
        print(f"# one client, small ops (16-byte values), ops/s, median of {args.repeats} runs")
        print(f"{'layout':<42}{'set':>10}{'get':>10}{'add':>10}")
        layouts = frozenset(args.layouts.split(","))
        for mode in modes:
            for label, rates in throughput(args.ops, args.repeats, secrets[mode], layouts):
                name = f"{label}, auth {mode}"
                print(
                    f"{name:<42}{rates['set']:>10,.0f}{rates['get']:>10,.0f}{rates['add']:>10,.0f}"
                )

    if "big" in parts:
        print(f"\n# one 64 MiB value, server process, seconds, median of {args.repeats} runs")
        for mode in modes:
            took = big_value(args.repeats, secrets[mode])
            print(f"auth {mode:<4} set {took['set']:7.3f}  get {took['get']:7.3f}")
        print(f"HMAC-SHA256 over 64 MiB in this process: {hmac_64mib(args.repeats):.3f} s")

    if "wire" in parts:
        print(
            f"\n# protocol code alone (sans-IO), microseconds per request, best of {args.repeats}"
        )
        for mac in (False, True):
            took = wire_round_trips(args.ops, args.repeats, mac)
            label = "on " if mac else "off"
            print(f"frame MACs {label}  set {took['set']:6.2f}  get {took['get']:6.2f}")

    if "connect" in parts:
        print(f"\n# connect + handshake, {args.connects} connections, microseconds")
        for mode in modes:
            took = handshakes(args.connects, secrets[mode])
            print(
                f"auth {mode:<4} p50 {took['p50'] * 1e6:8.0f}  p90 {took['p90'] * 1e6:8.0f}  "
                f"mean {took['mean'] * 1e6:8.0f}"
            )

    if "rendezvous" not in parts:
        return 0
    secret = "" if args.auth == "off" else SECRET
    print(f"\n# rendezvous: {args.clients} clients in {args.procs} processes, auth {args.auth}")
    res = rendezvous(args.clients, args.procs, secret)
    print(
        f"clients ok {res['ok']}/{res['clients']}, errors {len(res['errors'])}, "
        f"connection resets {res['resets']}, arrived {res['arrived']}, left {res['left']}"
    )
    print(
        f"rendezvous wall time {res['elapsed_s']:.2f} s (includes spawning {res['procs']} "
        f"processes); connect p50 {res['connect_p50_ms']:.1f} ms, "
        f"max {res['connect_max_ms']:.1f} ms"
    )
    for error in res["errors"][:5]:
        print("  error:", error)
    return 0 if not res["errors"] and res["ok"] == res["clients"] else 1


if __name__ == "__main__":
    sys.exit(main())
