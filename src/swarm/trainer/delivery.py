"""Exactly-once delivery, the trainer's side: every gradient a stage accumulated for one of our
microbatches is kept (the stage's inputs and output gradient) until a step of the stage that outlives
any one replica took it in (`swarm.core.delivery.judge`); one lost with the replica that held it is
accumulated again from what was kept (a replay)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from swarm.config import TrainerConfig
from swarm.core import Asked, LedgerReply, Verdict, judge, merge_answers, worth_asking
from swarm.net.directory import short
from swarm.net.transport import CallFailed, StageClient
from swarm.trainer.calls import MicrobatchFailed, Served, StageCaller
from swarm.trainer.view import SwarmView
from swarm.wire.calls import LedgerQuery
from swarm.wire.codecs import Carried

log = logging.getLogger("swarm.trainer")


@dataclass
class KeptGradient:
    """What it takes to accumulate a stage's gradient of one microbatch again, and where it stands."""

    req: str
    stage: int
    method: str  # the call that accumulates it again: "backward", or "forward" for the last stage
    tensors: list[Carried]
    holder: str
    epoch: int
    judge_after: float  # monotonic time before which no verdict is taken (a doubtful call may still run)
    doubtful: bool = False  # its accumulating call went unanswered: `holder` may not hold it
    replaying: bool = False


class GradientKeeper:
    def __init__(self, tc: TrainerConfig, client: StageClient, caller: StageCaller, view: SwarmView,
                 announce_period: float, done: Callable[[], bool], stop: asyncio.Event):
        self.tc = tc
        self.client, self.caller, self.view = client, caller, view
        self.announce_period = announce_period
        self.done = done  # the trainer sends no more microbatches (no step after ours need be durable)
        self.stop = stop
        self.kept: dict[tuple[str, int], KeptGradient] = {}
        self.replays = 0  # lost gradients accumulated again, by a server that answered
        self._replaying: set[asyncio.Task] = set()
        self._asked: dict[int, Asked] = {}  # stage -> the last question to its replicas
        self.questions = 0  # `ledger` calls made

    def keep(self, req: str, stage: int, method: str, tensors: list[Carried], served: Served) -> None:
        doubtful = served.holder != served.peer
        judge_after = time.monotonic() + (self.tc.request_timeout if doubtful else 0.0)
        self.kept[req, stage] = KeptGradient(req, stage, method, tensors, served.holder, served.epoch, judge_after,
                                             doubtful)

    async def loop(self) -> None:
        while True:
            await asyncio.sleep(self.announce_period)
            try:
                await self._judge_all()
            except Exception as e:  # a view or a replica that failed to answer: the next pass asks again
                log.warning("could not check the delivery of gradients: %s", e)

    async def _judge_all(self) -> None:
        """Ask each stage's replicas about our kept gradients, where their answers may have changed since
        the last question (`swarm.core.delivery.worth_asking`): the two most advanced (a second one checks
        the first's claims, see `swarm.core.delivery.merge_answers`) and every live holder. Epochs far
        ahead of what most replicas announce are not believed (see SwarmView.live_epoch)."""
        now = time.monotonic()
        for stage in range(self.view.num_stages):
            open_ = [g for g in self.kept.values() if g.stage == stage and not g.replaying and g.judge_after <= now]
            live = self.view.servers[stage]
            if not open_ or not live:
                continue
            last = self._asked.get(stage)
            shown = (frozenset((r.peer_id, r.epoch) for r in live),
                     frozenset(g.holder for g in open_ if self.view.seen_lately(stage, g.holder)))
            in_doubt = any(g.doubtful and (last is None or g.req not in last.reqs) for g in open_)
            if not worth_asking(last, shown, now, self.announce_period, in_doubt, self.done()):
                continue
            self._asked[stage] = Asked(shown, now, frozenset(g.req for g in open_))
            top = self.view.live_epoch(stage)
            advanced = sorted((r for r in live if r.epoch <= top), key=lambda r: r.epoch, reverse=True)
            ask = sorted({r.peer_id for r in advanced[:2]} | {g.holder for g in open_
                                                                if self.view.seen_lately(stage, g.holder)})
            self.questions += len(ask)
            replies = await asyncio.gather(*(self._ask_ledger(peer, stage, open_) for peer in ask))
            answers = {peer: reply for peer, reply in zip(ask, replies, strict=True) if reply is not None}
            if not answers:
                continue
            for g in open_:
                verdict = judge(g.epoch, self.view.seen_lately(stage, g.holder),
                                merge_answers(answers, g.req, g.holder, self.tc.keep_epochs),
                                self.tc.keep_epochs, need_durable=not self.done())
                if verdict is Verdict.DONE:
                    del self.kept[g.req, g.stage]
                elif verdict is Verdict.REPLAY:
                    g.replaying = True
                    task = asyncio.create_task(self._replay(g))
                    self._replaying.add(task)
                    task.add_done_callback(self._replaying.discard)

    async def _ask_ledger(self, peer: str, stage: int, open_: list[KeptGradient]) -> LedgerReply | None:
        query = LedgerQuery(stage, tuple(g.req for g in open_))
        try:
            reply, _ = await self.client.call(peer, "ledger", query.to_meta(), [], self.tc.min_request_timeout)
        except CallFailed as e:
            log.debug("ledger of %s did not answer: %s", short(peer), e)
            return None
        parsed = LedgerReply.parse(reply)
        if parsed is None:
            log.debug("ledger of %s answered with a malformed reply", short(peer))
        return parsed

    async def _replay(self, g: KeptGradient) -> None:
        """Accumulate a lost gradient again, from the stage inputs and output gradient we kept."""
        try:
            served = await self.caller.call(g.stage, g.method, g.req, g.tensors, accumulating=True)
        except MicrobatchFailed as e:
            log.warning("replay of microbatch %s at stage %d failed: %s", g.req, g.stage, e)
            g.replaying = False
            return
        if served.holder == served.peer:
            self.replays += 1
            log.info("microbatch %s: stage %d gradient lost with %s, accumulated again on %s",
                     g.req, g.stage, short(g.holder), short(served.holder))
        else:  # its accumulating call went unanswered: judged again, from that server's ledger
            log.info("microbatch %s: stage %d gradient lost with %s, sent again to %s, unanswered: in doubt there",
                     g.req, g.stage, short(g.holder), short(served.holder))
        self.keep(g.req, g.stage, g.method, g.tensors, served)

    async def settle(self) -> int:
        """After the last microbatch: wait (bounded) until every gradient we sent is in a step; how many
        are not. A gradient in doubt cannot be judged before its `judge_after` (request_timeout after the
        call failed), so it is given settle_timeout from then: one that failed just before the end is
        still judged, and replayed if it was lost, rather than left unresolved."""
        started = time.monotonic()
        while self.kept and not self.stop.is_set():
            judgeable = max(g.judge_after for g in self.kept.values())
            if time.monotonic() >= max(started, judgeable) + self.tc.settle_timeout:
                break
            await asyncio.sleep(0.1)
        if self.kept:
            log.warning("%d microbatch gradients not confirmed in a step after %.0fs", len(self.kept),
                        self.tc.settle_timeout)
        return len(self.kept)
