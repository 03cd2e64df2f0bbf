"""Copies of stages' state held by this peer outside those stages, so that a stage whose replicas all die
together (one provider's preemption wave) comes back at most `backup.every` steps behind.

A holder pulls: it reads the swarm's layout from the DHT, works out which stages it holds (rendezvous
hashing, stragglers last: `swarm.core.backups`), and downloads a stage's state from its most advanced replica once the
stage is `every` steps past its copy, over the same streamed, exact `state` call a newcomer uses; like a
newcomer, it keeps the state only where the stage's other replicas vouch for its digest
(`swarm.core.vouching`) and the tensors it got are what that digest and the stage's layout say
(`swarm.server.state_io.check_state`). The stage's step loop never waits for it: the replica lends its
tensors to the download instead of copying them. Copies live in the holder's memory, announced in the DHT
(`BackupRecord`) and served by the `backup` call to a server that enters a stage no replica is left of.

The holder also notes every fresh start it sees in the layout (a stage an operator restarted from its
initial weights), for its summary.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.config import BackupConfig, ModelConfig, NetConfig
from swarm.core.backups import may_drop, needs_refresh, pause_after, stages_to_hold, stragglers
from swarm.net.directory import Directory, note_fresh_start, short
from swarm.net.protocol import Tagged
from swarm.net.transport import CallFailed, StageClient
from swarm.server.state_io import StateLayout, check_state
from swarm.wire.records import BackupRecord, ServerRecord
from swarm.wire.validate import Unavailable

log = logging.getLogger("swarm.backup")


@dataclass
class Copy:
    meta: dict[str, Any]
    tensors: list[torch.Tensor]
    seen: int  # the newest epoch of the stage seen since
    source: str
    megabytes: float = field(init=False)

    def __post_init__(self) -> None:
        self.megabytes = sum(t.numel() * t.element_size() for t in self.tensors) / 2**20

    @property
    def epoch(self) -> int:
        return int(self.meta["epoch"])


class BackupKeeper:
    def __init__(self, me: str, config_hash: str, model: ModelConfig, cfg: BackupConfig, net: NetConfig,
                 client: StageClient, directory: Directory, own_stage: Callable[[], int | None],
                 every_stage: bool = False):
        """`own_stage`: the stage this peer serves now (None: none); `every_stage`: hold a copy of every
        stage (a `swarm backup` peer) rather than those the ranking gives this server."""
        self.me, self.hash, self.model = me, config_hash, model
        self.layouts: dict[int, StateLayout] = {}  # (built as first needed)
        self.cfg, self.ttl = cfg, net.record_ttl + 2 * cfg.period
        self.announce_period = net.announce_period
        self.client, self.directory = client, directory
        self.own_stage, self.every_stage = own_stage, every_stage
        self.copies: dict[int, Copy] = {}
        self.over_budget: set[int] = set()  # stages refused for want of memory (logged once each)
        self.fresh_starts: dict[str, dict[str, Any]] = {}  # replica -> its stage and when it started afresh
        self.counters: Counter[str] = Counter()
        self.paused_until = 0.0  # (monotonic) no copy is refreshed before then: see backup.max_share

    async def loop(self) -> None:
        announcing = asyncio.create_task(self._announce_loop())
        try:
            while True:
                try:
                    await self.look()
                except Exception as e:  # a DHT read or a download that failed: the next look tries again
                    log.warning("backup look failed: %s", e)
                await asyncio.sleep(self.cfg.period)
        finally:
            announcing.cancel()

    async def look(self) -> None:
        """Refresh the copies that are due, drop those no longer ours to hold. The stages are taken as this
        peer read them within the period, if it did (its mover's look, its trainer's view): a copy is then
        refreshed up to a period later, and the DHT nodes holding the keys serve one read fewer."""
        layout = {k: [r for r in records if r.config_hash == self.hash]
                  for k, records in (await self.directory.stages(self.model.num_stages, fresh=self.cfg.period)).items()}
        for records in layout.values():
            for r in records:
                note_fresh_start(self.fresh_starts, r)
        wanted = self._wanted(layout)
        for stage, records in layout.items():
            epochs = [r.epoch for r in records]
            copy = self.copies.get(stage)
            if copy is not None:
                copy.seen = max([copy.seen, *epochs])
                if may_drop(copy.epoch, stage in wanted, epochs):
                    del self.copies[stage]
                    log.info("dropped the copy of stage %d (epoch %d): no longer held here", stage, copy.epoch)
                    continue
            if copy is not None and time.monotonic() < self.paused_until:
                continue
            if stage in wanted and stage not in self.over_budget and needs_refresh(
                    copy.epoch if copy else None, max(epochs, default=0), self.cfg.every):
                started = time.monotonic()
                await self._refresh(stage, records)
                ended = time.monotonic()
                self.paused_until = ended + pause_after(ended - started, self.cfg.max_share)

    def _wanted(self, layout: dict[int, list[ServerRecord]]) -> set[int]:
        own = self.own_stage()
        if self.every_stage:
            return set(layout) - {own}
        peers = {k: [r.peer_id for r in records if r.peer_id != self.me] for k, records in layout.items()}
        if own is not None:
            peers.setdefault(own, []).append(self.me)
        slow = stragglers({k: {r.peer_id: r.throughput for r in records} for k, records in layout.items()})
        return stages_to_hold(self.me, peers, self.cfg.holders, slow) - {own}

    async def _refresh(self, stage: int, records: list[ServerRecord]) -> None:
        for source in sorted(records, key=lambda r: -r.epoch):
            started = time.monotonic()
            try:
                meta, tensors = await self.client.call(source.peer_id, "state", {"stage": stage}, [],
                                                       self.cfg.download_timeout)
            except CallFailed as e:
                log.warning("copy of stage %d from %s failed: %s", stage, short(source.peer_id), e)
                continue
            if not await self.directory.vouch(stage, self.hash, self.me, source.peer_id, meta, records,
                                              self.announce_period):
                self.counters["unvouched"] += 1  # no copy to restore the stage from
                continue
            problem = await asyncio.to_thread(self._problem, stage, meta, tensors)
            if problem:
                self.counters["unusable"] += 1
                log.warning("copy of stage %d from %s refused: %s", stage, short(source.peer_id), problem)
                continue
            old = self.copies.get(stage)
            copy = Copy(meta, tensors, max(source.epoch, int(meta["epoch"])), source.peer_id)
            budget = self.cfg.max_mb
            others = sum(c.megabytes for k, c in self.copies.items() if k != stage)
            if budget and others + copy.megabytes > budget:
                self.over_budget.add(stage)
                log.warning("not holding a copy of stage %d: %.0f MiB would exceed backup.max_mb=%g (%.0f MiB "
                            "held)", stage, copy.megabytes, budget, others)
                return
            self.copies[stage] = copy
            took = time.monotonic() - started
            self.counters["copies"] += 1
            self.counters["copy_megabytes"] += copy.megabytes
            self.counters["copy_seconds"] += took
            log.info("holding stage %d at epoch %d (%.1f MiB from %s in %.1fs%s)", stage, copy.epoch,
                     copy.megabytes, short(source.peer_id), took, f"; was epoch {old.epoch}" if old else "")
            await self._announce(stage, copy)
            return

    def _problem(self, stage: int, meta: dict[str, Any], tensors: list[torch.Tensor]) -> str | None:
        """What unfits a vouched-for state to be kept (None: nothing), checked as a replica loading it checks
        it. A source can announce its stage's honest digest and serve other tensors: caught here, a copy
        like that is refused while the stage's replicas can still serve another, where kept it would be
        found out only once they had all died and it was the copy the stage came back from."""
        if stage not in self.layouts:
            self.layouts[stage] = StateLayout.of_stage(self.model, stage)
        try:
            check_state(self.layouts[stage], meta, tensors)
        except ValueError as e:
            return str(e)
        return None

    async def _announce_loop(self) -> None:
        while True:
            for stage, copy in list(self.copies.items()):
                try:
                    await self._announce(stage, copy)
                except Exception as e:
                    log.warning("could not announce the copy of stage %d: %s", stage, e)
            await asyncio.sleep(self.cfg.period)

    async def _announce(self, stage: int, copy: Copy) -> None:
        record = BackupRecord(self.me, stage, copy.epoch, max(copy.seen, copy.epoch), self.hash,
                              round(copy.megabytes, 3))
        await self.directory.announce_backup(record, self.ttl)

    async def serve(self, stage: int) -> tuple[dict[str, Any], list[Tagged]]:
        """The `backup` call: this peer's copy of `stage`, exact."""
        copy = self.copies.get(stage)
        if copy is None:
            raise Unavailable(f"no copy of stage {stage} here")
        self.counters["served"] += 1
        return copy.meta, [Tagged("state", t) for t in copy.tensors]

    def local(self, stage: int) -> tuple[dict[str, Any], list[torch.Tensor]] | None:
        """This peer's copy of `stage`, if it holds one."""
        copy = self.copies.get(stage)  # cloned: the stage trains what it loads, and the copy must stay as held
        return None if copy is None else (copy.meta, [t.clone() for t in copy.tensors])

    def summary(self) -> dict[str, Any]:
        return {
            "copies_held": {str(k): {"epoch": c.epoch, "seen": c.seen, "megabytes": round(c.megabytes, 3)}
                            for k, c in sorted(self.copies.items())},
            "copy_counters": dict(self.counters),
            "fresh_starts": sorted(self.fresh_starts.values(), key=lambda f: f["time"]),
        }
