"""A swarm of separate hosts, started as the README says: every peer on a network namespace host of its
own (its own IP on a bridge, no shared loopback), each with its own run directory, default networking."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from swarm.ops import netlab
from swarm.ops.netlab import Host, NetLab
from swarm.results import read_jsonl

from .helpers import assert_exactly_once, assert_replicas_in_step

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0 or not netlab.available(), reason="network namespaces need root and iproute2"),
]
SWARM = str(Path(sys.executable).parent / "swarm")  # the command the README runs
RUN_TOML = """
[model]
d_model = 64
n_heads = 2
d_ff = 128
n_layers = 2
seq_len = 64
num_stages = 2

[optim]
warmup_steps = 2
target_batch_size = 16

[trainer]
microbatch_size = 4
max_inflight = 3
target_steps = 1000
request_timeout = 10.0
ban_seconds = 3.0

[rebalance]
enabled = false
"""


class Machines:
    """Peers on namespace hosts, each started with a `swarm` command line and its own run directory."""

    def __init__(self, lab: NetLab, root: Path):
        self.lab, self.root = lab, root
        self.config = root / "run.toml"
        self.config.write_text(RUN_TOML)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, behind_nat: bool = False) -> subprocess.Popen:
        host = self.lab.add_host_behind_nat(name) if behind_nat else self.lab.add_host(name)
        (self.root / name).mkdir()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        cmd = [*netlab.wrap(host), SWARM, *args, "--config", str(self.config), "--run-dir", str(self.root / name)]
        with open(self.log(name), "wb") as out:
            self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
        return self.procs[name]

    def host(self, name: str) -> Host:
        return self.lab.hosts[name]

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def wait_for(self, what: str, condition: Callable[[], object], timeout: float = 90.0) -> object:
        deadline = time.monotonic() + timeout
        while not (found := condition()):
            for name, proc in self.procs.items():
                if proc.poll() not in (None, 0, 4, -signal.SIGKILL):
                    raise AssertionError(f"{name} exited {proc.returncode}:\n{self.log(name).read_text()[-3000:]}")
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)
        return found

    def addresses(self, name: str, after: str) -> list[str]:
        """The multiaddrs a peer printed after `after` (the bootstrap's `--initial-peers`, a server's `up on`)."""
        def printed():
            match = re.search(re.escape(after) + r" ((?:/ip\S+ ?)+)", self.log(name).read_text())
            return match and match.group(1).split()
        return self.wait_for(f"{name}'s addresses", printed)

    def steps(self, name: str) -> list[dict]:
        return [step for path in (self.root / name / "peers").glob("*.steps.jsonl") for step in read_jsonl(path)]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


@pytest.fixture
def machines(tmp_path):
    lab = NetLab(1 + (os.getpid() + 7) % 250)
    machines = Machines(lab, tmp_path)
    try:
        yield machines
    finally:
        machines.stop()
        lab.close()


BEHIND_NAT = netlab.nat_available()  # iptables: the second trainer, and a server, behind a NAT


@pytest.mark.timeout(300)
def test_separate_hosts_train_by_the_readme_and_outlive_the_bootstrap(machines, tmp_path):
    """Every peer on a host of its own, the README's commands and default networking. With iptables,
    the second trainer sits behind a masquerading NAT and trains, and a server behind one is refused."""
    m = machines
    m.start("bootstrap", "dht")
    peers = m.addresses("bootstrap", "--initial-peers")
    # other hosts can use what it prints: its own IP on the bridge, not loopback
    assert all(f"/ip4/{m.host('bootstrap').ip}/" in a for a in peers), peers
    servers = {f"s{k}{r}": k for k in (0, 1) for r in "ab"}
    for name, stage in servers.items():
        m.start(name, "server", "--stage", str(stage), "--initial-peers", *peers)
    for name in servers:  # the trainers come once the servers are up, in the README's order
        m.addresses(name, "up on")
    for index in (0, 1):
        m.start(f"t{index}", "trainer", "--index", str(index), "--initial-peers", *peers,
                behind_nat=BEHIND_NAT and index == 1)
    if BEHIND_NAT:
        refused = m.start("natserver", "server", "--stage", "0", "--initial-peers", *peers, behind_nat=True)
    m.wait_for("3 steps on every server", lambda: all(len(m.steps(s)) >= 3 for s in servers))
    # one trainer alone takes the stages through their first steps; the other may still be joining through the
    # bootstrap (it loads the corpus first), and must be in before the bootstrap dies
    m.wait_for("both trainers to join", lambda: all(" started: " in m.log(f"t{i}").read_text() for i in (0, 1)))
    if BEHIND_NAT:
        assert refused.wait(timeout=120) == 4
        text = m.log("natserver").read_text()
        assert "the swarm cannot connect to this server" in text and "behind a NAT" in text, text[-2000:]
        assert m.host("natserver-router").ip in text  # peers saw it come from its router
        assert "Traceback" not in text

    # the bootstrap machine dies; a new server joins through a server's address and serves
    os.killpg(m.procs["bootstrap"].pid, signal.SIGKILL)
    through = m.addresses("s0a", "up on")
    assert all(f"/ip4/{m.host('s0a').ip}/" in a for a in through), through
    reached = max(len(m.steps(s)) for s in servers)
    m.start("s1c", "server", "--stage", "1", "--initial-peers", *through)
    m.wait_for("the new server to step with its stage", lambda: m.steps("s1c"), timeout=120)
    assert max(len(m.steps(s)) for s in servers) > reached  # the swarm went on training meanwhile

    for index in (0, 1):  # SIGTERM: finish the microbatches in flight, settle their gradients, exit
        m.procs[f"t{index}"].send_signal(signal.SIGTERM)
    for index in (0, 1):
        assert m.procs[f"t{index}"].wait(timeout=120) == 0, m.log(f"t{index}").read_text()[-3000:]
    m.stop()

    # each peer wrote to its own run directory; `swarm report` gathers them as an operator would
    merged = tmp_path / "merged"
    peer_dirs = [str(tmp_path / name) for name in (*servers, "s1c", "t0", "t1")]
    subprocess.run([SWARM, "report", *peer_dirs, "--run-dir", str(merged)], check=True, timeout=120)
    summary = json.loads((merged / "summary.json").read_text())
    assert summary["final_loss"] < summary["first_loss"], summary
    assert_exactly_once(summary)
    assert_replicas_in_step(summary, merged)
    assert len(summary["stages"]["1"]["replicas"]) == 3
    # replicas of a stage, each on its own host, told each other their counts near the steps (`count` calls)
    heard = [json.loads(p.read_text()).get("counts_heard", 0) for n in (*servers, "s1c")
             for p in (tmp_path / n / "peers").glob("server-*.json")]
    assert sum(heard) > 0, heard
    trainers = {t["index"]: t for t in map(json.loads, (p.read_text() for n in ("t0", "t1")
                                                       for p in (tmp_path / n / "peers").glob("trainer-*.json")))}
    assert trainers[1]["samples"] > 0 and trainers[1]["unresolved"] == 0  # the one behind the NAT, with iptables
    assert not tracebacks_in(tmp_path)


def tracebacks_in(root: Path) -> dict[str, str]:
    return {log.name: text for log in root.glob("*.log") if "Traceback" in (text := log.read_text())}
