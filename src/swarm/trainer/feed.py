"""The trainer's side of shared data progress (swarm.core.dataplan): lease blocks of a pass through the
DHT, hand out their microbatches, record what is consumed before it reaches an accumulating stage, and
give the blocks back when the trainer stops."""

from __future__ import annotations

import asyncio
import itertools
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
    merged_all,
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
    """One microbatch's samples: positions [start, end) of block `block` of pass `pass_`, handed out
    under one holding of the block (a block lost and taken again is a new holding)."""

    pass_: int
    block: int
    start: int
    end: int
    holding: int

    @property
    def label(self) -> str:
        return f"p{self.pass_}b{self.block}:{self.start}-{self.end}"


@dataclass
class Held:
    claim: Claim
    holding: int
    confirmed_until: float  # the lease as last stored successfully: past it, the block may be another's
    todo: list[Range] = field(default_factory=list)  # microbatch ranges not handed out yet
    lost: bool = False  # taken over by another trainer


class DataFeed:
    def __init__(self, table: SampleTable, directory: Directory, me: str, data: DataConfig, microbatch: int,
                 rng: random.Random):
        self.table, self.directory, self.me, self.data, self.microbatch, self.rng = (
            table, directory, me, data, microbatch, rng)
        self.corpus = f"{table.name}b{data.block_samples}"
        self.num_blocks = block_count(len(table), data.block_samples)
        self.low_pass = 0  # passes below it are finished
        self.held: dict[tuple[int, int], Held] = {}
        # the newest record seen of each block: consumed ranges only grow, so what a read misses (a DHT
        # node that did not answer) is not taken for progress lost
        self.seen: dict[tuple[int, int], Claim] = {}
        self.holdings = itertools.count()
        self.version = self.published = 0  # changes made to held claims, and those published
        self.publishing = asyncio.Lock()
        self.taken: list[dict] = []  # each block this trainer took, for its summary
        self.dropped = 0  # microbatches not sent: their block was taken over

    # ---- handing out microbatches ------------------------------------------------------------

    async def next(self) -> tuple[torch.Tensor, Piece]:
        while True:
            for (pass_, block), held in self.held.items():
                if held.todo:
                    start, end = held.todo.pop(0)
                    base = block * self.data.block_samples
                    piece = Piece(pass_, block, start, end, held.holding)
                    return self.table.samples(pass_, base + start, base + end), piece
            await self._take_block()

    async def consume(self, piece: Piece) -> None:
        """Record the piece consumed (and published) before any stage accumulates it; `BlockLost` if
        the block is no longer this trainer's, or its lease could not be confirmed in time."""
        key = (piece.pass_, piece.block)
        held = self.held.get(key)
        if held is not None and held.holding == piece.holding:
            held.claim = replace(held.claim, done=merged(held.claim.done, (piece.start, piece.end)))
            await self._publish_through(self._changed())
            if self.held.get(key) is held and self.directory.now() > held.confirmed_until:
                self._lose(*key, "its lease could not be renewed in time")
        if held is None or held.holding != piece.holding or held.lost:
            self.dropped += 1
            raise BlockLost(f"block {piece.block} of pass {piece.pass_} is no longer held by this trainer")

    def _lose(self, pass_: int, block: int, why: str) -> None:
        held = self.held.pop((pass_, block))
        held.lost = True
        log.warning("block %d of pass %d lost (%s): %d microbatch(es) of it not sent", block, pass_, why,
                    len(held.todo))

    # ---- leases ------------------------------------------------------------------------------

    async def loop(self) -> None:
        """Renew the leases of the blocks held (a few times per lease)."""
        while True:
            await asyncio.sleep(self.data.lease_seconds / 4)
            try:
                await self._publish_through(self._changed())
            except Exception as e:  # the DHT did not answer this time: the next renewal tries again
                log.warning("could not renew the leases of its data blocks: %s: %s", type(e).__name__, e)

    async def release(self) -> None:
        """Give the blocks held back at once, their progress kept: the next trainer goes on from there."""
        async with self.publishing:
            for (pass_, block), held in list(self.held.items()):
                await self._write(pass_, block, held, lease_until=0.0)
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
                stored = await self._write(pass_, block, held, self.directory.now() + self.data.lease_seconds)
                if stored is not None and stored.finished:  # nothing of it is left to record
                    del self.held[(pass_, block)]
            self.published = upto

    async def _write(self, pass_: int, block: int, held: Held, lease_until: float) -> Claim | None:
        """Store the held claim with a new lease, unless the block was taken over (then it is lost). While
        the lease last stored holds, no one may take the block over, and the record need not be read."""
        found = None
        if self.directory.now() >= held.confirmed_until:
            found = (await self._read(pass_, block // BLOCKS_PER_KEY * BLOCKS_PER_KEY)).get(block)
        if found is not None and found.owner != self.me:
            self._lose(pass_, block, f"taken over by {short(found.owner)}: this trainer's lease lapsed")
            return None
        held.claim = stored = replace(held.claim, lease_until=lease_until)
        if await self._store(pass_, block, stored):
            held.confirmed_until = lease_until
        return stored

    async def _store(self, pass_: int, block: int, claim: Claim) -> bool:
        known = self.seen.get((pass_, block))
        if known is not None:
            claim = replace(claim, done=merged_all(known.done, claim.done))
        self.seen[(pass_, block)] = claim
        return await self.directory.record_block(self._key(pass_, block), block, claim, RECORD_LIFETIME)

    async def _read(self, pass_: int, first: int) -> dict[int, Claim]:
        """The group of blocks starting at `first`: their records as read, checked against what this
        trainer knows of each block, merged with what it has seen of them."""
        sane_lease = self.directory.now() + 4 * self.data.lease_seconds  # a farther one would lock the block
        claims = {}
        for block, claim in (await self.directory.blocks(self._key(pass_, first))).items():
            if (block < self.num_blocks and claim.size == block_size(block, len(self.table), self.data.block_samples)
                    and claim.lease_until <= sane_lease):
                claims[block] = claim
        for (p, block), known in self.seen.items():
            if p == pass_ and first <= block < first + BLOCKS_PER_KEY:
                read = claims.get(block, known)
                claims[block] = self.seen[(p, block)] = replace(read, done=merged_all(known.done, read.done))
        return claims

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
        for first in range(0, self.num_blocks, BLOCKS_PER_KEY):
            group = range(first, min(first + BLOCKS_PER_KEY, self.num_blocks))
            blocks = [b for b in group if (pass_, b) not in self.held]
            claims = await self._read(pass_, first)
            block = pick_block(claims, blocks, self.me, self.directory.now(), self.rng, SPREAD)
            if block is not None:
                return (block, claims.get(block)), False
            finished = finished and len(blocks) == len(group) and all(b in claims and claims[b].finished for b in group)
        return None, finished

    async def _claim(self, pass_: int, block: int, before: Claim | None) -> bool:
        size = block_size(block, len(self.table), self.data.block_samples)
        done = before.done if before is not None else ()
        lease_until = self.directory.now() + self.data.lease_seconds
        if not await self._store(pass_, block, Claim(self.me, lease_until, done, size)):
            return False
        await asyncio.sleep(CLAIM_SETTLE)
        found = (await self._read(pass_, block // BLOCKS_PER_KEY * BLOCKS_PER_KEY)).get(block)
        if found is None or found.owner != self.me:
            return False  # a rival's claim landed last: it holds the block
        claim = Claim(self.me, lease_until, found.done, size)
        self.held[(pass_, block)] = Held(claim, next(self.holdings), lease_until,
                                         cut(missing(claim.done, size), self.microbatch))
        consumed = size - sum(e - s for s, e in missing(claim.done, size))
        self.taken.append({"pass": pass_, "block": block, "from": before.owner if before else None,
                           "consumed_before": consumed})
        if before is not None and before.owner != self.me:
            log.info("took over block %d of pass %d from %s: %d of %d samples were consumed", block, pass_,
                     short(before.owner), consumed, size)
        else:
            log.info("took block %d of pass %d (%d samples)", block, pass_, size)
        return True
