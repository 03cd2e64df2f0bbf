"""The swarm's phone book: servers and trainers announce themselves in the DHT and read each other.

Records expire unless renewed, so a peer that vanishes drops out of every view within `record_ttl`
seconds; a peer that leaves gracefully writes a tombstone so it drops out at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections import Counter
from collections.abc import Collection, Iterable, Mapping

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from swarm.core.dataplan import Claim
from swarm.core.vouching import LOOKS, Announced, vouched
from swarm.net.identity import public_key_of
from swarm.wire.records import (
    BackupRecord,
    RecordError,
    ServerRecord,
    TrainerRecord,
    backup_key,
    block_from_value,
    block_value,
    stage_key,
    trainers_key,
)

log = logging.getLogger(__name__)
CLOCK_SLACK = 10.0  # seconds by which peers' clocks may differ (the DHT's time is each peer's own)
FORGET_EXPIRED = 600.0  # seconds after its last record expired that a server's expiry is forgotten
# announcement periods between renewals of a peer's own record with no news (servers and trainers): a record lives
# net.record_ttl (6 s by default), so a few renewals still fall within its life, and each renewal is a store that
# every DHT node nearest its key serves, CPU taken from every host's compute
RENEW_PERIODS = 2


class Directory:
    def __init__(self, dht: DHT, run_id: str, record_ttl: float):
        self.dht = dht
        self.run_id = run_id
        self.ttl = record_ttl
        # server -> DHT time at which the newest of its records read so far expires: a read begun after
        # that which does not list it shows it stopped renewing (`lapsed_in`)
        self.expires: dict[str, float] = {}
        self._unvouched: set[str] = set()  # sources of states refused as unvouched (logged once each)
        # this peer's DHT operations by what they were for: each is served by several DHT nodes, CPU taken
        # from every host's compute, so the peer's summary shows its share of the DHT's load
        self.ops: Counter[str] = Counter()
        # stage key (or the trainers') -> the latest read of it (its monotonic and DHT times begun, its future):
        # see `read_stages`
        self._shared: dict[str, tuple[float, float, asyncio.Future]] = {}
        # stage -> the tombstones of servers that left it for another stage, as last read (see `in_transit`)
        self._moved_off: dict[int, list[ServerRecord]] = {}

    async def announce_server(self, record: ServerRecord) -> None:
        self.ops["announce"] += 1
        await self.dht.store(
            stage_key(self.run_id, record.stage),
            record.to_value(),
            expiration_time=get_dht_time() + self.ttl,
            subkey=record.peer_id,
            return_future=True,
        )

    async def withdraw_server(self, record: ServerRecord) -> None:
        tombstone = ServerRecord(**{**record.__dict__, "gone": True})
        await self.announce_server(tombstone)

    async def stage(self, stage: int) -> list[ServerRecord]:
        """Live servers of one stage, malformed and withdrawn entries dropped."""
        return (await self.read_stages([stage]))[0][stage]

    async def stages(self, num_stages: int, fresh: float = 0.0) -> dict[int, list[ServerRecord]]:
        """All stages, read in one search of the DHT: each node asked is asked for every stage's key at once,
        and a node that does not answer delays the view once, not once per stage. A stage read by this peer
        within `fresh` seconds is taken as read (see `read_stages`)."""
        return (await self.read_stages(range(num_stages), fresh))[0]

    async def read_stages(self, stages: Iterable[int], fresh: float = 0.0
                          ) -> tuple[dict[int, list[ServerRecord]], float]:
        """Live servers of each of `stages`, and the DHT time the reads that found them began (the earliest,
        for `lapsed_in`). Readers of one peer that each read stages periodically (a trainer's view and the
        step loop of the server it runs in) share reads where their needs overlap, rather than each asking
        every DHT node holding the keys: where each of `stages` was read within `fresh` seconds (the read done
        or under way), none is read again. Otherwise one search reads them all: it asks each node for every key
        at once, for about what the stale ones alone would cost, and leaves a fresher read of each to share
        (a backup keeper's look at every stage then serves the step loop's next read of its own). A failed
        read is not shared."""
        keys = {k: stage_key(self.run_id, k) for k in stages}
        now = time.monotonic()
        reads = {k: self._reusable(key, fresh, now) for k, key in keys.items()}
        if any(read is None for read in reads.values()):
            self.ops["stages"] += 1
            began = self.now()
            search = asyncio.ensure_future(self._search(list(keys.values())))
            for k, key in keys.items():
                read = asyncio.ensure_future(_value_of(search, key))
                read.add_done_callback(_retrieved)
                reads[k] = (began, read)
                self._shared[key] = (now, began, read)
        found = {k: self._live_servers(k, await asyncio.shield(read)) for k, (_, read) in reads.items()}
        return found, min(began for began, _ in reads.values())

    async def _search(self, keys: list[str]) -> dict:
        if len(keys) == 1:
            return {keys[0]: await self.dht.get(keys[0], latest=True, return_future=True)}
        return await self.dht.run_coroutine(functools.partial(_latest_of, keys), return_future=True)

    def _reusable(self, key: str, fresh: float, now: float) -> tuple[float, asyncio.Future] | None:
        began, dht_began, read = self._shared.get(key, (-math.inf, 0.0, None))
        if read is None or now - began > fresh or (read.done() and (read.cancelled() or read.exception())):
            return None
        return dht_began, read

    def _live_servers(self, stage: int, found) -> list[ServerRecord]:
        parse = _by_peer(ServerRecord.from_value)
        entries = [(r, expires) for r, expires in _entries(found, parse, self.ttl + CLOCK_SLACK) if r.stage == stage]
        live = [(r, expires) for r, expires in entries if not r.gone]
        self._moved_off[stage] = [r for r, _ in entries if r.gone and r.moving]
        for r, expires in live:
            self.expires[r.peer_id] = max(expires, self.expires.get(r.peer_id, expires))
        long_gone = get_dht_time() - FORGET_EXPIRED
        for peer in [p for p, expires in self.expires.items() if expires < long_gone]:
            del self.expires[peer]
        return [r for r, _ in live]

    def in_transit(self, stages: Mapping[int, list[ServerRecord]]) -> list[ServerRecord]:
        """The servers between two stages, as the read that found `stages`' live servers shows them: each
        left one of them for another (its tombstone there says it was moving) and is live in none yet. It
        announces itself at its new stage only once it holds that stage's state, so until then only its
        tombstone, which lives `record_ttl`, tells others that it is on its way."""
        live = {r.peer_id for records in stages.values() for r in records}
        return [r for k in stages for r in self._moved_off.get(k, []) if r.peer_id not in live]

    async def live_at(self, stage: int, epoch: int, peers: frozenset[str]) -> frozenset[str]:
        """Those of `peers` whose records in a fresh read of `stage` are live and at `epoch`."""
        return frozenset(r.peer_id for r in await self.stage(stage) if r.peer_id in peers and r.epoch == epoch)

    async def lapsed(self, stage: int, peers: frozenset[str]) -> frozenset[str]:
        """Those of `peers` out of `stage` by `lapsed_in`, in a fresh read; no read at all while each of
        `peers` has a record known live."""
        began = self.now()
        if not (due := lapsed_in(self.expires, peers, (), began)):
            return frozenset()
        return lapsed_in(self.expires, due, {r.peer_id for r in await self.stage(stage)}, began)

    async def vouch(self, stage: int, config_hash: str, me: str, source: str, meta: dict,
                    known: Iterable[ServerRecord], wait: float) -> bool:
        """Whether the replicas of `stage` other than `me` vouch for a state `source` served, described by
        `meta` (its epoch and digest; see swarm.core.vouching), from the records `known` (read before the
        download) and up to `LOOKS` reads of the stage's records after it, `wait` seconds apart. A source
        refused so is logged once."""
        digest, epoch = meta.get("digest"), meta.get("epoch")
        seen = _announced(known, config_hash)
        for look in range(LOOKS if isinstance(digest, str) and isinstance(epoch, int) else 0):
            if look:
                await asyncio.sleep(wait)
            seen |= _announced(await self.stage(stage), config_hash)
            if vouched(digest, epoch, seen, me):
                return True
        if source not in self._unvouched:
            self._unvouched.add(source)
            log.warning("state of stage %d from %s refused: the stage's other replicas do not vouch for its digest "
                        "%s at epoch %s", stage, short(source), str(digest)[:16], epoch)
        return False

    async def announce_trainer(self, record: TrainerRecord, ttl: float | None = None) -> None:
        self.ops["announce"] += 1
        await self.dht.store(
            trainers_key(self.run_id),
            record.to_value(),
            expiration_time=get_dht_time() + (ttl or self.ttl),
            subkey=record.peer_id,
            return_future=True,
        )

    async def trainers(self, fresh: float = 0.0) -> list[TrainerRecord]:
        """The trainers' records; a read by this peer begun within `fresh` seconds, done or under way, serves
        instead of a new one (a server's mover takes its step loop's, which it reads as seldom)."""
        key, now = trainers_key(self.run_id), time.monotonic()
        if (reusable := self._reusable(key, fresh, now)) is None:
            self.ops["trainers"] += 1
            read = asyncio.ensure_future(self.dht.get(key, latest=True, return_future=True))
            read.add_done_callback(_retrieved)
            self._shared[key] = (now, self.now(), read)
        else:
            read = reusable[1]
        return _parse(await asyncio.shield(read), _by_peer(TrainerRecord.from_value))


    async def announce_backup(self, record: BackupRecord, ttl: float) -> None:
        self.ops["announce"] += 1
        await self.dht.store(backup_key(self.run_id, record.stage), record.to_value(),
                             expiration_time=get_dht_time() + ttl, subkey=record.peer_id, return_future=True)

    async def backups(self, stage: int) -> list[BackupRecord]:
        """The copies of a stage held outside it (see swarm.core.backups)."""
        self.ops["backups"] += 1
        found = await self.dht.get(backup_key(self.run_id, stage), latest=True, return_future=True)
        return [r for r in _parse(found, _by_peer(BackupRecord.from_value)) if r.stage == stage]

    async def blocks(self, key: str) -> dict[int, Claim]:
        """The block records under one data key (see swarm.core.dataplan): block -> claim."""
        self.ops["data"] += 1
        found = await self.dht.get(key, latest=True, return_future=True)
        return dict(_parse(found, block_from_value))

    async def record_block(self, key: str, block: int, claim: Claim, lifetime: float) -> bool:
        """Publish a block's claim; whether the DHT took it. The newest write wins (hivemind keeps the value
        that expires last), so a claim is read back before it is relied on."""
        self.ops["data"] += 1
        return await self.dht.store(key, block_value(claim), expiration_time=get_dht_time() + lifetime,
                             subkey=str(block), return_future=True)

    def now(self) -> float:
        """DHT time, which leases are measured in."""
        return get_dht_time()


async def _latest_of(keys: list[str], _dht: DHT, node: DHTNode) -> dict:
    """Run in the DHT's process: the latest value of each key, found in one search."""
    return await node.get_many(keys, sufficient_expiration_time=math.inf)


