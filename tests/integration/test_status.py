"""`swarm status` as an operator runs it, against a live local swarm; and the trainer's progress lines."""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from swarm.config import SwarmConfig, load_config, replace
from swarm.ops.local import LocalSwarm
from swarm.ops.status import SwarmStatus, follow

from .helpers import interrupt, small_config

pytestmark = pytest.mark.integration
PROGRESS = re.compile(r"trainer …\w{6}: ([\d,]+) samples \([\d.]+/s\), loss [\d.]+, servers/stage (\d+/\d+), step \d+")


class Watch:
    """`swarm status --watch 1` run as a user would, knowing only the run id and where to join (the stage
    count is learned from the servers: the default config's differs); its snapshots read as they come."""

    def __init__(self, swarm: LocalSwarm, *args: str):
        cmd = [sys.executable, "-m", "swarm.cli.main", "status", "--watch", "1", "--initial-peers",
               *swarm.initial_peers, "--set", f'net.run_id="{swarm.cfg.net.run_id}"', *args]
        self.json = "--json" in args
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.process.stdout], daemon=True).start()

    def until(self, wanted: Callable, timeout: float):
        """The first snapshot (a JSON object, or the table's lines) for which `wanted` is true."""
        deadline, table = time.monotonic() + timeout, []
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic())).rstrip("\n")
            except queue.Empty:
                raise AssertionError(f"no such snapshot within {timeout:.0f}s; last: {table}") from None
            if self.json:
                snapshot = json.loads(line)
            elif line:
                table.append(line)
                if not line.startswith("verdict: "):
                    continue
                snapshot, table = table, []
            else:
                continue
            if wanted(snapshot):
                return snapshot



def read_until(cfg: SwarmConfig, wanted: Callable[[SwarmStatus], bool], timeout: float) -> SwarmStatus:
    """The first of `swarm status`'s reads (each from a DHT client of its own) for which `wanted` is true."""
    deadline = time.monotonic() + timeout
    while True:
        read: list[SwarmStatus] = []
        follow(cfg, read.append)
        if wanted(read[0]):
            return read[0]
        assert time.monotonic() < deadline, f"no such read within {timeout:.0f}s; last: {read[0]}"


@pytest.mark.timeout(300)
def test_status_shows_servers_trainers_and_a_stage_without_server(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, "local.servers_per_stage=1", "local.trainers=1", "trainer.target_steps=1000",
                       "trainer.progress_every=1.0")
    assert load_config().model.num_stages != cfg.model.num_stages  # what `swarm status` is left to discover
    swarm = LocalSwarm(cfg)
    try:
        swarm.start()
        as_json, as_table = Watch(swarm, "--json"), Watch(swarm)

        # (a snapshot read while the loaded host kept a server's record from being renewed is not this one)
        out = as_json.until(lambda s: s["trainers"] and s["trainers"][0]["completed"] > 0
                            and all(len(stage["servers"]) == 1 for stage in s["stages"]), 60)
        dht = read_until(replace(cfg, net={"initial_peers": swarm.initial_peers}),
                         lambda status: len(status.trainers) == 1
                         and all(len(status.servers.get(k, [])) == 1 for k in (0, 1)), 60)
        assert out["run_id"] == cfg.net.run_id and out["num_stages"] == 2
        assert [s["stage"] for s in out["stages"]] == [0, 1]
        for stage in out["stages"]:
            (server,) = stage["servers"]
            assert [server["peer_id"]] == [r.peer_id for r in dht.servers[stage["stage"]]]
            assert server["name"] == f"server-s{stage['stage']}-{stage['stage'] + 1}"
            assert stage["epoch"] == server["epoch"] and stage["pending"] == server["pending"]
            assert stage["capacity"] == (server["capacity"] or server["throughput"])
            assert {"queue", "moving", "tenure", "mode"} <= server.keys()
        (trainer,) = out["trainers"]
        assert trainer["peer_id"] == dht.trainers[0].peer_id
        assert trainer["loss"] > 0 and not trainer["done"]
        assert "no server" not in out["verdict"]["text"]

        gone = swarm.servers(stage=1)[0]
        gone.process.send_signal(signal.SIGINT)  # leaves gracefully: its tombstone takes it out of the DHT at once
        gone.process.wait(timeout=30)
        out = as_json.until(lambda s: not s["stages"][1]["servers"] and s["stages"][0]["servers"], 30)
        assert out["stages"][1]["epoch"] is None and out["verdict"]["findings"][0] == "stage 1 has no server"
        table = as_table.until(lambda t: "stage 1: no server" in t and any("server-s0-1" in line for line in t), 30)
        assert [line.split()[0] for line in table if "…" in line and "server-" in line] == ["server-s0-1"]
        assert table[-1].startswith("verdict: stage 1 has no server"), table
        assert interrupt(as_json.process) == 0 and interrupt(as_table.process) == 0

        log = swarm.trainers()[0].log_path.read_text()
        progress = [(int(m[1].replace(",", "")), m[2]) for m in PROGRESS.finditer(log)]
        assert any(samples > 0 and servers == "1/1" for samples, servers in progress), log[-2000:]
    finally:
        swarm.stop()


@pytest.mark.timeout(60)
def test_status_says_so_when_it_cannot_join() -> None:
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/QmXm1B5iXeaB3zSdEnEoP6uP5szTpT6XRFi6V8xCkXyUFW"
    done = subprocess.run([sys.executable, "-m", "swarm.cli.main", "status", "--initial-peers", nobody],
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 4, done.stderr
    assert "swarm: could not join the swarm" in done.stderr and "Traceback" not in done.stderr
