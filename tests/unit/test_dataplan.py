"""Shared data progress: block ranges, which block a trainer takes, the records, and trainers that
come and go over one pass (against an in-memory stand-in for the DHT's newest-write-wins storage)."""

from __future__ import annotations

import asyncio
import random

import pytest
from tests.unit.test_data import byte_table

from swarm.config import DataConfig
from swarm.core.dataplan import LEASE_MARGIN, Claim, cut, merged, missing, pick_block
from swarm.trainer import feed as feed_module
from swarm.trainer.feed import BlockLost, DataFeed, Piece
from swarm.wire.records import RecordError, block_from_value, block_value


def test_ranges_merge_and_the_gaps_are_what_is_left() -> None:
    done = merged(merged(merged((), (8, 12)), (0, 4)), (4, 6))
    assert done == ((0, 6), (8, 12))
    assert missing(done, 16) == [(6, 8), (12, 16)]
    assert cut(missing(done, 16), 3) == [(6, 8), (12, 15), (15, 16)]
    assert missing(merged(done, (6, 16)), 16) == [] and Claim("a", 0, merged(done, (6, 16)), 16).finished


def test_a_trainer_takes_its_own_block_then_one_left_unfinished_then_a_low_free_one() -> None:
    rng = random.Random(0)
    claims = {0: Claim("a", 100.0, ((0, 8),), 8),  # finished
              1: Claim("b", 100.0, (), 8),  # held by b
              2: Claim("c", 50.0, ((0, 2),), 8)}  # c's lease lapsed at 50
    assert pick_block(claims, range(6), "b", 60.0, rng, spread=1) == 1  # its own
    # a block left unfinished (c's lease lapsed) before any untouched one, whatever the spread
    assert {pick_block(claims, range(6), "a", 60.0, rng, spread=3) for _ in range(20)} == {2}
    assert pick_block(claims, range(6), "a", 40.0, rng, spread=1) == 3  # c still holds 2
    assert {pick_block(claims, range(6), "a", 40.0, rng, spread=2) for _ in range(50)} == {3, 4}
    assert pick_block(claims, range(3), "a", 40.0, rng, spread=4) is None


def test_block_records_round_trip_and_malformed_ones_are_refused() -> None:
    claim = Claim("peerA", 12.5, ((0, 4), (8, 12)), 16)
    assert block_from_value("7", block_value(claim)) == (7, claim)
    for subkey, value in [("x", block_value(claim)), ("1", {**block_value(claim), "size": 0}),
                          ("1", {**block_value(claim), "done": [[4, 2]]}),
                          ("1", {**block_value(claim), "done": [[0, 17]]}),
                          ("1", {**block_value(claim), "owner": 3}), ("1", [])]:
        with pytest.raises(RecordError):
            block_from_value(subkey, value)


class MemoryDirectory:
    """The DHT as block records see it: per key and subkey, the write that expires last wins."""

    run_id = "test"

    def __init__(self) -> None:
        self.clock = 1000.0
        self.stored: dict[str, dict[int, tuple[float, dict]]] = {}

    def now(self) -> float:
        return self.clock

    async def blocks(self, key: str) -> dict[int, Claim]:
        return dict(block_from_value(str(b), value) for b, (_, value) in self.stored.get(key, {}).items())

    async def record_block(self, key: str, block: int, claim: Claim, lifetime: float) -> bool:
        expires = self.clock + lifetime
        entries = self.stored.setdefault(key, {})
        if block not in entries or entries[block][0] <= expires:
            entries[block] = (expires, block_value(claim))
        return True


