"""How a launcher follows its local swarm: every DHT look is served by the swarm's servers, so a plain run is
looked at seldom while it trains, and often once its trainers are over (to end as soon as the stages flushed)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from swarm.config import load_config
from swarm.ops import local
from swarm.ops.local import LocalSwarm, Peer
from swarm.ops.status import SwarmStatus
from swarm.wire.records import ServerRecord

FOLLOW_EVERY, TICK = 1.0, 0.01


def record(pending: int) -> ServerRecord:
    return ServerRecord(peer_id="12D3KooWaaaaaa", stage=0, throughput=1.0, queue=0, epoch=3, pending=pending,
                        config_hash="h", model={"num_stages": 1}, optim={"mode": "sync"})


def follow(tmp_path, monkeypatch, hook=None) -> tuple[list[float], float]:
    """Follow a swarm whose one trainer (a real process, ended by closing its stdin) trains through three
    looks, watched by `hook` (an `on_status`); the stages hold samples for two looks after it ended. The
    times of the looks, and the trainer's end."""
    monkeypatch.setattr(local, "FOLLOW_EVERY", FOLLOW_EVERY)
    monkeypatch.setattr(local, "TICK", TICK)
    swarm = LocalSwarm(load_config(overrides=[f'run_dir="{tmp_path}"', "model.num_stages=1"]))
    trainer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    swarm.peers.append(Peer("trainer-0", "trainer", trainer, tmp_path / "trainer-0.log"))
    looks: list[float] = []
    ended: list[float] = []

    async def read_status(directory, num_stages: int) -> SwarmStatus:
        looks.append(time.monotonic())
        if len(looks) == 3:
            trainer.stdin.close()
            trainer.wait()
            ended.append(time.monotonic())
        return SwarmStatus({0: [record(8 if len(looks) < 6 else 0)]}, [], time.time())

    monkeypatch.setattr(local, "read_status", read_status)
    try:
        status = asyncio.run(swarm._follow(None, progress=False, on_status=hook))
    finally:
        trainer.kill()
        trainer.wait()
    assert status.pending == 0 and len(looks) == 6
    return looks, ended[0]


def assert_seldom_while_training(looks: list[float], ended: float) -> None:
    """The two looks while the trainer ran came FOLLOW_EVERY apart. A look is decided on the launcher's tick
    and timed here once it has begun, so two looks' times differ from their decisions' (FOLLOW_EVERY apart
    or more) by how long each took to begin, far less than a tick."""
    training = [b - a for a, b in zip(looks, looks[1:], strict=False) if b <= ended]
    assert len(training) == 2 and min(training) >= FOLLOW_EVERY - TICK


def test_a_plain_run_is_looked_at_seldom_while_it_trains_and_often_after(tmp_path, monkeypatch) -> None:
    looks, ended = follow(tmp_path, monkeypatch)
    after = [b - a for a, b in zip(looks, looks[1:], strict=False) if b > ended]
    assert_seldom_while_training(looks, ended)
    assert len(after) == 3 and max(after) < FOLLOW_EVERY / 2


def test_a_watched_run_is_looked_at_every_tick(tmp_path, monkeypatch) -> None:
    looks, _ = follow(tmp_path, monkeypatch, lambda status: None)
    assert max(b - a for a, b in zip(looks, looks[1:], strict=False)) < FOLLOW_EVERY / 2


def test_a_run_whose_watcher_is_done_is_looked_at_as_a_plain_one(tmp_path, monkeypatch) -> None:
    """A benchmark watches for the step at which it kills a peer, then measures the swarm's rate: from then
    on its looks must take no more from the servers than a plain run's."""
    seen: list[SwarmStatus] = []

    def kill_once(status: SwarmStatus) -> bool:
        seen.append(status)
        return True  # done: the peer is killed

    looks, ended = follow(tmp_path, monkeypatch, kill_once)
    assert len(seen) == 1
    assert_seldom_while_training(looks, ended)


def test_a_failed_trainer_ends_the_follow_at_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(local, "FOLLOW_EVERY", FOLLOW_EVERY)
    monkeypatch.setattr(local, "TICK", TICK)
    swarm = LocalSwarm(load_config(overrides=[f'run_dir="{tmp_path}"', "model.num_stages=1"]))
    trainer = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    trainer.wait()
    swarm.peers.append(Peer("trainer-0", "trainer", trainer, tmp_path / "trainer-0.log"))

    async def read_status(directory, num_stages: int) -> SwarmStatus:
        raise AssertionError("a failed trainer is seen before any look")

    monkeypatch.setattr(local, "read_status", read_status)
    with pytest.raises(RuntimeError, match="trainer-0 failed \\(exit code 3\\)"):
        asyncio.run(swarm._follow(None, progress=False, on_status=None))
