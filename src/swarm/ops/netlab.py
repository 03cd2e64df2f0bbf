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