async def _value_of(search: asyncio.Future, key: str):
    return (await asyncio.shield(search)).get(key)


def _retrieved(read: asyncio.Future) -> None:
    """A shared read that failed is the failure of whoever awaits it; with no one left to, it is not logged
    as an exception never retrieved."""
    if not read.cancelled():
        read.exception()


def lapsed_in(expires: Mapping[str, float], peers: Iterable[str], listed: Collection[str], began: float
              ) -> frozenset[str]:
    """Those of `peers` that a read begun at DHT time `began` did not list (`listed`), though the newest of
    their records read before (`Directory.expires`) had expired by then: they stopped renewing (frozen, cut
    off, or dead). A live server's renewals keep its expiry ahead of every read, so one read that misses it
    (a DHT lookup can come back partial) proves nothing. The rule trainers leave a server's calls by."""
    return frozenset(p for p in peers if p not in listed and expires.get(p, math.inf) <= began)


def _announced(records: Iterable[ServerRecord], config_hash: str) -> set[Announced]:
    """What the records of this run's replicas (their settings ours) announce of their weights."""
    return {(r.peer_id, r.epoch, r.digest) for r in records if r.config_hash == config_hash}


def _by_peer(parse):
    """`parse` for records whose subkey names their writer: a subkey that is no peer id whose key signs
    records (see swarm.net.identity; the DHT checked the signature) is malformed, and a call to it could
    not even be addressed."""
    def checked(subkey: str, value):
        if public_key_of(subkey) is None:
            raise RecordError(f"subkey {subkey[:60]!r} is not a peer id")
        return parse(subkey, value)
    return checked


