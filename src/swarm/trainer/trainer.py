"""The microbatch pipeline: data -> stage 0 -> ... -> last stage (loss) -> ... -> stage 0 backward.

One microbatch, in order (`_microbatch`):
  1. for each stage but the last, pick a server (stochastic wiring) and run `forward`;
  2. the last stage runs forward, loss and backward in one call and returns d(loss)/d(inputs);
  3. backward through the earlier stages in reverse, preferring the server that ran the forward
     (it kept the graph); any other replica recomputes the forward from the inputs we resend.
A failed call bans that server for a while and retries the same stage elsewhere. Several
microbatches are in flight at once so one trainer keeps servers of every stage busy.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.config import ConfigMismatch, SwarmConfig, config_hash, describe_mismatch, model_fingerprint
from swarm.core import BanList, Candidate, SmoothWeightedRoundRobin, backoff_delay, choose_server
from swarm.data import SampleShard, load_documents, split_inputs_targets
from swarm.net.directory import Directory, short
from swarm.net.node import start_dht
from swarm.net.transport import CallFailed, StageClient
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


class Trainer:
    def __init__(self, cfg: SwarmConfig):
        self.cfg = cfg
        self.tc = cfg.trainer
        self.hash = config_hash(cfg.model)
        self.num_stages = cfg.model.num_stages
        self.rng = random.Random(cfg.data.seed * 7919 + self.tc.index)
        self.bans = BanList(self.tc.ban_seconds, self.tc.ban_seconds * 8)
        self.round_robin = [SmoothWeightedRoundRobin() for _ in range(self.num_stages)]
        self.view: dict[int, list[ServerRecord]] = {k: [] for k in range(self.num_stages)}
        self.inflight: dict[str, int] = {}
        self.stage_epoch = [0] * self.num_stages
        self.completed: list[Completed] = []
        self.failed = 0
        self.retries = 0
        self.call_seconds: dict[str, float] = {}  # "stage/method" -> time spent waiting on such calls
        self._ids = itertools.count()
        self._mismatch_logged: set[str] = set()
        self._waiting_logged: set[int] = set()

    def run(self) -> None:
        asyncio.run(self.train())

    # ---- the training loop -------------------------------------------------------------------

    async def train(self, stop: asyncio.Event | None = None) -> None:
        self.stop = stop or asyncio.Event()
        shard = SampleShard(
            load_documents(self.cfg.data), self.cfg.model.seq_len, self.tc.index, self.tc.num_trainers,
            self.cfg.data.seed,
        )
        batches = shard.batches(self.tc.microbatch_size)
        self.dht = start_dht(self.cfg.net, client_mode=True)
        try:
            self.peer_id = self.dht.peer_id.to_base58()
            self.client = StageClient(await self.dht.replicate_p2p())
            self.directory = Directory(self.dht, self.cfg.net.run_id, self.cfg.net.record_ttl)
            self.started = time.time()
            log.info("trainer %s started: shard %d/%d with %d samples, target %d steps",
                     short(self.peer_id), self.tc.index, self.tc.num_trainers, len(shard), self.tc.target_steps)
            await self._refresh()
            self._check_config()
            refresher = asyncio.create_task(self._refresh_loop())
            slots = asyncio.Semaphore(self.tc.max_inflight)
            running: set[asyncio.Task] = set()
            while not self._finished():
                await slots.acquire()
                if self._finished():
                    slots.release()
                    break
                task = asyncio.create_task(self._microbatch(next(batches)))
                running.add(task)
                task.add_done_callback(lambda t: (running.discard(t), slots.release()))
            if running:
                await asyncio.gather(*running)
            refresher.cancel()
            await self._announce(done=True)
            log.info("trainer %s done: %d samples, %d microbatches failed, %d retries",
                     short(self.peer_id), self._samples(), self.failed, self.retries)
        finally:
            self._write_summary()
            self.dht.shutdown()

    def _finished(self) -> bool:
        return self.stop.is_set() or min(self.stage_epoch) >= self.tc.target_steps

    def _samples(self) -> int:
        return sum(c.samples for c in self.completed)

    async def _microbatch(self, batch: torch.Tensor) -> None:
        inputs, targets = split_inputs_targets(batch)
        req = f"{next(self._ids)}"
        try:
            x, path = inputs, []
            for k in range(self.num_stages - 1):
                peer, (_, (y,)) = await self._call(k, "forward", req, [x])
                path.append((peer, x))
                x = y
            _, (meta, grads) = await self._call(self.num_stages - 1, "forward", req, [x, targets])
            loss, epoch = float(meta["loss"]), int(meta["epoch"])
            for k in reversed(range(self.num_stages - 1)):
                peer, x_k = path[k]
                _, (_, grads) = await self._call(k, "backward", req, [x_k, grads[0]], prefer=peer)
        except MicrobatchFailed as e:
            self.failed += 1
            log.warning("microbatch %s given up: %s", req, e)
            return
        except Exception:
            self.failed += 1
            log.exception("microbatch %s crashed", req)
            return
        self.completed.append(Completed(time.time(), inputs.shape[0], loss, epoch))

    # ---- calling a stage, with stochastic wiring and retries -----------------------------------

    def _pick(self, stage: int, prefer: str | None) -> str | None:
        now = time.monotonic()
        live = {r.peer_id: r for r in self.view[stage]}
        if prefer in live and not self.bans.is_banned(prefer, now):
            return prefer
        candidates = [
            Candidate(r.peer_id, r.throughput, r.queue, self.inflight.get(r.peer_id, 0)) for r in live.values()
        ]
        if self.tc.routing == "wrr":
            return self.round_robin[stage].pick(candidates, self.bans.banned(now))
        return choose_server(candidates, self.rng, self.bans.banned(now))

    async def _call(self, stage: int, method: str, req: str, tensors, prefer: str | None = None):
        """Call `method` of some server of `stage`, retrying elsewhere on failure.

        A call that failed without timing out (the connection broke) is first repeated on the same
        server with the same request id: the server may have applied it already, and only that
        server can tell a repeat from a new request.
        """
        meta = {"req": req, "stage": stage, "config": self.hash}
        repeat: str | None = None
        for attempt in range(self.tc.max_attempts):
            peer = repeat or self._pick(stage, prefer)
            while peer is None:
                if self.stop.is_set():
                    raise MicrobatchFailed(f"stopped while waiting for a server of stage {stage}")
                await self._wait_for_server(stage)
                peer = self._pick(stage, prefer)
            self.inflight[peer] = self.inflight.get(peer, 0) + 1
            started = time.perf_counter()
            try:
                reply = await self.client.call(peer, method, meta, tensors, self.tc.request_timeout)
            except CallFailed as e:
                if e.refused:
                    raise MicrobatchFailed(f"stage {stage} refused the request: {e}") from e
                self.retries += 1
                if not e.timed_out and repeat is None:
                    repeat = peer
                    log.info("stage %d %s on %s failed (%s); repeating it there", stage, method, short(peer), e)
                else:
                    repeat, prefer = None, None
                    self.bans.ban(peer, time.monotonic())
                    log.info("stage %d %s on %s failed (%s); retrying elsewhere", stage, method, short(peer), e)
                await asyncio.sleep(backoff_delay(attempt, 0.05, 2.0, self.rng))
                continue
            finally:
                self.inflight[peer] -= 1
                key = f"{stage}/{method}"
                self.call_seconds[key] = self.call_seconds.get(key, 0.0) + time.perf_counter() - started
            self.bans.forgive(peer)
            self.stage_epoch[stage] = max(self.stage_epoch[stage], int(reply[0].get("epoch", 0)))
            return peer, reply
        raise MicrobatchFailed(f"stage {stage} {method} failed on {self.tc.max_attempts} attempts")

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
                        log.warning("ignoring server %s: different model config (%s)", short(r.peer_id),
                                    describe_mismatch(model_fingerprint(self.cfg.model), r.model))
                    continue
                usable.append(r)
                self.stage_epoch[stage] = max(self.stage_epoch[stage], r.epoch)
            if usable and stage in self._waiting_logged:
                self._waiting_logged.discard(stage)
                log.info("stage %d has %d server(s) again", stage, len(usable))
            self.view[stage] = usable

    def _check_config(self) -> None:
        """Refuse to start against a swarm whose servers all run another model config."""
        if self._mismatch_logged and not any(self.view.values()):
            raise ConfigMismatch(
                "every server of this run uses a different model config (see the lines above); "
                "use the swarm's model section, or another net.run_id"
            )

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.net.announce_period / 2)
            try:
                await self._refresh()
                await self._announce(done=False)
            except Exception as e:
                log.warning("could not refresh the swarm view: %s", e)

    async def _announce(self, done: bool) -> None:
        recent = self.completed[-20:]
        loss = sum(c.loss for c in recent) / len(recent) if recent else float("nan")
        record = TrainerRecord(self.peer_id, self._samples(), self.failed, loss, done)
        await self.directory.announce_trainer(record, ttl=60.0 if done else None)

    def _write_summary(self) -> None:
        if not hasattr(self, "peer_id"):
            return
        out = Path(self.cfg.run_dir) / "peers"
        out.mkdir(parents=True, exist_ok=True)
        summary = {
            "role": "trainer",
            "index": self.tc.index,
            "peer_id": self.peer_id,
            "samples": self._samples(),
            "failed": self.failed,
            "retries": self.retries,
            "started": getattr(self, "started", None),
            "call_seconds": self.call_seconds,
            "completed": [[c.time, c.samples, c.loss, c.epoch] for c in self.completed],
        }
        (out / f"trainer-{self.tc.index}-{self.peer_id[-8:]}.json").write_text(json.dumps(summary))
