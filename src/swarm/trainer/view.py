"""A trainer's view of the swarm: the live servers of each stage that share its settings, refreshed from
the DHT; the highest epoch it has seen of each stage; when it last saw each server."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Collection

from swarm.config import describe_mismatch
from swarm.net.directory import Directory, lapsed_in, note_fresh_start, short
from swarm.wire.records import ServerRecord

log = logging.getLogger("swarm.trainer")
LAPSE_MARGIN = 0.1  # seconds after a record's expiry that the view read telling whether it was renewed begins
EPOCH_LEAD = 2  # steps a replica may be ahead of most of its stage's and still set the epoch callers expect


class SwarmView:
    def __init__(self, num_stages: int, config_hash: str, agreed: dict, announce_period: float):
        self.num_stages = num_stages
        self.hash, self.agreed = config_hash, agreed
        self.announce_period = announce_period
        self.servers: dict[int, list[ServerRecord]] = {k: [] for k in range(num_stages)}
        self.stage_epoch = [0] * num_stages  # the highest epoch seen of each stage (in a record or a reply)
        self._at_top: list[set[str]] = [set() for _ in range(num_stages)]  # the servers seen at that epoch
        self.mismatched: set[str] = set()  # servers ignored for other settings (each logged once)
        self.waiting: set[int] = set()  # stages found without a server (logged once until one is back)
        # (stage, server) -> when it was last in our view of the stage (monotonic); a server that moved to
        # another stage is gone from this one
        self._last_seen: dict[tuple[int, str], float] = {}
        self._refreshes = 0
        self._last_listed: dict[tuple[int, str], int] = {}  # (stage, server) -> the last refresh that listed it
        # servers missing from a view whose read began after their newest record had expired: not renewed
        self._lapsed: set[tuple[int, str]] = set()
        # replicas whose operator started their stage afresh mid-run (its training lost): when, for the summary
        self.fresh_starts: dict[str, dict] = {}

    async def refresh(self, directory: Directory) -> None:
        began = directory.now()
        for stage, records in (await directory.stages(self.num_stages)).items():
            usable = []
            for r in records:
                if r.config_hash != self.hash:
                    if r.peer_id not in self.mismatched:
                        self.mismatched.add(r.peer_id)
                        log.warning("ignoring server %s: other settings (%s)", short(r.peer_id),
                                    describe_mismatch(self.agreed, r.agreed()))
                    continue
                usable.append(r)
                self.saw_epoch(stage, r.epoch, r.peer_id)
                note_fresh_start(self.fresh_starts, r)
            if usable and stage in self.waiting:
                self.waiting.discard(stage)
                log.info("stage %d has %d server(s) again", stage, len(usable))
            self.servers[stage] = usable
            self._went_back(stage, usable)
            now = time.monotonic()
            self._last_seen.update(((stage, r.peer_id), now) for r in usable)
            self._last_listed.update(((stage, r.peer_id), self._refreshes) for r in usable)
            listed = {r.peer_id for r in usable}
            self._lapsed -= {(stage, peer) for peer in listed}
            self._lapsed |= {(stage, peer) for peer in lapsed_in(
                directory.expires, (p for k, p in self._last_listed if k == stage), listed, began)}
        self._refreshes += 1

    def saw_epoch(self, stage: int, epoch: int, peer: str) -> None:
        if epoch > self.stage_epoch[stage]:
            self.stage_epoch[stage] = epoch
            self._at_top[stage] = set()
        if epoch == self.stage_epoch[stage]:
            self._at_top[stage].add(peer)

    def _went_back(self, stage: int, usable: list[ServerRecord]) -> None:
        """A stage whose replicas all died and that came back from an older copy or checkpoint: every
        server seen at its highest epoch is gone, and the live ones are behind it. The stage is where they
        are (its lost steps are to be taken again)."""
        if not usable or self._at_top[stage] & {r.peer_id for r in usable}:
            return
        now = max(r.epoch for r in usable)
        if now < self.stage_epoch[stage]:
            log.warning("stage %d is back at epoch %d: the replicas that were at epoch %d are gone",
                        stage, now, self.stage_epoch[stage])
            self.stage_epoch[stage] = now
            self._at_top[stage] = {r.peer_id for r in usable if r.epoch == now}

    def live_epoch(self, stage: int, ignore: Collection[str] = ()) -> int:
        """The stage's epoch as its live replicas announce it: a replica behind it must not serve us.
        (Not the highest epoch ever seen: a stage whose replicas all died restarts from a checkpoint.)
        Servers in `ignore` (their last call from us failed or was refused) do not count, nor an epoch
        more than EPOCH_LEAD ahead of what most replicas announce (the lower median): an epoch announced
        by a peer that does not serve, or lies, would make every replica that does serve look stale."""
        epochs = [r.epoch for r in self.servers[stage] if r.peer_id not in ignore]
        if not epochs:
            return 0
        most = statistics.median_low(epochs)
        return max(e for e in epochs if e <= most + EPOCH_LEAD)

    def settled_epoch(self, stage: int) -> int:
        """How far the stage has trained, as most of its live replicas say (the lower median): one record
        claiming a far higher epoch, a stranger's, does not end the run. A stage without a live replica
        is where it was last seen."""
        epochs = [r.epoch for r in self.servers[stage]]
        return statistics.median_low(epochs) if epochs else self.stage_epoch[stage]

    def gone(self, stage: int, peer: str) -> bool:
        """Whether a server is out of its stage: missing from a view read after its newest record had
        expired (it stopped renewing it: a frozen or cut-off machine), or from the last two views (its
        record was withdrawn, or it moved; two, since one DHT lookup can come back partial under load)."""
        return (stage, peer) in self._lapsed or self._refreshes - self._last_listed.get((stage, peer), -1) > 2

    def seen_lately(self, stage: int, peer: str) -> bool:
        """Whether a server counts as alive: in one of the views of the last few announcement periods, or
        in one of the last few views. One view that misses it (a DHT lookup can come back partial under
        load) does not make it dead, and neither do views that stall (a lookup waiting on an unreachable
        DHT node): a live holder taken for dead has its gradients accumulated twice."""
        recently = time.monotonic() - self._last_seen.get((stage, peer), -math.inf) < 3 * self.announce_period
        return recently or self._refreshes - self._last_listed.get((stage, peer), -math.inf) <= 3


def until_next_view(period: float, directory: Directory, waited_on: Collection[str]) -> float:
    """Seconds until the next view: an announcement period, or less where a server our calls wait on has a
    record expiring sooner. The view read just after that expiry tells whether it was renewed, so calls
    waiting on a frozen server are given up within one read of its record's expiry."""
    now = directory.now()
    due = [directory.expires[peer] - now for peer in waited_on if peer in directory.expires]
    return min([period] + [d + LAPSE_MARGIN for d in due if d > 0])
