"""A peer's helper processes (hivemind's DHT process and its p2pd daemon) live and die with the peer:
none outlives a SIGKILL of it, and a peer whose own network stack died, or that is left without a
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


def helpers_of(peer: Peer, timeout: float = 60.0) -> dict[str, int]:
    """The peer's DHT process and p2pd daemon, by pid, once both are up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        below = {pid: command(pid) for pid in descendants(peer.process.pid)}
        p2pd = [pid for pid, cmd in below.items() if "p2pd" in cmd]
        dht = [pid for pid, cmd in below.items() if "swarm.cli.main" in cmd]
        if p2pd and dht:
            return {"dht": dht[0], "p2pd": p2pd[0]}
        time.sleep(0.2)
    raise AssertionError(f"{peer.name}'s helper processes did not come up: {peer.log_tail()}")


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
        helpers = {p.name: helpers_of(p) for p in (server, *trainers)}
        # the helpers are in a process group of their own: a signal to the peer's group does not reach them
        for pids in helpers.values():
            assert {os.getpgid(pid) for pid in pids.values()} == {pids["dht"]}
            # a local peer's daemon keeps to local.daemon_threads (1) threads, not one per core
            environ = Path(f"/proc/{pids['p2pd']}/environ").read_bytes().split(b"\0")
            assert b"GOMAXPROCS=1" in environ
        for trainer in trainers:
            swarm._wait(lambda t=trainer: " started: a corpus" in t.log_path.read_text(), 60, trainer.name, trainer)

        # the daemon of trainer 1 dies: it notices within its health bound and exits with its results
        os.kill(helpers["trainer-1"]["p2pd"], signal.SIGKILL)
        assert trainers[1].process.wait(timeout=bound + 5) == 5, trainers[1].log_tail()
        assert "cut off from the swarm: the p2pd daemon did not answer" in trainers[1].log_path.read_text()
        (summary,) = (tmp_path / "peers").glob("trainer-1-*.json")
        assert json.loads(summary.read_text())["role"] == "trainer"
        assert not running(list(helpers["trainer-1"].values()))

        # trainer 0 has had no server for stage 1 all along: it gives up after trainer.no_server_timeout
        assert trainers[0].process.wait(timeout=cfg.trainer.no_server_timeout + 20) == 5, trainers[0].log_tail()
        assert "stage 1 has had no server for" in trainers[0].log_path.read_text()

        # the server's main process alone is SIGKILLed: its helpers go with it (none answers in its name)
        os.kill(server.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while running(list(helpers[server.name].values())) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(list(helpers[server.name].values()))
    finally:
        swarm.stop()
