"""Everything that belongs to serving one stage, built fresh each time a server enters a stage (on
start, and on every move): the stage's module and optimizer (`StageRuntime`), what it accepts and emits,
its throughput figures, counters, step history and the flags the server's jobs share.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import torch

from swarm.config import ModelConfig, OptimConfig, ServerConfig
from swarm.core import StageRate
from swarm.core.stepping import PlanMemory, accept_proposal, unseen_in, worth_telling
from swarm.model import build_stage, stage_boundary
from swarm.server.checkpoints import CheckpointStore
from swarm.server.lossscale import LossScale
from swarm.server.records import StepRecord
from swarm.server.runtime import StageRuntime
from swarm.wire.calls import CountNote
from swarm.wire.codecs import Policy
from swarm.wire.validate import TensorSpec

log = logging.getLogger("swarm.server")
# the first windows of work at a stage carry one-off costs (first-call allocations, lazy initialization):
# the capacity figure, which decides moves and must not be skewed for long, starts after them
WARMUP_WINDOWS = 3
GAP_ALPHA = 0.1  # weight of the newest gap between passes in their running average
IDLE_GAPS = 4  # usual gaps between passes that must go by without work before the run may be over
MAX_TOLD = 256  # peers whose counts are kept (a stage has far fewer replicas)
# seconds a round proposed with replicas the step plan had not seen waits for the plan to read the stage (one
# DHT read); then, or at once where the step loop is busy elsewhere (a download), it is judged as it stands
UNSEEN_WAIT = 3.0


def stage_specs(model: ModelConfig, module: torch.nn.Module) -> tuple[TensorSpec, TensorSpec | None]:
    """What the stage accepts and emits, as its module declares it (or probed; see `stage_boundary`)."""
    inputs, outputs = stage_boundary(model, module)
    ids_bound = model.vocab_size if not inputs.dtype.is_floating_point else None
    in_spec = TensorSpec(inputs.dtype, inputs.shape, max_value=ids_bound)
    return in_spec, None if outputs is None else TensorSpec(outputs.dtype, outputs.shape)


class WorkMeter:
    """Samples/s of forward+backward compute, folded from windows of at least one announcement period:
    over the last few windows for routing (`meter`, of the work as served), and over the last ten or so
    for rebalancing (`capacity`, of the work as it would go with the server's cores to itself: see
    `ComputeGate.run_locked`), which must not move servers on a passing fluctuation."""

    def __init__(self, last_stage: bool):
        passes = ("forward",) if last_stage else ("forward", "backward")
        self.meter = StageRate(passes, alpha=0.3)
        self.capacity = StageRate(passes, alpha=0.1, skip=WARMUP_WINDOWS)
        self._window: dict[str, tuple[int, float]] = {}  # pass -> (samples, seconds) since the last fold
        self._alone: dict[str, float] = {}  # pass -> its seconds in the window with the cores to itself
        self._start = time.monotonic()
        self.last = -math.inf  # (monotonic) when the last forward or backward pass was done
        self.gap = 0.0  # seconds between passes, averaged: how long this stage usually waits for work

    def count(self, work: str, samples: int, seconds: float, alone: float | None = None) -> None:
        done, spent = self._window.get(work, (0, 0.0))
        self._window[work] = (done + samples, spent + seconds)
        self._alone[work] = self._alone.get(work, 0.0) + (seconds if alone is None else alone)
        now = time.monotonic()
        if math.isfinite(self.last):
            self.gap += GAP_ALPHA * (now - self.last - self.gap)
        self.last = now

    def unusually_idle(self, period: float) -> bool:
        """Whether no work came for longer than a period and than several of this stage's usual gaps
        between passes: the run may be over (a stage that is not the bottleneck waits longer between
        passes, and around each step, without the run being over)."""
        return time.monotonic() - self.last > max(period, IDLE_GAPS * self.gap)

    def fold(self, period: float) -> None:
        now = time.monotonic()
        if self._window and now - self._start >= period:
            self.meter.update(self._window)
            self.capacity.update({work: (done, self._alone[work]) for work, (done, _) in self._window.items()})
            self._window, self._alone, self._start = {}, {}, now


class ServedStage:
    def __init__(self, index: int, peer_id: str, label: str, runtime: StageRuntime, in_spec: TensorSpec,
                 out_spec: TensorSpec | None, checkpoints: CheckpointStore | None):
        self.index = index
        self.peer_id = peer_id
        self.label = label  # how logs name this server
        self.runtime = runtime
        self.in_spec, self.out_spec = in_spec, out_spec
        self.checkpoints = checkpoints
        self.work = WorkMeter(runtime.is_last)
        self.steps: list[StepRecord] = []
        self.counters = {"refused": 0, "failed_rounds": 0, "catch_ups": 0, "lost_samples": 0, "stale_refusals": 0,
                         "busy_refusals": 0, "samples_served": 0, "counts_heard": 0}
        self.started = time.time()
        self.since = time.monotonic()
        self.busy_start = 0.0  # the compute gate's busy seconds when the server entered the stage
        self.wake = asyncio.Event()  # the stage may be ready to step: look now
        self.plan = PlanMemory()  # what the step plan carries between looks
        self.proposal: tuple[int, tuple[str, ...]] | None = None  # a round a groupmate began, accepted
        self.proposed = asyncio.Event()  # set with `proposal`: it ends a failed round's backoff
        self.asked_by_unseen = -math.inf  # (monotonic) when a round was proposed with replicas our plan had not seen
        self.planned_from = -math.inf  # (monotonic) when the read of the stage the step plan last decided from began
        self._planned = asyncio.Event()  # set, and replaced, when the plan has decided from a newer read
        self.round_epoch: int | None = None  # the epoch whose step round is running
        self.durable_epoch = 0  # the newest epoch that outlives this replica (see the `ledger` handler)
        self.lapsed = False  # the process stalled so long that its DHT record may have lapsed
        self.serving = False  # between entering the stage and leaving it
        self.moving_to: int | None = None  # the stage this server is about to move to
        self.drained = False  # moving, and done with this stage's work: it takes no more of it
        self.stale_logged = -1  # the last epoch at which this replica said it is behind
        self.entry: dict | None = None  # how it took the stage's state with no replica left (swarm.server.restoring)
        self.fresh = 0.0  # unix time it started the stage afresh mid-run, at its operator's word (0: it did not)
        self.previous_stage = -1  # the stage this server moved here from (-1: it joined here)
        self._handed: dict[str, tuple[int, float]] = {}  # peer -> (epoch, monotonic time) of our state it took
        self._told: dict[str, tuple[CountNote, float]] = {}  # peer -> the newest count it told us, and when

    @classmethod
    def build(cls, model: ModelConfig, optim: OptimConfig, server: ServerConfig, index: int, peer_id: str,
              label: str, wire: Policy | None = None) -> ServedStage:
        """The stage at its initial weights (run on the compute thread: building may take a while).
        `wire`: the codecs results are packed with on the compute thread (see swarm.wire.codecs.on_host)."""
        module = build_stage(model, index)  # this stage alone, where the model spec allows it
        in_spec, out_spec = stage_specs(model, module)
        runtime = StageRuntime(module, optim, server.device, server.autocast, server.graph_ttl, wire,
                               LossScale(server.fp16_loss_scale, server.fp16_growth_interval))
        checkpoints = (CheckpointStore(server.checkpoint_dir, index, server.keep_checkpoints)
                       if server.checkpoint_dir else None)
        return cls(index, peer_id, label, runtime, in_spec, out_spec, checkpoints)

    @property
    def tenure(self) -> float:
        return time.monotonic() - self.since

    async def accept_proposal(self, epoch: int, group: tuple[str, ...]) -> bool:
        """A groupmate began the round for `epoch` with `group` (see swarm.averaging.allreduce): join it
        unless the step plan objects (`swarm.core.stepping.accept_proposal`), waking the step loop. Where
        the only objection is members the plan has not seen at our epoch (a replica that announced itself
        since our last read: at a stage's first round, each replica's), the step loop reads the stage at
        once and the proposal is judged again from that read. Refused at once, the proposer's round failed
        and it waited out a backoff, with a warning in both logs, at every start."""
        if self._join(epoch, group):
            return True
        if not unseen_in(self.plan, self.peer_id, self.runtime.epoch, epoch, group):
            return False
        asked = self.asked_by_unseen = time.monotonic()  # the step loop reads the stage before it decides
        self.wake.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(UNSEEN_WAIT):  # (not wait_for: it can lose a cancellation)
                while self.planned_from < asked:
                    await self._planned.wait()
        return self._join(epoch, group)

    def _join(self, epoch: int, group: tuple[str, ...]) -> bool:
        if not accept_proposal(self.plan, self.peer_id, self.runtime.epoch, epoch, group):
            return False
        self.proposal = (epoch, group)
        self.proposed.set()
        self.wake.set()
        return True

    def note_planned(self, read_began: float) -> None:
        """The step plan decided from a read of the stage begun at `read_began` (monotonic): proposals
        waiting for a read begun after they came are judged again."""
        if read_began > self.planned_from:
            self.planned_from = read_began
            self._planned.set()
            self._planned = asyncio.Event()

    def near_step(self, period: float, target_batch_size: int) -> bool:
        """Whether other replicas were at our epoch in the step plan's last view and the stage may reach
        its step within two `period`s (`swarm.core.stepping.worth_telling`): only then do the sample
        counts replicas announce and read decide anything."""
        epoch, peers = self.plan.peers_at_epoch
        return epoch == self.runtime.epoch and worth_telling(
            self.runtime.pending_samples, len(peers), self.plan.peers_pending, self.work.meter.rate, period,
            target_batch_size)

    def note_handed(self, peer: str, epoch: int) -> None:
        """`peer` downloaded our state at `epoch`: the step plan waits a while for it to join us there."""
        self._handed = {p: (e, t) for p, (e, t) in self._handed.items() if e >= self.runtime.epoch}
        self._handed[peer] = (epoch, time.monotonic())

    def handed_now(self) -> dict[str, float]:
        """The peers that downloaded our state at our current epoch, and when."""
        return {p: t for p, (e, t) in self._handed.items() if e == self.runtime.epoch}

    def note_count(self, peer: str, note: CountNote) -> None:
        """A count another replica told us (`count` calls, near the step): the step plan takes it over the
        sample count of that peer's DHT record at the same epoch, and looks at once if it is for ours. Only
        peers in the stage's records are listened to (see `told_counts`), so a stranger's note changes nothing."""
        now, epoch = time.monotonic(), self.runtime.epoch
        held = self._told.get(peer)
        if held is not None and held[0].seq >= note.seq or not epoch <= note.epoch <= epoch + 1:
            return  # an older note that overtook a newer one, or one of no step we are about to take
        self._told = {p: (n, t) for p, (n, t) in self._told.items() if n.epoch >= epoch}
        while len(self._told) >= MAX_TOLD:  # (many identities, each telling once: the oldest go)
            del self._told[min(self._told, key=lambda p: self._told[p][1])]
        self._told[peer] = (note, now)
        self.counters["counts_heard"] += 1
        if note.epoch == self.runtime.epoch:
            self.wake.set()

    def told_counts(self) -> dict[str, tuple[int, int, float]]:
        """peer -> (epoch, samples, monotonic time) of the newest count it told us."""
        return {p: (n.epoch, n.pending, t) for p, (n, t) in self._told.items()}

    def drop_if_lapsed(self) -> bool:
        """A replica that stalled long enough for its DHT record to lapse has been taken for dead:
        trainers accumulate the gradients it held again elsewhere. So it drops them before anything
        else, or they would enter a step twice. Call with the compute gate held. Not while a round has
        this replica's gradients out (the stage's other replicas are summing them): after it."""
        if not self.lapsed or self.round_epoch is not None:
            return False
        self.lapsed = False
        if not self.runtime.pending_samples:
            return False
        lost = self.runtime.discard_gradients()
        self.counters["lost_samples"] += lost
        log.warning("stage %d server %s was taken for gone: dropping %d unstepped samples, which trainers "
                    "send again", self.index, self.label, lost)
        return True
