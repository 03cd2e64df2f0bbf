"""The fuzzer (swarm.net.fuzz) against live stage servers: every well-framed bad message is answered with
an error, garbage ends its stream, and the servers keep serving good requests throughout."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from swarm.net.directory import Directory
from swarm.net.fuzz import Fuzzer, forward_targets
from swarm.net.node import start_dht
from swarm.net.transport import StageClient
from swarm.ops.local import LocalSwarm

from .helpers import small_config, tracebacks, wait_for_stages

pytestmark = pytest.mark.integration
MESSAGES = int(os.environ.get("SWARM_FUZZ_MESSAGES", "800"))  # per stage server (benchmarks/attacks.py: 10,000)


@pytest.mark.timeout(300)
def test_fuzzed_messages_to_every_call_crash_nothing_and_are_answered(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, "local.servers_per_stage=1")
    swarm = LocalSwarm(cfg)
    swarm.start_bootstrap()
    for stage in range(cfg.model.num_stages):
        swarm.add_server(stage)

    async def scenario() -> list:
        net = small_config(tmp_path, f"net.initial_peers={list(swarm.initial_peers)!r}".replace("'", '"')).net
        dht = start_dht(net, client_mode=True)
        try:
            p2p = await dht.replicate_p2p()
            servers = await wait_for_stages(Directory(dht, cfg.net.run_id, cfg.net.record_ttl), 2, 90)
            fuzzer = Fuzzer(p2p, StageClient(p2p), seed=1)
            return [await fuzzer.run(t, MESSAGES) for t in forward_targets(cfg, servers)]
        finally:
            dht.shutdown()

    try:
        reports = asyncio.run(scenario())
        alive = [p.alive() for p in swarm.servers()]
    finally:
        swarm.stop()
    for report in reports:
        assert report.sent == MESSAGES and not report.problems, report.problems[:5]
        assert report.slowest_alive_check < 5.0, report
        # some mutations leave a valid call (a state or ledger query, a new request id): most are refused
        framed = sum(n for k, n in report.outcomes.items() if not k.startswith("bytes"))
        refused = sum(n for k, n in report.outcomes.items() if k.endswith(":error") and not k.startswith("bytes"))
        assert refused >= 0.6 * framed, report.outcomes
    assert all(alive) and len(alive) == 2
    assert not tracebacks(tmp_path)
