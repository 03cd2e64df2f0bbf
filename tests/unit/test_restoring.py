"""A server entering a stage with no replica left: what its earlier looks saw of the stage counts."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from swarm.server import restoring


class Churned:
    """The DHT as a newcomer read it in a failed run: its stage's last replica (just killed) at epoch 4, then,
    once that record lapsed, no replica there and, in the same churn, no record of the other stages either."""

    def __init__(self) -> None:
        self.looks = 0

    async def stage(self, index: int) -> list:
        self.looks += 1
        dead = SimpleNamespace(peer_id="dead", epoch=4, config_hash="h")
        return [dead] if self.looks == 1 else []

    async def stages(self, num_stages: int) -> dict:
        return {k: [] for k in range(num_stages)}

    async def backups(self, index: int) -> list:
        return []


class Unreachable:
    async def download(self, records, method: str = "state", force: bool = False) -> bool:
        return False

    def note_restored(self, epoch: int) -> None:
        raise AssertionError("nothing was restored")


def test_a_stage_seen_further_along_is_waited_for_after_its_last_replicas_record_lapses(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(restoring, "RETRY_SECONDS", 0.01)
    st = SimpleNamespace(index=1, peer_id="me", label="server-s1-3", fresh=None, entry=None,
                         runtime=SimpleNamespace(epoch=0))
    directory = Churned()

    async def enter() -> bool:
        """Whether it served: stopped after four looks, unless it entered the stage before."""
        stop = asyncio.Event()
        entering = asyncio.create_task(restoring.take_stage_state(st, Unreachable(), directory, "h", 2, False, stop))
        while directory.looks < 4 and not entering.done():
            await asyncio.sleep(0.005)
        stop.set()
        return await entering

    with caplog.at_level(logging.ERROR, logger="swarm.server"):
        assert asyncio.run(enter()) is False  # it waited, and was stopped waiting
    assert st.entry is None and st.fresh is None
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["stage 1 server server-s1-3 is not serving"]