def _parse(found, parse, max_lifetime: float = math.inf) -> list:
    """The well-formed records of a dictionary value; those set to outlive `max_lifetime` are ignored (a
    server record that would stay in view long after its writer died)."""
    return [record for record, _ in _entries(found, parse, max_lifetime)]


def _entries(found, parse, max_lifetime: float) -> list[tuple]:
    """`_parse`'s records, each with the DHT time at which it expires."""
    if found is None or not isinstance(found.value, dict):
        return []
    entries, latest = [], get_dht_time() + max_lifetime
    for subkey, item in found.value.items():
        if item.expiration_time > latest:
            log.debug("ignoring record %s: it expires too late", str(subkey)[:60])
            continue
        try:
            entries.append((parse(str(subkey), item.value), item.expiration_time))
        except (RecordError, TypeError, ValueError) as e:
            log.debug("ignoring malformed record from %s: %s", subkey, e)
    return entries


def note_fresh_start(noted: dict[str, dict], record: ServerRecord) -> None:
    """Remember, and log once, a replica whose operator started its stage afresh mid-run (`fresh`): every
    peer's summary lists them, since the stage's training before that is lost."""
    if record.fresh and record.peer_id not in noted:
        noted[record.peer_id] = {"stage": record.stage, "time": record.fresh}
        log.warning("stage %d was started afresh by %s: its training before that is lost",
                    record.stage, short(record.peer_id))


def short(peer_id: str) -> str:
    """Peer ids are long base58 strings; logs show the tail, which is what differs between peers."""
    return "…" + peer_id[-6:]
