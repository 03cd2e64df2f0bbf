"""Calling a stage: pick a server (stochastic wiring), call it with a timeout that follows measured
latency, and on failure retry: on the same server when the connection broke (it answers a repeat from
its reply cache), elsewhere otherwise, banning the server that failed.

A call that got no answer may still have been applied. Its retry elsewhere then asks for the input
gradient only, and the first server stays the holder of the gradient, in doubt until its stage's
ledger tells (see `swarm.trainer.delivery`). Accumulating calls are retried until they succeed (a stage
without servers is waited for): giving one up would leave the microbatch in some stages' steps and not
in others.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from swarm.config import TrainerConfig
from swarm.core import BanList, Candidate, LatencyTracker, SmoothWeightedRoundRobin, backoff_delay, choose_server
from swarm.core.routing import ServerLatencies, awaiting_first_answer
from swarm.net.directory import Directory, short
from swarm.net.protocol import Tagged
from swarm.net.transport import CallFailed, StageClient
from swarm.trainer.view import SwarmView
from swarm.wire.calls import StageCall
from swarm.wire.codecs import Carried, rows

log = logging.getLogger("swarm.trainer")
LOOK_AGAIN = 0.5  # seconds between looks at a stage none of whose servers takes a call (one may move back)


class MicrobatchFailed(Exception):
    """A stage could not be completed on any server within the allowed attempts."""


@dataclass
class Served:
    """A stage call that succeeded, and who holds the gradient it accumulated (if it accumulated one)."""

    peer: str  # the server that answered
    meta: dict
    tensors: list[Carried]  # as they came, packed: the trainer relays them to the next stage untouched
    holder: str  # the server that accumulated (or, after an unanswered call, may have accumulated) it
    epoch: int  # the stage's epoch at the holder when it accumulated, as far as we know


@dataclass
class _Attempts:
    """Where a call's retries stand."""

    count: int = 0
    repeat: str | None = None  # the server to repeat the call on (its connection broke)
    prefer: str | None = None  # the server to try first (the backward goes where the forward ran)
    holder: tuple[str, int] | None = None  # (server, epoch) of an unanswered accumulating call
    refusals: int = 0  # servers that refused it
    with_inputs: bool = False  # the server that ran the forward no longer held its inputs


