"""A server's announcement in the DHT: what trainers route by and what its stage's replicas decide their
steps from. Renewed every RENEW_PERIODS announcement periods; at once when what others act on changes (its
epoch, weights, a move). Near a step beside other replicas at this one's epoch, its sample count goes to
them straight (`count` calls) as it grows; by the DHT, every period and sooner, only where a call failed."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from swarm.config import NetConfig
from swarm.net.directory import RENEW_PERIODS, Directory, short
from swarm.server.gate import ComputeGate
from swarm.server.stage import ServedStage
from swarm.wire import PROTOCOL_VERSION
from swarm.wire.calls import CountNote
from swarm.wire.records import ServerRecord

log = logging.getLogger("swarm.server")
OVERLAPPING = 3  # renewals of the record that may wait on the DHT at once


class Announcer:
    def __init__(self, agreed: dict, config_hash: str, name: str, net: NetConfig, peer_id: str, directory: Directory,
                 gate: ComputeGate, stage: ServedStage, in_hand: Callable[[], int],
                 tell: Callable[[str, CountNote], Awaitable[None]]):
        """`agreed`: the settings every peer of the run shares (swarm.config.agreed); they travel in every
        record, so that a peer with other settings is told which differ. `in_hand`: calls received and not
        yet answered (swarm.net.servicer.StageServicer.in_hand). `tell`: a `count` call to a peer."""
        self.agreed = agreed
        self.target_batch_size = int(agreed["optim"]["target_batch_size"])
        self.name = name
        self.period, self.ttl = net.announce_period, net.record_ttl
        # (where a record lives less than RENEW_PERIODS periods' worth of renewals, it is renewed as before)
        self.renew_every = min(RENEW_PERIODS * self.period, max(self.period, self.ttl / 3))
        self.hash = config_hash
        self.peer_id = peer_id
        self.directory = directory
        self.gate = gate
        self.stage = stage
        self.in_hand = in_hand
        self._announced_pending = 0
        self._announced_news: tuple = ()
        self.tell = tell
        self._seq = 0  # orders our count notes
        self._telling: dict[str, asyncio.Task] = {}  # peer -> the note on its way to it
        self._told: dict[str, tuple[int, int]] = {}  # peer -> (epoch, samples) it was last told
        self._tell_failed = -math.inf  # (monotonic) when a note last failed: counts go by the DHT for a period

    def record(self) -> ServerRecord:
        st = self.stage
        return ServerRecord(
            peer_id=self.peer_id,
            stage=st.index,
            throughput=st.work.meter.rate,
            capacity=st.work.capacity.rate,
            queue=self.gate.queued,
            epoch=st.runtime.epoch,
            pending=st.runtime.pending_samples,
            config_hash=self.hash,
            model=self.agreed["model"],
            tenure=st.tenure,
            moving=st.moving_to is not None,
            name=self.name,
            optim=self.agreed["optim"],
            protocol=PROTOCOL_VERSION,
            fresh=st.fresh,
            digest=st.runtime.last_digest,
            previous_stage=st.previous_stage,
            calls=self.in_hand(),
        )

    def has_news(self, near: bool) -> bool:
        """Whether the record changed, since it was last announced, in what others act on at once: `news`,
        and near a step beside other replicas (`near`) the sample count, from which they decide the step."""
        return self.news() != self._announced_news or (
            near and self.stage.runtime.pending_samples != self._announced_pending)

    def news(self) -> tuple:
        """What of the record others act on as soon as it changes: trainers route by the epoch (a replica
        behind refuses their calls), replicas step and catch up by epochs and weights, and the stages count
        their servers by where they are and where they go. Rates and queues drift: a renewal carries them."""
        st = self.stage
        return st.index, st.runtime.epoch, st.runtime.last_digest, st.moving_to, st.fresh, st.previous_stage

    async def announce(self) -> None:
        self.stage.work.fold(self.period)
        record, news = self.record(), self.news()
        await self.directory.announce_server(record)
        self._announced_pending, self._announced_news = record.pending, news

    def tell_counts(self, now: float) -> bool:
        """Near the step, tell the replicas at our epoch our sample count straight (`count` calls), each
        new count as it comes, one note on its way to a peer at a time; whether counts go that way now (not
        for a period after a note failed: the DHT record carries them then, as it does to any replica not
        yet seen at our epoch)."""
        st = self.stage
        epoch, peers = st.plan.peers_at_epoch
        if epoch != st.runtime.epoch or now - self._tell_failed < self.period:
            return False
        count = (epoch, st.runtime.pending_samples)
        for peer in peers:
            if self._told.get(peer) != count and (peer not in self._telling or self._telling[peer].done()):
                self._seq += 1
                self._told[peer] = count
                note = CountNote(st.index, *count, self._seq)
                self._telling[peer] = asyncio.create_task(self._tell(peer, note))
        self._told = {p: c for p, c in self._told.items() if p in peers}
        self._telling = {p: t for p, t in self._telling.items() if p in peers or not t.done()}
        return True

    async def _tell(self, peer: str, note: CountNote) -> None:
        try:
            await self.tell(peer, note)
        except Exception as e:  # the DHT record carries our counts meanwhile
            self._tell_failed = time.monotonic()
            self._told.pop(peer, None)
            log.debug("count note to %s failed: %s", short(peer), e)

    async def withdraw(self) -> None:
        await self.directory.withdraw_server(self.record())

    async def _announce_quietly(self) -> None:
        try:
            await self.announce()
        except Exception as e:  # the DHT may be briefly unreachable; the next announcement retries
            log.warning("announcement failed: %s", e)

    async def loop(self) -> None:
        """Re-announce every `renew_every`, and at once with news (`has_news`). Near the stage's step beside
        other replicas at our epoch, they decide when the stage steps from each other's sample counts, so
        stale counts mean oversized steps: each new count is told to them straight (`tell_counts`), or,
        where that failed, announced every period and sooner. A replica alone at its epoch has no one to
        tell, and far from the step nothing is decided yet: every store is served by each DHT node holding
        the stage's key, CPU taken from the compute of every host.

        The loop also notices when this process stalled (it was frozen) for so long that its record
        may have lapsed. Announcements run beside it, so a slow DHT store is not taken for a stall; and the
        renewals that fall due go out while earlier ones still wait (up to OVERLAPPING), since a store can
        wait out the DHT's RPC timeout on an unresponsive node once to find the key's nodes and once to
        store: renewals in turn would then come further apart than a record lives, and trainers would take
        this live server for gone. The DHT keeps, of a subkey's values, the one that expires last, so a late
        store never replaces a newer one.
        """
        st = self.stage
        last = tick = time.monotonic()
        sending: set[asyncio.Task] = set()
        while True:
            await asyncio.sleep(min(0.1, self.period))
            now = time.monotonic()
            if now - tick > self.ttl - self.period:
                st.lapsed = True
                log.warning("stage %d server %s stalled for %.1fs", st.index, st.label, now - tick)
            tick = now
            sending = {task for task in sending if not task.done()}
            if len(sending) >= OVERLAPPING:
                continue
            st.work.fold(self.period)  # the rates a renewal carries are a period's, however far apart renewals are
            # near the step, counts go to the replicas at our epoch straight; by the DHT only where they cannot
            near = st.near_step(self.period, self.target_batch_size) and not self.tell_counts(now)
            # an early announcement only when none is under way: it tells news, not that we are alive
            if now - last >= (self.period if near else self.renew_every) or (not sending and self.has_news(near)):
                last = now
                sending.add(asyncio.create_task(self._announce_quietly()))
