"""A bootstrap peer inside a launcher's process: others join through it and are greeted while the launcher's
own thread runs no event loop, and it leaves no process behind."""

from __future__ import annotations

import asyncio
import os

from swarm.config import load_config
from swarm.net.bootstrap import Bootstrap
from swarm.net.join import greet, peer_ids
from swarm.net.node import start_dht


def test_a_newcomer_joins_and_is_greeted_and_shutdown_ends_the_bootstraps_processes() -> None:
    bootstrap = Bootstrap(load_config(overrides=['net.host="127.0.0.1"']).net)
    helper = bootstrap.dht.pid
    try:
        assert bootstrap.addresses and all("/ip4/127.0.0.1/" in a for a in bootstrap.addresses)
        peers = "[" + ",".join(f'"{a}"' for a in bootstrap.addresses) + "]"
        newcomer = start_dht(load_config(overrides=[f"net.initial_peers={peers}", 'net.host="127.0.0.1"']).net)
        try:
            async def hello() -> list:
                return await greet(await newcomer.replicate_p2p(), peer_ids(bootstrap.addresses), [])

            # the launcher's main thread runs no loop of the bootstrap's: the greeting is answered by its own
            (greeting,) = asyncio.run(hello())
            assert greeting.peer == bootstrap.dht.peer_id.to_base58()
            assert abs(greeting.clock.offset) < 1.0
        finally:
            newcomer.shutdown()
    finally:
        bootstrap.shutdown()
    assert not bootstrap._thread.is_alive() and not bootstrap.dht.is_alive()
    assert not os.path.exists(f"/proc/{helper}")  # its DHT process, reaped
