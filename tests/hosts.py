"""Simulated hosts for tests: network namespaces joined by a bridge, each with its own
hostname, ``/dev/shm`` and pid namespace, so meshcomm sees separate hosts.

A :class:`Hosts` of N makes a switch namespace holding a bridge and, per host, a namespace
with one end of a veth pair (the other end on the bridge) and an address ``10.213.S.(i+1)``
(``S`` from the test's pid, so parallel runs do not meet). :meth:`Hosts.run` starts a command
on a host inside ``unshare --uts --mount --pid``: its own hostname and a private tmpfs on
``/dev/shm`` (so the shared-memory host key differs), in a session of its own.
:meth:`Hosts.run_all` starts several processes in one host's namespaces (ranks that share
memory). :meth:`Hosts.shape` limits what each host sends with tc tbf (needs ``tc``).
:meth:`Hosts.cut` takes a host's link down (no RST, no FIN: its peers see silence).
:meth:`Hosts.close` kills every process started and deletes every namespace, also after a
failed test. Root only; :func:`available` says why not otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence

__all__ = ["Hosts", "available"]


def available() -> str | None:
    """None if simulated hosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"simulated hosts need {tool!r}"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Hosts:
    """N simulated hosts on one bridge (a context manager: ``with Hosts(2) as hosts:``)."""

    def __init__(self, count: int) -> None:
        self.count = count
        tag = os.getpid() % 100_000
        self._prefix = f"mc{tag}"
        self._subnet = f"10.213.{tag % 250}"
        self.switch = f"{self._prefix}sw"
        self.names = [f"{self._prefix}h{i}" for i in range(count)]
        self.addresses = [f"{self._subnet}.{i + 1}" for i in range(count)]
        self._procs: list[subprocess.Popen[str]] = []
        self._made: list[str] = []

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (name, address) in enumerate(zip(self.names, self.addresses, strict=True)):
            _ip("netns", "add", name)
            self._made.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
            # Both ends are made in the host's namespace, then one moves to the switch.
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}")
            _ip("-n", name, "link", "set", f"p{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"p{i}", "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")

    def run(
        self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[str]:
        """Start ``argv`` on host ``host`` (its own hostname, /dev/shm and pids)."""
        script = (
            f"hostname {self.names[host]} && mount -t tmpfs -o size=512m tmpfs /dev/shm "
            '&& exec "$@"'
        )
        command = [
            "ip", "netns", "exec", self.names[host],
            "unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc",
            "sh", "-c", script, "sh", *argv,
        ]  # fmt: skip
        proc = subprocess.Popen(
            command,
            env=dict(os.environ if env is None else env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._procs.append(proc)
        return proc

    def run_all(
        self,
        host: int,
        argv: Sequence[str],
        envs: Sequence[Mapping[str, str]],
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[str]:
        """Start ``argv`` once per entry of ``envs`` (extra variables each) on host ``host``,
        all in one hostname, /dev/shm and pid namespace (so they share memory, as ranks
        started by one launcher do); the command fails when any of them does."""
        lines = ['pids=""']
        for extra in envs:
            assigns = " ".join(shlex.quote(f"{k}={v}") for k, v in extra.items())
            command = " ".join(shlex.quote(a) for a in argv)
            lines.append(f'env {assigns} {command} & pids="$pids $!"')
        lines.append('rc=0; for p in $pids; do wait "$p" || rc=1; done; exit "$rc"')
        return self.run(host, ["sh", "-c", "\n".join(lines)], env)

    def shape(self, rate: str = "1gbit", burst: str = "512kb", latency: str = "200ms") -> None:
        """Limit what every host sends to ``rate`` (tc tbf on its eth0), as a NIC would."""
        for name in self.names:
            _ip("netns", "exec", name, "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
                "rate", rate, "burst", burst, "latency", latency)  # fmt: skip

    def cut(self, host: int) -> None:
        """Take host ``host``'s link down (its packets go nowhere; no RST, no FIN)."""
        _ip("-n", self.switch, "link", "set", f"p{host}", "down")

    def close(self) -> None:
        """Kill everything started, delete every namespace (idempotent)."""
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
                proc.communicate(timeout=10)
        self._procs.clear()
        for name in reversed(self._made):
            subprocess.run(
                ["ip", "netns", "del", name], capture_output=True, timeout=30, check=False
            )
        self._made.clear()
