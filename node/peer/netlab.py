"""A network lab on one machine: hosts in Linux network namespaces on one bridge, links capped and cut.

Each host is a namespace with one interface ``e0`` (an address in ``10.77.<lab>.0/24``) whose veth peer sits on a
bridge in the lab's own namespace. A host's rate is capped in both directions with ``tc ... tbf``: on ``e0``
(what it sends) and on its bridge port (what it receives; an egress qdisc does not shape ingress). Cutting a
host takes its bridge port down; healing brings it back. A process runs on a host through ``ip netns exec``
(``Host.argv``), so its sockets see only that host's interfaces.

Namespace names are global on a machine: each lab prefixes them with ``plx<pid><n>`` (the creating process and a
counter), and ``close`` deletes them (which removes their veths and qdiscs) after stopping the processes it was
given. Needs root and ``ip``/``tc`` (iproute2), and ``nft`` (nftables) for hosts behind NAT; ``unavailable`` says
why a machine cannot run one.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass, field

_counter = itertools.count()
_RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}  # tc's units: bits per second, powers of ten


class NetLabError(RuntimeError):
    """A lab command failed (the message has the command and what it printed)."""


def unavailable() -> str | None:
    """Why this machine cannot build a lab (not root, no iproute2, network namespaces refused), or ``None``."""
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, veths and qdiscs)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network lab needs `{tool}` (Debian package iproute2)"
    probe = f"plxprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"network namespaces are refused here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def check_rate(rate: str) -> str:
    """A tc rate such as ``50mbit``; ``ValueError`` otherwise."""
    number = rate.rstrip("abcdefghijklmnopqrstuvwxyz")
    if not (number.isdigit() and int(number) > 0 and rate[len(number):] in _RATE_UNITS):
        raise ValueError(f"rate {rate!r}: write a positive whole number and one of {', '.join(_RATE_UNITS)}")
    return rate


def rate_bytes_per_s(rate: str) -> float:
    """Bytes per second of a tc rate such as ``20mbit`` (2.5e6)."""
    number = check_rate(rate).rstrip("abcdefghijklmnopqrstuvwxyz")
    return int(number) * _RATE_UNITS[rate[len(number):]] / 8


@dataclass
class Host:
    """One namespace of the lab."""

    name: str
    namespace: str
    address: str
    port: str
    """Its veth's end on the bridge (in the lab's namespace)."""
    rate: str | None = None
    behind: str | None = None
    """The router host this one is masqueraded behind (``NetLab.add_nat_host``), or ``None``: dialable."""

    def argv(self, *command: str) -> list[str]:
        """``command`` run on this host."""
        return ["ip", "netns", "exec", self.namespace, *command]

    def maddr(self, port: int = 0) -> str:
        return f"/ip4/{self.address}/tcp/{port}"


@dataclass
class NetLab:
    """Hosts on one bridge (module docstring). Use as a context manager, or call ``close`` in ``finally``."""

    lab: int = field(default_factory=lambda: next(_counter))
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.lab < 250:
            raise ValueError("at most 250 labs per process")
        self.prefix = f"plx{os.getpid()}{self.lab}"
        self.bridge_ns = f"{self.prefix}-br"
        self._made: list[str] = []
        try:
            self._ns("add", self.bridge_ns)
            self._run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            self._run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _run(self, *argv: str) -> None:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise NetLabError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.stdout.strip()}")

    def _ns(self, verb: str, name: str) -> None:
        self._run("ip", "netns", verb, name)
        if verb == "add":
            self._made.append(name)

    def add_host(self, name: str, *, rate: str | None = None) -> Host:
        """A host on the bridge with the next address, its link capped at ``rate`` both ways (None: uncapped)."""
        if name in self.hosts or not name.isalnum() or len(name) > 6:
            raise ValueError(f"host name {name!r}: a new name of at most 6 letters or digits")
        index = len(self.hosts) + 2
        host = Host(name, f"{self.prefix}-{name}", f"10.77.{self.lab}.{index}", f"v{self.lab}{name}")
        self._ns("add", host.namespace)
        # Both ends made inside the lab's namespaces: no name of it ever exists in the machine's own namespace, where
        # another lab (another process) may use the same one.
        self._run("ip", "-n", self.bridge_ns, "link", "add", host.port, "type", "veth", "peer", "name", "e0", "netns",
                  host.namespace)
        self._run("ip", "-n", self.bridge_ns, "link", "set", host.port, "master", "br0")
        self._run("ip", "-n", self.bridge_ns, "link", "set", host.port, "up")
        self._run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "e0")
        self._run("ip", "-n", host.namespace, "link", "set", "e0", "up")
        self._run("ip", "-n", host.namespace, "link", "set", "lo", "up")
        self.hosts[name] = host
        if rate is not None:
            self.set_rate(name, rate)
        return host

    def add_nat_host(self, name: str, *, rate: str | None = None) -> Host:
        """A host behind a NAT router of its own (``<name>r`` on the bridge, masquerading with nftables): it can
        dial every host, and no host can dial it. Its ``address`` is private; ``port`` and the rate cap are its
        router's link, so ``cut`` and ``set_rate`` act on the path to it."""
        if shutil.which("nft") is None:
            raise NetLabError("a NAT host needs `nft` (Debian package nftables)")
        if name in self.hosts or not name.isalnum() or len(name) > 5:
            raise ValueError(f"NAT host name {name!r}: a new name of at most 5 letters or digits")
        router = self.add_host(f"{name}r", rate=rate)
        subnet = f"172.{16 + sum(1 for h in self.hosts.values() if h.behind is not None)}.{self.lab}"
        host = Host(name, f"{self.prefix}-{name}", f"{subnet}.2", router.port, rate=rate, behind=router.name)
        self._ns("add", host.namespace)
        self._run("ip", "-n", router.namespace, "link", "add", "e1", "type", "veth", "peer", "name", "e0", "netns",
                  host.namespace)
        self._run("ip", "-n", router.namespace, "addr", "add", f"{subnet}.1/24", "dev", "e1")
        self._run("ip", "-n", router.namespace, "link", "set", "e1", "up")
        self._run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "e0")
        self._run("ip", "-n", host.namespace, "link", "set", "e0", "up")
        self._run("ip", "-n", host.namespace, "link", "set", "lo", "up")
        self._run("ip", "-n", host.namespace, "route", "add", "default", "via", f"{subnet}.1")
        self._run("ip", "netns", "exec", router.namespace, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        nft = ["ip", "netns", "exec", router.namespace, "nft"]
        self._run(*nft, "add", "table", "ip", "nat")
        self._run(*nft, "add", "chain", "ip", "nat", "post", "{ type nat hook postrouting priority 100; }")
        self._run(*nft, "add", "rule", "ip", "nat", "post", "oifname", "e0", "masquerade")
        self.hosts[name] = host
        return host

    def set_rate(self, name: str, rate: str) -> None:
        """Cap ``name``'s link at ``rate`` in both directions (replacing any cap)."""
        host = self.hosts[name]
        edge = self.hosts[host.behind] if host.behind is not None else host
        for namespace, dev in ((edge.namespace, "e0"), (self.bridge_ns, host.port)):
            self._run("ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                      check_rate(rate), "burst", "32kbit", "latency", "400ms")
        host.rate = rate

    def cut(self, name: str) -> None:
        """Disconnect ``name`` from the bridge (its processes keep running, alone)."""
        self._run("ip", "-n", self.bridge_ns, "link", "set", self.hosts[name].port, "down")

    def heal(self, name: str) -> None:
        """Connect ``name`` to the bridge again."""
        self._run("ip", "-n", self.bridge_ns, "link", "set", self.hosts[name].port, "up")

    def close(self) -> None:
        """Delete every namespace this lab made (their veths and qdiscs go with them). Stop the processes that run
        on its hosts first: a process whose namespace is deleted keeps running, cut off."""
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        self._made.clear()
        self.hosts.clear()

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Host", "NetLab", "NetLabError", "check_rate", "unavailable"]
