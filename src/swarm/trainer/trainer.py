"""The microbatch pipeline: data -> stage 0 -> ... -> last stage (loss) -> ... -> stage 0 backward.

One microbatch, in order (`_microbatch`):
  1. for each stage but the last, pick a server (stochastic wiring) and run `forward`;
  2. the last stage runs forward, loss and backward in one call and returns d(loss)/d(inputs);
  3. backward through the earlier stages in reverse, preferring the server that ran the forward
     (it kept the graph); any other replica recomputes the forward from the inputs we resend.
A failed call bans that server for a while and retries the same stage elsewhere. Several
microbatches are in flight at once so one trainer keeps servers of every stage busy.

Delivery (see `swarm.core.delivery`): every gradient a stage accumulates for a microbatch is tracked
until the stage's ledger shows it in a step that is on disk. A call that may have been applied (it
timed out, or its connection broke twice) is retried elsewhere for the input gradient only; a
gradient lost with the replica that held it is accumulated again from what the trainer kept. The
microbatches whose forward failed before anything was accumulated are retried whole.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import signal
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from swarm.config import ConfigMismatch, SwarmConfig, agreed, config_hash, describe_mismatch
from swarm.core import (
    BanList,
    Candidate,
    LatencyTracker,
    SmoothWeightedRoundRobin,
    Verdict,
    backoff_delay,
    choose_server,
    judge,
    merge_answers,
)
from swarm.data import SampleShard, load_documents, split_inputs_targets
from swarm.net.directory import short
from swarm.net.peer import join
from swarm.net.protocol import Tagged, Traffic
from swarm.net.transport import CallFailed
from swarm.results import PeerResults
from swarm.wire.records import ServerRecord, TrainerRecord

log = logging.getLogger("swarm.trainer")


class MicrobatchFailed(Exception):
    """A stage could not be completed on any server within the allowed attempts."""


@dataclass
class Completed:
    time: float
    samples: int
    loss: float
    epoch: int  # the last stage's epoch when it computed this loss
    req: str


@dataclass
class Served:
    """A stage call that succeeded, and who holds the gradient it accumulated (if it accumulated one)."""

    peer: str  # the server that answered
    meta: dict
    tensors: list[torch.Tensor]
    holder: str  # the server that accumulated (or, after an unanswered call, may have accumulated) it
    epoch: int  # the stage's epoch at the holder when it accumulated, as far as we know


@dataclass
class Delivery:
    """A stage's gradient of one microbatch, kept until a durable step of the stage took it in."""

    req: str
    stage: int
    method: str  # the call that accumulates it again: "backward", or "forward" for the last stage
    tensors: list[torch.Tensor]
    holder: str
    epoch: int
    judge_after: float  # monotonic time before which no verdict is taken (a doubtful call may still run)
    replaying: bool = False


