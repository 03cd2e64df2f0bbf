"""The stage's records as a server reads them: when a replica counts as gone from its stage."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import ValueWithExpiration

from swarm.core import plan_for_swarm
from swarm.net import directory as directory_module
from swarm.net.directory import Directory
from swarm.net.identity import peer_id_of
from swarm.server.moving import seats
from swarm.wire.records import ServerRecord, TrainerRecord, stage_key, trainers_key


class _DHT:
    """One key's subkeys, as the DHT keeps them: each value until its writer's expiry; counts its reads."""

    def __init__(self, clock: list[float]):
        self.clock, self.values, self.reads = clock, {}, 0

    async def store(self, key, value, expiration_time, subkey, return_future=True) -> bool:
        self.values[subkey] = ValueWithExpiration(value, expiration_time)
        return True

    async def get(self, key, latest=True, return_future=True):
        self.reads += 1
        return SimpleNamespace(value={k: v for k, v in self.values.items() if v.expiration_time > self.clock[0]})


def test_a_replica_is_gone_once_a_read_begun_after_its_records_expiry_misses_it(monkeypatch) -> None:
    """The frozen replica stops renewing; the other renews every second. Until the newest record read of
    each has expired nothing is read at all; after, one read tells them apart. A peer never seen in a read
    is never taken for gone on this evidence."""
    clock = [100.0]
    monkeypatch.setattr(directory_module, "get_dht_time", lambda: clock[0])
    dht = _DHT(clock)
    directory = Directory(dht, "run", record_ttl=6.0)
    frozen, renewing, stranger = (peer_id_of(Ed25519PrivateKey.generate().public_key()) for _ in range(3))
    records = {p: ServerRecord(p, 0, 1.0, 3, 0, 0, "hash", {}) for p in (frozen, renewing)}

    async def main() -> None:
        for record in records.values():
            await directory.announce_server(record)  # both expire at 106
        assert {r.peer_id for r in await directory.stage(0)} == {frozen, renewing}
        reads = dht.reads
        for clock[0] in (101.0, 102.0, 103.0, 104.0, 105.0):
            await directory.announce_server(records[renewing])
            assert await directory.lapsed(0, frozenset({frozen, renewing, stranger})) == frozenset()
        assert dht.reads == reads  # every record known live: nothing to read
        clock[0] = 106.5
        assert await directory.lapsed(0, frozenset({frozen, renewing, stranger})) == {frozen}
        assert dht.reads == reads + 1
        await directory.announce_server(records[frozen])  # thawed: renewing again
        assert await directory.lapsed(0, frozenset({frozen})) == frozenset()

    asyncio.run(main())


class _SearchingDHT:
    """Stage keys as the DHT's process finds them: single reads and multi-key searches, each counted; a
    read can be held open (`gate`) or made to fail once (`fail`)."""

    def __init__(self, values: dict) -> None:
        self.values, self.gets, self.searches = values, 0, 0
        self.gate: asyncio.Event | None = None
        self.fail = False

    async def _found(self, key):
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            self.fail = False
            raise TimeoutError("no DHT node answered")
        return SimpleNamespace(value=self.values.get(key, {}))

    async def get(self, key, latest=True, return_future=True):
        self.gets += 1
        return await self._found(key)

    async def run_coroutine(self, coro, return_future=True):
        self.searches += 1
        node = SimpleNamespace(get_many=self._get_many)
        return await coro(self, node)

    async def _get_many(self, keys, sufficient_expiration_time):
        return {key: await self._found(key) for key in keys}


def _stage_values(clock: float) -> tuple[dict, list[str]]:
    peers = [peer_id_of(Ed25519PrivateKey.generate().public_key()) for _ in range(2)]
    values = {stage_key("run", k): {p: ValueWithExpiration(ServerRecord(p, k, 1.0, 0, 0, 0, "hash", {}).to_value(),
                                                           clock + 6.0)}
              for k, p in enumerate(peers)}
    return values, peers


def test_every_stage_is_read_in_one_search_and_a_recent_read_is_shared_with_its_begin_time(monkeypatch) -> None:
    """A trainer's view reads every stage in one search of the DHT; the step loop of the server it runs in,
    reading its own stage within `fresh` of that, takes the same read, with the DHT time the read began
    (what `lapsed_in` judges by), rather than asking every DHT node again. Without `fresh`, or once the
    read is older than `fresh`, the stage is read anew."""
    clock, now = [100.0], [50.0]
    monkeypatch.setattr(directory_module, "get_dht_time", lambda: clock[0])
    monkeypatch.setattr(directory_module.time, "monotonic", lambda: now[0])
    values, peers = _stage_values(clock[0])
    dht = _SearchingDHT(values)
    directory = Directory(dht, "run", record_ttl=6.0)

    async def main() -> None:
        layout = await directory.stages(2)
        assert {k: [r.peer_id for r in rs] for k, rs in layout.items()} == {0: [peers[0]], 1: [peers[1]]}
        assert (dht.searches, dht.gets) == (1, 0)
        clock[0], now[0] = 100.4, 50.4
        found, began = await directory.read_stages([1], fresh=0.5)
        assert [r.peer_id for r in found[1]] == [peers[1]] and began == 100.0
        assert (dht.searches, dht.gets) == (1, 0)
        found, began = await directory.read_stages([1])  # no `fresh`: a read of its own
        assert began == 100.4 and dht.gets == 1
        now[0] = 51.0
        _, began = await directory.read_stages([0], fresh=0.5)  # the shared read is 1 s old
        assert began == 100.4 and dht.gets == 2
        assert directory.ops == {"stages": 3}

    asyncio.run(main())


def test_readers_share_a_read_under_way_but_not_one_that_failed() -> None:
    """Two readers wanting a stage at once wait on one read; when that read fails, both see the failure
    and the next reader reads again rather than taking the failure for the stage's records."""
    values, peers = _stage_values(directory_module.get_dht_time())
    dht = _SearchingDHT(values)
    directory = Directory(dht, "run", record_ttl=6.0)

    async def main() -> None:
        dht.gate, dht.fail = asyncio.Event(), True
        first = asyncio.create_task(directory.read_stages([0], fresh=5.0))
        second = asyncio.create_task(directory.read_stages([0], fresh=5.0))
        await asyncio.sleep(0)
        dht.gate.set()
        results = await asyncio.gather(first, second, return_exceptions=True)
        assert [type(r) for r in results] == [TimeoutError, TimeoutError] and dht.gets == 1
        found, _ = await directory.read_stages([0], fresh=5.0)
        assert [r.peer_id for r in found[0]] == [peers[0]] and dht.gets == 2

    asyncio.run(main())


