"""The trainer's side of shared data progress (swarm.core.dataplan): lease blocks of a pass through the
DHT, hand out their microbatches, record what is consumed before it reaches an accumulating stage, and
give the blocks back when the trainer stops."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field, replace

import torch

from swarm.config import DataConfig
from swarm.core.dataplan import (
    BLOCKS_PER_KEY,
    Claim,
    Range,
    block_count,
    block_size,
    cut,
    merged,
    missing,
    pick_block,
)
from swarm.data import SampleTable
from swarm.net.directory import Directory, short
from swarm.wire.records import data_key

log = logging.getLogger(__name__)
RECORD_LIFETIME = 30 * 24 * 3600.0  # seconds block records stay in the DHT: they are the run's data progress
CLAIM_SETTLE = 0.5  # seconds between publishing a claim and reading it back (a rival's write lands first)
SPREAD = 4  # a trainer picks among this many of the lowest free blocks, so that rivals rarely collide


class BlockLost(Exception):
    """Another trainer holds the block now (this one's lease lapsed): its microbatch must not be sent."""


@dataclass(frozen=True)
class Piece:
    """One microbatch's samples: positions [start, end) of block `block` of pass `pass_`."""

    pass_: int
    block: int
    start: int
    end: int

    @property
    def label(self) -> str:
        return f"p{self.pass_}b{self.block}:{self.start}-{self.end}"


@dataclass
class Held:
    claim: Claim
    todo: list[Range] = field(default_factory=list)  # microbatch ranges not handed out yet
    lost: bool = False


class DataFeed:
    def __init__(self, table: SampleTable, directory: Directory, me: str, data: DataConfig, microbatch: int,
                 rng: random.Random):
        self.table, self.directory, self.me, self.data, self.microbatch, self.rng = (
            table, directory, me, data, microbatch, rng)
        self.corpus = f"{table.name}b{data.block_samples}"
        self.num_blocks = block_count(len(table), data.block_samples)
        self.low_pass = 0  # passes below it are finished
        self.held: dict[tuple[int, int], Held] = {}
        self.version = self.published = 0  # changes made to held claims, and those published
        self.publishing = asyncio.Lock()
        self.taken: list[dict] = []  # each block this trainer took, for its summary
        self.dropped = 0  # microbatches not sent: their block was taken over

    # ---- handing out microbatches ------------------------------------------------------------

    async def next(self) -> tuple[torch.Tensor, Piece]:
        while True:
            for (pass_, block), held in self.held.items():
                if held.todo and not held.lost:
                    start, end = held.todo.pop(0)
                    base = block * self.data.block_samples
                    return self.table.samples(pass_, base + start, base + end), Piece(pass_, block, start, end)
            await self._take_block()

    async def consume(self, piece: Piece) -> None:
        """Record the piece consumed (and published) before any stage accumulates it; `BlockLost` if
        the block is no longer this trainer's."""
        held = self.held.get((piece.pass_, piece.block))
        if held is None or held.lost:
            self.dropped += 1
            raise BlockLost(f"block {piece.block} of pass {piece.pass_} is held by another trainer")
        held.claim = replace(held.claim, done=merged(held.claim.done, (piece.start, piece.end)))
        await self._publish_through(self._changed())
        if held.lost:
            self.dropped += 1
            raise BlockLost(f"block {piece.block} of pass {piece.pass_} was taken over")

    # ---- leases ------------------------------------------------------------------------------

    async def loop(self) -> None:
        """Renew the leases of the blocks held (a few times per lease)."""
        while True:
            await asyncio.sleep(self.data.lease_seconds / 4)
            await self._publish_through(self._changed())

    async def release(self) -> None:
        """Give the blocks held back at once, their progress kept: the next trainer goes on from there."""
        async with self.publishing:
            for (pass_, block), held in list(self.held.items()):
                if not held.lost:
                    await self._store(pass_, block, replace(held.claim, lease_until=0.0))
            self.held.clear()

    def _changed(self) -> int:
        self.version += 1
        return self.version

    async def _publish_through(self, version: int) -> None:
        """Publish every held claim as of `version` or later; one write serves every waiter before it."""
        async with self.publishing:
            if self.published >= version:
                return
            upto = self.version
            for (pass_, block), held in list(self.held.items()):
                if not held.lost:
                    await self._renew(pass_, block, held)
            self.published = upto

    async def _renew(self, pass_: int, block: int, held: Held) -> None:
        found = (await self.directory.blocks(self._key(pass_, block))).get(block)
        if found is not None and found.owner != self.me:
            held.lost = True
            log.warning("block %d of pass %d was taken over by %s (this trainer's lease lapsed): %d microbatch(es) "
                        "of it not sent", block, pass_, short(found.owner), len(held.todo))
            return
        held.claim = stored = replace(held.claim, lease_until=self.directory.now() + self.data.lease_seconds)
        await self._store(pass_, block, stored)
        if stored.finished:  # published as finished: nothing of it is left to record
            del self.held[(pass_, block)]

    async def _store(self, pass_: int, block: int, claim: Claim) -> None:
        await self.directory.record_block(self._key(pass_, block), block, claim, RECORD_LIFETIME)

    def _key(self, pass_: int, block: int) -> str:
        return data_key(self.directory.run_id, self.corpus, pass_, block // BLOCKS_PER_KEY)

    # ---- taking a block ----------------------------------------------------------------------

    async def _take_block(self) -> None:
        """Hold one more block: the lowest free ones of the lowest pass that has any."""
        pass_ = self.low_pass
        while True:
            picked, finished = await self._pick(pass_)
            if finished and pass_ == self.low_pass:
                self.low_pass += 1
                log.info("pass %d over the data is done", pass_)
            if picked is None:
                pass_ += 1
                continue
            block, before = picked
            if await self._claim(pass_, block, before):
                return

    async def _pick(self, pass_: int) -> tuple[tuple[int, Claim | None] | None, bool]:
        """A free block of the pass and its record (None if none is free), and whether the pass is done."""
        finished = True
        for group in range(0, self.num_blocks, BLOCKS_PER_KEY):
            blocks = range(group, min(group + BLOCKS_PER_KEY, self.num_blocks))
            claims = await self.directory.blocks(self._key(pass_, group))
            mine = {b for b in self.held if b[0] == pass_}
            claims = {b: c for b, c in claims.items() if b in blocks and (pass_, b) not in mine}
            free = [b for b in blocks if (pass_, b) not in mine]
            block = pick_block(claims, free, self.me, self.directory.now(), self.rng, SPREAD)
            if block is not None:
                return (block, claims.get(block)), False
            finished = finished and all(b in claims and claims[b].finished for b in blocks)
        return None, finished

    async def _claim(self, pass_: int, block: int, before: Claim | None) -> bool:
        size = block_size(block, len(self.table), self.data.block_samples)
        done = before.done if before is not None else ()
        claim = Claim(self.me, self.directory.now() + self.data.lease_seconds, done, size)
        await self._store(pass_, block, claim)
        await asyncio.sleep(CLAIM_SETTLE)
        found = (await self.directory.blocks(self._key(pass_, block))).get(block)
        if found is None or found.owner != self.me:
            return False  # a rival's claim landed last: it holds the block
        claim = replace(claim, done=found.done)
        self.held[(pass_, block)] = Held(claim, cut(missing(claim.done, size), self.microbatch))
        consumed = size - sum(e - s for s, e in missing(claim.done, size))
        self.taken.append({"pass": pass_, "block": block, "from": before.owner if before else None,
                           "consumed_before": consumed})
        if before is not None and before.owner != self.me:
            log.info("took over block %d of pass %d from %s: %d of %d samples were consumed", block, pass_,
                     short(before.owner), consumed, size)
        else:
            log.info("took block %d of pass %d (%d samples)", block, pass_, size)
        return True
