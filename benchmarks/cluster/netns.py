"""Emulated machines on one box: a Linux network namespace per machine, shaped links to a private bridge.

    from benchmarks.cluster import Network

    with Network(["w0", "w1", "c0"], bandwidth="200mbit") as net:
        net.address("w0")                      # "10.77.0.1"
        net.popen("w0", ["python", "x.py"])    # runs inside w0's namespace; stopped at teardown

Layout (nothing is created in, or changed on, the host's own network namespace):

- one namespace per machine, ``bpe-<pid>-<token>-<machine>``, with ``lo`` up and one interface
  ``bpe<token>m<i>`` holding ``<subnet>.<i+1>/24`` (10.77.0.0/24 by default);
- one more namespace ``bpe-<pid>-<token>-br`` holding a bridge ``bpe<token>br`` and the other ends
  ``bpe<token>b<i>`` of the machines' veth pairs (the veths are created inside the namespaces, so they
  never appear on the host);
- a ``tbf`` qdisc at rate ``B`` on BOTH ends of every veth: the machine's end shapes what the machine sends
  (its uplink), the bridge's end shapes what the bridge forwards to it (its downlink), so every machine has a
  full-duplex link of bandwidth ``B``; traffic between processes of one machine (its own address, loopback)
  is not shaped, as on a real machine.

The namespace names carry the creating process's pid: :func:`cleanup_stale` removes what killed runs left
(namespaces whose creator is dead; deleting a namespace deletes its veths and qdiscs). :class:`Network`
calls it on start, and ``python -m benchmarks.cluster --cleanup`` runs it by hand.

Teardown always runs: on normal exit, on an exception, on Ctrl-C, and on SIGTERM/SIGHUP (turned into
``SystemExit`` while the network is up, in the main thread); Ctrl-C and SIGTERM are blocked while it runs.
It kills every process still inside the namespaces (only ours: the namespaces are new), then deletes them.

Root only, with ``ip`` and ``tc`` (iproute2): elsewhere :func:`unavailable_reason` says why and
:class:`Network` raises :class:`EmulatorUnavailable`.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

NS_ROOT = "bpe"  # every namespace this module creates starts with "bpe-"
DEFAULT_SUBNET = "10.77.0.0/24"
DEFAULT_BANDWIDTH = "200mbit"
_NS_PATTERN = re.compile(rf"^{NS_ROOT}-(\d+)-([0-9a-f]+)-")
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_MACHINE_NAME = re.compile(r"^[A-Za-z0-9_.]{1,32}$")


class EmulatorError(RuntimeError):
    """Setting up or using the emulated network failed (the message names the command and its output)."""


class EmulatorUnavailable(EmulatorError):
    """This machine cannot run the emulator (not root, or ip/tc missing)."""


def unavailable_reason() -> str | None:
    """Why the emulator cannot run here, or None if it can."""
    if sys.platform != "linux":
        return "the cluster emulator needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the cluster emulator needs root (it creates network namespaces, veth pairs and tc qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the cluster emulator needs `{tool}` (iproute2), which is not on PATH"
    return None


def require_available() -> None:
    reason = unavailable_reason()
    if reason:
        raise EmulatorUnavailable(reason)


def parse_rate(text: str) -> float:
    """A tc rate (``200mbit``, ``1gbit``, ``25mbps``: tc's units, bytes for ``*bps``) in bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = (m.group(2) if m else "").lower() or "bit"
    if not m or unit not in _RATE_UNITS:
        raise ValueError(f"bad bandwidth {text!r} (examples: 200mbit, 1gbit, 50mbps)")
    value = float(m.group(1)) * _RATE_UNITS[unit]
    if value <= 0:
        raise ValueError(f"bandwidth must be positive, got {text!r}")
    return value


def run(argv: Sequence[str], *, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a command; on failure raise EmulatorError with the command and what it printed."""
    try:
        result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EmulatorError(f"`{' '.join(argv)}` failed: {exc}") from exc
    if check and result.returncode != 0:
        raise EmulatorError(f"`{' '.join(argv)}` failed (status {result.returncode}): "
                            f"{(result.stderr or result.stdout).strip()}")
    return result


def list_namespaces() -> list[str]:
    """Names of all network namespaces (``ip netns list``)."""
    out = run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(ns: str, grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, every process inside ``ns`` (processes we started there)."""
    def pids() -> list[int]:
        out = run(["ip", "netns", "pids", ns], check=False).stdout
        return [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]

    found = pids()
    for pid in found:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while found and time.monotonic() < deadline:
        time.sleep(0.05)
        found = [p for p in pids() if _pid_alive(p)]
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def delete_namespaces(names: Iterable[str]) -> list[str]:
    """Kill what runs inside, then delete; the names that could not be deleted."""
    failed = []
    for ns in names:
        _kill_namespace_processes(ns)
        if run(["ip", "netns", "delete", ns], check=False).returncode != 0 and ns in list_namespaces():
            failed.append(ns)
    return failed


def our_namespaces(prefix: str | None = None) -> list[str]:
    """Namespaces created by this module (all runs), or only those of one :class:`Network` ``prefix``."""
    names = [ns for ns in list_namespaces() if _NS_PATTERN.match(ns)]
    return [ns for ns in names if ns.startswith(prefix + "-")] if prefix else names


def cleanup_stale() -> list[str]:
    """Delete namespaces left by runs whose creating process is dead; the names removed."""
    stale = []
    for ns in our_namespaces():
        m = _NS_PATTERN.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            stale.append(ns)
    delete_namespaces(stale)
    return stale


@dataclass(frozen=True)
class Machine:
    name: str
    index: int
    ns: str        # network namespace
    ifname: str    # its veth end inside ns (GLOO_SOCKET_IFNAME)
    peer: str      # the other end, in the bridge namespace
    address: str   # IPv4 address inside ns


class Network:
    """Emulated machines with full-duplex links of ``bandwidth`` to one bridge; a context manager.

    ``bandwidth``: a tc rate (``200mbit``). ``burst``: tbf bucket in bytes (default: 2 ms at the rate, at
    least 32 KiB). ``queue_s``: how much the shaper may queue, in seconds at the rate (default 0.25 s:
    deep enough that several senders converging on one machine's downlink are queued, not dropped).
    ``mtu``: of every link (the shapers count whole frames, headers included: at 1500 about 4% of the rate
    goes to Ethernet/IP/TCP headers, at 9000 under 1%). ``sysctls``: set in every machine's namespace
    (``net.*`` keys are per namespace), e.g. ``{"net.ipv4.tcp_slow_start_after_idle": "0"}``.
    """

    def __init__(self, machines: Sequence[str], *, bandwidth: str = DEFAULT_BANDWIDTH,
                 subnet: str = DEFAULT_SUBNET, burst: int | None = None, queue_s: float = 0.25,
                 mtu: int = 1500, sysctls: Mapping[str, str] | None = None) -> None:
        require_available()
        if not machines:
            raise ValueError("at least one machine")
        if len(set(machines)) != len(machines):
            raise ValueError(f"duplicate machine names in {list(machines)}")
        for name in machines:
            if not _MACHINE_NAME.match(name):
                raise ValueError(f"bad machine name {name!r} (letters, digits, '_', '.'; at most 32)")
        net = ipaddress.ip_network(subnet)
        if not net.is_private or net.version != 4:
            raise ValueError(f"subnet {subnet} must be a private IPv4 range")
        hosts = list(net.hosts())
        if len(machines) > min(len(hosts), 99):
            raise ValueError(f"{len(machines)} machines do not fit in {subnet} (at most {min(len(hosts), 99)})")
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu {mtu} out of range (576..65535)")
        self.mtu = mtu
        self.sysctls = dict(sysctls or {})
        for key in self.sysctls:
            if not re.fullmatch(r"net(\.[A-Za-z0-9_]+)+", key):
                raise ValueError(f"sysctl {key!r}: only net.* keys are per network namespace")
        self.rate_bps = parse_rate(bandwidth)
        self.bandwidth = bandwidth
        self.bytes_per_s = self.rate_bps / 8
        self.burst = burst or max(32 * 1024, 2 * (mtu + 14), int(self.bytes_per_s * 0.002))
        self.limit = max(4 * self.burst, int(self.bytes_per_s * queue_s))
        existing = set(list_namespaces())
        self.token = secrets.token_hex(2)
        while any(ns.startswith(f"{NS_ROOT}-{os.getpid()}-{self.token}-") for ns in existing):
            self.token = secrets.token_hex(2)  # another Network of this process holds it
        self.prefix = f"{NS_ROOT}-{os.getpid()}-{self.token}"
        self.prefixlen = net.prefixlen
        self.bridge_ns = f"{self.prefix}-br"
        self.bridge = f"{NS_ROOT}{self.token}br"
        self.machines = {
            name: Machine(name, i, f"{self.prefix}-{name}", f"{NS_ROOT}{self.token}m{i}",
                          f"{NS_ROOT}{self.token}b{i}", str(hosts[i]))
            for i, name in enumerate(machines)
        }
        self._created: list[str] = []  # namespaces, in creation order
        self._procs: list[subprocess.Popen[Any]] = []
        self._saved_handlers: dict[int, Any] = {}
        self._up = False
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------------------------------------
    # life cycle
    # ---------------------------------------------------------------------------------------------------------
    def __enter__(self) -> "Network":
        self._install_signal_handlers()
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Create the namespaces, links, addresses and shapers (undone by :meth:`down` on any failure)."""
        cleanup_stale()
        atexit.register(self.down)
        self._up = True
        self._add_ns(self.bridge_ns)
        self._ip(self.bridge_ns, "link", "set", "lo", "up")
        self._ip(self.bridge_ns, "link", "add", self.bridge, "type", "bridge")
        for m in self.machines.values():
            self._add_ns(m.ns)
            self._ip(m.ns, "link", "set", "lo", "up")
            for key, value in self.sysctls.items():
                run(["ip", "netns", "exec", m.ns, "sysctl", "-q", "-w", f"{key}={value}"])
            # created inside the bridge namespace, the peer moved straight into the machine's: never on the host
            self._ip(self.bridge_ns, "link", "add", m.peer, "type", "veth", "peer", "name", m.ifname, "netns", m.ns)
            self._ip(self.bridge_ns, "link", "set", m.peer, "master", self.bridge)
            if self.mtu != 1500:
                self._ip(self.bridge_ns, "link", "set", m.peer, "mtu", str(self.mtu))
                self._ip(m.ns, "link", "set", m.ifname, "mtu", str(self.mtu))
            self._ip(m.ns, "addr", "add", f"{m.address}/{self.prefixlen}", "dev", m.ifname)
            self._shape(m.ns, m.ifname)           # uplink: what the machine sends
            self._shape(self.bridge_ns, m.peer)   # downlink: what the bridge forwards to the machine
            self._ip(self.bridge_ns, "link", "set", m.peer, "up")
            self._ip(m.ns, "link", "set", m.ifname, "up")
        self._ip(self.bridge_ns, "link", "set", self.bridge, "up")

    def down(self) -> None:
        """Stop our processes and delete every namespace we created (idempotent, signals blocked)."""
        with self._lock:
            if not self._up and not self._created:
                self._restore_signal_handlers()
                return
            blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
            old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
            try:
                for p in self._procs:
                    if p.poll() is None:
                        p.terminate()
                deadline = time.monotonic() + 5.0
                for p in self._procs:
                    try:
                        p.wait(timeout=max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
                self._procs.clear()
                # machines first, the bridge namespace last (deleting a namespace deletes its veths and qdiscs)
                failed = delete_namespaces(list(reversed(self._created)))
                self._created.clear()
                self._up = False
                atexit.unregister(self.down)
                if failed:
                    raise EmulatorError(f"could not delete network namespaces {failed}")
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
                self._restore_signal_handlers()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def raise_exit(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._saved_handlers[sig] = signal.signal(sig, raise_exit)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._saved_handlers.items():
            signal.signal(sig, handler)
        self._saved_handlers.clear()

    def _add_ns(self, ns: str) -> None:
        run(["ip", "netns", "add", ns])
        self._created.append(ns)

    @staticmethod
    def _ip(ns: str, *args: str) -> None:
        run(["ip", "-n", ns, *args])

    def _shape(self, ns: str, dev: str) -> None:
        run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", self.bandwidth,
             "burst", str(self.burst), "limit", str(self.limit)])

    # ---------------------------------------------------------------------------------------------------------
    # using it
    # ---------------------------------------------------------------------------------------------------------
    def machine(self, name: str) -> Machine:
        try:
            return self.machines[name]
        except KeyError:
            raise KeyError(f"no machine {name!r} (machines: {', '.join(self.machines)})") from None

    def address(self, name: str) -> str:
        return self.machine(name).address

    def ifname(self, name: str) -> str:
        return self.machine(name).ifname

    def exec_prefix(self, name: str) -> list[str]:
        """Prepend to a command to run it inside machine ``name``."""
        return ["ip", "netns", "exec", self.machine(name).ns]

    def popen(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside machine ``name``; stopped (SIGTERM, then SIGKILL) at teardown."""
        if not self._up:
            raise EmulatorError("the network is not up")
        proc = subprocess.Popen([*self.exec_prefix(name), *argv], env=dict(env) if env is not None else None,
                                **kwargs)
        self._procs.append(proc)
        return proc

    def sample_links(self, path: str, interval_s: float = 0.005) -> subprocess.Popen[Any]:
        """Start a sampler of every machine's link counters (stopped at teardown, or by ``terminate()``).

        It runs in the bridge's namespace and appends one line per ``interval_s`` to ``path``:
        ``unix_time tx_0 rx_0 tx_1 rx_1 ...`` in machine order, bytes seen from the machine (tx = uplink).
        """
        if not self._up:
            raise EmulatorError("the network is not up")
        peers = [m.peer for m in self.machines.values()]
        code = _SAMPLER.format(peers=peers, path=str(path), interval=float(interval_s))
        proc = subprocess.Popen(["ip", "netns", "exec", self.bridge_ns, sys.executable, "-c", code])
        self._procs.append(proc)
        return proc

    def qdiscs(self) -> dict[str, str]:
        """``tc qdisc show`` of every namespace (for checks and reports)."""
        return {ns: run(["tc", "-n", ns, "qdisc", "show"]).stdout for ns in self._created}

    def link_counters(self) -> dict[str, dict[str, int]]:
        """Bytes and drops of every machine's link, seen from the machine: tx = uplink, rx = downlink.

        Read from the bridge's ends (one ``ip`` call): what the machine sent arrives there as rx.
        """
        out = run(["ip", "-n", self.bridge_ns, "-s", "-j", "link", "show"]).stdout
        by_peer = {link["ifname"]: link.get("stats64", {}) for link in json.loads(out)}
        counters = {}
        for m in self.machines.values():
            stats = by_peer.get(m.peer, {})
            counters[m.name] = {"tx_bytes": stats.get("rx", {}).get("bytes", 0),
                                "rx_bytes": stats.get("tx", {}).get("bytes", 0)}
        return counters

    def tc_drops(self) -> dict[str, int]:
        """Packets the shapers dropped, per machine (uplink + downlink)."""
        drops: dict[str, int] = {}
        for m in self.machines.values():
            total = 0
            for ns, dev in ((m.ns, m.ifname), (self.bridge_ns, m.peer)):
                out = run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev], check=False).stdout
                try:
                    total += sum(int(q.get("drops", 0)) for q in json.loads(out or "[]"))
                except (ValueError, TypeError):
                    pass
            drops[m.name] = total
        return drops


