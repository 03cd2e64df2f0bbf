"""A peer that leaves closes its connection to its p2p daemon, and with it the socket it listened on for
calls: hivemind removes that file only then, and a process that skipped it left one behind in the temp
directory for every peer that ever served (hundreds a day on a test runner). Real DHT and daemon."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hivemind.proto import runtime_pb2

from swarm.config import load_config
from swarm.net.node import start_dht
from swarm.net.peer import SwarmPeer

SOCKETS = "hivemind-p2pclient-*.sock"


def client_sockets() -> set[Path]:
    return set(Path("/tmp").glob(SOCKETS))


@pytest.mark.timeout(60)
def test_a_peer_leaving_removes_the_socket_it_served_calls_on() -> None:
    async def scenario() -> tuple[set[Path], set[Path]]:
        before = client_sockets()
        dht = start_dht(load_config().net)
        p2p = await dht.replicate_p2p()

        async def ping(requests, context):
            yield runtime_pb2.ExpertResponse()

        # a streaming handler, as a stage's: the peer listens for calls from here on
        await p2p.add_protobuf_handler("ping", ping, runtime_pb2.ExpertRequest, stream_input=True, stream_output=True)
        serving = client_sockets() - before
        peer = SwarmPeer(dht, p2p, None, None, None, dht.peer_id.to_base58(), None, None, None)
        await peer.leave()
        return serving, client_sockets() - before

    serving, left = asyncio.run(scenario())
    assert len(serving) == 1 and not left