def test_a_search_that_must_go_out_reads_every_stage_asked_for() -> None:
    """Where every stage asked for was read within `fresh`, none is read; where one was not, one search
    reads them all (at about the cost of the stale one alone), and its reads serve the readers after."""
    values, peers = _stage_values(directory_module.get_dht_time())
    dht = _SearchingDHT(values)
    directory = Directory(dht, "run", record_ttl=6.0)

    async def main() -> None:
        await directory.read_stages([0])
        found, _ = await directory.read_stages([0, 1], fresh=5.0)
        assert {k: [r.peer_id for r in rs] for k, rs in found.items()} == {0: [peers[0]], 1: [peers[1]]}
        assert (dht.gets, dht.searches) == (1, 1)  # stage 0 again, with stage 1
        await directory.read_stages([0], fresh=5.0)
        await directory.read_stages([1], fresh=5.0)
        assert (dht.gets, dht.searches) == (1, 1)

    asyncio.run(main())


def test_a_recent_read_of_the_trainers_serves_a_reader_that_allows_it(monkeypatch) -> None:
    """A server's mover takes the trainers as its step loop last read them, up to `fresh` old, even while
    that read is under way; a reader that allows nothing older, or a read older than `fresh`, reads anew."""
    now = [50.0]
    monkeypatch.setattr(directory_module.time, "monotonic", lambda: now[0])
    trainer = peer_id_of(Ed25519PrivateKey.generate().public_key())
    record = TrainerRecord(trainer, 64, 0, 3.5, False, 10.0)
    dht = _SearchingDHT({trainers_key("run"): {trainer: ValueWithExpiration(record.to_value(),
                                                                            directory_module.get_dht_time() + 6)}})
    directory = Directory(dht, "run", record_ttl=6.0)

    async def main() -> None:
        dht.gate = asyncio.Event()
        first = asyncio.ensure_future(directory.trainers())
        await asyncio.sleep(0)
        shared = asyncio.ensure_future(directory.trainers(fresh=5.0))
        await asyncio.sleep(0)
        dht.gate.set()
        assert [t.peer_id for t in await first] == [t.peer_id for t in await shared] == [trainer]
        assert dht.gets == 1
        now[0] += 4.0
        await directory.trainers(fresh=5.0)
        assert dht.gets == 1
        await directory.trainers()
        assert dht.gets == 2
        now[0] += 5.5
        await directory.trainers(fresh=5.0)
        assert dht.gets == 3
        assert directory.ops["trainers"] == 3

    asyncio.run(main())