class Trainer:
    def __init__(self, cfg: SwarmConfig):
        self.cfg = cfg
        self.tc = cfg.trainer
        self.hash = config_hash(cfg)
        self.num_stages = cfg.model.num_stages
        self.rng = random.Random(cfg.data.seed * 7919 + self.tc.index)
        self.bans = BanList(self.tc.ban_seconds, self.tc.ban_seconds * 8)
        self.round_robin = [SmoothWeightedRoundRobin() for _ in range(self.num_stages)]
        self.view: dict[int, list[ServerRecord]] = {k: [] for k in range(self.num_stages)}
        self.inflight: dict[str, int] = {}
        self.stage_epoch = [0] * self.num_stages
        self.completed: list[Completed] = []
        self.deliveries: dict[tuple[str, int], Delivery] = {}
        self.latency = {(k, m): LatencyTracker() for k in range(self.num_stages) for m in ("forward", "backward")}
        self.failed = 0
        self.retries = 0
        self.replays = 0
        self.unresolved = 0
        self.done = False
        self.call_seconds: dict[str, float] = {}  # "stage/method" -> time spent waiting on such calls
        self.traffic = Traffic()
        self._ids = itertools.count()
        self._mismatch_logged: set[str] = set()
        self._waiting_logged: set[int] = set()
        self._requeued: list[torch.Tensor] = []  # batches whose forward failed: they are retried whole
        self._replaying: set[asyncio.Task] = set()
        # (stage, server) -> when it was last in our view of the stage (monotonic); a server that moved to
        # another stage is gone from this one
        self._last_seen: dict[tuple[int, str], float] = {}

    def run(self) -> None:
        asyncio.run(self.train())

    # ---- the training loop -------------------------------------------------------------------

    async def train(self, stop: asyncio.Event | None = None) -> None:
        """Train until the target steps (or SIGTERM, which lets the microbatches in flight finish and
        their gradients settle; SIGINT or `stop` ends at once)."""
        self.stop = stop or asyncio.Event()
        self.draining = False
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._drain)
        shard = SampleShard(
            load_documents(self.cfg.data), self.cfg.model.seq_len, self.tc.index, self.tc.num_trainers,
            self.cfg.data.seed,
        )
        batches = shard.batches(self.tc.microbatch_size)
        peer = await join(self.cfg.net, self.cfg.wire, self.traffic, serving=False)
        self.peer_id, self.client, self.directory = peer.peer_id, peer.client, peer.directory
        try:
            self.started = time.time()
            log.info("trainer %s started: shard %d/%d with %d samples, target %d steps",
                     short(self.peer_id), self.tc.index, self.tc.num_trainers, len(shard), self.tc.target_steps)
            await self._refresh()
            self._check_config()
            background = [asyncio.create_task(self._refresh_loop()), asyncio.create_task(self._delivery_loop()),
                          asyncio.create_task(self._progress_loop())]
            slots = asyncio.Semaphore(self.tc.max_inflight)
            running: set[asyncio.Task] = set()
            while not self._finished():
                await slots.acquire()
                if self._finished():
                    slots.release()
                    break
                batch = self._requeued.pop(0) if self._requeued else next(batches)
                task = asyncio.create_task(self._microbatch(batch))
                running.add(task)
                task.add_done_callback(lambda t: (running.discard(t), slots.release()))
            if running:
                await asyncio.gather(*running)
            self.done = True
            await self._announce()
            await self._settle()
            for task in background:
                task.cancel()
            await self._announce()
            log.info("trainer %s done: %d samples, %d microbatches failed, %d retries, %d gradients replayed",
                     short(self.peer_id), self._samples(), self.failed, self.retries, self.replays)
        finally:
            self._write_summary()
            peer.leave()

    def _finished(self) -> bool:
        return self.stop.is_set() or self.draining or min(self.stage_epoch) >= self.tc.target_steps

    def _drain(self) -> None:
        if not self.draining:
            log.info("trainer stopping: finishing the microbatches in flight")
        self.draining = True

    def _samples(self) -> int:
        return sum(c.samples for c in self.completed)

    async def _microbatch(self, batch: torch.Tensor) -> None:
        inputs, targets = split_inputs_targets(batch)
        req = f"{next(self._ids)}"
        last = self.num_stages - 1
        try:
            x, path = inputs, []
            for k in range(last):
                served = await self._call(k, "forward", req, [x])
                path.append((served.peer, x))
                x = served.tensors[0]
        except MicrobatchFailed as e:  # nothing was accumulated yet: the batch is retried whole
            self.failed += 1
            self._requeued.append(batch)
            log.warning("microbatch %s forward failed (%s); its batch will be sent again", req, e)
            return
        try:
            served = await self._call(last, "forward", req, [x, targets], accumulating=True)
            self._track(req, last, "forward", [x, targets], served)
            loss, epoch, grads = float(served.meta["loss"]), int(served.meta["epoch"]), served.tensors
            for k in reversed(range(last)):
                peer, x_k = path[k]
                served = await self._call(k, "backward", req, [x_k, grads[0]], prefer=peer, accumulating=True)
                self._track(req, k, "backward", [x_k, grads[0]], served)
                grads = served.tensors
        except MicrobatchFailed as e:  # stopping, or refused: accumulating calls are otherwise retried
            self.failed += 1
            log.warning("microbatch %s abandoned: %s", req, e)
            return
        self.completed.append(Completed(time.time(), inputs.shape[0], loss, epoch, req))

    # ---- calling a stage, with stochastic wiring and retries -----------------------------------

    def _pick(self, stage: int, prefer: str | None) -> str | None:
        now = time.monotonic()
        live = {r.peer_id: r for r in self.view[stage]}
        if prefer in live and not self.bans.is_banned(prefer, now):
            return prefer
        candidates = [  # a server on its way to another stage takes no new work
            Candidate(r.peer_id, r.throughput, r.queue, self.inflight.get(r.peer_id, 0))
            for r in live.values() if not r.moving
        ]
        if self.tc.routing == "wrr":
            return self.round_robin[stage].pick(candidates, self.bans.banned(now))
        return choose_server(candidates, self.rng, self.bans.banned(now))

    async def _call(
        self,
        stage: int,
        method: str,
        req: str,
        tensors: list[torch.Tensor],
        prefer: str | None = None,
        accumulating: bool = False,
    ) -> Served:
        """Call `method` of some server of `stage`, retrying elsewhere on failure.

        A call that got no answer may still have been applied. If its connection broke, it is first
        repeated on the same server with the same request id (that server answers a repeat without
        applying it twice). Otherwise an accumulating call goes elsewhere for the input gradient only,
        and the first server stays the holder of the gradient, in doubt until its stage's ledger tells.
        Accumulating calls are retried until they succeed (a stage without servers is waited for):
        giving one up would leave the microbatch in some stages' steps and not in others.
        """
        meta = {"req": req, "stage": stage, "config": self.hash}
        repeat: str | None = None
        holder: tuple[str, int] | None = None  # (server, epoch) of an unanswered accumulating call
        attempt = 0
        while attempt < self.tc.max_attempts or accumulating:
            if self.stop.is_set():
                raise MicrobatchFailed(f"stopped during stage {stage} {method}")
            peer = repeat or self._pick(stage, prefer)
            while peer is None:
                if self.stop.is_set():
                    raise MicrobatchFailed(f"stopped while waiting for a server of stage {stage}")
                await self._wait_for_server(stage)
                peer = self._pick(stage, prefer)
            tracker = self.latency[stage, method]
            timeout = tracker.timeout(min(self.tc.min_request_timeout, self.tc.request_timeout),
                                      self.tc.request_timeout)
            # past `deadline` a server drops the request: by then we have sent it elsewhere, and a delivery
            # in doubt is judged only request_timeout after its failure (see _track)
            deadline = time.time() + timeout + self.tc.request_timeout / 2
            meta.update(epoch=self._live_epoch(stage), timeout=timeout, deadline=deadline,
                        accumulate=accumulating and holder is None)
            self.inflight[peer] = self.inflight.get(peer, 0) + 1
            started = time.perf_counter()
            try:
                reply = await self.client.call(peer, method, meta, _tagged(stage, method, tensors), timeout)
            except CallFailed as e:
                if e.refused:
                    raise MicrobatchFailed(f"stage {stage} refused the request: {e}") from e
                self.retries += 1
                attempt += 1
                if not e.answered and not e.timed_out and repeat is None:
                    repeat = peer
                    log.info("stage %d %s on %s failed (%s); repeating it there", stage, method, short(peer), e)
                else:
                    if meta["accumulate"] and not e.answered:
                        holder = (peer, int(meta["epoch"]))
                    repeat, prefer = None, None
                    self.bans.ban(peer, time.monotonic())
                    log.info("stage %d %s on %s failed (%s); retrying elsewhere%s", stage, method, short(peer), e,
                             " for the input gradient only" if holder else "")
                await asyncio.sleep(backoff_delay(min(attempt, 6), 0.05, 2.0, self.rng))
                continue
            finally:
                self.inflight[peer] -= 1
                elapsed = time.perf_counter() - started
                key = f"{stage}/{method}"
                self.call_seconds[key] = self.call_seconds.get(key, 0.0) + elapsed
            tracker.observe(elapsed)
            self.bans.forgive(peer)
            epoch = int(reply[0].get("epoch", 0))
            self.stage_epoch[stage] = max(self.stage_epoch[stage], epoch)
            held_by, held_at = holder or (peer, epoch)
            return Served(peer, reply[0], reply[1], held_by, held_at)
        raise MicrobatchFailed(f"stage {stage} {method} failed on {self.tc.max_attempts} attempts")

    # ---- exactly-once delivery of gradients -----------------------------------------------------

    def _track(self, req: str, stage: int, method: str, tensors: list[torch.Tensor], served: Served) -> None:
        doubtful = served.holder != served.peer
        judge_after = time.monotonic() + (self.tc.request_timeout if doubtful else 0.0)
        self.deliveries[req, stage] = Delivery(req, stage, method, tensors, served.holder, served.epoch, judge_after)

    async def _delivery_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.net.announce_period)
            try:
                await self._judge_deliveries()
            except Exception as e:  # a view or a replica that failed to answer: the next pass asks again
                log.warning("could not check the delivery of gradients: %s", e)

    async def _judge_deliveries(self) -> None:
        """Ask each stage's most advanced replica (and any other live holder) about our open gradients."""
        now = time.monotonic()
        for stage in range(self.num_stages):
            open_ = [d for d in self.deliveries.values()
                     if d.stage == stage and not d.replaying and d.judge_after <= now]
            live = {r.peer_id: r for r in self.view[stage]}
            if not open_ or not live:
                continue
            ask = {max(live.values(), key=lambda r: r.epoch).peer_id}
            ask |= {d.holder for d in open_ if self._seen_lately(stage, d.holder)}
            answers = await asyncio.gather(*(self._ask_ledger(peer, stage, open_) for peer in ask))
            answers = [a for a in answers if a is not None]
            if not answers:
                continue
            for d in open_:
                answer = merge_answers(answers, d.req)
                verdict = judge(d.epoch, self._seen_lately(stage, d.holder), answer, self.tc.keep_epochs,
                                need_durable=not self.done)
                if verdict is Verdict.DONE:
                    del self.deliveries[d.req, d.stage]
                elif verdict is Verdict.REPLAY:
                    d.replaying = True
                    task = asyncio.create_task(self._replay(d))
                    self._replaying.add(task)
                    task.add_done_callback(self._replaying.discard)

    def _seen_lately(self, stage: int, peer: str) -> bool:
        """Whether a server counts as alive: in one of the views of the last few announcement periods.
        One view that misses it (a DHT lookup can come back partial under load) does not make it dead."""
        return time.monotonic() - self._last_seen.get((stage, peer), -math.inf) < 3 * self.cfg.net.announce_period

    async def _ask_ledger(self, peer: str, stage: int, open_: list[Delivery]) -> dict | None:
        meta = {"stage": stage, "ids": [d.req for d in open_]}
        try:
            reply, _ = await self.client.call(peer, "ledger", meta, [], self.tc.min_request_timeout)
        except CallFailed as e:
            log.debug("ledger of %s did not answer: %s", short(peer), e)
            return None
        return reply

    async def _replay(self, d: Delivery) -> None:
        """Accumulate a lost gradient again, from the stage inputs and output gradient we kept."""
        try:
            served = await self._call(d.stage, d.method, d.req, d.tensors, accumulating=True)
        except MicrobatchFailed as e:
            log.warning("replay of microbatch %s at stage %d failed: %s", d.req, d.stage, e)
            d.replaying = False
            return
        self.replays += 1
        log.info("microbatch %s: stage %d gradient lost with %s, accumulated again on %s",
                 d.req, d.stage, short(d.holder), short(served.holder))
        self._track(d.req, d.stage, d.method, d.tensors, served)

    async def _settle(self) -> None:
        """After the last microbatch: wait (bounded) until every gradient we sent is in a step."""
        deadline = time.monotonic() + self.tc.settle_timeout
        while self.deliveries and time.monotonic() < deadline and not self.stop.is_set():
            await asyncio.sleep(0.1)
        self.unresolved = len(self.deliveries)
        if self.unresolved:
            log.warning("%d microbatch gradients not confirmed in a step after %.0fs", self.unresolved,
                        self.tc.settle_timeout)

    def _live_epoch(self, stage: int) -> int:
        """The stage's epoch as its live replicas announce it: a replica behind it must not serve us.
        (Not the highest epoch ever seen: a stage whose replicas all died restarts from a checkpoint.)"""
        return max((r.epoch for r in self.view[stage]), default=0)

    async def _wait_for_server(self, stage: int) -> None:
        if self.view[stage]:  # servers exist but all are banned: wait for the first ban to run out
            now = time.monotonic()
            await asyncio.sleep(max(0.05, min(self.bans.remaining(r.peer_id, now) for r in self.view[stage])))
            return
        if stage not in self._waiting_logged:
            self._waiting_logged.add(stage)
            log.warning("no live server for stage %d; waiting for one to appear", stage)
        await asyncio.sleep(self.cfg.net.announce_period)
        await self._refresh()

    # ---- the view of the swarm ---------------------------------------------------------------

    async def _refresh(self) -> None:
        for stage, records in (await self.directory.stages(self.num_stages)).items():
            usable = []
            for r in records:
                if r.config_hash != self.hash:
                    if r.peer_id not in self._mismatch_logged:
                        self._mismatch_logged.add(r.peer_id)
                        log.warning("ignoring server %s: other settings (%s)", short(r.peer_id),
                                    describe_mismatch(agreed(self.cfg), r.agreed()))
                    continue
                usable.append(r)
                self.stage_epoch[stage] = max(self.stage_epoch[stage], r.epoch)
            if usable and stage in self._waiting_logged:
                self._waiting_logged.discard(stage)
                log.info("stage %d has %d server(s) again", stage, len(usable))
            self.view[stage] = usable
            now = time.monotonic()
            self._last_seen.update(((stage, r.peer_id), now) for r in usable)

    def _check_config(self) -> None:
        """Refuse to start against a swarm whose servers all run with other settings."""
        if self._mismatch_logged and not any(self.view.values()):
            raise ConfigMismatch(
                "every server of this run uses other settings (see the lines above); "
                "use the swarm's model and optim sections and swarm version, or another net.run_id"
            )

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.net.announce_period / 2)
            try:
                await self._refresh()
                await self._announce()
            except Exception as e:
                log.warning("could not refresh the swarm view: %s", e)

    async def _announce(self) -> None:
        """`done` tells servers that no new microbatch will come, so they may flush what they hold."""
        record = TrainerRecord(self.peer_id, self._samples(), self.failed, self._recent_loss(), self.done,
                               self._recent_rate())
        await self.directory.announce_trainer(record, ttl=60.0 if self.done else None)

    # ---- progress, for the person watching ---------------------------------------------------------

    def _recent_loss(self) -> float:
        recent = self.completed[-20:]
        return sum(c.loss for c in recent) / len(recent) if recent else float("nan")

    def _recent_rate(self) -> float:
        """Samples/s completed over the last `trainer.progress_every` seconds (since the start, before)."""
        now = time.time()
        since = max(now - self.tc.progress_every, self.started)
        samples = sum(c.samples for c in itertools.takewhile(lambda c: c.time >= since, reversed(self.completed)))
        return samples / max(now - since, 1e-9)

    def _progress(self) -> str:
        loss = self._recent_loss()
        return (f"{self._samples():,} samples ({self._recent_rate():.1f}/s), loss "
                + ("-" if math.isnan(loss) else f"{loss:.3f}")
                + ", servers/stage " + "/".join(str(len(self.view[k])) for k in range(self.num_stages)))

    async def _progress_loop(self) -> None:
        """Every `trainer.progress_every` seconds, a log line (a progress bar of the stages' steps where
        stderr is a terminal): a trainer is what an operator watches to see that the swarm trains."""
        bar = None
        if sys.stderr.isatty():
            bar = tqdm(total=self.tc.target_steps, desc=f"trainer {short(self.peer_id)}", unit="step",
                       dynamic_ncols=True)
        try:
            while True:
                await asyncio.sleep(self.tc.progress_every)
                step = min(self.stage_epoch)
                if bar is None:
                    log.info("trainer %s: %s, step %d", short(self.peer_id), self._progress(), step)
                else:
                    bar.update(min(step, bar.total) - bar.n)
                    bar.set_postfix_str(self._progress())
        finally:
            if bar is not None:
                bar.close()

    def _write_summary(self) -> None:
        if not hasattr(self, "peer_id"):
            return
        PeerResults(self.cfg.run_dir).write(f"trainer-{self.tc.index}-{self.peer_id[-8:]}.json", {
            "role": "trainer",
            "index": self.tc.index,
            "peer_id": self.peer_id,
            "samples": self._samples(),
            "failed": self.failed,
            "retries": self.retries,
            "replays": self.replays,
            "unresolved": self.unresolved,
            "started": getattr(self, "started", None),
            "call_seconds": self.call_seconds,
            "traffic": self.traffic.as_dict(),
            "completed": [[c.time, c.samples, c.loss, c.epoch, c.req] for c in self.completed],
        })


def _tagged(stage: int, method: str, tensors: list[torch.Tensor]) -> list[Tagged]:
    """What a stage call carries: the stage's input (token ids at the first stage, activations after),
    then the targets (forward to the last stage) or the gradient of the stage's output (backward)."""
    roles = ("tokens" if stage == 0 else "activations", "gradients" if method == "backward" else "tokens")
    return [Tagged(role, t) for role, t in zip(roles, tensors, strict=False)]
