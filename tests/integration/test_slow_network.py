"""The emulated slow network: every peer on a network namespace host of its own with a shaped link,
and a round trip added to every stage call by the transport."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from swarm.ops import netlab
from swarm.ops.local import LocalSwarm

from .helpers import assert_exactly_once, assert_replicas_in_step, run_swarm, small_config

pytestmark = pytest.mark.integration
RTT_MS = 200.0  # well above what a call of this small model takes on loopback (tens of ms)


@pytest.mark.slow  # ~35 s: in make test-slow, keeping make test well inside its time budget
@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0 or not netlab.available(), reason="network namespaces need root and iproute2")
def test_every_peer_sits_behind_a_shaped_link_and_every_call_pays_the_round_trip(tmp_path):
    cfg = small_config(tmp_path, "trainer.target_steps=4", "local.netns=true", "local.link_mbit=50",
                       f"net.emulated_rtt_ms={RTT_MS}")
    swarm = LocalSwarm(cfg)
    qdiscs: dict[str, str] = {}

    def inspect(status) -> None:
        for peer in swarm.peers:
            if peer.host is not None and peer.name not in qdiscs:
                inside = subprocess.run([*netlab.wrap(peer.host), "tc", "qdisc", "show", "dev", peer.host.inner],
                                        capture_output=True, text=True).stdout
                outside = subprocess.run(["tc", "qdisc", "show", "dev", peer.host.link],
                                         capture_output=True, text=True).stdout
                qdiscs[peer.name] = inside + outside

    summary = run_swarm(swarm, inspect)

    roles = {p.name: p.role for p in swarm.peers if p.role != "dht"}
    assert sorted(qdiscs) == sorted(roles)  # servers and trainers alike
    for name, shown in qdiscs.items():
        assert shown.count("tbf") == 2 and shown.count("rate 50Mbit") == 2, (name, shown)
    for path in (tmp_path / "peers").glob("trainer-*.json"):
        trainer = json.loads(path.read_text())
        microbatches = len(trainer["completed"])
        # each microbatch made at least one call per stage forward and one per stage but the last backward
        calls = microbatches * (2 * cfg.model.num_stages - 1)
        assert sum(trainer["call_seconds"].values()) >= calls * RTT_MS / 1000, trainer["call_seconds"]
    assert_exactly_once(summary)
    assert_replicas_in_step(summary, tmp_path)