def test_a_look_at_the_layout_takes_a_read_of_the_stages_made_within_its_period(monkeypatch) -> None:
    """A server's mover and its backup keeper each look at every stage once a period: a look takes a read
    this peer made within `fresh` seconds (the other's, a trainer's view) rather than asking every DHT node
    again; the mover's second look, before it moves, reads anew (`fresh` 0), as does any look once the
    last read is older than `fresh`."""
    now = [50.0]
    monkeypatch.setattr(directory_module.time, "monotonic", lambda: now[0])
    values, peers = _stage_values(directory_module.get_dht_time())
    dht = _SearchingDHT(values)
    directory = Directory(dht, "run", record_ttl=6.0)

    async def main() -> None:
        layout = await directory.stages(2, fresh=5.0)  # (the backup keeper's look)
        assert [r.peer_id for rs in layout.values() for r in rs] == peers and dht.searches == 1
        now[0] += 3.0
        assert [s.peer for s in await seats(directory, 2, "hash", fresh=5.0)] == peers
        assert dht.searches == 1
        await seats(directory, 2, "hash", fresh=0.0)
        assert dht.searches == 2
        now[0] += 5.5
        await directory.stages(2, fresh=5.0)
        assert dht.searches == 3 and dht.gets == 0

    asyncio.run(main())


def test_a_server_between_two_stages_is_seen_moving_until_it_is_live_at_its_new_one(monkeypatch) -> None:
    """A server that left stage 0 for stage 1 has only its tombstone there until it holds stage 1's state
    and announces itself: the mover's look counts it as moving from stage 0 (so the policy waits, rather
    than send another server after it), other readers not at all; once it is live at stage 1, it is there."""
    clock = [100.0]
    monkeypatch.setattr(directory_module, "get_dht_time", lambda: clock[0])
    values, peers = _stage_values(clock[0])
    mover, *stayers = (peer_id_of(Ed25519PrivateKey.generate().public_key()) for _ in range(3))
    left = ServerRecord(mover, 0, 1.0, 0, 0, 0, "hash", {}, moving=True, gone=True)
    values[stage_key("run", 0)][mover] = ValueWithExpiration(left.to_value(), clock[0] + 6.0)
    for peer in stayers:  # stage 0 keeps three servers to stage 1's one
        values[stage_key("run", 0)][peer] = ValueWithExpiration(
            ServerRecord(peer, 0, 1.0, 0, 0, 0, "hash", {}).to_value(), clock[0] + 6.0)
    directory = Directory(_SearchingDHT(values), "run", record_ttl=6.0)

    def plan(found):
        return plan_for_swarm([replace(s, tenure=60.0, throughput=1.0) for s in found], 2, min_gain=1.1, cooldown=8.0)

    async def main() -> None:
        seen = await seats(directory, 2, "hash", in_transit=True)
        assert [(s.peer, s.stage, s.moving) for s in seen if s.peer == mover] == [(mover, 0, True)]
        assert len(seen) == 5 and plan(seen) is None
        others_view = await seats(directory, 2, "hash")
        assert mover not in {s.peer for s in others_view} and plan(others_view) is not None
        arrived = ServerRecord(mover, 1, 1.0, 0, 0, 0, "hash", {}, previous_stage=0)
        values[stage_key("run", 1)][mover] = ValueWithExpiration(arrived.to_value(), clock[0] + 6.0)
        seen = await seats(directory, 2, "hash", in_transit=True)
        assert [(s.peer, s.stage, s.moving) for s in seen if s.peer == mover] == [(mover, 1, False)]

    asyncio.run(main())
