"""A peer's helper process (its p2pd daemon) lives and dies with the peer:
it does not outlive a SIGKILL of it, and a peer whose own network stack died, or that is left without a
server for a stage, exits with an error instead of waiting forever. (No training is needed for any
of it: one server of stage 0, none of stage 1, two trainers.)"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from swarm.ops.local import LocalSwarm, Peer
from swarm.ops.procs import descendants

from .helpers import command, running, small_config

pytestmark = pytest.mark.integration


def daemon_of(peer: Peer, timeout: float = 60.0) -> int:
    """The peer's p2pd daemon (its only helper process: its DHT node runs on its own loop), once it is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p2pd = [pid for pid in descendants(peer.process.pid) if "p2pd" in command(pid)]
        if p2pd:
            return p2pd[0]
        time.sleep(0.2)
    raise AssertionError(f"{peer.name}'s daemon did not come up: {peer.log_tail()}")


@pytest.mark.timeout(180)
def test_helpers_die_with_their_peer_and_a_cut_off_peer_exits(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, "trainer.no_server_timeout=15.0")
    swarm = LocalSwarm(cfg)
    try:
        swarm.start_bootstrap()
        server = swarm.add_server(0)
        # trainer 1 can only leave through its daemon's death: no stage-1 server's absence ends it first
        bound = cfg.net.health_misses * (cfg.net.health_every + 5.0)
        trainers = [swarm.add_trainer(0), swarm.add_trainer(1, (f"trainer.no_server_timeout={10 * bound}",))]
        peers = (server, *trainers)
        daemons = {p.name: daemon_of(p) for p in peers}
        # each daemon is in a process group of its own: a signal to the peer's group does not reach it
        for peer in peers:
            pid = daemons[peer.name]
            assert os.getpgid(pid) == pid != os.getpgid(peer.process.pid)
            # a local peer's daemon keeps to local.daemon_threads (1) threads, not one per core
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert b"GOMAXPROCS=1" in environ
        for trainer in trainers:
            swarm._wait(lambda t=trainer: " started: a corpus" in t.log_path.read_text(), 60, trainer.name, trainer)

        # the daemon of trainer 1 dies: it notices within its health bound and exits with its results
        os.kill(daemons["trainer-1"], signal.SIGKILL)
        assert trainers[1].process.wait(timeout=bound + 5) == 5, trainers[1].log_tail()
        assert "cut off from the swarm: the p2pd daemon" in trainers[1].log_path.read_text()
        (summary,) = (tmp_path / "peers").glob("trainer-1-*.json")
        assert json.loads(summary.read_text())["role"] == "trainer"
        assert not running([daemons["trainer-1"]])

        # trainer 0 has had no server for stage 1 all along: it gives up after trainer.no_server_timeout
        assert trainers[0].process.wait(timeout=cfg.trainer.no_server_timeout + 20) == 5, trainers[0].log_tail()
        assert "stage 1 has had no server for" in trainers[0].log_path.read_text()

        # the server's main process alone is SIGKILLed: its daemon goes with it (none answers in its name)
        os.kill(server.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while running([daemons[server.name]]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running([daemons[server.name]])
    finally:
        swarm.stop()
