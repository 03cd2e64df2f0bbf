"""A newcomer greets the peer it joins through: the clock comparison and the dial-back, over real RPCs."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest

from swarm.config import load_config
from swarm.net.node import JoinError, check_join, start_dht
from swarm.ops.local import LocalSwarm

from .helpers import small_config

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_a_newcomer_measures_its_clock_against_the_swarm_and_is_dialled_back(tmp_path, caplog):
    swarm = LocalSwarm(small_config(tmp_path))
    swarm.start_bootstrap()
    try:
        peers = ",".join(f'"{a}"' for a in swarm.initial_peers)
        net = load_config(overrides=[f"net.initial_peers=[{peers}]", 'net.host="127.0.0.1"']).net
        dht = start_dht(net)
        async def scenario() -> None:
            p2p = await dht.replicate_p2p()

            def join(skew: float, serving: bool = False):
                return check_join(dht, p2p, net, serving, clock=lambda: time.time() + skew)

            with caplog.at_level(logging.WARNING, logger="swarm.net.node"):
                await join(0.0, serving=True)  # in step, and reachable on loopback: nothing to say
                assert not caplog.records
                await join(-1.2)
                said = re.search(r"clock is ([\d.]+)s \(±([\d.]+)s\) behind the swarm's", caplog.text)
                assert said, caplog.text
                offset, spread = map(float, said.groups())  # measured over RPCs: the half round trip bounds it
                assert abs(offset - 1.2) <= spread + 0.01, caplog.text
            with pytest.raises(JoinError, match=r"ahead of the swarm's.*net.max_clock_offset=2.0s"):
                await join(10.0)

        try:
            asyncio.run(scenario())
        finally:
            dht.shutdown()
    finally:
        swarm.stop()


@pytest.mark.timeout(60)
def test_an_identity_file_keeps_the_peer_id_across_restarts(tmp_path):
    """`swarm dht --identity FILE --port P` restarted answers at the same multiaddr, so the
    --initial-peers everyone was given stay valid."""
    net = load_config(overrides=[f'net.identity_path="{tmp_path / "dht.key"}"', 'net.host="127.0.0.1"']).net
    ids = []
    for _ in range(2):
        dht = start_dht(net)
        ids.append(dht.peer_id.to_base58())
        dht.shutdown()
    assert (tmp_path / "dht.key").exists() and ids[0] == ids[1]
