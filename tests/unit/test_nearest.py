"""Stores that go straight to the nodes last found nearest their key, on real DHT nodes and daemons."""

from __future__ import annotations

import asyncio

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator
from hivemind.utils import get_dht_time

from swarm.net.identity import DecodableValues, PeerSignatures, peer_id_of
from swarm.net.nearest import NearestStores

KEY = "run.stage.0"


async def _nodes(keys: list[Ed25519PrivateKey]) -> list[DHTNode]:
    """A DHT node per key, each with its own daemon and a peer's validators, the first the others' bootstrap."""
    nodes: list[DHTNode] = []
    for key in keys:
        maddrs = [str(a) for a in await nodes[0].get_visible_maddrs()] if nodes else []
        nodes.append(await DHTNode.create(
            initial_peers=maddrs, record_validator=CompositeValidator([PeerSignatures(key), DecodableValues()]),
            cache_nearest=0, cache_refresh_before_expiry=0, wait_timeout=10.0))  # (RPCs slow under a loaded CI)
    return nodes


class _Searches:
    """Counts the `find` RPCs a node sends: each is a step of a search for a key's nearest nodes."""

    def __init__(self, node: DHTNode) -> None:
        self.count, self._find = 0, node.protocol.call_find
        node.protocol.call_find = self._counted

    async def _counted(self, *args, **kwargs):
        self.count += 1
        return await self._find(*args, **kwargs)


def _held_at(nodes: list[DHTNode], subkey: str) -> list[DHTNode]:
    """The nodes whose own storage holds `subkey` of KEY."""
    key_id = DHTID.generate(source=KEY)
    return [node for node in nodes
            if (found := node.protocol.storage.get(key_id)) is not None and subkey in found.value.data]


def test_stores_go_straight_to_the_nodes_found_before_and_search_again_when_one_is_gone() -> None:
    """The first store searches; the next ones within the TTL send no `find` at all and land at the same
    nodes, readable by every other node; a store with an older expiry than the one held is refused, and says
    so; past the TTL the nodes are searched for again. Once one of them is gone, a store takes hivemind's
    full path, which searches again, and still lands."""
    clock = [0.0]
    keys = [Ed25519PrivateKey.generate() for _ in range(6)]

    async def main() -> None:
        nodes = await _nodes(keys)
        writer, readers = nodes[1], [n for n in nodes if n is not nodes[1]]
        try:
            stores = NearestStores(writer, ttl=30.0, clock=lambda: clock[0])
            finds = _Searches(writer)
            subkey = "plain"  # (not a peer id: stored unsigned; a peer's own record is signed, below)
            assert await stores.store(KEY, b"first", get_dht_time() + 30, subkey)
            assert stores.searches == 1 and finds.count > 0
            first_holders = _held_at(nodes, subkey)
            assert len(first_holders) == min(writer.num_replicas, len(nodes))

            searched = finds.count
            assert await stores.store(KEY, b"second", get_dht_time() + 30, subkey)
            assert finds.count == searched and stores.searches == 1
            assert _held_at(nodes, subkey) == first_holders
            for reader in readers:
                found = await reader.get(KEY, latest=True)
                assert found.value[subkey].value == b"second"

            # a peer's own record goes signed: every node holding it checked the signature
            own = peer_id_of(keys[1].public_key())
            assert await stores.store(KEY, b"signed", get_dht_time() + 5, own)
            assert (await readers[0].get(KEY, latest=True)).value[own].value == b"signed"

            # an older value than the one held is refused, by every node that holds the newer one
            assert not await stores.store(KEY, b"stale", get_dht_time() + 10, subkey)

            clock[0] += 31.0  # past the TTL: the nodes are searched for again
            assert await stores.store(KEY, b"third", get_dht_time() + 60, subkey)
            assert stores.searches == 2
            assert await stores.store(KEY, b"fourth", get_dht_time() + 61, subkey)
            assert stores.searches == 2

            gone = next(n for n in _held_at(nodes, subkey) if n is not writer)
            await gone.shutdown()
            live = [n for n in nodes if n is not gone]
            # the store to a node that does not answer takes hivemind's full path (whose result is that of
            # whichever replica answered last) and forgets the nodes found: the record still lands
            await stores.store(KEY, b"fifth", get_dht_time() + 62, subkey)
            assert stores.searches == 3
            assert (await live[0].get(KEY, latest=True)).value[subkey].value == b"fifth"
        finally:
            await asyncio.gather(*(n.shutdown() for n in nodes), return_exceptions=True)

    asyncio.run(main())
