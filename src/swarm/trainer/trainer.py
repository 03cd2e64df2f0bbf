"""The microbatch pipeline: data -> stage 0 -> ... -> last stage (loss) -> ... -> stage 0 backward.

One microbatch, in order (`Trainer._microbatch`):
  1. for each stage but the last, pick a server (stochastic wiring) and run `forward`
     (`swarm.trainer.calls`: routing, timeouts, retries elsewhere);
  2. the last stage runs forward, loss and backward in one call and returns d(loss)/d(inputs);
  3. backward through the earlier stages in reverse, preferring the server that ran the forward
     (it kept the graph); any other replica recomputes the forward from the inputs we resend.
Each stage accumulates the microbatch's gradient (`swarm.server.handlers`), steps once its replicas hold
`optim.target_batch_size` samples together (`swarm.server.stepping`); the trainer keeps what it takes
to accumulate each gradient again until the stage's ledger shows it in a durable step
(`swarm.trainer.delivery`). Several microbatches are in flight at once so one trainer keeps servers of
every stage busy; microbatches whose forward failed before anything was accumulated are retried whole.
With `trainer.eval_every`, held-out samples go through the stages' `evaluate` call, which changes
nothing on the servers, for a validation loss (`swarm.trainer.evaluation`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import signal
import time

import torch

from swarm.config import ConfigMismatch, SwarmConfig, agreed, config_hash
from swarm.data import load_samples, split_inputs_targets
from swarm.exiting import STOP_MARGIN, deadline
from swarm.metrics import Figure, MetricsEndpoint, peer_figures
from swarm.net.directory import RENEW_PERIODS, short
from swarm.net.lifeline import CutOff
from swarm.net.peer import SwarmPeer, join
from swarm.net.protocol import Traffic
from swarm.results import PeerResults
from swarm.supervise import supervised
from swarm.trainer.board import TrainerBoard
from swarm.trainer.calls import MicrobatchFailed, StageCaller
from swarm.trainer.delivery import GradientKeeper
from swarm.trainer.evaluation import Validator
from swarm.trainer.feed import BlockLost, DataFeed, Piece
from swarm.trainer.progress import Completed, Progress
from swarm.trainer.view import SwarmView, until_next_view
from swarm.wire.records import TrainerRecord

log = logging.getLogger("swarm.trainer")
RELEASE_TIMEOUT = 5.0  # seconds a stopping trainer spends giving its data blocks back


class StageUnreachable(CutOff):
    """A stage has had no server for longer than `trainer.no_server_timeout`."""


class Trainer:
    def __init__(self, cfg: SwarmConfig):
        self.cfg = cfg
        self.tc = cfg.trainer
        self.hash = config_hash(cfg)
        self.num_stages = cfg.model.num_stages
        self.rng = random.Random(cfg.data.seed * 7919 + self.tc.index)
        self.view = SwarmView(self.num_stages, self.hash, agreed(cfg), cfg.net.announce_period)
        self.progress = Progress(self.view, self.tc.progress_every, self.tc.target_steps)
        self.traffic = Traffic()
        self.failed = 0
        self.unresolved = 0
        self.done = False
        self._ids = itertools.count()
        self._requeued: list[tuple[torch.Tensor, Piece]] = []  # batches whose forward failed: retried whole
        self._forwarding: set[asyncio.Task] = set()  # microbatches not accumulated anywhere yet
        self.given_up = 0  # microbatches given up on their way forward when the run was over
        self.draining = False  # (`finish`: possibly before `train` has begun, in a server stopping early)
        self.stopped_starting: float | None = None  # when the trainer started its last microbatch
        # what /metrics and TensorBoard show: the figures the swarm sees in its last announcement
        self.metrics = MetricsEndpoint(cfg.net, "trainer")
        self.board = TrainerBoard(self.tc.tensorboard_dir, self.tc.index)
        self.announced: TrainerRecord | None = None

    def run(self) -> None:
        asyncio.run(self.train())

    # ---- the training loop -------------------------------------------------------------------

    async def train(self, stop: asyncio.Event | None = None, host: SwarmPeer | None = None) -> None:
        """Train until the target steps (or SIGTERM, which lets the microbatches already accumulating
        finish and their gradients settle; SIGINT or `stop` ends at once).

        `host`: the swarm peer of the server this trainer runs inside (`server.train`), with a client of
        this trainer's own: the process's signals, DHT peer and life are the server's. Without it the
        trainer joins the swarm as a peer of its own."""
        self.stop = stop or asyncio.Event()
        if host is None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._drain)
        # (off the event loop: inside a server, that loop answers calls and renews the server's records)
        self.table = table = await asyncio.to_thread(load_samples, self.cfg.data, self.cfg.model)
        peer = host or await join(self.cfg.net, self.cfg.wire, self.traffic, serving=False)
        self.peer_id, self.directory = peer.peer_id, peer.directory
        self.feed = DataFeed(table, peer.directory, peer.peer_id, self.cfg.data, self.tc.microbatch_size, self.rng)
        period = self.cfg.net.announce_period
        self.caller = StageCaller(self.tc, peer.client, peer.directory, self.view, self.hash, period, self.rng,
                                  self.stop, peer.sign)
        self.keeper = GradientKeeper(self.tc, peer.client, self.caller, self.view, period, lambda: self.done,
                                     self.stop)
        self.validator = Validator(table, self.caller, self.num_stages, self.tc.microbatch_size, self.tc.eval_every,
                                   self.tc.max_inflight, self._step, period)
        try:
            self.metrics.start(self.peer_id, f"trainer-{self.tc.index}", self._figures)
            self.progress.started = time.time()
            log.info("trainer %s started: a corpus of %d samples (%d more held out for validation), taken in "
                     "blocks of %d shared through the DHT, target %d steps", short(self.peer_id), len(table),
                     self.cfg.data.validation_samples, self.cfg.data.block_samples, self.tc.target_steps)
            await peer.guard(self._train(), self._watch_stages())
            log.info("trainer %s done: %d samples, %d microbatches failed, %d retries, %d gradients replayed",
                     short(self.peer_id), self.progress.samples(), self.failed, self.caller.retries,
                     self.keeper.replays)
        finally:
            self.metrics.close()
            self.board.close()
            await self._release_blocks()
            self._write_summary()
            if host is None:
                await peer.leave()

    async def _release_blocks(self) -> None:
        """What is left of its data blocks goes to the next trainer at once, not when its lease lapses."""
        try:
            await asyncio.wait_for(self.feed.release(), RELEASE_TIMEOUT)
        except Exception as e:  # a trainer cut off from the swarm: its leases lapse instead
            log.warning("could not give its data blocks back (%s: %s); they pass on when its leases lapse",
                        type(e).__name__, e)

    async def _train(self) -> None:
        await self.view.refresh(self.directory)
        self._check_config()
        # in the servers' view before its first microbatch: a replica alone in its stage steps only while
        # it sees a trainer, and one that saw none when its first step was due waited out a grace more
        await self._announce()
        loops = {"view": self._refresh_loop, "delivery": self.keeper.loop,
                 "progress": lambda: self.progress.loop(short(self.peer_id)), "lease": self.feed.loop}
        if self.tc.eval_every:
            loops["validation"] = self.validator.loop
        background = {name: asyncio.create_task(supervised(name, loop)) for name, loop in loops.items()}
        try:
            await self._feed()
            if self.tc.eval_every and not (self.stop.is_set() or self.draining):
                background["validation"].cancel()  # an evaluation under way gives way to the final one
                await self.validator.final()
            self.done = True
            await self._announce()
            self.unresolved = await self.keeper.settle()
        finally:
            for task in background.values():
                task.cancel()
        await self._announce()

    async def _watch_stages(self) -> None:
        """Raise `StageUnreachable` once a stage has had no server for `trainer.no_server_timeout` seconds."""
        limit = self.tc.no_server_timeout
        empty_since: dict[int, float] = {}
        while limit:
            await asyncio.sleep(self.cfg.net.announce_period)
            now = time.monotonic()
            for stage, servers in self.view.servers.items():
                if servers:
                    empty_since.pop(stage, None)
                    continue
                since = empty_since.setdefault(stage, now)
                if now - since > limit:
                    raise StageUnreachable(f"stage {stage} has had no server for {now - since:.0f}s "
                                           f"(trainer.no_server_timeout={limit:g})")

    async def _feed(self) -> None:
        """Keep `trainer.max_inflight` microbatches in the pipeline until the run is over; then give up
        those still on their way forward (see `_give_up_forwards`) and let the others finish."""
        slots = asyncio.Semaphore(self.tc.max_inflight)
        running: set[asyncio.Task] = set()
        while not self._finished():
            await slots.acquire()
            if self._finished():
                slots.release()
                break
            batch, piece = self._requeued.pop(0) if self._requeued else await self.feed.next()
            task = asyncio.create_task(self._microbatch(batch, piece))
            running.add(task)
            self._forwarding.add(task)
            task.add_done_callback(lambda t: (running.discard(t), self._forwarding.discard(t), slots.release()))
        self.stopped_starting = time.time()
        self._give_up_forwards()
        # a microbatch given up ends cancelled, whether it was under way or had not yet run (on a fast GPU the
        # target can be reached while the last one is handed out): that is no error
        for result in await asyncio.gather(*running, return_exceptions=True):
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result

    def _give_up_forwards(self) -> None:
        """Once the run is over (its target reached, or SIGTERM), a microbatch still on its way forward has
        been accumulated nowhere and its samples are not consumed: waiting for it would only hold the run's
        end behind the slowest server's queue (its forward, then its backward there). Its calls are
        cancelled (a server drops a request whose caller went away before its turn) and its samples stay
        in the block, for whoever takes the block next."""
        self.given_up = len(self._forwarding)
        for task in self._forwarding:
            task.cancel()
        if self.given_up:
            log.info("the run is over: %d microbatch(es) still on their way forward given up", self.given_up)

    def _step(self) -> int:
        """The stages' step: the least epoch among them, as far as this trainer has seen them settle."""
        return min(self.view.settled_epoch(k) for k in range(self.num_stages))

    def _finished(self) -> bool:
        return self.stop.is_set() or self.draining or self._step() >= self.tc.target_steps

    def _drain(self) -> None:
        """SIGTERM to a trainer of its own: `finish`, within a bound after which the process ends."""
        if not self.draining:
            # the last calls in flight, then the stages' confirmation of every gradient, bound the drain
            bound = 2 * self.tc.request_timeout + self.tc.settle_timeout + STOP_MARGIN
            deadline(bound, f"trainer …{getattr(self, 'peer_id', '')[-6:]}", asyncio.get_running_loop())
        self.finish()

    def finish(self) -> None:
        """Start no more microbatches; let those already accumulating finish and their gradients settle."""
        if not self.draining:
            log.info("trainer stopping: finishing the microbatches in flight")
        self.draining = True

    async def _microbatch(self, batch: torch.Tensor, piece: Piece) -> None:
        owed: list[str] = []  # servers that ran this microbatch's forwards, whose backwards are still to come
        try:
            await self._through_stages(batch, piece, owed)
        finally:
            for peer in owed:
                self.caller.repay(peer)

    async def _through_stages(self, batch: torch.Tensor, piece: Piece, owed: list[str]) -> None:
        inputs, targets = split_inputs_targets(batch, self.table.pad_id)
        req = f"{next(self._ids)}@{piece.label}"  # unique per trainer, and says which samples it carries
        last = self.num_stages - 1
        call, keep = self.caller.call, self.keeper.keep
        try:
            x, path = inputs, []
            for k in range(last):
                served = await call(k, "forward", req, [x])
                path.append((served.peer, x))
                self.caller.owe(served.peer)
                owed.append(served.peer)
                x = served.tensors[0]
        except MicrobatchFailed as e:  # nothing was accumulated yet: the batch is retried whole
            self.failed += 1
            self._requeued.append((batch, piece))
            log.warning("microbatch %s forward failed (%s); its batch will be sent again", req, e)
            return
        self._forwarding.discard(asyncio.current_task())  # from here on it finishes, however the run ends
        try:
            await self.feed.consume(piece)  # from here on, sending it again could count it twice
        except BlockLost as e:
            log.warning("microbatch %s not sent: %s", req, e)
            return
        except Exception as e:  # its record could not be written: it goes again, recorded first again
            self._requeued.append((batch, piece))
            log.warning("microbatch %s could not be recorded (%s: %s); it will be sent again", req,
                        type(e).__name__, e)
            return
        try:
            served = await call(last, "forward", req, [x, targets], accumulating=True)
            keep(req, last, "forward", [x, targets], served)
            loss, epoch, grads = float(served.meta["loss"]), int(served.meta["epoch"]), served.tensors
            for k in reversed(range(last)):
                peer, x_k = path[k]
                self.caller.repay(owed.pop())  # (this stage's: the last one left)
                served = await call(k, "backward", req, [x_k, grads[0]], prefer=peer, accumulating=True)
                keep(req, k, "backward", [x_k, grads[0]], served)
                grads = served.tensors
        except MicrobatchFailed as e:  # stopping, or refused: accumulating calls are otherwise retried
            self.failed += 1
            log.warning("microbatch %s abandoned: %s", req, e)
            return
        self.progress.completed.append(Completed(time.time(), inputs.shape[0], loss, epoch, req))

    # ---- the view of the swarm, and our announcement in it ---------------------------------------

    def _check_config(self) -> None:
        """Refuse to start against a swarm whose servers all run with other settings."""
        if self.view.mismatched and not any(self.view.servers.values()):
            raise ConfigMismatch(
                "every server of this run uses other settings (see the lines above); "
                "use the swarm's model and optim sections and swarm version, or another net.run_id"
            )

    async def _refresh_loop(self) -> None:
        """The view once per announcement period, as often as servers renew their records (a gone server's
        calls are abandoned within a few views); our own record every RENEW_PERIODS periods, which is all a
        record living `net.record_ttl` needs, since servers and the launcher read trainers' records seldom.
        Each read and write is served by every DHT node holding the key, CPU taken from every host's compute."""
        renewed = -math.inf
        while True:
            waited_on = {peer for _, peer in self.caller.waited_on()}
            await asyncio.sleep(until_next_view(self.cfg.net.announce_period, self.directory, waited_on))
            try:
                await self.view.refresh(self.directory)
                self.caller.abandon_gone()
                if time.monotonic() - renewed >= RENEW_PERIODS * self.cfg.net.announce_period:
                    renewed = time.monotonic()
                    await self._announce()
            except Exception as e:
                log.warning("could not refresh the swarm view: %s", e)

    async def _announce(self) -> None:
        """`done` tells servers that no new microbatch will come, so they may flush what they hold."""
        p, val = self.progress, self.validator.latest
        validation = {} if val is None else {"val_loss": val.loss, "val_step": val.step}
        record = TrainerRecord(self.peer_id, p.samples(), self.failed, p.recent_loss(), self.done, p.recent_rate(),
                               **validation)
        await self.directory.announce_trainer(record, ttl=60.0 if self.done else None)
        self.announced = record
        self.board.add(record)

    def _figures(self) -> list[Figure]:
        counters = {"retries": self.caller.retries, "replays": self.keeper.replays}
        return peer_figures("trainer", self.announced, counters, self.traffic)

    def _write_summary(self) -> None:
        if not hasattr(self, "peer_id"):
            return
        PeerResults(self.cfg.run_dir).write(f"trainer-{self.tc.index}-{self.peer_id[-8:]}.json", {
            "role": "trainer",
            "index": self.tc.index,
            "peer_id": self.peer_id,
            "samples": self.progress.samples(),
            "failed": self.failed,
            "given_up": self.given_up,
            "stopped_starting": self.stopped_starting,
            "retries": self.caller.retries,
            "inputs_resent": self.caller.inputs_resent,
            "replays": self.keeper.replays,
            "ledger_questions": self.keeper.questions,  # `ledger` calls asking where its gradients stand
            "unresolved": self.unresolved,
            "started": self.progress.started,
            "call_seconds": self.caller.call_seconds,
            "traffic": self.traffic.as_dict(),
            "dht_ops": dict(self.directory.ops),  # this peer's, by kind (inside a server: the server's too)
            "fresh_starts": sorted(self.view.fresh_starts.values(), key=lambda f: f["time"]),
            "completed": [[c.time, c.samples, c.loss, c.epoch, c.req] for c in self.progress.completed],
            "data": {"blocks_taken": self.feed.taken, "low_pass": self.feed.low_pass, "dropped": self.feed.dropped,
                     "table": self.table.name},
            "validation": self.validator.summary(),
        })
