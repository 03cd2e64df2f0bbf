"""A holder's copies: refreshes are paced by `backup.max_share` (after a download of d seconds the next
refresh waits (1 / max_share - 1) d, however fast the stage steps; a stage with no copy yet never waits),
and a copy is kept only once its tensors pass the checks a replica loading them would make."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from swarm.backup.keeper import BackupKeeper
from swarm.config import load_config
from swarm.core.backups import pause_after
from swarm.model import build_stage
from swarm.server.runtime import StageRuntime
from swarm.server.state_io import StateLayout
from swarm.wire.records import ServerRecord

DOWNLOAD = 0.05  # seconds each of the fake downloads takes


class Stages:
    """The DHT as the keeper reads it: one server in each of stages 0 and 1 at the epochs set here, and the
    servers of `more` beside them, one epoch ahead (their copies are asked for first)."""

    def __init__(self) -> None:
        self.epochs = {0: 0, 1: 0}
        self.more: dict[int, list[str]] = {}

    async def stages(self, n: int, fresh: float = 0.0) -> dict[int, list[ServerRecord]]:
        def record(peer: str, k: int, ahead: int) -> ServerRecord:
            return ServerRecord(peer, k, 1.0, 0, self.epochs[k] + ahead, 0, "hash", {})

        return {k: [record(f"s{k}", k, 0), *(record(peer, k, 1) for peer in self.more.get(k, []))] for k in range(n)}

    async def vouch(self, *args) -> bool:
        return True

    async def announce_backup(self, record, ttl) -> None:
        pass


class States:
    """Serves each stage's state (of a replica that has not stepped, told as being at the epoch its record
    says) after DOWNLOAD seconds, counting downloads; the peers in `lying` serve other weights than their
    digest says, as a hostile replica could."""

    def __init__(self, stages: Stages, replicas: dict[int, StageRuntime]) -> None:
        self.stages, self.replicas = stages, replicas
        self.downloads: list[tuple[int, str]] = []
        self.lying: set[str] = set()

    async def call(self, peer, method, meta, tensors, timeout):
        assert method == "state"
        await asyncio.sleep(DOWNLOAD)
        stage = meta["stage"]
        self.downloads.append((stage, peer))
        state, tensors = self.replicas[stage].state()
        epoch = next(r.epoch for r in (await self.stages.stages(2))[stage] if r.peer_id == peer)
        if peer in self.lying:
            tensors = [tensors[0] + 1, *tensors[1:]]
        return {**state, "epoch": epoch}, tensors


def keeper(max_share: float) -> tuple[BackupKeeper, Stages, States]:
    cfg = load_config(overrides=["model.num_stages=2", "model.n_layers=2", "model.d_model=32", "model.d_ff=64",
                                 "backup.every=2", f"backup.max_share={max_share}"])
    stages = Stages()
    client = States(stages, {k: StageRuntime(build_stage(cfg.model, k), cfg.optim) for k in range(2)})
    return BackupKeeper("s0", "hash", cfg.model, cfg.backup, cfg.net, client, stages, lambda: 0), stages, client


@pytest.mark.parametrize("max_share", [0.1, 1.0])
def test_refreshes_wait_their_share_of_time_and_a_first_copy_does_not(max_share):
    async def scenario():
        holder, stages, client = keeper(max_share)
        stages.epochs[1] = 1
        await holder.look()
        assert client.downloads == [(1, "s1")] and holder.copies[1].epoch == 1  # the first copy: at once
        if max_share < 1:
            assert holder.paused_until - time.monotonic() > 8 * DOWNLOAD  # about 9 downloads' time
        stages.epochs[1] = 5  # `every` (2) steps past the copy, and more
        await holder.look()
        return [stage for stage, _ in client.downloads], holder.copies[1].epoch

    downloads, epoch = asyncio.run(scenario())
    assert (downloads, epoch) == (([1], 1) if max_share < 1 else ([1, 1], 5))


def test_a_copy_whose_tensors_are_not_what_its_digest_says_is_refused_for_an_honest_one():
    """The most advanced replica announces (and so is vouched for at) its stage's honest digest, but serves
    other weights: the holder refuses them and keeps the next replica's state, bit for bit."""

    async def scenario():
        holder, stages, client = keeper(1.0)
        stages.epochs[1] = 1
        stages.more[1] = ["liar"]
        client.lying.add("liar")
        await holder.look()
        return holder, client

    holder, client = asyncio.run(scenario())
    assert client.downloads == [(1, "liar"), (1, "s1")]
    assert holder.counters["unusable"] == 1
    copy = holder.copies[1]
    assert copy.source == "s1" and copy.epoch == 1
    _, honest = client.replicas[1].state()
    assert all(torch.equal(a, b) for a, b in zip(copy.tensors, honest, strict=True))


def test_the_pause_keeps_refreshes_to_their_share():
    assert pause_after(7.0, 0.1) == pytest.approx(63.0)  # 7 s of every 70
    assert pause_after(7.0, 1.0) == 0.0


def test_a_stage_layout_built_without_weights_is_the_one_its_replicas_check_states_against():
    cfg = load_config(overrides=["model.num_stages=3", "model.share_weights=true"])
    for k in range(3):
        assert StateLayout.of_stage(cfg.model, k) == StageRuntime(build_stage(cfg.model, k), cfg.optim).layout