@pytest.fixture
def shared(monkeypatch):
    monkeypatch.setattr(feed_module, "CLAIM_SETTLE", 0.0)
    table = byte_table([random.Random(0).randbytes(1600)], seq_len=16, seed=1, validation=10)  # 90 + 10 held out
    data = DataConfig(block_samples=max(8, len(table) // 5), lease_seconds=10.0)
    return table, data, MemoryDirectory()


def test_trainers_coming_and_going_cover_a_pass_once(shared) -> None:
    table, data, directory = shared

    def trainer(name: str) -> DataFeed:
        return DataFeed(table, directory, name, data, microbatch=3, rng=random.Random(name))

    async def scenario() -> tuple[list, DataFeed, DataFeed]:
        consumed = []
        a, b = trainer("a"), trainer("b")
        first_a, first_b = await a.next(), await b.next()
        assert first_a[1].block != first_b[1].block  # rivals hold different blocks
        for _ in range(2):
            _, piece = await a.next()
            await a.consume(piece)
            consumed.append(piece)
        await a.consume(first_a[1])
        consumed.append(first_a[1])
        in_flight = (await a.next())[1]  # a dies with this one sent but not consumed
        await b.consume(first_b[1])
        consumed.append(first_b[1])

        directory.clock += data.lease_seconds + LEASE_MARGIN + 1  # a's lease lapses; b's too, but b renews it
        await b._publish_through(b._changed())
        c = trainer("c")
        while c.low_pass == 0:
            _, piece = await c.next()
            if piece.pass_ > 0:
                break
            await c.consume(piece)
            consumed.append(piece)
        assert any(t["from"] == "a" and t["consumed_before"] == 3 * 3 for t in c.taken)  # it went on from a's record
        with pytest.raises(BlockLost):  # a, back after its lease lapsed, must not send what it held
            await a.consume(in_flight)
        return consumed, b, c

    consumed, b, c = asyncio.run(scenario())
    # b still holds its block: everything else of pass 0 was consumed exactly once
    held = {block for (_, block) in b.held}
    positions = [(p.block, i) for p in consumed if p.pass_ == 0 and p.block not in held for i in range(p.start, p.end)]
    assert len(positions) == len(set(positions))
    expected = sum(min(data.block_samples, len(table) - k * data.block_samples)
                   for k in range(-(-len(table) // data.block_samples)) if k not in held)
    assert len(positions) == expected
    trained = {tuple(table.samples(0, block * data.block_samples + i, block * data.block_samples + i + 1)[0].tolist())
               for block, i in positions}
    assert len(trained) == len(positions) and not trained & set(map(tuple, table.validation().tolist()))


async def one_consumed(table, directory, data) -> tuple[DataFeed, Piece]:
    """Trainer "a", having consumed the first microbatch it was handed."""
    feed = DataFeed(table, directory, "a", data, microbatch=4, rng=random.Random(0))
    _, piece = await feed.next()
    await feed.consume(piece)
    return feed, piece


def test_a_released_block_goes_on_at_once_where_it_stopped(shared) -> None:
    table, data, directory = shared

    async def scenario() -> None:
        a, piece = await one_consumed(table, directory, data)
        await a.release()
        b = DataFeed(table, directory, "b", data, microbatch=4, rng=random.Random(0))
        while not b.taken or b.taken[-1]["block"] != piece.block:  # long before a's lease would lapse
            await b.next()
        assert b.taken[-1] == {"pass": 0, "block": piece.block, "from": "a", "consumed_before": 4}

    asyncio.run(scenario())


class SlowDirectory(MemoryDirectory):
    """Reads and writes that take a while, so that microbatches complete while a record is being written."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    async def blocks(self, key: str) -> dict[int, Claim]:
        await asyncio.sleep(self.rng.random() * 0.005)
        return await super().blocks(key)

    async def record_block(self, key: str, block: int, claim: Claim, lifetime: float) -> bool:
        await asyncio.sleep(self.rng.random() * 0.005)
        return await super().record_block(key, block, claim, lifetime)


def test_microbatches_completing_while_records_are_written_are_each_handed_out_once(shared) -> None:
    table, _, _ = shared
    rng = random.Random(5)
    feed = DataFeed(table, SlowDirectory(rng), "a", DataConfig(block_samples=12, lease_seconds=1.0), 3, rng)
    handed: list[str] = []

    async def scenario() -> None:
        renewing = asyncio.create_task(feed.loop())
        slots = asyncio.Semaphore(3)

        async def microbatch(piece) -> None:
            await asyncio.sleep(rng.random() * 0.02)
            await feed.consume(piece)
            slots.release()

        running = []
        for _ in range(len(table) // 3):
            await slots.acquire()
            _, piece = await feed.next()
            handed.append(piece.label)
            running.append(asyncio.create_task(microbatch(piece)))
        await asyncio.gather(*running)
        renewing.cancel()

    asyncio.run(scenario())
    assert len(handed) == len(set(handed)) == len(table) // 3


def test_progress_survives_a_read_that_misses_the_record_and_bogus_records_are_ignored(shared) -> None:
    table, data, directory = shared

    async def scenario() -> None:
        a, piece = await one_consumed(table, directory, data)
        directory.stored.clear()  # the DHT node holding the record did not answer, or lost it
        _, other = await a.next()
        await a.consume(other)
        (record,) = [c for c in (await directory.blocks(a._key(0, piece.block))).values()]
        assert record.done == merged(merged((), (piece.start, piece.end)), (other.start, other.end))

        # a peer's record claiming a whole block with a size no block has, or a lease far off, is not believed
        key, wrong = a._key(0, 0), Claim("mallory", directory.now() + 1e6, ((0, 1),), 1)
        await directory.record_block(key, piece.block + 1, wrong, 1e9)
        assert piece.block + 1 not in await a._read(0, 0)

    asyncio.run(scenario())
