"""Test hosts on one machine: network namespaces joined by veth links to one bridge.

Each host is a namespace with one veth link to a bridge in the root namespace; peers in the root
namespace listen on the bridge's address, so every peer reaches every other one through it. A link
can be cut (the host is partitioned from everyone, DHT included) and healed, and shaped with a token
bucket (`tc tbf`) in both directions. Traffic never leaves the namespaces created here. The link
operations need only the `Host` record, so another process (`swarm fault`) can apply them.

Needs root and iproute2. Everything created is named after the lab, and `close` removes it all.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass


class NetLabError(OSError):
    """A namespace, link or queue could not be set up (not root, or iproute2 is missing)."""


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    ip: str
    link: str  # the veth end in the root namespace (the one cut and shaped)
    inner: str  # the veth end inside the namespace


def nat_available() -> bool:
    """Whether hosts behind a NAT can be made here (iptables, on top of namespaces)."""
    return shutil.which("iptables") is not None and available()


def available() -> bool:
    """Whether namespaces can be made here: iproute2 present and allowed to add a namespace."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    probe = "swprobe"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetLabError(f"{' '.join(cmd)}: {done.stderr.strip()}")


def wrap(host: Host) -> tuple[str, ...]:
    """The command prefix that runs a program inside the host's namespace."""
    return ("ip", "netns", "exec", host.netns)


def cut(host: Host) -> None:
    """Partition the host from everyone (its packets go nowhere until `heal`)."""
    _run("ip", "link", "set", host.link, "down")


def heal(host: Host) -> None:
    _run("ip", "link", "set", host.link, "up")


def shape(host: Host, mbit: float, latency_ms: int = 100) -> None:
    """Limit the host's link to `mbit` in each direction (a token bucket on both veth ends). The bucket
    holds 4 ms of traffic (at least 64 KiB): a smaller one than a timer tick's worth caps the rate
    below `mbit`."""
    burst_bytes = max(64 * 1024, int(mbit * 1e6 / 8 * 0.004))
    tbf = ["tbf", "rate", f"{mbit}mbit", "burst", str(burst_bytes), "latency", f"{latency_ms}ms"]
    _run("tc", "qdisc", "replace", "dev", host.link, "root", *tbf)
    _run("ip", "netns", "exec", host.netns, "tc", "qdisc", "replace", "dev", host.inner, "root", *tbf)


def unshape(host: Host) -> None:
    subprocess.run(["tc", "qdisc", "del", "dev", host.link, "root"], capture_output=True)
    subprocess.run(["ip", "netns", "exec", host.netns, "tc", "qdisc", "del", "dev", host.inner, "root"],
                   capture_output=True)


class NetLab:
    def __init__(self, lab_id: int):
        """`lab_id` (1-250) picks the subnet 10.77.<lab_id>.0/24 and the interface names."""
        if not 1 <= lab_id <= 250:
            raise ValueError(f"lab_id must be in 1..250, got {lab_id}")
        self.id = lab_id
        self.bridge = f"swbr{lab_id}"
        self.gateway = f"10.77.{lab_id}.1"
        self.hosts: dict[str, Host] = {}
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def add_host(self, name: str) -> Host:
        n = len(self.hosts) + 2
        host = Host(name, f"sw{self.id}h{n}", f"10.77.{self.id}.{n}", f"sw{self.id}v{n}", f"sw{self.id}i{n}")
        _run("ip", "netns", "add", host.netns)
        self.hosts[name] = host
        _run("ip", "link", "add", host.link, "type", "veth", "peer", "name", host.inner)
        _run("ip", "link", "set", host.inner, "netns", host.netns)
        _run("ip", "link", "set", host.link, "master", self.bridge)
        _run("ip", "link", "set", host.link, "up")
        inside = ("ip", "netns", "exec", host.netns)
        _run(*inside, "ip", "addr", "add", f"{host.ip}/24", "dev", host.inner)
        _run(*inside, "ip", "link", "set", host.inner, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        return host

    def add_host_behind_nat(self, name: str) -> Host:
        """A host on a private link behind a router that masquerades it onto the bridge (a home NAT):
        it can open connections to every other host, none can be opened to it. The returned `Host`'s
        link is the router's, so cutting or shaping it acts on the whole NAT. Needs iptables."""
        router = self.add_host(f"{name}-router")
        n = len(self.hosts) + 2  # numbered as `add_host` numbers hosts
        private = f"10.78.{self.id}"
        host = Host(name, f"sw{self.id}h{n}", f"{private}.2", router.link, f"sw{self.id}i{n}")
        outer = f"sw{self.id}p{n}"  # the router's end of the private link
        _run("ip", "netns", "add", host.netns)
        self.hosts[name] = host
        _run("ip", "link", "add", outer, "netns", router.netns, "type", "veth", "peer", "name", host.inner,
             "netns", host.netns)
        in_router = ("ip", "netns", "exec", router.netns)
        in_host = ("ip", "netns", "exec", host.netns)
        _run(*in_router, "ip", "addr", "add", f"{private}.1/24", "dev", outer)
        _run(*in_router, "ip", "link", "set", outer, "up")
        _run(*in_router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run(*in_router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", router.inner, "-j", "MASQUERADE")
        _run(*in_host, "ip", "addr", "add", f"{host.ip}/24", "dev", host.inner)
        _run(*in_host, "ip", "link", "set", host.inner, "up")
        _run(*in_host, "ip", "link", "set", "lo", "up")
        _run(*in_host, "ip", "route", "add", "default", "via", f"{private}.1")
        return host

    def close(self) -> None:
        """Remove every link, namespace and the bridge (processes inside must have ended first)."""
        for host in self.hosts.values():
            subprocess.run(["ip", "link", "del", host.link], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        self.hosts.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
