"""A stage server's life: join the DHT, load the stage's current state, announce, serve, step, leave.

Concurrency: one asyncio loop handles the network; all torch work runs on one compute thread,
entered through `_gate` (an asyncio lock), so requests queue instead of oversubscribing the cores.
The stage's optimizer step also holds the gate for its whole round: no gradient can slip in between
the all-reduce and the step, which is what makes the step synchronous across the stage. An async
stage's averaging round holds the gate only to take its snapshot and to apply the average: the
exchange runs while the compute thread goes on serving (and updating the weights locally).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from swarm.averaging.allreduce import RoundFailed, StageAllReduce, WeightsDiverged
from swarm.config import ConfigMismatch, SwarmConfig, agreed, config_hash, describe_mismatch, model_fingerprint
from swarm.core import (
    Move,
    Seat,
    StageRate,
    backoff_delay,
    capacities,
    choose_stage,
    expected_group,
    layout_of,
    plan_for_swarm,
    stage_ready,
)
from swarm.model import build_stage, stage_boundary
from swarm.net.directory import Directory, short
from swarm.net.faultfile import FaultFile
from swarm.net.join import JoinServicer
from swarm.net.node import check_join, start_dht, visible_addresses
from swarm.net.protocol import Tagged, Traffic
from swarm.net.servicer import StageServicer
from swarm.net.transport import CallFailed, StageClient
from swarm.server.checkpoints import CheckpointStore
from swarm.server.runtime import BatchGraph, StageRuntime, StepRecord
from swarm.wire import PROTOCOL_VERSION
from swarm.wire.records import ServerRecord
from swarm.wire.validate import BadRequest, TensorSpec, Unavailable, check_same_batch, check_tensor

log = logging.getLogger("swarm.server")
_RECOMPUTE = object()  # marks a backward whose kept graph could not be used
REPLY_CACHE = 32  # recent accumulating calls remembered, to answer retries without applying them twice
# the first windows of work at a stage carry one-off costs (first-call allocations, lazy initialization):
# the capacity figure, which decides moves and must not be skewed for long, starts after them
WARMUP_WINDOWS = 3


def _ignore_cancelled_stream_handlers(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Python 3.11's stream-server callback calls `task.exception()` on a cancelled handler task (fixed
    in 3.12), so every RPC stream still open when a server leaves would print a CancelledError
    traceback. Those cancellations are the intended end of the stream; everything else is reported."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        log.debug("stream handler cancelled at shutdown: %s", context.get("message"))
        return
    loop.default_exception_handler(context)


def _accumulate(meta: dict[str, Any]) -> bool:
    """A trainer asks for the input gradient only when another replica may already hold this microbatch."""
    return meta.get("accumulate", True) is not False


@dataclass(frozen=True)
class Deadline:
    """When a request is no longer worth applying. `arrival_bound`: the caller's timeout counted from
    the request's arrival, on our clock. `wall`: the caller's own bound on the wall clock, which holds
    even for requests that sat in buffers while this process was frozen; the caller sets it well before
    it would send the work elsewhere, leaving room for clocks that disagree by seconds."""

    arrival_bound: float = math.inf
    wall: float = math.inf

    def passed(self) -> bool:
        return time.monotonic() > self.arrival_bound or time.time() > self.wall


def _expiry(meta: dict[str, Any]) -> Deadline:
    timeout, wall = meta.get("timeout"), meta.get("deadline")
    return Deadline(
        time.monotonic() + timeout if isinstance(timeout, int | float) and timeout > 0 else math.inf,
        float(wall) if isinstance(wall, int | float) else math.inf,
    )


def stage_specs(cfg: SwarmConfig, module: torch.nn.Module) -> tuple[TensorSpec, TensorSpec | None]:
    """What the stage accepts and emits, as its module declares it (or probed; see `stage_boundary`)."""
    inputs, outputs = stage_boundary(cfg.model, module)
    ids_bound = cfg.model.vocab_size if not inputs.dtype.is_floating_point else None
    in_spec = TensorSpec(inputs.dtype, inputs.shape, max_value=ids_bound)
    return in_spec, None if outputs is None else TensorSpec(outputs.dtype, outputs.shape)


class StageServer:
    def __init__(self, cfg: SwarmConfig):
        self.cfg = cfg
        self.hash = config_hash(cfg)
        self.max_request_bytes = int(cfg.net.max_payload_mb * 2**20)
        self.rng = random.Random()
        self.traffic = Traffic()  # bytes on the wire by role, since this server entered its stage
        self._reset_stage(cfg.server.stage)

    def _reset_stage(self, stage: int) -> None:
        """Everything that belongs to serving one stage; a server that moves to another starts it afresh."""
        self.stage = stage
        # samples/s of compute, from windows of at least one announcement period: over the last few
        # windows for routing, and over the last ten or so for rebalancing, which must not move servers
        # on a passing fluctuation
        passes = ("forward",) if stage == self.cfg.model.num_stages - 1 else ("forward", "backward")
        self.meter = StageRate(passes, alpha=0.3)
        self.capacity_meter = StageRate(passes, alpha=0.1, skip=WARMUP_WINDOWS)
        self._window: dict[str, tuple[int, float]] = {}  # pass -> work (samples, seconds) since the last fold
        self._window_start = time.monotonic()
        self.steps: list[StepRecord] = []
        self.counters = {"refused": 0, "failed_rounds": 0, "catch_ups": 0, "lost_samples": 0, "stale_refusals": 0,
                         "samples_served": 0}
        self.traffic.counts.clear()
        self._queued = 0
        self.busy_seconds = 0.0  # compute-thread time while serving this stage
        self.started = time.time()
        self._stage_since = time.monotonic()
        self._fwd_queue: list[tuple[str, torch.Tensor, asyncio.Future]] = []
        self._tasks: set[asyncio.Task] = set()
        self._replies: dict[str, Any] = {}  # request key -> reply, for recent calls that accumulated gradients
        self._batch_waits: dict[BatchGraph, dict[str, tuple[torch.Tensor, asyncio.Future]]] = {}
        self._proposal: tuple[int, tuple[str, ...]] | None = None  # a round a groupmate began
        self._behind_since: dict[str, float] = {}
        # replicas that failed a round of ours: until when they are left out, and the epoch they were at
        self._suspects: dict[str, tuple[float, int]] = {}
        self._alone_since = math.inf  # since when no other replica of the stage is in view
        self._peers_at_epoch: tuple[int, set[str]] = (-1, set())  # other replicas last seen at our epoch
        self._announced_pending = 0
        self._round_epoch: int | None = None  # the epoch whose step round is running
        self._stale_logged = -1  # the last epoch at which this replica said it is behind
        self._durable_epoch = 0  # the newest epoch that outlives this replica (see `ledger`)
        self._lapsed = False  # the process stalled so long that its DHT record may have lapsed
        self._serving = False  # between entering the stage and leaving it
        self._moving_to: int | None = None  # the stage this server is about to move to (see _rebalance_loop)
        self._drained = False  # moving, and done with this stage's work: it takes no more of it

    @property
    def label(self) -> str:
        """How logs name this server: the operator's name for it, if any, and the tail of its peer id."""
        tail = short(self.peer_id) if hasattr(self, "peer_id") else "(starting)"
        return f"{self.cfg.server.name} {tail}" if self.cfg.server.name else tail

    # ---- lifecycle ---------------------------------------------------------------------------

    def run(self) -> None:
        asyncio.run(self.serve())

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        cfg = self.cfg
        if cfg.server.threads:
            torch.set_num_threads(cfg.server.threads)
        self.stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop.set)
        loop.set_exception_handler(_ignore_cancelled_stream_handlers)
        self._gate = asyncio.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self._moved = asyncio.Event()
        self._cost = 0.0  # what the compute thread's last job cost (see _slowed)
        self._cost_by_cpu = cfg.server.device == "cpu" and torch.get_num_threads() == 1

        self.dht = start_dht(cfg.net)
        try:
            self.peer_id = self.dht.peer_id.to_base58()
            p2p = await self.dht.replicate_p2p()
            faults = FaultFile(cfg.net.fault_file) if cfg.net.fault_file else None
            half_rtt = cfg.net.emulated_rtt_ms / 2000
            self.client = StageClient(p2p, faults, cfg.wire.policy(), self.traffic, half_rtt)
            self.directory = Directory(self.dht, cfg.net.run_id, cfg.net.record_ttl)
            await check_join(self.dht, cfg.net, serving=True)
            await self._check_configs()
            await JoinServicer(p2p).add_p2p_handlers(p2p)
            await StageServicer(self, faults, cfg.wire.policy(), self.traffic, half_rtt).add_p2p_handlers(p2p)
            stage = await self._first_stage()
            while True:
                await self._enter_stage(stage)
                loops = [self._announce_loop(), self._step_loop(), self._batch_loop()]
                if cfg.rebalance.enabled:
                    loops.append(self._rebalance_loop())
                tasks = [asyncio.create_task(t) for t in loops]
                waits = [asyncio.ensure_future(e.wait()) for e in (self.stop, self._moved)]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
                target = None if self.stop.is_set() else self._moving_to
                await self._leave(tasks, target)
                if target is None:
                    break
                self._write_summary()  # the summary of the stage it leaves, as a replica that left
                stage = target
        finally:
            self._write_summary()
            self._executor.shutdown(wait=True)
            self.dht.shutdown()

    async def _first_stage(self) -> int:
        """The configured stage, or with `server.auto_stage` the one with the least capacity now."""
        if not self.cfg.server.auto_stage:
            return self.cfg.server.stage
        layout = layout_of(await self._seats(), self.cfg.model.num_stages)
        stage, caps = choose_stage(layout), capacities(layout)
        log.info("server %s joins stage %d, the one with the least capacity (samples/s by stage: %s)",
                 self.label, stage, " ".join(f"{k}:{c:.1f}" for k, c in caps.items()))
        return stage

    async def _enter_stage(self, stage: int) -> None:
        """Build the stage's module, take its newest state (from disk or from its live replicas), announce."""
        cfg = self.cfg
        self._reset_stage(stage)
        self._fwd_ready = asyncio.Event()
        self._wake = asyncio.Event()
        self._moved.clear()
        loop = asyncio.get_running_loop()
        self.runtime, self.in_spec, self.out_spec = await loop.run_in_executor(self._executor, self._build, stage)
        self.checkpoints = (
            CheckpointStore(cfg.server.checkpoint_dir, stage, cfg.server.keep_checkpoints)
            if cfg.server.checkpoint_dir else None
        )
        self.allreduce = StageAllReduce(self.client, self.peer_id, stage, cfg.net.allreduce_timeout, self._on_wake)
        self._resume_from_disk()
        ahead = [r for r in await self.directory.stage(stage) if r.epoch > self.runtime.epoch]
        if ahead:
            await self._download_state(ahead)
        self._serving = True
        log.info(
            "stage %d server %s up on %s (any peer can join through these), epoch %d, device %s",
            stage, self.label, " ".join(visible_addresses(self.dht)), self.runtime.epoch, cfg.server.device,
        )
        await self._announce()

    def _build(self, stage: int) -> tuple[StageRuntime, TensorSpec, TensorSpec | None]:
        """The stage's runtime at its initial weights, and what it accepts and emits (on the compute thread)."""
        cfg = self.cfg
        module = build_stage(cfg.model, stage)  # this stage alone, where the model spec allows it
        in_spec, out_spec = stage_specs(cfg, module)
        runtime = StageRuntime(module, cfg.optim, cfg.server.device, cfg.server.autocast, cfg.server.graph_ttl)
        return runtime, in_spec, out_spec

    async def _leave(self, tasks: list[asyncio.Task], target: int | None = None) -> None:
        """Stop taking work, withdraw from the stage, finish what was accepted, then go (bounded in time):
        out of the swarm, or on to stage `target`.

        New requests are already answered "shutting down" (trainers retry them elsewhere). Gradients
        this replica holds but has not stepped leave with it (`lost_samples` in the summary counts
        them); trainers accumulate them again elsewhere once its record is gone.
        """
        started = time.monotonic()
        self._serving = False
        log.info("stage %d server %s %s", self.stage, self.label,
                 "leaving" if target is None else f"moving to stage {target}")
        announcer, stepper, batcher, *others = tasks
        for task in (announcer, *others):
            task.cancel()
        # a sync round holds the gate, so it finishes for the whole stage first; an async round's exchange
        # (run without the gate) is called off, and its other replicas retry without this one
        async with self._gate:
            stepper.cancel()
        await asyncio.gather(announcer, stepper, *others, return_exceptions=True)
        await self.directory.withdraw_server(self._record())
        deadline = started + self.cfg.server.leave_timeout
        while (self._fwd_queue or self._queued > 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        batcher.cancel()
        await asyncio.gather(batcher, return_exceptions=True)
        async with self._gate:  # let the computation in progress finish
            pass
        if self.checkpoints is not None and self.steps:
            await self._checkpoint()  # a restart continues exactly where this replica left off
        self.counters["lost_samples"] += self.runtime.pending_samples
        log.info("stage %d server %s left after %.1fs%s", self.stage, self.label,
                 time.monotonic() - started,
                 f", dropping {self.runtime.pending_samples} unstepped samples" if self.runtime.pending_samples else "")

    async def _check_configs(self) -> None:
        for records in (await self.directory.stages(self.cfg.model.num_stages)).values():
            for r in records:
                if r.config_hash != self.hash:
                    raise ConfigMismatch(
                        f"server {short(r.peer_id)} of stage {r.stage} runs with other settings "
                        f"({describe_mismatch(agreed(self.cfg), r.agreed())}); "
                        "use the same model and optim sections and swarm version, or another net.run_id"
                    )

    # ---- announcements -------------------------------------------------------------------------

    def _record(self) -> ServerRecord:
        return ServerRecord(
            peer_id=self.peer_id,
            stage=self.stage,
            throughput=self.meter.rate,
            capacity=self.capacity_meter.rate,
            queue=self._queued,
            epoch=self.runtime.epoch,
            pending=self.runtime.pending_samples,
            config_hash=self.hash,
            model=model_fingerprint(self.cfg.model),
            optim=agreed(self.cfg)["optim"],
            protocol=PROTOCOL_VERSION,
            tenure=time.monotonic() - self._stage_since,
            moving=self._moving_to is not None,
            name=self.cfg.server.name,
        )

    async def _announce(self) -> None:
        now = time.monotonic()
        if self._window and now - self._window_start >= self.cfg.net.announce_period:
            self.meter.update(self._window)
            self.capacity_meter.update(self._window)
            self._window, self._window_start = {}, now
        record = self._record()
        await self.directory.announce_server(record)
        self._announced_pending = record.pending

    async def _announce_quietly(self) -> None:
        try:
            await self._announce()
        except Exception as e:  # the DHT may be briefly unreachable; the next announcement retries
            log.warning("announcement failed: %s", e)

    async def _announce_loop(self) -> None:
        """Re-announce every period, and sooner while gradients accumulate: replicas decide when the
        stage steps from each other's announced sample counts, so stale counts mean oversized steps.

        The loop also notices when this process stalled (it was frozen) for so long that its record
        may have lapsed. Announcements run beside it, so a slow DHT store is not taken for a stall.
        """
        period, ttl = self.cfg.net.announce_period, self.cfg.net.record_ttl
        last = tick = time.monotonic()
        sending: asyncio.Task | None = None
        while True:
            await asyncio.sleep(min(0.1, period))
            now = time.monotonic()
            if now - tick > ttl - period:
                self._lapsed = True
                log.warning("stage %d server %s stalled for %.1fs", self.stage, self.label, now - tick)
            tick = now
            if sending is not None and not sending.done():
                continue
            changed = self.runtime.pending_samples != self._announced_pending
            if changed or now - last >= period:
                last = now
                sending = asyncio.create_task(self._announce_quietly())

    def _drop_if_presumed_gone(self) -> bool:
        """A replica that stalled long enough for its DHT record to lapse has been taken for dead:
        trainers accumulate the gradients it held again elsewhere. So it drops them before anything
        else, or they would enter a step twice. Call with the gate held."""
        if not self._lapsed:
            return False
        self._lapsed = False
        if not self.runtime.pending_samples:
            return False
        lost = self.runtime.discard_gradients()
        self.counters["lost_samples"] += lost
        log.warning("stage %d server %s was taken for gone: dropping %d unstepped samples, which trainers "
                    "send again", self.stage, self.label, lost)
        return True

    # ---- compute ------------------------------------------------------------------------------

    async def _compute(self, fn, *args, expires: Deadline | None = None, work: str | None = None, samples: int = 0):
        """Run `fn` on the compute thread once it is free; a request whose caller has given up on it
        by then is dropped rather than applied (the caller may be retrying it elsewhere). `work`: the
        pass ("forward" or "backward") of `samples` samples it is, for the throughput figures."""
        self._queued += 1
        acquired = False
        try:
            async with self._gate:
                self._queued -= 1
                acquired = True
                if expires is not None and expires.passed():
                    raise Unavailable("the request expired while it queued")
                self._drop_if_presumed_gone()
                return await self._run_timed(fn, *args, work=work, samples=samples)
        finally:
            if not acquired:
                self._queued -= 1

    async def _run_timed(self, fn, *args, work: str | None = None, samples: int = 0):
        """Run on the compute thread. Shielded: a cancelled caller must not release the gate while
        the thread still works (a step could then read gradients half accumulated).

        Only forward and backward passes (`work`) count toward the throughput figures: an optimizer
        step costs every replica of a stage the same whatever share of the samples it served, so
        counting it would make a server look slower the more replicas its stage has."""
        start = time.perf_counter()
        job = asyncio.get_running_loop().run_in_executor(self._executor, self._slowed, fn, *args)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            await asyncio.wait([job])
            raise
        finally:
            elapsed = time.perf_counter() - start
            self.busy_seconds += elapsed
            if work is not None:
                self._count_work(work, samples, self._cost if self._cost_by_cpu else elapsed)

    def _count_work(self, work: str, samples: int, seconds: float) -> None:
        """Add to the current throughput window of one pass ("forward" or "backward")."""
        done, spent = self._window.get(work, (0, 0.0))
        self._window[work] = (done + samples, spent + seconds)

    def _slowed(self, fn, *args):
        """Run `fn`, then idle `server.slowdown - 1` times its CPU time: a slower machine, to the swarm.

        The compute thread's CPU time, not its wall time, so that a host shared with other servers
        (whose processes delay this one) does not slow it down further. For the same reason, when
        this thread does all of the work (a CPU server with one torch thread), its CPU time (times
        the slowdown) is what the work costs in the throughput figures: waiting for a core that other
        processes, or this server's own network thread, hold says nothing of the server's speed, and
        a figure that fell whenever a server got busy would move servers back and forth."""
        start = time.thread_time()
        try:
            return fn(*args)
        finally:
            used = time.thread_time() - start
            if self.cfg.server.slowdown > 1.0:
                time.sleep((self.cfg.server.slowdown - 1.0) * used)
            self._cost = used * self.cfg.server.slowdown

    async def _batch_loop(self) -> None:
        """Merge forward requests that queued up while the compute thread was busy into one batch."""
        limit = self.cfg.server.merge_samples
        while True:
            await self._fwd_ready.wait()
            async with self._gate:
                batch, size = [], 0
                while self._fwd_queue and (not batch or size + self._fwd_queue[0][1].shape[0] <= limit):
                    item = self._fwd_queue.pop(0)
                    batch.append(item)
                    size += item[1].shape[0]
                if not self._fwd_queue:
                    self._fwd_ready.clear()
                self._queued -= len(batch)
                try:
                    outputs = await self._run_timed(
                        self.runtime.forward, [(r, x) for r, x, _ in batch], work="forward", samples=size
                    )
                except Exception as e:
                    log.exception("forward batch failed")
                    for _, _, fut in batch:
                        if not fut.done():
                            fut.set_exception(RuntimeError(f"forward failed: {e}"))
                    continue
                for (_, _, fut), y in zip(batch, outputs, strict=True):
                    if not fut.done():
                        fut.set_result(y)

    # ---- RPC handlers (called by StageServicer) --------------------------------------------------

    def _check_stage(self, meta: dict[str, Any]) -> None:
        """Callers find servers through the DHT, whose view lags: one that still takes this server for a
        replica of a stage it left (or is leaving) is sent elsewhere."""
        if self.stop.is_set():
            raise Unavailable("server is shutting down")
        if not self._serving:
            raise Unavailable("server is between stages")
        if meta.get("stage") != self.stage:
            raise Unavailable(f"this server hosts stage {self.stage}, not {meta.get('stage')!r}")

    def _admit(self, meta: dict[str, Any], caller: str, new_work: bool) -> str:
        """The request's key, once it is known to be for this stage, from a compatible caller, not stale.
        `new_work`: a microbatch new to this server, which it no longer takes once it is moving."""
        self._check_stage(meta)
        if meta.get("config") != self.hash:
            raise BadRequest(f"config hash {meta.get('config')!r} differs from this server's {self.hash}")
        if self._moving_to is not None and (new_work or self._drained):
            raise Unavailable(f"this server is moving to stage {self._moving_to}")
        req = meta.get("req")
        if not isinstance(req, str) or not req:
            raise BadRequest("missing request id")
        self._refuse_if_stale(meta.get("epoch", 0))
        return f"{caller}/{req}"

    def _refuse_if_stale(self, stage_epoch: Any) -> None:
        """Stale replicas never serve: a caller that has seen the stage at a later epoch than ours is
        turned away (it retries elsewhere), and this replica catches up before it serves again."""
        if not isinstance(stage_epoch, int) or stage_epoch <= self.runtime.epoch:
            return
        if self._round_epoch == self.runtime.epoch:
            return  # our own step to that epoch is under way; the request waits for it behind the gate
        self.counters["stale_refusals"] += 1
        if self._stale_logged != self.runtime.epoch:
            self._stale_logged = self.runtime.epoch
            log.warning("stage %d server %s is at epoch %d but the stage is at %d: catching up before serving",
                        self.stage, self.label, self.runtime.epoch, stage_epoch)
        self._wake.set()
        raise Unavailable(f"stale replica: at epoch {self.runtime.epoch}, the stage is at {stage_epoch}")

    def refused(self, method: str, caller: str, error: BadRequest) -> None:
        """One log line per refused request; the caller got the same text back."""
        self.counters["refused"] += 1
        log.warning("%s from %s refused: %s", method, short(caller), error.args[0])

    def _check_forward(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        limit = self.cfg.server.max_request_samples
        if not self.runtime.is_last:
            if len(tensors) != 1:
                raise BadRequest(f"forward takes one tensor, got {len(tensors)}")
            check_tensor("inputs", tensors[0], self.in_spec, limit)
            return tensors[0], None
        if len(tensors) != 2:
            raise BadRequest(f"the last stage takes (inputs, targets), got {len(tensors)} tensors")
        x, targets = tensors
        check_tensor("inputs", x, self.in_spec, limit)
        check_tensor("targets", targets, TensorSpec(torch.int64, x.shape[1:2], self.cfg.model.vocab_size), limit)
        check_same_batch(("inputs", x), ("targets", targets))
        return x, targets

    def _check_backward(self, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.out_spec is None:
            raise BadRequest("the last stage runs its backward within forward")
        if len(tensors) != 2:
            raise BadRequest(f"backward takes (inputs, grad_outputs), got {len(tensors)} tensors")
        x, dy = tensors
        check_tensor("inputs", x, self.in_spec, self.cfg.server.max_request_samples)
        check_tensor("grad_outputs", dy, self.out_spec, self.cfg.server.max_request_samples)
        check_same_batch(("inputs", x), ("grad_outputs", dy))
        return x, dy

    async def forward(self, meta, tensors, caller):
        key = self._admit(meta, caller, new_work=True)
        x, targets = self._check_forward(tensors)
        if targets is not None and (cached := self._cached_reply(key)) is not None:
            return cached
        self.counters["samples_served"] += x.shape[0]  # a repeat answered from the cache is not counted again
        if targets is not None:
            loss, grad = await self._compute(
                self.runtime.forward_backward_last, key, x, targets, _accumulate(meta), expires=_expiry(meta),
                work="forward", samples=x.shape[0],
            )
            await self._delay_reply("forward")
            return self._backward_done(key, {"loss": loss}, grad)
        fut = asyncio.get_running_loop().create_future()
        self._fwd_queue.append((key, x, fut))
        self._queued += 1
        self._fwd_ready.set()
        y = await fut
        await self._delay_reply("forward")
        return {"epoch": self.runtime.epoch}, [Tagged("activations", y)]

    async def backward(self, meta, tensors, caller):
        key = self._admit(meta, caller, new_work=False)
        x, dy = self._check_backward(tensors)
        if (cached := self._cached_reply(key)) is not None:
            return cached
        accumulate = _accumulate(meta) and self.runtime.accumulates(key)
        graph = self.runtime.live_graph(key)
        grad = _RECOMPUTE
        if accumulate and graph is not None and graph.size > 1:
            grad = await self._batched_backward(graph, key, dy)
        if grad is _RECOMPUTE:
            grad = await self._compute(
                self.runtime.backward, key, x, dy, accumulate, expires=_expiry(meta), work="backward",
                samples=x.shape[0],
            )
        await self._delay_reply("backward")
        return self._backward_done(key, {}, grad)

    async def _delay_reply(self, work: str) -> None:
        """`server.reply_delay`: the reply waits, and the wait counts as time this pass took, so the
        announced throughput (and with it the share of work stochastic wiring sends here) falls."""
        delay = self.cfg.server.reply_delay
        if delay:
            self._count_work(work, 0, delay)
            await asyncio.sleep(delay)

    async def _batched_backward(self, graph: BatchGraph, key: str, dy: torch.Tensor):
        """Wait (briefly) for the other requests of this request's forward batch, then one backward for all.

        Requests whose gradient has not come by `server.batch_backward_wait` are left out and
        recomputed when it comes; so is everyone if a step changed the weights meanwhile.
        """
        waiting = self._batch_waits.setdefault(graph, {})
        future = asyncio.get_running_loop().create_future()
        waiting[key] = (dy, future)
        if len(waiting) == graph.size:
            self._spawn(self._run_batch_backward(graph))
        elif len(waiting) == 1:
            asyncio.get_running_loop().call_later(
                self.cfg.server.batch_backward_wait, lambda: self._spawn(self._run_batch_backward(graph))
            )
        return await future

    def _spawn(self, coro) -> None:
        """Run a background task, holding a reference so it is neither collected nor silently lost."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_batch_backward(self, graph: BatchGraph) -> None:
        waiting = self._batch_waits.pop(graph, None)
        if not waiting:
            return  # already run
        grads = {key: dy for key, (dy, _) in waiting.items()}
        try:
            async with self._gate:
                if self.runtime.live_graph(next(iter(grads))) is not graph:
                    results = dict.fromkeys(grads, _RECOMPUTE)
                else:
                    results = await self._run_timed(
                        self.runtime.backward_batch, graph, grads, work="backward",
                        samples=sum(graph.rows[key].stop - graph.rows[key].start for key in grads),
                    )
        except Exception as e:
            log.exception("batched backward failed")
            results = dict.fromkeys(grads, e)
        for key, (_, future) in waiting.items():
            if future.done():
                continue
            if isinstance(results[key], Exception):
                future.set_exception(results[key])
            else:
                future.set_result(results[key])

    def _cached_reply(self, key: str):
        """The reply to a repeat of a gradient call whose gradient this stage already holds or stepped
        (a call whose reply was lost). A repeat that would accumulate something new is computed."""
        if key not in self._replies or self.runtime.accumulates(key):
            return None
        meta, tensors = self._replies[key]
        return {**meta, "epoch": self.runtime.epoch}, tensors

    def _backward_done(self, key: str, meta: dict[str, Any], grad: torch.Tensor | None):
        """Remember the reply of a gradient call, so that a repeat of it costs no compute."""
        reply = {"epoch": self.runtime.epoch, **meta}, [] if grad is None else [Tagged("gradients", grad)]
        self._replies[key] = reply
        while len(self._replies) > REPLY_CACHE:
            del self._replies[next(iter(self._replies))]
        self._wake.set()  # the stage may have just reached its batch size
        return reply

    async def state(self, meta, tensors, caller):
        self._check_stage(meta)
        state, tensors = await self._compute(self.runtime.state)
        return state, [Tagged("state", t) for t in tensors]

    async def ledger(self, meta, tensors, caller):
        """Where the caller's microbatches stand here: committed by a step (and at which epoch), held in
        this replica's unstepped gradient, or neither. `durable` is the newest epoch that would outlive
        this replica: on disk when the stage keeps checkpoints, else reached by a step two or more
        replicas took (or loaded from a peer)."""
        self._check_stage(meta)
        ids = meta.get("ids")
        if not isinstance(ids, list) or not all(isinstance(r, str) for r in ids):
            raise BadRequest("ledger takes a list of request ids")
        keys = {f"{caller}/{r}": r for r in ids}
        rt = self.runtime
        # read in the reverse order of a step's writes (commit, unpend, epoch; see apply_step) so that a
        # step running meanwhile cannot make a microbatch look neither pending nor committed
        epoch = rt.epoch
        pending = [r for k, r in keys.items() if k in rt.pending]
        committed = {r: e for k, r in keys.items() if (e := rt.committed.get(k)) is not None}
        return {"epoch": epoch, "committed": committed, "pending": pending, "durable": self._durable_epoch}, []

    async def reduce(self, meta, tensors, caller):
        self._check_stage(meta)
        return await self.allreduce.contribute(meta, tensors, caller)

    def _on_wake(self, epoch: int, group: tuple[str, ...]) -> bool:
        """A groupmate began the round for our epoch: join it, with the group it proposed, unless that
        group leaves out a replica we know is at this epoch (its samples would be dropped later) or
        counts one that just failed a round of ours."""
        if epoch != self.runtime.epoch or self.peer_id not in group or self._suspects.keys() & set(group):
            return False
        if self._peers_at_epoch[0] == epoch and not self._peers_at_epoch[1] <= set(group):
            return False
        self._proposal = (epoch, group)
        self._wake.set()
        return True

    # ---- moving between stages ---------------------------------------------------------------

    async def _seats(self) -> list[Seat]:
        """Every live server of the run (with our settings) as the rebalancing policy sees it."""
        stages = await self.directory.stages(self.cfg.model.num_stages)
        return [Seat(r.peer_id, r.stage, r.capacity, r.tenure, r.moving)
                for records in stages.values() for r in records if r.config_hash == self.hash]

    async def _planned_move(self) -> tuple[Move, dict[int, float]] | None:
        """The move the policy makes now if it is this server's, with the stages' capacities: none once
        the trainers are done (the run is ending) or while this server's own record is not in view (the
        view is then incomplete)."""
        trainers = await self.directory.trainers()
        if not trainers or all(t.done for t in trainers):
            return None
        seats = await self._seats()
        if self.peer_id not in {seat.peer for seat in seats}:
            return None
        rc, stages = self.cfg.rebalance, self.cfg.model.num_stages
        move = plan_for_swarm(seats, stages, rc.min_gain, rc.cooldown)
        if move is None or move.peer != self.peer_id:
            return None
        return move, capacities(layout_of(seats, stages))

    async def _rebalance_loop(self) -> None:
        """Look at the swarm's layout every period; when the policy names this server, look again after
        a random delay (another server may have acted meanwhile), then drain and move."""
        rc = self.cfg.rebalance
        while True:
            await asyncio.sleep(rc.period)
            try:
                if await self._planned_move() is None:
                    continue
                await asyncio.sleep(self.rng.uniform(0.0, rc.jitter))
                planned = await self._planned_move()
                if planned is not None and await self._drain_for(*planned):
                    self._moved.set()
                    return
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a DHT lookup that failed: the next period looks again
                log.warning("rebalancing check failed: %s", e)

    async def _drain_for(self, move: Move, caps: dict[int, float]) -> bool:
        """Finish this stage's work before moving: trainers route new microbatches elsewhere (the record
        says `moving`, and new work is refused), the in-flight ones' backward passes are still served,
        and the stage's next step takes in the gradients this replica holds, so nothing is left to
        replay. Bounded by `server.leave_timeout`; what is still held then is dropped (and replayed by
        its trainers). False if the move is called off: no other server is left to serve the stage."""
        started = time.monotonic()
        self._moving_to = move.target
        log.info("stage %d server %s moves to stage %d (samples/s by stage: %s; bottleneck %.1f -> %.1f "
                 "predicted); finishing its work here", self.stage, self.label, move.target,
                 " ".join(f"{k}:{c:.1f}" for k, c in caps.items()), move.before, move.after)
        await self._announce()
        deadline = started + self.cfg.server.leave_timeout
        while time.monotonic() < deadline and (
            self.runtime.pending_samples or self._queued or self._fwd_queue or self.runtime.graphs
        ):
            await asyncio.sleep(0.05)
        # from here on even backward passes go elsewhere (set without yielding to the loop in between:
        # a backward admitted before is counted in _queued, so none can slip in unstepped)
        self._drained = True
        others = [r for r in await self.directory.stage(self.stage) if r.peer_id != self.peer_id and not r.moving]
        if not others:
            log.warning("stage %d server %s stays: no other server of the stage is left", self.stage, self.label)
            self._moving_to, self._drained = None, False
            await self._announce()
            return False
        self._log_move(move, caps, time.monotonic() - started)
        return True

    def _log_move(self, move: Move, caps: dict[int, float], drained: float) -> None:
        """Each move as one JSON line beside the server's summaries, for reports and plots."""
        entry = {"time": time.time(), "peer_id": self.peer_id, "name": self.cfg.server.name, "source": move.source,
                 "target": move.target, "before": move.before, "after": move.after, "capacities": caps,
                 "drain_seconds": drained, "held_samples": self.runtime.pending_samples}
        out = Path(self.cfg.run_dir) / "peers"
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"moves-{self.peer_id[-8:]}.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    # ---- the stage's optimizer step ------------------------------------------------------------

    async def _step_loop(self) -> None:
        failures = 0
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.25)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                group = await self._group_to_step_with()
                if group is None:
                    continue
                await self._step_round(self.runtime.epoch, group)
                failures = 0
            except WeightsDiverged as e:
                await self._resolve_divergence(e)
            except RoundFailed as e:
                failures += 1
                self.counters["failed_rounds"] += 1
                for peer in e.unreachable:  # left out of the next groups until its record expires
                    self._suspects[peer] = (time.monotonic() + self.cfg.net.record_ttl, self.runtime.epoch)
                log.warning("stage %d step %d round failed (%s); retrying", self.stage, self.runtime.epoch + 1, e)
                await asyncio.sleep(backoff_delay(failures, 0.2, 3.0, self.rng))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("step loop error")
                await asyncio.sleep(1.0)

    async def _group_to_step_with(self) -> tuple[str, ...] | None:
        """The replicas to take this epoch's step with, or None if the stage should not step yet.

        A replica never steps on a partial view: a peer that looks one epoch behind is usually just
        late to announce the step it took with us, so we wait for it, and only leave it out once it
        has looked behind for longer than a few announcement periods (it is then catching up by
        downloading state, and would refuse the round anyway). Likewise a replica steps alone only
        after it has seen no other replica for that long: a peer that started with it may not have
        announced itself yet.
        """
        epoch = self.runtime.epoch
        if self._proposal is not None:
            proposed_epoch, group = self._proposal
            self._proposal = None
            if proposed_epoch == epoch:
                return group
        now = time.monotonic()
        others = [r for r in await self.directory.stage(self.stage) if r.peer_id != self.peer_id]
        # a suspect stays one while its record does not move on: one that changed epoch is alive
        epochs = {r.peer_id: r.epoch for r in others}
        self._suspects = {p: (until, e) for p, (until, e) in self._suspects.items()
                          if until > now and epochs.get(p, e) == e}
        view = [r for r in others if r.peer_id not in self._suspects]
        if view:
            self._alone_since = math.inf
        elif self._alone_since == math.inf:  # no need to wait for replicas we know but cannot reach
            self._alone_since = now - (math.inf if others else 0.0)
        ahead = [r for r in others if r.epoch > epoch]  # a suspect further along still proves us behind
        if ahead:
            await self._download_state(ahead)
            return None
        peers = {r.peer_id: r.pending for r in view if r.epoch == epoch}
        self._peers_at_epoch = (epoch, set(peers))
        if not (stage_ready(self.runtime.pending_samples, peers, self.cfg.optim.target_batch_size)
                or await self._run_is_over(peers)):
            return None
        grace = 3 * self.cfg.net.announce_period + 1.0
        behind = {r.peer_id for r in view if r.epoch < epoch}
        self._behind_since = {p: self._behind_since.get(p, now) for p in behind}
        if any(now - since < grace for since in self._behind_since.values()):
            return None
        if not view:
            if not await self.directory.trainers():
                # no trainer in view either: more likely cut off from the swarm than its last replica, and
                # once the swarm is back in view, its other replicas may take a moment more to appear
                self._alone_since = max(self._alone_since, now)
                return None
            if now - self._alone_since < grace:
                return None
        return expected_group(self.peer_id, peers)

    async def _resolve_divergence(self, error: WeightsDiverged) -> None:
        """Replicas at one epoch hold different weights (they once stepped without each other): the
        replica with the smallest peer id keeps its weights and the others take them."""
        keeper = min(error.group)
        log.warning("stage %d replicas diverged at epoch %d (%s); %s", self.stage, self.runtime.epoch, error,
                    "keeping ours" if keeper == self.peer_id else f"taking the weights of {short(keeper)}")
        if keeper != self.peer_id:
            view = [r for r in await self.directory.stage(self.stage) if r.peer_id == keeper]
            await self._download_state(view, force=True)

    async def _run_is_over(self, peers: dict[str, int]) -> bool:
        """All trainers finished: flush what the stage still holds, so no completed sample is left out."""
        if self.runtime.pending_samples + sum(peers.values()) == 0:
            return False
        # every trainer in view said it sends no more (a killed trainer's record expires; a replica that
        # sees no trainer at all may be cut off from the swarm, and must not step on its own)
        trainers = await self.directory.trainers()
        return bool(trainers) and all(t.done for t in trainers)

    async def _step_round(self, epoch: int, group: tuple[str, ...]) -> None:
        average = self._average_round if self.runtime.asynchronous else self._sync_round
        record = await average(epoch, group)
        if record is None:
            return
        self.steps.append(record)
        self._log_step(record)
        if record.group > 1 and self.checkpoints is None:  # with checkpoints, only the disk counts
            self._durable_epoch = record.epoch
        if self.runtime.asynchronous:
            log.info("stage %d average %d: %d samples from %d replica(s), lr %.2e, mean delta norm %.3f, "
                     "drift %.4f", self.stage, record.epoch, record.samples, record.group, record.lr,
                     record.grad_norm, record.drift)
        else:
            log.info("stage %d step %d: %d samples from %d replica(s), lr %.2e, grad norm %.3f",
                     self.stage, record.epoch, record.samples, record.group, record.lr, record.grad_norm)
        await self._announce()
        if self.checkpoints is not None and record.epoch % self.cfg.server.checkpoint_every == 0:
            await self._checkpoint()

    async def _sync_round(self, epoch: int, group: tuple[str, ...]) -> StepRecord | None:
        """All-reduce the stage's gradients and step, holding the gate throughout."""
        async with self._gate:
            if self._drop_if_presumed_gone() or self.runtime.epoch != epoch:
                return None
            self._behind_since.clear()
            self._round_epoch = epoch
            try:
                samples, ids = self.runtime.pending_samples, sorted(self.runtime.pending)
                flat = await self._run_timed(self.runtime.flat_grad)
                mean, samples, ids = await self._reduce(epoch, group, flat, samples, ids)
                return await self._run_timed(self.runtime.apply_step, mean, samples, len(group), ids)
            finally:
                self._round_epoch = None

    async def _average_round(self, epoch: int, group: tuple[str, ...]) -> StepRecord | None:
        """Average the replicas' weights (async mode); serving goes on while the deltas travel."""
        async with self._gate:
            if self._drop_if_presumed_gone() or self.runtime.epoch != epoch:
                return None
            self._behind_since.clear()
            own = await self._run_timed(self.runtime.begin_average)
        self._round_epoch = epoch
        try:
            mean, samples, ids = await self._reduce(epoch, group, own.contribution, own.samples, own.ids)
            async with self._gate:
                return await self._run_timed(self.runtime.finish_average, own, mean, samples, len(group), ids)
        finally:
            self._round_epoch = None

    async def _reduce(
        self, epoch: int, group: tuple[str, ...], flat: torch.Tensor, samples: int, ids: list[str]
    ) -> tuple[torch.Tensor, int, list[str]]:
        """The stage's sample-weighted mean of `flat` (sums over samples), its samples and microbatches."""
        if len(group) == 1:
            return flat / max(samples, 1), samples, ids
        result = await self.allreduce.run(epoch, group, flat, samples, self.runtime.last_digest, ids)
        return result.mean, result.samples, result.ids

    async def _checkpoint(self) -> None:
        meta, tensors = await self._compute(self.runtime.state)
        path = await asyncio.get_running_loop().run_in_executor(None, self.checkpoints.save, meta, tensors)
        self._durable_epoch = max(self._durable_epoch, int(meta["epoch"]))
        log.info("stage %d checkpoint at epoch %d: %s", self.stage, meta["epoch"], path)

    def _resume_from_disk(self) -> None:
        if self.checkpoints is None:
            return
        found = self.checkpoints.latest()
        if found is None:
            return
        meta, tensors = found
        try:
            self.runtime.load_state(meta, tensors)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            log.warning("stage %d checkpoint at epoch %s is unusable (%s); starting without it",
                        self.stage, meta.get("epoch"), e)
            return
        self._durable_epoch = self.runtime.epoch
        log.info("stage %d resumed from checkpoint at epoch %d", self.stage, self.runtime.epoch)

    # ---- catching up -------------------------------------------------------------------------

    async def _download_state(self, candidates: list[ServerRecord], force: bool = False) -> None:
        """Load parameters and optimizer state from the most advanced replica that answers."""
        for source in sorted(candidates, key=lambda r: -r.epoch):
            try:
                meta, tensors = await self.client.call(
                    source.peer_id, "state", {"stage": self.stage}, [], self.cfg.trainer.request_timeout
                )
            except CallFailed as e:
                log.warning("state download from %s failed: %s", short(source.peer_id), e)
                continue
            async with self._gate:
                if int(meta.get("epoch", -1)) < self.runtime.epoch + (0 if force else 1):
                    return
                lost = self.runtime.pending_samples
                try:
                    await self._run_timed(self.runtime.load_state, meta, tensors)
                except (KeyError, TypeError, ValueError, RuntimeError) as e:
                    log.warning("state from %s is unusable: %s", short(source.peer_id), e)
                    continue
            self.counters["catch_ups"] += 1
            self.counters["lost_samples"] += lost
            with open(self._summary_path(".loads.jsonl"), "a") as out:  # steps logged before are superseded
                loaded = {"time": time.time(), "epoch": self.runtime.epoch, "source": source.peer_id}
                out.write(json.dumps(loaded) + "\n")
            if self.checkpoints is None:
                self._durable_epoch = self.runtime.epoch  # the source holds it too
            log.info(
                "stage %d server %s loaded epoch %d from %s%s",
                self.stage, self.label, self.runtime.epoch, short(source.peer_id),
                f" (dropped {lost} samples computed at older weights)" if lost else "",
            )
            return

    # ---- results -----------------------------------------------------------------------------

    def _summary_path(self, suffix: str) -> Path:
        out = Path(self.cfg.run_dir) / "peers"
        out.mkdir(parents=True, exist_ok=True)
        return out / f"server-s{self.stage}-{self.peer_id[-8:]}{suffix}"

    def _log_step(self, record: StepRecord) -> None:
        """Each step as it happens, one JSON line: the stage's history survives a replica that is killed."""
        with open(self._summary_path(".steps.jsonl"), "a") as out:
            out.write(json.dumps(asdict(record)) + "\n")

    def _write_summary(self) -> None:
        runtime = getattr(self, "runtime", None)
        if runtime is None or not hasattr(self, "peer_id"):
            return
        summary = {
            "role": "server",
            "stage": self.stage,
            "peer_id": self.peer_id,
            "epoch": runtime.epoch,
            "digest": runtime.digest(),
            "steps": len(self.steps),  # each one is in the .steps.jsonl beside this file
            "fast_backwards": runtime.fast_backwards,
            "recomputed_backwards": runtime.recomputed_backwards,
            "duplicates": runtime.duplicates,
            "mode": self.cfg.optim.mode,
            "reply_delay": self.cfg.server.reply_delay,
            # local updates between each gradient's forward and its application -> gradients
            "staleness": {str(k): n for k, n in sorted(runtime.staleness.items())},
            # the stage's recent steps as this replica knows them (also those it loaded from a peer or disk)
            "ledger": {str(e): ids for e, ids in runtime.ledger().items()},
            "throughput": self.meter.rate,
            "capacity": self.capacity_meter.rate,
            "traffic": self.traffic.as_dict(),
            "busy_seconds": self.busy_seconds,
            "alive_seconds": time.time() - self.started,
            **self.counters,
        }
        self._summary_path(".json").write_text(json.dumps(summary, indent=1))
