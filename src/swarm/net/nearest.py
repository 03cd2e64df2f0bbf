"""Storing a record at the DHT nodes nearest its key without searching for them at every store.

hivemind's store looks the nearest nodes up anew each time: a search that asks every node within its beam
(up to 20) before the store itself asks the `num_replicas` nearest. Every peer renews the same few keys
(its record, its data leases) every few seconds, and the nodes nearest a key seldom change, so that search
was half of a store's cost to the swarm: in a DHT of five nodes on one machine, 11-12 ms of CPU over every
process per store, against 6 ms going straight to the nodes found before.

So the nodes found for a key are kept for NEAREST_TTL seconds and stores go straight to them. A store that
one of them does not answer (gone, partitioned) forgets them and takes hivemind's full path, which searches
again. A node that joined nearer the key is missed by stores for at most NEAREST_TTL: readers still find
the record, since a read asks every node within its beam, wider than the nodes a record is stored at.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTRecord
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID

NEAREST_TTL = 30.0  # seconds the nodes found nearest a key are stored at without a new search


class NearestStores:
    """Stores of one DHT node (run in its process, beside hivemind's own store)."""

    def __init__(self, node: DHTNode, ttl: float = NEAREST_TTL, clock: Callable[[], float] = time.monotonic):
        self.node, self.ttl, self.clock = node, ttl, clock
        self._nearest: dict[DHTID, tuple[float, dict[DHTID, PeerID]]] = {}  # key -> (when found, nodes)
        self.searches = 0  # searches for a key's nearest nodes, full stores included

    async def store(self, key, value, expiration_time: float, subkey=None) -> bool:
        """Whether every node the record went to took it (a node holding a newer value refuses it), as
        hivemind's `DHTNode.store` with the same arguments, signed and checked by the same validators."""
        key_id = DHTID.generate(source=key)
        nearest = await self._nodes(key_id)
        protocol = self.node.protocol
        record = DHTRecord(key_id.to_bytes(), protocol.serializer.dumps(subkey), protocol.serializer.dumps(value),
                           expiration_time)
        if protocol.record_validator is not None:
            record = DHTRecord(record.key, record.subkey, protocol.record_validator.sign_value(record),
                               expiration_time)
        remote = [peer for node_id, peer in nearest.items() if node_id != self.node.node_id]
        answers = await asyncio.gather(*(protocol.call_store(peer, keys=[key_id], values=[record.value],
                                                             expiration_time=[expiration_time], subkeys=[subkey])
                                         for peer in remote))
        if any(answer is None for answer in answers):  # a node did not answer: search again, store the full way
            self._nearest.pop(key_id, None)
            self.searches += 1
            return await self.node.store(key, value, expiration_time, subkey=subkey)
        took = [bool(answer[0]) for answer in answers]
        if self.node.node_id in nearest:
            valid = protocol.record_validator is None or protocol.record_validator.validate(record)
            took.append(valid and protocol.storage.store(key_id, record.value, expiration_time, subkey=subkey))
        return all(took)

    async def _nodes(self, key_id: DHTID) -> dict[DHTID, PeerID]:
        """The `num_replicas` nodes nearest `key_id`, this one among them where it is: as found within the
        last `ttl` seconds, else searched for."""
        found, now = self._nearest.get(key_id), self.clock()
        if found is None or now - found[0] > self.ttl:
            self.searches += 1
            nearest = (await self.node.find_nearest_nodes([key_id], k_nearest=self.node.num_replicas))[key_id]
            # (keys no longer stored to, a data block's finished group say, are forgotten)
            self._nearest = {k: v for k, v in self._nearest.items() if now - v[0] <= self.ttl}
            self._nearest[key_id] = found = (now, nearest)
        return found[1]
