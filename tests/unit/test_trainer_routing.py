"""The trainer's server choice per stage follows `trainer.routing`, with bans and preferences."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from swarm.config import agreed, config_hash, load_config
from swarm.trainer.calls import StageCaller
from swarm.trainer.view import SwarmView
from swarm.wire.records import ServerRecord


def _trainer(routing: str) -> StageCaller:
    cfg = load_config(overrides=[f'trainer.routing="{routing}"', "model.num_stages=2"])
    view = SwarmView(2, config_hash(cfg), agreed(cfg), 1.0)
    view.servers[0] = [
        ServerRecord(peer, 0, throughput, 0, 0, 0, config_hash(cfg), {})
        for peer, throughput in (("a", 1.0), ("b", 3.0))
    ]
    return StageCaller(cfg.trainer, None, None, view, config_hash(cfg), 1.0, random.Random(0), asyncio.Event())


def test_round_robin_routing_gives_exact_shares_per_cycle():
    trainer = _trainer("wrr")
    picks = Counter(trainer.pick(0, None) for _ in range(400))
    assert picks == {"a": 100, "b": 300}


@pytest.mark.parametrize("routing", ["random", "wrr"])
def test_preferred_and_banned_servers(routing):
    trainer = _trainer(routing)
    assert all(trainer.pick(0, "a") == "a" for _ in range(20))  # the backward goes where the forward ran
    trainer.bans.ban("b", now=float("inf"))  # banned for good, whatever the clock says
    assert {trainer.pick(0, None) for _ in range(50)} == {"a"}
    trainer.bans.ban("a", now=float("inf"))
    assert trainer.pick(0, None) is None
