"""The stage's optimizer step, as one replica takes part in it.

Each look (every 0.25 s, or when woken: a gradient came in, a groupmate began a round, a request showed
us stale) gathers a `StepView` from the DHT and asks the pure step plan (`swarm.core.stepping.plan_step`)
what to do: wait, catch up from a replica further along, or step with a group. A sync step takes the
replica's gradient sum out, all-reduces it with the group's and applies the same AdamW step on every
replica, holding the compute gate only to take the sum out and to step (backwards go on in between, into
the next step); an async round averages the replicas' weights while they go on serving (see
`swarm.server.runtime`). Each step is logged as it happens, announced, and checkpointed every
`server.checkpoint_every` steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import asdict, replace

import torch

from swarm.averaging.allreduce import StageAllReduce
from swarm.averaging.failures import RoundFailed, WeightsDiverged
from swarm.config import NetConfig, OptimConfig
from swarm.core import backoff_delay
from swarm.core.stepping import (
    CatchUp,
    Decision,
    Replica,
    Step,
    StepView,
    plan_step,
    suspect,
    trainers_read_every,
    unproven,
)
from swarm.core.vouching import keeper as keeper_of
from swarm.net.directory import RENEW_PERIODS, Directory, lapsed_in, short
from swarm.results import PeerResults
from swarm.server.announcing import Announcer
from swarm.server.gate import ComputeGate
from swarm.server.records import StepPart, StepRecord
from swarm.server.stage import ServedStage
from swarm.server.transfer import StateTransfer
from swarm.wire.records import ServerRecord, TrainerRecord

log = logging.getLogger("swarm.server")
# seconds between looks when nothing wakes the step loop, and how long a read of the stage's records
# serves the looks that gradients wake in between while other replicas are in view and the stage is near its
# step (they announce once a second, and on new samples then); otherwise a read serves an announcement period
LOOK_EVERY = 0.5
STRIKES = 3  # rounds in a row a peer refuses before it is left out (a replica a step behind refuses one or two)
DISTRUST_TTLS = 10  # record lifetimes such a peer stays left out


def heard(record: ServerRecord, told: tuple[int, int, float] | None) -> Replica:
    """A replica as its record shows it, or as it told us itself (`count` calls) where that is as far along:
    near the step its notes are fresher than its record, which it renews only every few periods."""
    if told is not None and told[0] >= record.epoch:
        return Replica(record.peer_id, told[0], told[1])
    return Replica(record.peer_id, record.epoch, record.pending)


class Stepper:
    def __init__(self, stage: ServedStage, peer_id: str, optim: OptimConfig, net: NetConfig, checkpoint_every: int,
                 gate: ComputeGate, directory: Directory, allreduce: StageAllReduce, announcer: Announcer,
                 transfer: StateTransfer, results: PeerResults, steps_file: str, rng):
        self.stage = stage
        self.peer_id = peer_id
        self.target_batch_size = optim.target_batch_size
        self.net = net
        # a peer that looks behind, or a first peer, gets a few announcement periods to show up
        self.grace = 3 * net.announce_period + 1.0
        self.checkpoint_every = checkpoint_every
        self.gate = gate
        self.directory = directory
        self.allreduce = allreduce
        self.announcer = announcer
        self.transfer = transfer
        self.results, self.steps_file = results, steps_file
        self.rng = rng
        self._trainers_read: tuple[float, list[TrainerRecord]] = (-math.inf, [])
        self._records_read: tuple[float, list[ServerRecord]] = (-math.inf, [])
        self._stepped_at = -math.inf  # (monotonic) when this replica last stepped: reads begun before are stale
        self._seen: set[str] = set()  # the stage's other replicas seen in its records (while the directory
        self._lapsed: frozenset[str] = frozenset()  # keeps their expiries), and those the last read showed lapsed
        self._failures = 0  # rounds failed in a row, for the backoff
        self._strikes: dict[str, int] = {}  # peer -> rounds in a row it refused our part in
        self.finishing = False  # the server is leaving its stage: no new round starts
        self._round_over = asyncio.Event()  # no sync round under way
        self._round_over.set()

    async def loop(self) -> None:
        """Look, and act on what the plan says, until cancelled. An error, wherever it comes from (the
        handling of a failed round included), is logged and the loop goes on: a stage must not stop
        stepping because one look went wrong."""
        st = self.stage
        while True:
            try:  # (not wait_for: on Python 3.11 it loses a cancellation that comes as the event is set, and
                # a gradient sets it many times a second; a leaving server's step loop would run on)
                async with asyncio.timeout(LOOK_EVERY):
                    await st.wake.wait()
            except TimeoutError:
                pass
            st.wake.clear()
            try:
                await self._look_and_act()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("step loop error")
                await asyncio.sleep(1.0)

    async def _look_and_act(self) -> None:
        st = self.stage
        try:
            decision, records = await self._look()
            if isinstance(decision, CatchUp):
                await self._catch_up([r for r in records if r.peer_id in decision.sources])
            elif isinstance(decision, Step):
                await self._step(st.runtime.epoch, decision.group)
                self._records_read = (-math.inf, [])  # the group's records moved on with it
                self._stepped_at = time.monotonic()
                self._failures = 0
                self._strikes.clear()
        except WeightsDiverged as e:
            await self._resolve_divergence(e)
        except RoundFailed as e:
            self._failures += 1
            st.counters["failed_rounds"] += 1
            # left out of the next groups until their records expire
            st.plan = suspect(st.plan, e.unreachable, time.monotonic() + self.net.record_ttl, st.runtime.epoch)
            self._strike(e.refused_by)
            log.warning("stage %d step %d round failed (%s); retrying", st.index, st.runtime.epoch + 1, e)
            await self._back_off(backoff_delay(self._failures, 0.2, 3.0, self.rng))

    async def _back_off(self, delay: float) -> None:
        """Wait `delay` before our next round, unless a groupmate proposes one meanwhile and we accept it:
        joining that round repeats nothing of ours. After a stage's first round failed (its members had not
        yet read each other's records), the replica that refused read the stage and proposed the round
        itself, which then waited out our backoff while its samples, and ours, piled up."""
        st = self.stage
        st.proposed.clear()
        if st.proposal is None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):  # (not wait_for: it can lose a cancellation)
                    await st.proposed.wait()

    async def _catch_up(self, sources: list[ServerRecord]) -> None:
        """Download the state of a replica further along. Sources whose state the other replicas did not
        vouch for, and all of them when none gave a state for the epoch it announces, are set aside: until
        their records move on, their claims do not hold this replica back (a forged record would otherwise
        stop the stage for good, and a replica serving wrong weights be asked again at every look)."""
        st = self.stage
        loaded = await self.transfer.download(sources)
        none_had = bool(sources) and not loaded and all(r.epoch > st.runtime.epoch for r in sources)
        aside = sources if none_had else [r for r in sources if r.peer_id in self.transfer.unvouched]
        if aside:
            st.plan = unproven(st.plan, {r.peer_id: r.epoch for r in aside},
                               time.monotonic() + DISTRUST_TTLS * self.net.record_ttl)
        if none_had:
            log.warning("stage %d: no state to be had from %s at the epoch announced; stepping on",
                        st.index, ", ".join(short(r.peer_id) for r in sources))

    def _strike(self, refused_by: frozenset[str]) -> None:
        """A peer that refused our part in STRIKES rounds in a row, with no step between, is left out of
        the stage's groups for DISTRUST_TTLS record lifetimes, whatever epoch it announces: a replica that
        refuses every round (hostile, or broken) would otherwise be in every group the plan proposes."""
        for peer in refused_by:
            self._strikes[peer] = self._strikes.get(peer, 0) + 1
            if self._strikes[peer] == STRIKES:
                log.warning("stage %d: %s refused %d rounds in a row; left out of the stage's rounds for %.0fs",
                            self.stage.index, short(peer), STRIKES, DISTRUST_TTLS * self.net.record_ttl)
                self.stage.plan = suspect(self.stage.plan, [peer],
                                          time.monotonic() + DISTRUST_TTLS * self.net.record_ttl, None)

    async def _look(self) -> tuple[Decision, list[ServerRecord]]:
        """Gather the view, ask the plan, remember what it says to remember. A round a groupmate proposed
        for our epoch, which we accepted, the plan joins as it is: the stage is not read for it first, while
        the proposer's part waits on us."""
        st = self.stage
        proposal, st.proposal = st.proposal, None
        if proposal is not None and proposal[0] == st.runtime.epoch:
            records, trainers = self._records_read[1], self._trainers_read[1]
        else:
            records, trainers = await asyncio.gather(self._records(), self._trainers())
        # a note is fresher than the record only until the record's next renewal
        now, renewals = time.monotonic(), RENEW_PERIODS * self.net.announce_period
        told = {p: c for p, c in st.told_counts().items() if now - c[2] < renewals}
        view = StepView(
            now=now, me=self.peer_id, epoch=st.runtime.epoch, pending=st.runtime.pending_samples,
            others=tuple(heard(r, told.get(r.peer_id)) for r in records if r.peer_id != self.peer_id),
            trainers=len(trainers), trainers_done=all(t.done for t in trainers), proposal=proposal,
            target_batch_size=self.target_batch_size, grace=self.grace, lapsed=self._lapsed,
            handed=st.handed_now(),
        )
        decision, st.plan = plan_step(view, st.plan)
        st.note_planned(self._records_read[0])
        return decision, records

    async def _records(self) -> list[ServerRecord]:
        """The stage's records, read at most once per LOOK_EVERY while other replicas are in view and the
        stage is near its step (their sample counts then decide when it steps), else once per announcement
        period: a look woken by each new gradient would otherwise read the DHT several times a second, and
        every read is served by each DHT node holding the stage's key, CPU taken from every host's compute
        (in the straggler benchmark a server's DHT process, daemon and network threads took about a tenth
        of its 0.45-core share). Near the step, replicas that told us their counts within the period (`count`
        calls) need no such reads. A read of the stage by this peer begun up to that interval before (a
        trainer's view, in a server that trains) serves instead of a new one; near the step, up to half of it.
        A replica alone in view reads every RENEW_PERIODS periods, as often as records are renewed: nothing
        is decided from others' records then; a newcomer that loads our state is known from its download
        (and read at every look until it is at our epoch), any other is seen within those periods, inside
        the grace a replica gives others to show up before it steps alone; while it waits out that grace with a
        step's samples in hand, it reads at every look (`_waiting_alone`). A round proposed to us since our
        last read, with replicas that read did not show, has the stage read again whatever the interval
        (see `swarm.core.stepping.unseen_in`). After a step no read begun before it serves, and until the
        round's other members show our epoch the stage is read as near its step (`_mates_unseen`)."""
        now = time.monotonic()
        others = any(r.peer_id != self.peer_id for r in self._records_read[1])
        # (a peer loading our state is waited for: its record, once it is at our epoch, is read as soon)
        near = ((others and self.stage.near_step(self.net.announce_period, self.target_batch_size)
                 and not self._heard_from_all(now)) or bool(self.stage.handed_now()) or self._mates_unseen()
                or (not others and self._waiting_alone(now)))
        every = LOOK_EVERY if near else self.net.announce_period * (1 if others else RENEW_PERIODS)
        asked = self.stage.asked_by_unseen > self._records_read[0]
        if now - self._records_read[0] >= every or asked:
            fresh = 0.0 if asked else every / 2 if near else every
            found, began = await self.directory.read_stages(  # (a read begun before our step is stale)
                [self.stage.index], fresh=min(fresh, now - self._stepped_at))
            records = found[self.stage.index]
            listed = {r.peer_id for r in records}
            self._seen = {p for p in self._seen | listed if p in self.directory.expires and p != self.peer_id}
            self._lapsed = lapsed_in(self.directory.expires, self._seen, listed, began)
            self._records_read = (now, records)
        return self._records_read[1]

    def _waiting_alone(self, now: float) -> bool:
        """Whether the step plan, seeing no other replica, holds a step's samples and waits out the grace for
        one to show up. Only another replica's record can change what it decides then, and read every
        RENEW_PERIODS periods that record came late: at a run's start, where the trainers were up before the
        servers, a stage's two replicas each waited alone and took their first step on up to 19 times its
        samples."""
        return (0.0 <= now - self.stage.plan.alone_since < self.grace
                and self.stage.runtime.pending_samples >= self.target_batch_size)

    def _mates_unseen(self) -> bool:
        """Whether the other members of the round that took us to our epoch are not yet seen there. They
        stepped as we did and announce it at once; until their records show it, nothing decides the stage's
        next step, and a read a whole period away would hold that step back as long (the stage then steps
        on several times the samples it is set to, while the other stages step at their size)."""
        epoch, mates = self.stage.plan.groupmates
        seen_epoch, seen = self.stage.plan.peers_at_epoch
        return epoch == self.stage.runtime.epoch and bool(mates) and not (seen_epoch == epoch and mates <= seen)

    def _heard_from_all(self, now: float) -> bool:
        """Whether every replica last seen at our epoch told us its count within the last period (`count`
        calls): their counts then need no reads of their records."""
        epoch, peers = self.stage.plan.peers_at_epoch
        told = self.stage.told_counts()
        return epoch == self.stage.runtime.epoch and all(
            p in told and told[p][0] == epoch and now - told[p][2] < self.net.announce_period for p in peers)

    async def _trainers(self) -> list[TrainerRecord]:
        """The trainers in view, read as often as `trainers_read_every` says."""
        now = time.monotonic()
        seen = self._trainers_read[1]
        held = self.stage.runtime.pending_samples + self.stage.plan.peers_pending
        every = trainers_read_every(bool(seen), any(t.done for t in seen),
                                    self.stage.work.unusually_idle(self.net.announce_period), held,
                                    self.net.announce_period, LOOK_EVERY)
        if now - self._trainers_read[0] >= every:
            self._trainers_read = (now, await self.directory.trainers())
        return self._trainers_read[1]

    async def _resolve_divergence(self, error: WeightsDiverged) -> None:
        """Replicas at one epoch hold different weights (they once stepped without each other): all take
        the weights most of them announce (`swarm.core.vouching.keeper`), so that the download is vouched
        for by the replicas holding them."""
        st = self.stage
        records = [r for r in await self.directory.stage(st.index)
                   if r.peer_id in error.group and r.epoch == st.runtime.epoch and r.digest]
        digests = {**{r.peer_id: r.digest for r in records}, self.peer_id: st.runtime.last_digest}
        keeper = keeper_of(digests)
        ours = digests[keeper] == st.runtime.last_digest
        log.warning("stage %d replicas diverged at epoch %d (%s); %s", st.index, st.runtime.epoch, error,
                    "keeping ours" if ours else f"taking the weights of {short(keeper)}")
        if not ours:
            await self.transfer.download([r for r in records if r.peer_id == keeper], force=True)

    async def _step(self, epoch: int, group: tuple[str, ...]) -> None:
        """Step (or average) with `group`, unless the round does not open here."""
        st = self.stage
        round_ = self._average_round if st.runtime.asynchronous else self._sync_round
        record = await round_(epoch, group)
        if record is None:
            return
        # at once, before anything awaits: a groupmate may propose the next round as soon as it stepped
        st.plan = replace(st.plan, groupmates=(st.runtime.epoch, frozenset(group) - {self.peer_id}))
        st.steps.append(record)
        self.results.append(self.steps_file, asdict(record))
        if record.group > 1 and st.checkpoints is None:  # with checkpoints, only the disk counts
            st.durable_epoch = record.epoch
        if st.runtime.asynchronous:
            log.info("stage %d average %d: %d samples from %d replica(s), lr %.2e, mean delta norm %.3f, "
                     "drift %.4f after %d local update(s)", st.index, record.epoch, record.samples, record.group,
                     record.lr, record.grad_norm, record.drift, record.local_updates)
        else:
            log.info("stage %d step %d: %d samples from %d replica(s), lr %.2e, grad norm %.3f",
                     st.index, record.epoch, record.samples, record.group, record.lr, record.grad_norm)
        if not math.isfinite(record.grad_norm):
            log.error("stage %d step %d: the gradient was not finite, so the weights were left as they were",
                      st.index, record.epoch)
        await self.announcer.announce()
        if st.checkpoints is not None and record.epoch % self.checkpoint_every == 0:
            await self.transfer.checkpoint()

    def _opens(self, epoch: int) -> bool:
        """Whether the round for `epoch` goes ahead (call with the gate held): not if this replica was
        taken for gone meanwhile (it dropped its samples) or is no longer at that epoch. A peer that
        looks behind after this round is waited for anew."""
        st = self.stage
        if self.finishing or st.drop_if_lapsed() or st.runtime.epoch != epoch:
            return False
        st.plan = replace(st.plan, behind_since={})
        return True

    async def _sync_round(self, epoch: int, group: tuple[str, ...]) -> StepRecord | None:
        """All-reduce the stage's gradients and step. The gate is held to take the gradients out and to
        step, not while they travel: backwards go on meanwhile, into the next step (at the weights they
        ran at, as a graph a step overtook does: `swarm.server.stash`). A replica whose other replicas wait
        on its part in a round so loses no compute to them, and a slow one holds up no one but itself."""
        st = self.stage
        self._round_over.clear()
        try:
            async with self.gate.lock.urgent():
                if not self._opens(epoch):
                    return None
                if len(group) == 1:  # no one to wait for: letting go of the gate would only cost copies
                    return await self.gate.run_locked(st.runtime.step_alone)
                st.round_epoch = epoch
                own = await self.gate.run_locked(st.runtime.begin_step)
            try:
                mean, samples, ids = await self._reduce(epoch, group, own.flat, own.samples, own.ids)
            except BaseException:  # (cancelled too, even twice: the gradients must not be lost)
                await asyncio.shield(self._return_part(own))
                raise
            async with self.gate.lock.urgent():
                return await self.gate.run_locked(st.runtime.apply_step, mean, samples, len(group), ids, own)
        finally:
            st.round_epoch = None
            self._round_over.set()

    async def _return_part(self, own: StepPart) -> None:
        async with self.gate.lock.urgent():
            await self.gate.run_locked(self.stage.runtime.return_part, own)

    async def finish(self) -> None:
        """Start no round; let a sync round under way end, since the stage's other replicas wait on it."""
        self.finishing = True
        await self._round_over.wait()

    async def _average_round(self, epoch: int, group: tuple[str, ...]) -> StepRecord | None:
        """Average the replicas' weights (async mode); serving goes on while the deltas travel."""
        st = self.stage
        async with self.gate.lock.urgent():
            if not self._opens(epoch):
                return None
            own = await self.gate.run_locked(st.runtime.begin_average)
        st.round_epoch = epoch
        try:
            mean, samples, ids = await self._reduce(epoch, group, own.contribution, own.samples, own.ids)
            async with self.gate.lock.urgent():
                return await self.gate.run_locked(st.runtime.finish_average, own, mean, samples, len(group), ids)
        finally:
            st.round_epoch = None

    async def _reduce(
        self, epoch: int, group: tuple[str, ...], flat: torch.Tensor, samples: int, ids: list[str]
    ) -> tuple[torch.Tensor, int, list[str]]:
        """The stage's sample-weighted mean of `flat` (sums over samples), its samples and microbatches."""
        if len(group) == 1:  # in place: a stage's whole gradient is large, and nothing else reads `flat`
            return flat.div_(max(samples, 1)), samples, ids
        runtime = self.stage.runtime
        result = await self.allreduce.run(epoch, group, flat, samples, runtime.last_digest, ids,
                                          runtime.book.receipts_for(ids))
        return result.mean, result.samples, result.ids
