"""Timelines: ``MESHCOMM_TRACE=DIR`` writes a Chrome / Perfetto trace of every collective.

With ``MESHCOMM_TRACE`` set to a directory when ``meshcomm.init()`` runs, every rank records
each collective of each group (when it was called, when it ran, its bytes) and writes
``DIR/rank<N>.json`` at ``meshcomm.shutdown()`` (or at exit): one process per rank, one
track per group, events named by operation and group. Open a file in https://ui.perfetto.dev
or ``chrome://tracing``. The collectives then take the general path (no direct-path shortcut),
so tracing costs a few microseconds per call; unset, it costs nothing.

``python -m meshcomm.trace DIR`` merges the ranks' files into ``DIR/merged.json`` and prints a
straggler report per group: for each collective, how much later than the first rank each rank
called it, as a median and a 95th percentile over the collectives::

    world: rank 3 arrives 31.0 ms late (median; p95 33.4 ms) over 20 collectives

Clocks are aligned through the job's store at ``init``: rank 0 publishes its clock, every
rank notes the difference to its own when it reads it (within a store round trip, well under
a millisecond on one host); timestamps are written on rank 0's clock.

Example:
    >>> rows = [{"group": "world", "seq": 1, "rank": r, "issued": t} for r, t in
    ...         [(0, 0.0), (1, 0.031)]]
    >>> stragglers(rows)[0]["rank"], round(stragglers(rows)[0]["median_ms"])
    (1, 31)
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshcomm.errors import InvalidArgument, MeshCommError
from meshcomm.store.base import Store

__all__ = ["TRACE_ENV", "Recorder", "active", "main", "merge", "start", "stop", "stragglers"]

#: The environment variable naming the directory the traces go to.
TRACE_ENV = "MESHCOMM_TRACE"
# A rank keeps at most this many events (older ones are kept, newer dropped and counted):
# 10^6 events is ~200 MB of JSON, more than a trace viewer opens comfortably.
_MAX_EVENTS = 1_000_000
_CLOCK_KEY = "meshcomm/trace/clock"

#: The recorder of this process while tracing, else None (read on every collective).
active: Recorder | None = None


class Recorder:
    """One rank's events, written as Chrome trace JSON.

    Args:
        directory: where ``rank<N>.json`` goes.
        rank: this process's global rank.
        offset: seconds to subtract from ``time.time()`` to get rank 0's clock.
    """

    def __init__(self, directory: Path, rank: int, offset: float) -> None:
        self.directory = directory
        self.rank = rank
        self.offset = offset
        self.dropped = 0
        self._events: list[tuple[str, str, int, int, float, float, float]] = []
        self._lock = threading.Lock()
        self._written = False

    def add(
        self, group: str, op: str, seq: int, nbytes: int, issued: float, start: float, end: float
    ) -> None:
        """Record one collective (times from ``time.time()``); thread-safe."""
        with self._lock:
            if len(self._events) >= _MAX_EVENTS:
                self.dropped += 1
                return
            self._events.append((group, op, seq, nbytes, issued, start, end))

    def write(self) -> Path | None:
        """Write ``rank<N>.json`` (once); return its path, None if already written."""
        with self._lock:
            if self._written:
                return None
            self._written = True
            events = list(self._events)
        tracks: dict[str, int] = {}
        out: list[dict[str, Any]] = []
        for group, op, seq, nbytes, issued, start, end in events:
            tid = tracks.setdefault(group, len(tracks) + 1)
            out.append(
                {
                    "name": f"{op} {group}",
                    "ph": "X",
                    "pid": self.rank,
                    "tid": tid,
                    "ts": (start - self.offset) * 1e6,
                    "dur": max(0.0, end - start) * 1e6,
                    "args": {
                        "op": op,
                        "group": group,
                        "seq": seq,
                        "bytes": nbytes,
                        "issued_us": (issued - self.offset) * 1e6,
                    },
                }
            )
        meta = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": self.rank,
                "args": {"name": f"rank {self.rank}"},
            }
        ]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": g}}
            for g, tid in tracks.items()
        ]
        doc = {
            "traceEvents": meta + out,
            "displayTimeUnit": "ms",
            "meshcomm": {"rank": self.rank, "clock_offset_s": self.offset, "dropped": self.dropped},
        }
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"rank{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
        return path


def start(rank: int, store: Store | None, env: dict[str, str] | None = None) -> Recorder | None:
    """Begin tracing this process if ``MESHCOMM_TRACE`` is set (called by ``init``).

    Collective over the world when tracing (rank 0 publishes its clock in ``store``).

    Raises:
        InvalidArgument: ``MESHCOMM_TRACE`` names something that is not a directory.
    """
    global active
    raw = (os.environ if env is None else env).get(TRACE_ENV, "").strip()
    if not raw:
        return None
    directory = Path(raw)
    if directory.exists() and not directory.is_dir():
        raise InvalidArgument(f"{TRACE_ENV}={raw!r} is not a directory")
    offset = 0.0
    if store is not None:
        try:
            if rank == 0:
                store.set(_CLOCK_KEY, repr(time.time()))
            store.wait([_CLOCK_KEY])
            before = time.time()
            theirs = float(store.get(_CLOCK_KEY))
            # Our clock at the moment rank 0 wrote, to within a store round trip.
            offset = 0.0 if rank == 0 else before - theirs - (time.time() - before) / 2
        except (MeshCommError, OSError, ValueError):
            offset = 0.0  # unaligned clocks still make a usable trace on one host
    active = Recorder(directory, rank, offset)
    atexit.register(stop)
    return active


def stop() -> Path | None:
    """Write this rank's trace and stop recording (``shutdown`` and exit call it)."""
    global active
    recorder, active = active, None
    return None if recorder is None else recorder.write()


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stragglers(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per group, the rank that calls collectives latest, and by how much.

    Args:
        rows: one per (rank, collective): ``group``, ``seq``, ``rank``, ``issued`` (seconds,
            aligned clocks).

    Returns:
        One dict per group with more than one rank: ``group``, ``rank``, ``median_ms``,
        ``p95_ms``, ``count``; the latest rank by median lateness.
    """
    calls: dict[tuple[str, int], dict[int, float]] = {}
    for row in rows:
        calls.setdefault((row["group"], row["seq"]), {})[row["rank"]] = row["issued"]
    late: dict[str, dict[int, list[float]]] = {}
    for (group, _seq), by_rank in calls.items():
        if len(by_rank) < 2:
            continue
        first = min(by_rank.values())
        for rank, issued in by_rank.items():
            late.setdefault(group, {}).setdefault(rank, []).append(issued - first)
    out = []
    for group, lateness in sorted(late.items()):
        rank, values = max(lateness.items(), key=lambda kv: statistics.median(kv[1]))
        out.append(
            {
                "group": group,
                "rank": rank,
                "median_ms": statistics.median(values) * 1e3,
                "p95_ms": _quantile(values, 0.95) * 1e3,
                "count": len(values),
            }
        )
    return out


def merge(directory: Path) -> tuple[Path, list[dict[str, Any]]]:
    """Merge ``rank*.json`` of ``directory`` into ``merged.json``; return it and the report.

    Raises:
        InvalidArgument: no rank files there.
    """
    files = sorted(directory.glob("rank*.json"))
    if not files:
        raise InvalidArgument(f"no rank*.json trace files in {directory}")
    events: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for path in files:
        doc = json.loads(path.read_text())
        for event in doc.get("traceEvents", []):
            events.append(event)
            if event.get("ph") == "X":
                args = event["args"]
                rows.append(
                    {
                        "group": args["group"],
                        "seq": args["seq"],
                        "rank": event["pid"],
                        "issued": args["issued_us"] / 1e6,
                    }
                )
    merged = directory / "merged.json"
    merged.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return merged, stragglers(rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m meshcomm.trace DIR``: merge the ranks' traces and print the stragglers."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m meshcomm.trace DIR", file=sys.stderr)
        return 2
    try:
        merged, report = merge(Path(args[0]))
    except InvalidArgument as exc:
        print(f"meshcomm.trace: {exc}", file=sys.stderr)
        return 1
    print(f"merged trace: {merged} (open in https://ui.perfetto.dev)")
    for row in report:
        print(
            f"{row['group']}: rank {row['rank']} arrives {row['median_ms']:.1f} ms late "
            f"(median; p95 {row['p95_ms']:.1f} ms) over {row['count']} collectives"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
