"""The lifeline's watch and guard, against stand-ins for the DHT process and the daemon."""

from __future__ import annotations

import asyncio

import pytest

from swarm.config import NetConfig
from swarm.net.lifeline import CutOff, NetworkLost, guard, watch


class FakeDHT:
    def __init__(self, alive: bool = True):
        self.alive, self.pid, self.exitcode = alive, 1234, None if alive else -9

    def is_alive(self) -> bool:
        return self.alive


class FakeDaemon:
    def __init__(self, answers: int):
        self.answers, self.probes = answers, 0

    async def list_peers(self) -> list:
        self.probes += 1
        if self.probes > self.answers:
            raise ConnectionRefusedError("daemon socket gone")
        return []


def test_a_dead_dht_process_is_noticed_at_the_first_probe() -> None:
    with pytest.raises(NetworkLost, match="DHT process .* exited"):
        asyncio.run(watch(FakeDHT(alive=False), FakeDaemon(answers=10), 0.01, 1.0, 3))


def test_the_daemon_is_given_up_only_after_misses_in_a_row() -> None:
    daemon = FakeDaemon(answers=2)
    with pytest.raises(NetworkLost, match="did not answer 3 probes"):
        asyncio.run(watch(FakeDHT(), daemon, 0.01, 1.0, 3))
    assert daemon.probes == 5  # two answered, then three missed


def test_guard_returns_the_work_while_the_network_is_well() -> None:
    async def work() -> str:
        await asyncio.sleep(0.05)
        return "done"

    net = NetConfig(health_every=0.01)
    assert asyncio.run(guard(work(), FakeDHT(), FakeDaemon(answers=1000), net)) == "done"


def test_guard_cancels_the_work_when_a_watcher_raises() -> None:
    cancelled = []

    async def work() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def watcher() -> None:
        await asyncio.sleep(0.05)
        raise CutOff("no server for stage 1")

    with pytest.raises(CutOff, match="no server"):
        asyncio.run(guard(work(), FakeDHT(), FakeDaemon(answers=1000), NetConfig(), watcher()))
    assert cancelled == [True]


def test_a_watcher_that_ends_cleanly_leaves_the_others_watching() -> None:
    async def work() -> None:
        await asyncio.sleep(60)

    async def switched_off() -> None:  # e.g. trainer.no_server_timeout = 0
        return None

    net = NetConfig(health_every=0.01, health_misses=2)
    with pytest.raises(NetworkLost):
        asyncio.run(guard(work(), FakeDHT(), FakeDaemon(answers=3), net, switched_off()))
