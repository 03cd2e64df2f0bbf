"""Faults injected into a local swarm, each one logged with its time.

A killed peer stands for a machine that vanished, so the whole process group goes (hivemind's DHT
child and p2pd daemon outlive a SIGKILL of the main process alone and would keep answering). A frozen
peer (SIGSTOP) stands for a machine that stalls: its connections stay open but nothing answers.
Partitions and bandwidth limits act on the peer's network namespace (see `swarm.ops.netlab`), so they
need the peer to have been started in one. Delay and loss of RPC messages go through the peer's own
fault file (`net.fault_file`, read by `swarm.net.faultfile`), since not every kernel has `netem`.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from swarm.ops.local import LocalSwarm, Peer, fault_file
from swarm.ops.netlab import NetLab

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FaultEvent:
    time: float
    kind: str  # kill | freeze | thaw | cut | heal | shape | unshape | delay
    peer: str
    detail: str = ""


class FaultInjector:
    def __init__(self, swarm: LocalSwarm, lab: NetLab | None = None):
        self.swarm = swarm
        self.lab = lab
        self.events: list[FaultEvent] = []
        self._hosts: dict[str, str] = {}  # peer name -> its namespace host in the lab

    def add_server_in_namespace(self, stage: int) -> Peer:
        """A server of `stage` on a host of its own, so that its link can be cut and shaped."""
        if self.lab is None:
            raise ValueError("this injector has no network lab")
        host = self.lab.add_host(f"h{len(self.lab.hosts) + 2}")
        peer = self.swarm.add_server(stage, (f'net.host="{host.ip}"',), wrap=tuple(self.lab.wrap(host.name)))
        self._hosts[peer.name] = host.name
        return peer

    def _record(self, kind: str, peer: Peer, detail: str = "") -> None:
        event = FaultEvent(time.time(), kind, peer.name, detail)
        self.events.append(event)
        log.info("fault: %s %s %s", kind, peer.name, detail)
        with open(self.swarm.run_dir / "faults.jsonl", "a") as out:
            out.write(json.dumps(asdict(event)) + "\n")

    def _host(self, peer: Peer) -> str:
        if peer.name not in self._hosts:
            raise ValueError(f"{peer.name} was not started in a network namespace of this injector's lab")
        return self._hosts[peer.name]

    def kill(self, peer: Peer) -> None:
        peer.signal(signal.SIGKILL)
        self._record("kill", peer)

    def freeze(self, peer: Peer) -> None:
        peer.signal(signal.SIGSTOP)
        self._record("freeze", peer)

    def thaw(self, peer: Peer) -> None:
        peer.signal(signal.SIGCONT)
        self._record("thaw", peer)

    def cut(self, peer: Peer) -> None:
        self.lab.cut(self._host(peer))
        self._record("cut", peer)

    def heal(self, peer: Peer) -> None:
        self.lab.heal(self._host(peer))
        self._record("heal", peer)

    def shape(self, peer: Peer, mbit: float) -> None:
        self.lab.shape(self._host(peer), mbit)
        self._record("shape", peer, f"{mbit} Mbit/s")

    def unshape(self, peer: Peer) -> None:
        self.lab.unshape(self._host(peer))
        self._record("unshape", peer)

    def delay(self, peer: Peer, seconds: float = 0.0, drop: float = 0.0, blackhole: bool = False) -> None:
        """Delay, drop (with probability `drop`) or swallow every RPC message the peer sends or gets."""
        write_fault_file(fault_file(self.swarm.run_dir, peer.name), seconds, drop, blackhole)
        self._record("delay", peer, f"{seconds}s, drop {drop}" + (", blackhole" if blackhole else ""))


def write_fault_file(path: Path, seconds: float, drop: float, blackhole: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"delay": seconds, "drop": drop, "blackhole": blackhole}))
    tmp.replace(path)
