"""A peer's helper processes (hivemind's DHT process and its p2pd daemon) live and die with the peer:
none outlives a SIGKILL of it, and a peer whose own network stack died, or that is left without a
server for a stage, exits with an error instead of waiting forever."""

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


def wait_exit(peer: Peer, timeout: float) -> tuple[int, float]:
    started = time.monotonic()
    code = peer.process.wait(timeout=timeout)
    return code, time.monotonic() - started


@pytest.mark.timeout(240)
def test_helpers_die_with_their_peer_and_a_cut_off_peer_exits(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, "local.servers_per_stage=1", "trainer.target_steps=1000",
                       "trainer.no_server_timeout=4.0")
    swarm = LocalSwarm(cfg)
    try:
        swarm.start()
        trainer0, trainer1 = swarm.trainers()
        (server1,) = swarm.servers(stage=1)
        helpers = {p.name: helpers_of(p) for p in (trainer0, trainer1, server1)}
        # the helpers are in a process group of their own: a signal to the peer's group does not reach them
        for pids in helpers.values():
            assert {os.getpgid(pid) for pid in pids.values()} == {pids["dht"]}
        swarm._wait(lambda: "samples" in trainer0.log_path.read_text(), 90, "trainer-0's progress", trainer0)

        # the daemon of trainer 1 dies: it notices within its health bound and exits with its results
        os.kill(helpers["trainer-1"]["p2pd"], signal.SIGKILL)
        bound = cfg.net.health_misses * (cfg.net.health_every + 5.0) + 5.0
        code, took = wait_exit(trainer1, bound)
        assert code == 5, trainer1.log_tail()
        assert "cut off from the swarm" in trainer1.log_path.read_text()
        (summary,) = (tmp_path / "peers").glob("trainer-1-*.json")
        assert json.loads(summary.read_text())["role"] == "trainer"
        assert not running(list(helpers["trainer-1"].values()))

        # the only server of stage 1 is SIGKILLed: its helpers go with it (none answers in its name) ...
        os.kill(server1.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while running(list(helpers["server-s1-2"].values())) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(list(helpers["server-s1-2"].values()))
        # ... and trainer 0, left without a server for stage 1, gives up after trainer.no_server_timeout
        code, took = wait_exit(trainer0, cfg.net.record_ttl + cfg.trainer.no_server_timeout + 20)
        assert code == 5 and "stage 1 has had no server" in trainer0.log_path.read_text(), trainer0.log_tail()
    finally:
        swarm.stop()
