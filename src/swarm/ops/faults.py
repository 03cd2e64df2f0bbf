"""Faults injected into a local swarm, each one logged with its time (tests and `swarm fault` alike).

A killed peer stands for a machine that vanished, so all its processes go at once: its own process
group and its helpers' (hivemind's DHT process and p2pd daemon). A frozen peer (SIGSTOP to the same)
stands for a machine that stalls: its connections stay open but nothing answers.
Partitions and bandwidth limits act on the link of the peer's network namespace (a swarm started
with `local.netns`, see `swarm.ops.netlab`). Delay and loss of RPC messages go through the peer's
own fault file (see `swarm.net.faultfile`), since not every kernel has `netem`.

Peers are found by name in the swarm's `peers.json`, so the injector works from another process.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from swarm.ops import netlab
from swarm.ops.local import Peer, fault_file
from swarm.ops.netlab import Host
from swarm.ops.procs import signal_machine

log = logging.getLogger(__name__)
KILL_WAIT = 10.0  # seconds a killed peer of ours may take to be gone
ACTIONS = ("kill", "freeze", "thaw", "cut", "heal", "shape", "unshape", "delay")


@dataclass(frozen=True)
class FaultEvent:
    time: float
    kind: str  # one of ACTIONS
    peer: str
    detail: str = ""


def write_fault_file(path: Path, seconds: float, drop: float, blackhole: bool, methods: Sequence[str] = ()) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"delay": seconds, "drop": drop, "blackhole": blackhole, "methods": list(methods)}))
    tmp.replace(path)


class FaultInjector:
    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.events: list[FaultEvent] = []

    def _entry(self, peer: Peer | str) -> dict:
        name = peer if isinstance(peer, str) else peer.name
        registry = json.loads((self.run_dir / "peers.json").read_text())
        if name not in registry:
            raise ValueError(f"no peer named {name!r} in {self.run_dir}/peers.json (known: {', '.join(registry)})")
        return {"name": name, **registry[name]}

    def _host(self, peer: Peer | str) -> Host:
        entry = self._entry(peer)
        if not entry["host"]:
            raise ValueError(f"{entry['name']} has no network namespace (start the swarm with local.netns = true)")
        return Host(**entry["host"])

    def _signal(self, peer: Peer | str, sig: int) -> None:
        signal_machine(self._entry(peer)["pid"], sig)

    def _record(self, kind: str, peer: Peer | str, detail: str = "") -> None:
        event = FaultEvent(time.time(), kind, peer if isinstance(peer, str) else peer.name, detail)
        self.events.append(event)
        log.info("fault: %s %s %s", kind, event.peer, detail)
        with open(self.run_dir / "faults.jsonl", "a") as out:
            out.write(json.dumps(asdict(event)) + "\n")

    def kill(self, peer: Peer | str) -> None:
        """SIGKILL the peer's machine; a peer this process started is gone when this returns (a server
        started next may take its cores: `LocalSwarm.add_server`)."""
        self._signal(peer, signal.SIGKILL)
        if not isinstance(peer, str):
            try:
                peer.process.wait(timeout=KILL_WAIT)
            except subprocess.TimeoutExpired:
                log.warning("%s still runs %.0f s after SIGKILL", peer.name, KILL_WAIT)
        self._record("kill", peer)

    def freeze(self, peer: Peer | str) -> None:
        self._signal(peer, signal.SIGSTOP)
        self._record("freeze", peer)

    def thaw(self, peer: Peer | str) -> None:
        self._signal(peer, signal.SIGCONT)
        self._record("thaw", peer)

    def cut(self, peer: Peer | str) -> None:
        netlab.cut(self._host(peer))
        self._record("cut", peer)

    def heal(self, peer: Peer | str) -> None:
        netlab.heal(self._host(peer))
        self._record("heal", peer)

    def shape(self, peer: Peer | str, mbit: float) -> None:
        netlab.shape(self._host(peer), mbit)
        self._record("shape", peer, f"{mbit} Mbit/s")

    def unshape(self, peer: Peer | str) -> None:
        netlab.unshape(self._host(peer))
        self._record("unshape", peer)

    def delay(self, peer: Peer | str, seconds: float = 0.0, drop: float = 0.0, blackhole: bool = False,
              methods: Sequence[str] = ()) -> None:
        """Delay, drop (with probability `drop`) or swallow every RPC message the peer sends or serves (of
        `methods` only, where named)."""
        name = self._entry(peer)["name"]
        write_fault_file(fault_file(self.run_dir, name), seconds, drop, blackhole, methods)
        self._record("delay", peer, f"{seconds}s, drop {drop}" + (", blackhole" if blackhole else "")
                     + (f", {'/'.join(methods)} only" if methods else ""))
