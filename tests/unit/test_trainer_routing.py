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


def test_the_epoch_callers_expect_and_the_run_s_progress_ignore_a_lying_record():
    """A record at epoch 10^9 beside honest replicas at 53: calls still carry 53 (else every honest
    replica would refuse them as stale), and the run is not taken for finished. A replica a step or two
    ahead of the others still sets the epoch (its peers are catching up)."""
    cfg = load_config(overrides=["model.num_stages=2"])
    view = SwarmView(2, config_hash(cfg), agreed(cfg), 1.0)

    def stage(*epochs: int) -> list[ServerRecord]:
        return [ServerRecord(f"p{i}", 0, 1.0, 0, e, 0, config_hash(cfg), {}) for i, e in enumerate(epochs)]

    view.servers[0] = stage(53, 10**9)
    assert view.live_epoch(0) == 53 and view.settled_epoch(0) == 53
    view.servers[0] = stage(53, 53, 10**9)
    assert view.live_epoch(0) == 53 and view.settled_epoch(0) == 53
    assert view.live_epoch(0, ignore={"p0", "p1"}) == 10**9  # alone, it cannot be told from the truth
    view.servers[0] = stage(53, 55)
    assert view.live_epoch(0) == 55 and view.settled_epoch(0) == 53
    view.servers[0], view.stage_epoch[0] = [], 70
    assert view.live_epoch(0) == 0 and view.settled_epoch(0) == 70  # no live replica: where it was last seen
