"""A bootstrap peer inside a launcher's process: others join through it and are greeted while the launcher's
own thread runs no event loop, and it leaves no process behind. A newcomer whose initial peers cannot be
reached yet keeps trying for `net.join_timeout`."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from swarm.config import load_config
from swarm.net.bootstrap import Bootstrap
from swarm.net.join import greet, peer_ids
from swarm.net.node import JoinError, start_dht


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


class Retries(logging.Handler):
    """The warnings a newcomer logs each time none of its initial peers could be reached."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.first = 0, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("none of the initial peers could be reached"):
            self.count += 1
            self.first.set()


@pytest.fixture
def retries():
    handler, logger = Retries(), logging.getLogger("swarm.net.node")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def net_of(*overrides: str):
    return load_config(overrides=['net.host="127.0.0.1"', *overrides]).net


def test_a_newcomer_keeps_trying_while_its_bootstrap_restarts_and_joins_once_it_is_back(tmp_path: Path,
                                                                                       retries: Retries) -> None:
    key = tmp_path / "dht.key"
    bootstrap = Bootstrap(net_of(f'net.identity_path="{key}"'))
    addresses, port = bootstrap.addresses, bootstrap.addresses[0].split("/tcp/")[1].split("/")[0]
    bootstrap.shutdown()
    back: list[Bootstrap] = []
    done = threading.Event()

    def restart() -> None:
        """Once the newcomer found it gone: the bootstrap again, same identity and port (its DHT process
        lives as long as this thread)."""
        if retries.first.wait(timeout=60):
            back.append(Bootstrap(net_of(f'net.identity_path="{key}"', f"net.port={port}")))
            done.wait(timeout=120)
            back[0].shutdown()

    restarter = threading.Thread(target=restart)
    restarter.start()
    try:
        peers = "[" + ",".join(f'"{a}"' for a in addresses) + "]"
        newcomer = start_dht(net_of(f"net.initial_peers={peers}"))  # returns once it has joined
        try:
            async def hello() -> list:
                return await greet(await newcomer.replicate_p2p(), peer_ids(addresses), [])

            (greeting,) = asyncio.run(hello())
            assert back and greeting.peer == back[0].dht.peer_id.to_base58()
            assert retries.count >= 1
        finally:
            newcomer.shutdown()
    finally:
        done.set()
        restarter.join(timeout=60)


def test_a_newcomer_gives_up_after_the_join_timeout_and_says_why(tmp_path: Path, retries: Retries) -> None:
    bootstrap = Bootstrap(net_of())
    peers = "[" + ",".join(f'"{a}"' for a in bootstrap.addresses) + "]"
    bootstrap.shutdown()
    started = time.monotonic()
    with pytest.raises(JoinError, match="failed to connect to bootstrap peers.*check net.initial_peers"):
        start_dht(net_of(f"net.initial_peers={peers}", "net.join_timeout=2.0"))
    assert time.monotonic() - started >= 2.0 and retries.count >= 1
    with pytest.raises(JoinError):  # without a timeout, at once
        start_dht(net_of(f"net.initial_peers={peers}", "net.join_timeout=0"))
    assert retries.count >= 1