class StageCaller:
    def __init__(self, tc: TrainerConfig, client: StageClient, directory: Directory, view: SwarmView,
                 config_hash: str, announce_period: float, rng: random.Random, stop: asyncio.Event,
                 sign: Callable[[str, int, str, int], str] | None = None):
        self.tc = tc
        self.client, self.directory, self.view = client, directory, view
        self.hash = config_hash
        self.announce_period = announce_period
        self.rng = rng
        self.stop = stop
        self.sign = sign  # receipts for accumulating calls (swarm.net.receipts); None: calls carry none
        self.bans = BanList(tc.ban_seconds, tc.ban_seconds * 8)
        self.round_robin = [SmoothWeightedRoundRobin() for _ in range(view.num_stages)]
        self.latency = {(k, m): LatencyTracker() for k in range(view.num_stages)
                        for m in ("forward", "backward", "evaluate")}
        self.measured = [ServerLatencies() for _ in range(view.num_stages)]  # per server, to check announcements
        self.inflight: dict[str, int] = {}
        # backwards that will come to a server (it ran their forwards and keeps the graphs): its load as much
        # as the calls outstanding there, since on a slow server the backward is most of a microbatch's work
        self.owed: dict[str, int] = {}
        self._calls: dict[tuple[int, str], set[asyncio.Task]] = {}  # (stage, server) -> our calls waiting on it
        self._abandoned: set[asyncio.Task] = set()
        self._ended: dict[int, asyncio.Event] = {}  # stage -> set when one of our calls there ends
        self.retries = 0
        self.inputs_resent = 0  # backwards sent again with their inputs, which the forward's server had dropped
        self.call_seconds: dict[str, float] = {}  # "stage/method" -> time spent waiting on such calls
        self.clock: Callable[[], float] = time.perf_counter  # what a call's seconds are read from

    def pick(self, stage: int, prefer: str | None) -> str | None:
        now = time.monotonic()
        live = {r.peer_id: r for r in self.view.servers[stage]}
        # a backward goes where its forward ran, unless that server failed otherwise than by a forward's
        # timeout: a server behind a queue of forwards is alive and serves backwards before them
        # (swarm.server.turns), while sent elsewhere the backward would cost its forward again
        if prefer in live and (not self.bans.is_banned(prefer, now) or self.bans.only_slow(prefer, now)):
            return prefer
        measured = self.measured[stage]
        candidates = [  # a server on its way to another stage takes no new work
            Candidate(r.peer_id, r.throughput, r.queue, self.inflight.get(r.peer_id, 0) + self.owed.get(r.peer_id, 0),
                      measured.latency(r.peer_id))
            for r in live.values() if not r.moving
        ]
        passed_over = self.bans.banned(now) | awaiting_first_answer(candidates)
        if self.tc.routing == "wrr":
            return self.round_robin[stage].pick(candidates, passed_over)
        return choose_server(candidates, self.rng, passed_over)

    def owe(self, peer: str) -> None:
        """`peer` ran a forward whose backward will come to it: counted in its load until `repay`."""
        self.owed[peer] = self.owed.get(peer, 0) + 1

    def repay(self, peer: str) -> None:
        """The backward `owe` counted is on its way (counted in flight from here), or will not come."""
        self.owed[peer] -= 1
        if not self.owed[peer]:
            del self.owed[peer]

    async def call(self, stage: int, method: str, req: str, tensors: list[Carried], prefer: str | None = None,
                   accumulating: bool = False) -> Served:
        """Call `method` of some server of `stage`, retrying as the module says. A backward to `prefer`, the
        server that ran its forward, goes without the stage's inputs (`tensors[0]`): that server keeps them
        with the graph, and otherwise asks for them (`InputsNotHeld`)."""
        tried = _Attempts(prefer=prefer)
        while tried.count < self.tc.max_attempts or accumulating:
            peer = await self._server_for(stage, tried)
            call = self._stage_call(stage, method, req, accumulating and tried.holder is None, peer,
                                    rows(tensors[0]))
            lean = method == "backward" and peer == prefer and not tried.with_inputs
            started = time.monotonic()
            try:
                reply = await self._timed(method, peer, call, tensors[1:] if lean else tensors)
            except CallFailed as e:
                if lean and e.with_inputs:  # neither the server's fault nor the request's
                    tried.with_inputs = True
                    self.inputs_resent += 1
                    continue
                await self._after_failure(stage, method, peer, call, e, tried, time.monotonic() - started)
                continue
            self.bans.forgive(peer)
            epoch = int(reply[0].get("epoch", 0))
            self.view.saw_epoch(stage, epoch, peer)
            held_by, held_at = tried.holder or (peer, epoch)
            return Served(peer, reply[0], reply[1], held_by, held_at)
        raise MicrobatchFailed(f"stage {stage} {method} failed on {self.tc.max_attempts} attempts")

    async def _server_for(self, stage: int, tried: _Attempts) -> str:
        """The server for the next attempt, waiting for one if the stage has none (or all are banned)."""
        while True:
            if self.stop.is_set():
                raise MicrobatchFailed(f"stopped while calling stage {stage}")
            peer = tried.repeat or self.pick(stage, tried.prefer)
            if peer is not None:
                return peer
            await self._wait_for_server(stage)

    def _stage_call(self, stage: int, method: str, req: str, accumulate: bool, peer: str, samples: int
                    ) -> StageCall:
        """The call's metadata, its timeout following the latency measured for such calls, once for each
        request served ahead of it at `peer` (see `_ahead`): a call behind a long queue is not late, and
        giving it up to send it again behind the same queue would only waste the work. Past its deadline a
        server drops the request: by then we have sent it elsewhere, and a delivery in doubt is judged only
        request_timeout after its failure (see swarm.trainer.delivery). A server whose calls we found slower
        than the stage's typical call gets as many times longer (the measured latency is the stage's, fast
        and slow replicas together): a slow replica's calls would otherwise time out for being slow, not
        for failing. An accumulating call carries its receipt for `peer`."""
        tc = self.tc
        latency = self.latency[stage, method].timeout(min(tc.min_request_timeout, tc.request_timeout),
                                                      tc.request_timeout)
        slower = max(1.0, self.measured[stage].latency(peer) or 1.0)
        timeout = min(latency * slower * (1 + self._ahead(stage, peer, method)), tc.request_timeout)
        deadline = time.time() + timeout + tc.request_timeout / 2
        epoch = self.view.live_epoch(stage, ignore=self.bans.failing())
        receipt = self.sign(req, stage, peer, samples) if accumulate and self.sign is not None else ""
        return StageCall(req, stage, self.hash, epoch, timeout, deadline, accumulate, receipt)

    def _ahead(self, stage: int, peer: str, method: str) -> int:
        """Requests `peer` serves before a call sent now: ours in flight there (for a forward, also the
        backwards it owes us, which go before queued forwards there: swarm.server.turns), or the queue it
        announced (other callers' too, as of its last announcement), whichever is longer. In a straggler
        run a starting trainer's forward to the fast stage-0 server, sent with none of ours in flight there,
        timed out at the 5 s floor behind the backwards of the microbatches it had forwarded just before."""
        announced = next((r.queue for r in self.view.servers[stage] if r.peer_id == peer), 0)
        ours = self.inflight.get(peer, 0) + (self.owed.get(peer, 0) if method == "forward" else 0)
        return max(ours, announced)

    async def _timed(self, method: str, peer: str, call: StageCall, tensors: list[Carried]):
        # a call's seconds count against the server per request it had to serve (its queue and ours): a
        # fast server that routing keeps busy answers as late as a slow idle one, and must not look slow
        per_request = 1 + self._ahead(call.stage, peer, method)
        self.inflight[peer] = self.inflight.get(peer, 0) + 1
        started = self.clock()
        waiting = asyncio.ensure_future(
            self.client.call(peer, method, call.to_meta(), _tagged(call.stage, method, tensors), call.timeout,
                             unpack=False))
        self._calls.setdefault((call.stage, peer), set()).add(waiting)
        try:
            reply = await waiting
        except asyncio.CancelledError:
            if waiting not in self._abandoned or asyncio.current_task().cancelling():
                raise
            # given up as a timeout would be: it may have been applied, so an accumulating call's retry
            # elsewhere asks for the input gradient only
            raise CallFailed(f"{method} abandoned: the server is gone from the stage", timed_out=True) from None
        finally:
            self._calls[call.stage, peer].discard(waiting)
            self._abandoned.discard(waiting)
            self.inflight[peer] -= 1
            if (ended := self._ended.pop(call.stage, None)) is not None:
                ended.set()
            elapsed = self.clock() - started
            key = f"{call.stage}/{method}"
            self.call_seconds[key] = self.call_seconds.get(key, 0.0) + elapsed
        self.latency[call.stage, method].observe(elapsed)
        self.measured[call.stage].answered(peer, method, elapsed / per_request)
        return reply

    def waited_on(self) -> set[tuple[int, str]]:
        """(stage, server) of each server our calls are waiting on."""
        return {key for key, waiting in self._calls.items() if waiting}

    def abandon_gone(self) -> None:
        """Give up at once the calls waiting on a server that has been out of our view of its stage for a
        while (its record expired or was withdrawn, or it moved), instead of waiting out their timeouts:
        a frozen or cut-off server is left once its record expires and a view read after that misses it."""
        for (stage, peer), waiting in self._calls.items():
            if waiting and self.view.gone(stage, peer):
                log.info("%d stage %d call(s) to %s abandoned: it is gone from the stage", len(waiting), stage,
                         short(peer))
                for task in waiting:
                    self._abandoned.add(task)
                    task.cancel()

    async def _after_failure(self, stage: int, method: str, peer: str, call: StageCall, error: CallFailed,
                             tried: _Attempts, waited: float) -> None:
        """Decide where the next attempt goes, and back off before it."""
        self.retries += 1
        tried.count += 1
        if error.refused:  # not applied: another server may take it; a server that refuses is banned all the same
            tried.refusals += 1
            self._fault(stage, method, peer, call, waited)
            if tried.refusals >= self.tc.max_attempts or len(self.view.servers[stage]) <= tried.refusals:
                raise MicrobatchFailed(f"stage {stage} refused the request: {error}") from error
            log.info("stage %d %s refused by %s (%s); trying another server", stage, method, short(peer), error)
            tried.repeat, tried.prefer = None, None
            await asyncio.sleep(backoff_delay(min(tried.count, 6), 0.05, 2.0, self.rng))
            return
        if not error.answered and not error.timed_out and tried.repeat is None:
            tried.repeat = peer
            log.info("stage %d %s on %s failed after %.1fs (%s); repeating it there", stage, method, short(peer),
                     waited, error)
        else:
            if call.accumulate and not error.answered:
                tried.holder = (peer, call.epoch)
            tried.repeat, tried.prefer = None, None
            self._fault(stage, method, peer, call, waited, error.timed_out)
            log.info("stage %d %s on %s failed after %.1fs (%s); retrying elsewhere%s", stage, method, short(peer),
                     waited, error,
                     " for the input gradient only" if tried.holder else "")
        await asyncio.sleep(backoff_delay(min(tried.count, 6), 0.05, 2.0, self.rng))

    def _fault(self, stage: int, method: str, peer: str, call: StageCall, waited: float, timed_out: bool = False
               ) -> None:
        """Ban a server that failed a call and count the call against its measured latency, as long as we
        would have waited for it at least: a server announcing much and never answering then loses its
        weight in routing as well as its turn (see `swarm.core.routing.ServerLatencies`). A broken
        connection repeated on the same server is neither, until the repeat fails too. A call that timed
        out bans its server for as long as it waited, if that is less than `trainer.ban_seconds` (doubling
        while it keeps failing): a live server that fell behind, as a fast one can while its first calls
        warm it up, is out of turn only as long as its queue took, not for a whole ban with the stage's
        bulk of work sent to slower replicas; a hung one is still left out longer at each failure, and a
        frozen or dead one once its record lapses. A forward's timeout is the server being slow (see `pick`)."""
        self.bans.ban(peer, time.monotonic(), base=waited if timed_out else None,
                      slow=timed_out and method == "forward")
        self.measured[stage].failed(peer, method, max(waited, call.timeout) / (1 + self._ahead(stage, peer, method)))

    async def _wait_for_server(self, stage: int) -> None:
        servers = self.view.servers[stage]
        if servers:
            # servers exist but none takes a call now (banned, awaiting their first answer to us, or
            # moving): wait for the first ban to run out, or for a call there to end
            now = time.monotonic()
            bans = [self.bans.remaining(r.peer_id, now) for r in servers if self.bans.is_banned(r.peer_id, now)]
            ended = self._ended.setdefault(stage, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), max(0.05, min(bans, default=LOOK_AGAIN)))
            return
        if stage not in self.view.waiting:
            self.view.waiting.add(stage)
            log.warning("no live server for stage %d; waiting for one to appear", stage)
        await asyncio.sleep(self.announce_period)
        await self.view.refresh(self.directory)


def _tagged(stage: int, method: str, tensors: list[Carried]) -> list[Tagged]:
    """What a stage call carries: the stage's input (token ids at the first stage, activations after),
    then the targets (forward or evaluate to the last stage) or the gradient of the stage's output (backward,
    alone where the server keeps the inputs)."""
    roles = ("tokens" if stage == 0 else "activations", "gradients" if method == "backward" else "tokens")
    if method == "backward" and len(tensors) == 1:
        roles = roles[1:]
    return [Tagged(role, t) for role, t in zip(roles, tensors, strict=False)]
