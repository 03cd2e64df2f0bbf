"""The stage's records as a server reads them: when a replica counts as gone from its stage."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.utils import ValueWithExpiration

from swarm.net import directory as directory_module
from swarm.net.directory import Directory
from swarm.net.identity import peer_id_of
from swarm.wire.records import ServerRecord


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
