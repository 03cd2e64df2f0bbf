"""A holder's copy refreshes are paced by `backup.max_share`: after a download of d seconds the next
refresh waits (1 / max_share - 1) d, however fast the stage steps; a stage with no copy yet never waits."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from swarm.backup.keeper import BackupKeeper
from swarm.config import load_config
from swarm.core.backups import pause_after
from swarm.wire.records import ServerRecord

DOWNLOAD = 0.05  # seconds each of the fake downloads takes


class Stages:
    """The DHT as the keeper reads it: one server in each of stages 0 and 1, at the epochs set here."""

    def __init__(self) -> None:
        self.epochs = {0: 0, 1: 0}

    async def stages(self, n: int, fresh: float = 0.0) -> dict[int, list[ServerRecord]]:
        return {k: [ServerRecord(f"s{k}", k, 1.0, 0, self.epochs[k], 0, "hash", {})] for k in range(n)}

    async def vouch(self, *args) -> bool:
        return True

    async def announce_backup(self, record, ttl) -> None:
        pass


class States:
    """Serves each stage's state at its current epoch after DOWNLOAD seconds, counting downloads."""

    def __init__(self, stages: Stages) -> None:
        self.stages = stages
        self.downloads: list[int] = []

    async def call(self, peer, method, meta, tensors, timeout):
        assert method == "state"
        await asyncio.sleep(DOWNLOAD)
        self.downloads.append(meta["stage"])
        return {"epoch": self.stages.epochs[meta["stage"]]}, [torch.zeros(4)]


def keeper(max_share: float) -> tuple[BackupKeeper, Stages, States]:
    cfg = load_config(overrides=["model.num_stages=2", "backup.every=2", f"backup.max_share={max_share}"])
    stages = Stages()
    client = States(stages)
    return BackupKeeper("s0", "hash", 2, cfg.backup, cfg.net, client, stages, lambda: 0), stages, client


@pytest.mark.parametrize("max_share", [0.1, 1.0])
def test_refreshes_wait_their_share_of_time_and_a_first_copy_does_not(max_share):
    async def scenario():
        holder, stages, client = keeper(max_share)
        stages.epochs[1] = 1
        await holder.look()
        assert client.downloads == [1] and holder.copies[1].epoch == 1  # the first copy: at once
        if max_share < 1:
            assert holder.paused_until - time.monotonic() > 8 * DOWNLOAD  # about 9 downloads' time
        stages.epochs[1] = 5  # `every` (2) steps past the copy, and more
        await holder.look()
        return client.downloads, holder.copies[1].epoch

    downloads, epoch = asyncio.run(scenario())
    assert (downloads, epoch) == (([1], 1) if max_share < 1 else ([1, 1], 5))


def test_the_pause_keeps_refreshes_to_their_share():
    assert pause_after(7.0, 0.1) == pytest.approx(63.0)  # 7 s of every 70
    assert pause_after(7.0, 1.0) == 0.0
