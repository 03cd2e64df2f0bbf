"""The end of a run: once its target is reached, a trainer gives up the microbatches still on their way
forward (accumulated nowhere, their samples not consumed) instead of waiting behind a slow server's queue,
and lets every microbatch already accumulating finish."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from swarm.config import load_config
from swarm.trainer.calls import Served
from swarm.trainer.trainer import Trainer


def slow(index: int) -> bool:
    """Microbatches whose stage-0 forward waits at a server with a long queue: all but 0, 1 and 4."""
    return index not in (0, 1, 4)


class _Caller:
    """Stage 0 answers at once, but for the forwards of `slow` microbatches, which wait until cancelled."""

    def __init__(self, on_backward):
        self.on_backward = on_backward
        self.cancelled: list[str] = []
        self.owed: dict[str, int] = {}

    async def call(self, stage, method, req, tensors, prefer=None, accumulating=False):
        index = int(req.partition("@")[0])
        if stage == 0 and method == "forward" and slow(index):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(req)
                raise
        await asyncio.sleep(0)
        if method == "backward":
            self.on_backward(index)
        return Served("s0" if stage == 0 else "s1", {"loss": 1.0, "epoch": 0}, [torch.zeros(1)], "s0", 0)

    def owe(self, peer):
        self.owed[peer] = self.owed.get(peer, 0) + 1

    def repay(self, peer):
        self.owed[peer] -= 1


class _Feed:
    def __init__(self):
        self.handed = 0
        self.consumed: list[int] = []

    async def next(self):
        self.handed += 1
        return torch.zeros(2, 5, dtype=torch.long), SimpleNamespace(label=f"piece{self.handed - 1}",
                                                                    index=self.handed - 1)

    async def consume(self, piece):
        self.consumed.append(piece.index)


def test_a_finished_run_gives_up_forwards_in_flight_and_finishes_the_rest():
    cfg = load_config(overrides=["model.num_stages=2", "trainer.max_inflight=4"])
    trainer = Trainer(cfg)
    done = asyncio.Event()

    def on_backward(index: int) -> None:
        if index == 4:  # started once 0 or 1 came back: then 2, 3 and 5 wait at stage 0
            done.set()

    trainer.caller = caller = _Caller(on_backward)
    trainer.feed = feed = _Feed()
    trainer.keeper = SimpleNamespace(keep=lambda *args: None)
    trainer.table = SimpleNamespace(pad_id=0)
    trainer.stop, trainer.draining = asyncio.Event(), False
    trainer._finished = done.is_set

    async def run() -> None:
        async with asyncio.timeout(10):  # a trainer that waited on the slow forwards would never return
            await trainer._feed()

    asyncio.run(run())
    assert sorted(caller.cancelled) == ["2@piece2", "3@piece3", "5@piece5"]
    assert trainer.given_up == 3
    assert sorted(feed.consumed) == [0, 1, 4]
    assert sorted(c.req for c in trainer.progress.completed) == ["0@piece0", "1@piece1", "4@piece4"]
    assert not trainer._forwarding and all(n == 0 for n in caller.owed.values())
    assert trainer.stopped_starting is not None


def test_microbatches_given_up_before_they_ever_ran_end_the_run_quietly():
    """The target is reached while the last microbatches are being handed out, before their tasks first
    ran (as on a fast GPU): they are given up like the others, and the run ends without an error."""
    cfg = load_config(overrides=["model.num_stages=2", "trainer.max_inflight=4"])
    trainer = Trainer(cfg)
    trainer.caller = caller = _Caller(lambda index: None)
    trainer.feed = feed = _Feed()
    trainer.keeper = SimpleNamespace(keep=lambda *args: None)
    trainer.table = SimpleNamespace(pad_id=0)
    trainer.stop, trainer.draining = asyncio.Event(), False
    trainer._finished = lambda: feed.handed >= 3  # reached as the third is created, none having run

    async def run() -> None:
        async with asyncio.timeout(10):
            await trainer._feed()

    asyncio.run(run())
    assert trainer.given_up == 3 and feed.consumed == [] and caller.cancelled == []
    assert not trainer.progress.completed and not trainer._forwarding