_SAMPLER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
files = []
for peer in {peers!r}:
    base = "/sys/class/net/" + peer + "/statistics/"
    files += [os.open(base + "rx_bytes", os.O_RDONLY), os.open(base + "tx_bytes", os.O_RDONLY)]
with open({path!r}, "a", buffering=1 << 16) as out:
    try:
        nxt = time.monotonic()
        while True:
            values = [os.pread(fd, 32, 0).strip().decode() for fd in files]
            out.write(repr(time.time()) + " " + " ".join(values) + "\\n")
            nxt += {interval!r}
            time.sleep(max(0.0, nxt - time.monotonic()))
    finally:
        out.flush()
"""


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.cluster",
                                description="List or remove the network namespaces of the cluster emulator.")
    p.add_argument("--cleanup", action="store_true", help="delete namespaces whose creating process is dead")
    p.add_argument("--cleanup-all", action="store_true",
                   help="delete every namespace of the emulator, also those of live runs")
    args = p.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    if args.cleanup_all:
        names = our_namespaces()
        failed = delete_namespaces(names)
        print(f"deleted {len(names) - len(failed)} namespaces" + (f"; could not delete {failed}" if failed else ""))
        return 1 if failed else 0
    if args.cleanup:
        print(f"deleted {len(cleanup_stale())} stale namespaces")
        return 0
    for ns in our_namespaces():
        m = _NS_PATTERN.match(ns)
        alive = m is not None and _pid_alive(int(m.group(1)))
        print(f"{ns}\t{'live' if alive else 'stale'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
