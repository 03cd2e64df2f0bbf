"""A stage server's life: join the swarm, enter a stage (build it, take its newest state, announce),
serve and step until told to stop or to move, leave the stage (finish what it accepted), and move on
to another stage or out of the swarm.

What runs while it serves a stage, one job each: the announcer (`announcing`), the step loop
(`stepping`), the forward batcher (`batching`) and, with rebalancing on, the mover (`moving`); the
request handlers (`handlers`) answer calls throughout. All torch work goes through one compute gate
(`gate`). Everything that belongs to the stage is built fresh on each entry (`stage.ServedStage`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from swarm.averaging.allreduce import StageAllReduce
from swarm.averaging.checks import Bounds
from swarm.backup.keeper import BackupKeeper
from swarm.config import ConfigMismatch, SwarmConfig, agreed, config_hash, describe_mismatch
from swarm.exiting import STOP_MARGIN, on_stop_signals
from swarm.looplag import LoopLag
from swarm.metrics import Figure, MetricsEndpoint, loss_scale_figures, peer_figures
from swarm.net.directory import short
from swarm.net.join import JoinServicer
from swarm.net.node import visible_addresses
from swarm.net.peer import SwarmPeer, join
from swarm.net.protocol import Traffic
from swarm.net.servicer import StageServicer
from swarm.net.transport import StageClient
from swarm.ops.cpushare import quota_cores
from swarm.results import PeerResults
from swarm.server.announcing import Announcer
from swarm.server.batching import Batcher
from swarm.server.calibration import calibrate
from swarm.server.device import cpu_bf16_hint, resolve
from swarm.server.gate import ComputeGate
from swarm.server.handlers import StageHandlers
from swarm.server.moving import Mover, least_served_stage
from swarm.server.restoring import take_stage_state
from swarm.server.stage import ServedStage
from swarm.server.stepping import Stepper
from swarm.server.transfer import StateTransfer
from swarm.supervise import supervised
from swarm.trainer.trainer import Trainer
from swarm.wire.calls import CountNote

log = logging.getLogger("swarm.server")


def _ignore_cancelled_stream_handlers(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Python 3.11's stream-server callback calls `task.exception()` on a cancelled handler task (fixed
    in 3.12), so every RPC stream still open when a server leaves would print a CancelledError
    traceback. Those cancellations are the intended end of the stream; everything else is reported."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        log.debug("stream handler cancelled at shutdown: %s", context.get("message"))
        return
    loop.default_exception_handler(context)


@dataclass
class StageJobs:
    """What serves one stage, built on entry and stopped on leaving."""

    stage: ServedStage
    batcher: Batcher
    announcer: Announcer
    transfer: StateTransfer
    stepper: Stepper
    mover: Mover
    tasks: list[asyncio.Task] = field(default_factory=list)


class StageServer:
    def __init__(self, cfg: SwarmConfig):
        self.cfg = cfg
        self.agreed = agreed(cfg)
        self.hash = config_hash(cfg)
        self.traffic = Traffic()  # bytes on the wire by role, since this server entered its stage
        self.results = PeerResults(cfg.run_dir)
        self.rng = random.Random()
        self.peer: SwarmPeer | None = None
        self.stage: ServedStage | None = None
        self.announcer: Announcer | None = None  # the stage's, whose record /metrics shows
        self.metrics = MetricsEndpoint(cfg.net, "server")

    @property
    def label(self) -> str:
        """How logs name this server: the operator's name for it, if any, and the tail of its peer id."""
        tail = short(self.peer.peer_id) if self.peer is not None else "(starting)"
        return f"{self.cfg.server.name} {tail}" if self.cfg.server.name else tail

    def run(self) -> None:
        asyncio.run(self.serve())

    async def serve(self, stop: asyncio.Event | None = None) -> None:
        cfg = self.cfg
        if cfg.server.threads:
            torch.set_num_threads(cfg.server.threads)
        self.stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        # leaving takes up to leave_timeout to finish accepted work, then a checkpoint and the DHT's goodbye;
        # a trainer here then has as long again to finish its microbatches under way
        leaving = cfg.server.leave_timeout * (2 if cfg.server.train else 1)
        on_stop_signals(loop, self.stop.set, leaving + STOP_MARGIN, f"server {self.label}")
        loop.set_exception_handler(_ignore_cancelled_stream_handlers)
        self.lag = LoopLag()  # how long the event loop was kept from running (in the summary)
        # under a CPU quota the quota is the machine: time spent throttled is what the work costs there
        # (as served; see ComputeGate.run_locked for the figure rebalancing takes)
        alone, quota = cfg.server.device == "cpu" and torch.get_num_threads() == 1, quota_cores()
        self.gate = ComputeGate(cfg.server.slowdown, alone and quota is None, quota if alone else None,
                                cfg.server.compute_cores, cfg.server.flush_denormal)
        self.handlers = StageHandlers(cfg.model, cfg.server, self.hash, int(cfg.net.max_payload_mb * 2**20),
                                      self.gate, self.stop.is_set)
        self.peer = await join(cfg.net, cfg.wire, self.traffic, serving=True)
        if hint := cpu_bf16_hint(cfg.server.autocast, torch.device(cfg.server.device)):
            log.info("server %s: %s", self.label, hint)  # once, not at every stage it enters
        try:
            self.metrics.start(self.peer.peer_id, cfg.server.name, self._figures)
            await self.peer.guard(self._serve_stages())
        finally:
            self.metrics.close()
            self._write_summary()
            self.gate.close()
            await self.peer.leave()

    async def _serve_stages(self) -> None:
        """Serve a stage, and the next one the mover picks, until stopped."""
        cfg = self.cfg
        await self._check_configs()
        p2p, half_rtt = self.peer.p2p, cfg.net.emulated_rtt_ms / 2000
        await JoinServicer(p2p, self.peer.secret).add_p2p_handlers(p2p)
        self.servicer = StageServicer(self.handlers, self.peer.faults, cfg.wire.policy(), self.traffic, half_rtt,
                                      self.peer.secret, device=resolve(torch.device(cfg.server.device)))
        await self.servicer.add_p2p_handlers(p2p)
        self.keeper = BackupKeeper(self.peer.peer_id, self.hash, cfg.model, cfg.backup, cfg.net,
                                   self.peer.client, self.peer.directory, self._serving_stage)
        self.handlers.backups = self.keeper
        keeping = asyncio.create_task(supervised("backup", self.keeper.loop))
        self.lag.watch(asyncio.get_running_loop())
        port = cfg.net.metrics_port
        trainer = Trainer(replace(cfg, net=replace(cfg.net, metrics_port=port + 1 if port else 0))) \
            if cfg.server.train else None
        ended = asyncio.Event()  # the trainer's end at once
        training = asyncio.create_task(self._train_here(trainer, ended)) if trainer is not None else None
        failure = None
        try:
            stage, previous = cfg.server.stage, -1
            if cfg.server.auto_stage:
                stage = await least_served_stage(self.peer.directory, cfg.model.num_stages, self.hash, self.label)
            while (jobs := await self._enter(stage, previous)) is not None:
                target = await self._serve_until_stop_or_move(jobs)
                if target is None and trainer is not None:
                    trainer.finish()  # as SIGTERM tells a trainer of its own: it winds down while the server leaves
                await self._leave(jobs, target)
                if target is None:
                    break
                self._write_summary()  # the summary of the stage it leaves, as a replica that left
                stage, previous = target, stage
        finally:
            keeping.cancel()
            self.lag.unwatch()
            if training is not None:
                trainer.finish()
                await asyncio.wait([training], timeout=cfg.server.leave_timeout)  # its microbatches under way
                ended.set()  # then at once: its last calls and its summary
                await asyncio.wait([training], timeout=STOP_MARGIN / 3)
                training.cancel()
                (failure,) = await asyncio.gather(training, return_exceptions=True)
        if isinstance(failure, Exception):
            raise failure

    async def _train_here(self, trainer: Trainer, ended: asyncio.Event) -> None:
        """The trainer of `server.train`: on this server's DHT peer, with a client of its own whose calls to
        this server go straight to its servicer. Its failure stops the server."""
        client = self.peer.client.alongside(trainer.traffic, self.servicer)
        try:
            await trainer.train(ended, replace(self.peer, client=client))
        except BaseException:
            self.stop.set()
            raise

    def _serving_stage(self) -> int | None:
        return self.stage.index if self.stage is not None and self.stage.serving else None

    async def _check_configs(self) -> None:
        """Refuse to join a swarm whose servers all run with other settings (this server is misconfigured).
        Where some share ours, the others are ignored, as trainers ignore them: a stranger's record with
        another hash must not keep every new server out."""
        records = [r for rs in (await self.peer.directory.stages(self.cfg.model.num_stages)).values() for r in rs]
        if any(r.config_hash == self.hash for r in records):
            for r in records:
                if r.config_hash != self.hash:
                    log.warning("ignoring server %s: it runs with other settings", short(r.peer_id))
            return
        for r in records:
            if r.config_hash != self.hash:
                raise ConfigMismatch(
                    f"server {short(r.peer_id)} of stage {r.stage} runs with other settings "
                    f"({describe_mismatch(self.agreed, r.agreed())}); "
                    "use the same model and optim sections and swarm version, or another net.run_id"
                )

    def _results_name(self, stage: int) -> str:
        return f"server-s{stage}-{self.peer.peer_id[-8:]}"

    async def _enter(self, index: int, previous: int) -> StageJobs | None:
        """Build the stage's module, take its newest state (from disk, its live replicas or a copy held
        outside it), announce; None if stopped before it could serve. `previous`: the stage it moves
        from (-1: none)."""
        cfg, peer, gate = self.cfg, self.peer, self.gate
        self.traffic.counts.clear()
        st = await gate.run(ServedStage.build, cfg.model, cfg.optim, cfg.server, index, peer.peer_id, self.label,
                            cfg.wire.policy())
        st.busy_start = gate.busy_seconds
        st.previous_stage = previous
        gate.count_work = st.work.count
        batcher = Batcher(st.runtime, gate, cfg.server.merge_samples, cfg.server.batch_backward_wait)
        announcer = Announcer(self.agreed, self.hash, cfg.server.name, cfg.net, peer.peer_id, peer.directory, gate, st,
                              lambda: self.servicer.in_hand, partial(tell_count, peer.client, cfg.net.announce_period))
        name = self._results_name(index)
        transfer = StateTransfer(st, gate, peer.client, peer.directory, self.hash, self.results, name,
                                 cfg.server.download_timeout, cfg.net.announce_period, self.keeper.local)
        bounds = Bounds(cfg.server.max_grad_norm, cfg.server.max_request_samples, cfg.server.clip_to_median,
                        receipts=True)
        allreduce = StageAllReduce(peer.client, peer.peer_id, index, cfg.net.allreduce_timeout, st.accept_proposal,
                                   bounds, *(partial(read, index) for read in (peer.directory.live_at,
                                                                               peer.directory.lapsed)))
        stepper = Stepper(st, peer.peer_id, cfg.optim, cfg.net, cfg.server.checkpoint_every, gate, peer.directory,
                          allreduce, announcer, transfer, self.results, f"{name}.steps.jsonl", self.rng)
        mover = Mover(st, peer.peer_id, cfg.server.name, self.hash, cfg.model.num_stages, cfg.rebalance,
                      cfg.server.leave_timeout, peer.directory, gate, batcher, announcer, self.results, self.rng)
        self.stage, self.announcer = st, announcer
        self.handlers.enter(st, batcher, allreduce.contribute)
        transfer.resume_from_disk()
        if not await take_stage_state(st, transfer, peer.directory, self.hash, cfg.model.num_stages,
                                      cfg.server.fresh_start, self.stop):
            return None
        await calibrate(st, gate, cfg.trainer.microbatch_size, cfg.model.vocab_size)
        st.serving = True
        log.info("stage %d server %s up on %s (any peer can join through these), epoch %d, device %s",
                 index, self.label, " ".join(visible_addresses(peer.dht)), st.runtime.epoch, cfg.server.device)
        await announcer.announce()
        return StageJobs(st, batcher, announcer, transfer, stepper, mover)

    async def _serve_until_stop_or_move(self, jobs: StageJobs) -> int | None:
        """Run the stage's jobs until the server is stopped (None) or the mover has drained it (the target)."""
        loops = [supervised("announcer", jobs.announcer.loop), supervised("step", jobs.stepper.loop),
                 supervised("batcher", jobs.batcher.loop)]
        if self.cfg.rebalance.enabled:
            loops.append(supervised("mover", jobs.mover.loop))
        jobs.tasks = [asyncio.create_task(t) for t in loops]
        waits = [asyncio.ensure_future(e.wait()) for e in (self.stop, jobs.mover.moved)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        return None if self.stop.is_set() else jobs.stage.moving_to

    async def _leave(self, jobs: StageJobs, target: int | None) -> None:
        """Stop taking work, withdraw from the stage, finish what was accepted, then go (bounded in time):
        out of the swarm, or on to stage `target`.

        New requests are already answered "shutting down" (trainers retry them elsewhere). Gradients
        this replica holds but has not stepped leave with it (`lost_samples` in the summary counts
        them); trainers accumulate them again elsewhere once its record is gone.
        """
        st, started = jobs.stage, time.monotonic()
        st.serving = False
        log.info("stage %d server %s %s", st.index, self.label,
                 "leaving" if target is None else f"moving to stage {target}")
        announcer, stepper, batcher, *others = jobs.tasks
        for task in (announcer, *others):
            task.cancel()
        # a sync round under way finishes for the whole stage first; an async round's exchange is called
        # off, and its other replicas retry without this one
        await jobs.stepper.finish()
        async with self.gate.lock:
            stepper.cancel()
        await asyncio.gather(announcer, stepper, *others, return_exceptions=True)
        await jobs.announcer.withdraw()
        deadline = started + self.cfg.server.leave_timeout
        while (jobs.batcher.busy or self.gate.queued > 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        batcher.cancel()
        await asyncio.gather(batcher, return_exceptions=True)
        await self.gate.idle()  # let the computation in progress finish
        if st.checkpoints is not None and st.steps:
            await jobs.transfer.checkpoint()  # a restart continues exactly where this replica left off
        st.counters["lost_samples"] += st.runtime.pending_samples
        log.info("stage %d server %s left after %.1fs%s", st.index, self.label, time.monotonic() - started,
                 f", dropping {st.runtime.pending_samples} unstepped samples" if st.runtime.pending_samples else "")

    def _figures(self) -> list[Figure]:
        record = self.announcer.record() if self.announcer is not None else None
        st = self.stage
        return (peer_figures("server", record, st.counters if st is not None else {}, self.traffic)
                + loss_scale_figures(st.runtime.loss_scale if st is not None else None))

    def _write_summary(self) -> None:
        st = self.stage
        if st is None:
            return
        rt = st.runtime
        self.results.write(f"{self._results_name(st.index)}.json", {
            "role": "server",
            "stage": st.index,
            "peer_id": self.peer.peer_id,
            "epoch": rt.epoch,
            "digest": rt.digest(),
            "steps": len(st.steps),  # each one is in the .steps.jsonl beside this file
            "fast_backwards": rt.fast_backwards,
            "recomputed_backwards": rt.recomputed_backwards,
            "recomputed_why": dict(rt.recomputed),
            "duplicates": rt.duplicates,
            # in fp16: the replica's loss scale at the end, and its backwards run again for an overflow
            "fp16": None if rt.loss_scale is None else {"scale": rt.loss_scale.scale,
                                                        "overflows": rt.loss_scale.overflows},
            "mode": self.cfg.optim.mode,
            "reply_delay": self.cfg.server.reply_delay,
            # weight updates between each gradient's forward and the update that took it in -> gradients
            "staleness": {str(k): n for k, n in sorted(rt.staleness.counts.items())},
            # the stage's recent steps as this replica knows them (also those it loaded from a peer or disk)
            "ledger": {str(e): ids for e, ids in rt.book.steps().items()},
            "throughput": st.work.meter.rate,
            "capacity": st.work.capacity.rate,
            "traffic": self.traffic.as_dict(),
            "busy_seconds": self.gate.busy_seconds - st.busy_start,
            "compute_cores": list(self.gate.cores),  # the CPUs its compute thread could run on
            "alive_seconds": time.time() - st.started,
            # this peer's DHT operations by kind (with a trainer inside, the trainer's count here too)
            "dht_ops": dict(self.peer.directory.ops) if self.peer is not None else {},
            **self.lag.as_dict(),
            "entry": st.entry,  # how it took the stage's state when no replica was left, if it had to
            "fresh_start": st.fresh,
            **st.counters,
            **(self.keeper.summary() if hasattr(self, "keeper") else {}),
        }, indent=1)


async def tell_count(client: StageClient, timeout: float, peer: str, note: CountNote) -> None:
    """A `count` call (see swarm.server.announcing.Announcer.tell_counts)."""
    await client.call(peer, "count", note.to_meta(), [], timeout)
