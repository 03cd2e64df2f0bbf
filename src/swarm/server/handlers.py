"""The server's answers to each call of the protocol (called by `swarm.net.servicer.StageServicer`).

A microbatch's path through a stage, as the handlers see it: `forward` admits the call (for this stage,
from a compatible caller, not stale), checks its tensors, and runs the stage (the last stage also runs
its loss and backward, accumulating the gradient, in the same call); `backward` runs the backward of a
kept forward graph (or recomputes it) and accumulates the stage's parameter gradients, once per
microbatch id (`StageRuntime.accumulates`); a repeat of a gradient call is answered from the reply
cache. Accumulated gradients wait for the stage's step (`swarm.server.stepping`). `evaluate` (held-out
samples, for the validation loss) is admitted and checked like `forward` but changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import torch

from swarm.backup.keeper import BackupKeeper
from swarm.config import ModelConfig, ServerConfig
from swarm.net.directory import short
from swarm.net.protocol import Tagged
from swarm.net.quiet import Quiet
from swarm.net.receipts import receipt_valid
from swarm.server.batching import RECOMPUTE, Batcher
from swarm.server.gate import ComputeGate, Deadline
from swarm.server.replies import Reply, ReplyCache
from swarm.server.stage import ServedStage
from swarm.server.turns import IN_TURN, SOON
from swarm.wire.calls import CountNote, LedgerQuery, StageCall, StageQuery
from swarm.wire.validate import (
    IGNORE_INDEX,
    BadRequest,
    InputsNotHeld,
    TensorSpec,
    Unavailable,
    check_norm,
    check_same_batch,
    check_tensor,
)

log = logging.getLogger("swarm.server")
REFUSALS_LOGGED = 30  # refusals logged per call and minute; beyond, one line counts them
MAX_STATE_SENDS = 2  # state downloads gathered at once


class StageHandlers:
    """Answers calls for whatever stage the server serves at the moment (`stage`; None between stages)."""

    def __init__(self, model: ModelConfig, server: ServerConfig, config_hash: str, max_request_bytes: int,
                 gate: ComputeGate, stopping: Callable[[], bool]):
        self.model = model
        self.server = server
        self.hash = config_hash
        self.max_request_bytes = max_request_bytes
        self.gate = gate
        self.stopping = stopping
        self.stage: ServedStage | None = None
        self.batcher: Batcher | None = None
        self.replies = ReplyCache()
        self.reduce_with: Callable[[dict, list, str], Any] | None = None  # the stage's all-reduce
        self.backups: BackupKeeper | None = None  # the copies of other stages this server holds
        self.sending_state: set[str] = set()  # callers whose state download is being gathered
        self.quiet = Quiet(log, lines=REFUSALS_LOGGED)

    def enter(self, stage: ServedStage, batcher: Batcher, reduce_with: Callable) -> None:
        self.stage, self.batcher, self.reduce_with = stage, batcher, reduce_with
        self.replies = ReplyCache()

    # ---- admission ---------------------------------------------------------------------------

    def _serving(self, stage: int) -> ServedStage:
        """Callers find servers through the DHT, whose view lags: one that still takes this server for a
        replica of a stage it left (or is leaving) is sent elsewhere."""
        st = self.stage
        if self.stopping():
            raise Unavailable("server is shutting down")
        if st is None or not st.serving:
            raise Unavailable("server is between stages")
        if stage != st.index:
            raise Unavailable(f"this server hosts stage {st.index}, not {stage!r}")
        return st

    def _admit(self, call: StageCall, new_work: bool) -> ServedStage:
        """The stage, once the call is known to be for it, from a compatible caller, not stale. `new_work`:
        a microbatch new to this server, which it no longer takes once it is moving."""
        st = self._serving(call.stage)
        if call.config != self.hash:
            raise BadRequest(f"config hash {call.config!r} differs from this server's {self.hash}")
        if st.moving_to is not None and (new_work or st.drained):
            raise Unavailable(f"this server is moving to stage {st.moving_to}")
        self._refuse_if_stale(st, call.epoch)
        return st

    def _refuse_if_stale(self, st: ServedStage, stage_epoch: int) -> None:
        """Stale replicas never serve: a caller that has seen the stage at a later epoch than ours is
        turned away (it retries elsewhere), and this replica catches up before it serves again."""
        epoch = st.runtime.epoch
        if stage_epoch <= epoch or st.round_epoch == epoch:
            return  # (in a round to that epoch: served at the weights the round steps from)
        st.counters["stale_refusals"] += 1
        if st.stale_logged != epoch:
            st.stale_logged = epoch
            log.warning("stage %d server %s is at epoch %d but the stage is at %d: catching up before serving",
                        st.index, st.label, epoch, stage_epoch)
        st.wake.set()
        raise Unavailable(f"stale replica: at epoch {epoch}, the stage is at {stage_epoch}")

    def _refuse_if_backlogged(self, st: ServedStage, call: StageCall, samples: int) -> None:
        """Turn a forward away at once when the work queued ahead of it would outlast its caller's timeout
        (see swarm.server.backlog): the caller sends it elsewhere now instead of after the timeout. Behind
        an empty queue a forward is always taken, however long it takes: no other server would start it
        sooner than this one can."""
        wait = self.gate.wait()
        if wait > 0 and wait + self.gate.backlog.cost("forward", samples) > call.timeout:
            st.counters["busy_refusals"] += 1
            raise Unavailable(f"busy: about {wait:.0f}s of work queued ahead, past the call's "
                              f"{call.timeout:.0f}s timeout")

    def refused(self, method: str, caller: str, error: BadRequest) -> None:
        """A log line per refused request (the caller got the same text back), up to REFUSALS_LOGGED a
        minute per call: a peer can send garbage by the thousand (a fuzz run of 60,000 messages once wrote
        30,000 lines)."""
        if self.stage is not None:
            self.stage.counters["refused"] += 1
        self.quiet.warning(f"refused {method} requests", "%s from %s refused: %s", method, short(caller),
                           error.args[0])

    # ---- checks on tensors (each a pass over every value: run on a worker thread, off the event loop) --

    def _check_inputs(self, st: ServedStage, x: torch.Tensor) -> None:
        check_tensor("inputs", x, st.in_spec, self.server.max_request_samples, self.server.max_activation)

    def _check_forward(self, st: ServedStage, tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        limit = self.server.max_request_samples
        if not st.runtime.is_last:
            if len(tensors) != 1:
                raise BadRequest(f"forward takes one tensor, got {len(tensors)}")
            self._check_inputs(st, tensors[0])
            return tensors[0], None
        if len(tensors) != 2:
            raise BadRequest(f"the last stage takes (inputs, targets), got {len(tensors)} tensors")
        x, targets = tensors
        self._check_inputs(st, x)
        spec = TensorSpec(torch.int64, x.shape[1:2], self.model.vocab_size, ignored=IGNORE_INDEX)
        check_tensor("targets", targets, spec, limit)
        check_same_batch(("inputs", x), ("targets", targets))
        return x, targets

    def _check_backward(self, st: ServedStage, tensors: list[torch.Tensor]
                        ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(inputs, grad_outputs); inputs None where the caller left them out, as it does for the server
        that ran the forward (it keeps them: `_held_inputs`)."""
        if st.out_spec is None:
            raise BadRequest("the last stage runs its backward within forward")
        if len(tensors) not in (1, 2):
            raise BadRequest(f"backward takes (inputs, grad_outputs), or grad_outputs alone where the forward ran, "
                             f"got {len(tensors)} tensors")
        *given, dy = tensors
        check_tensor("grad_outputs", dy, st.out_spec, self.server.max_request_samples)
        check_norm("grad_outputs", dy, self.server.max_grad_norm)
        if not given:
            return None, dy
        self._check_inputs(st, given[0])
        check_same_batch(("inputs", given[0]), ("grad_outputs", dy))
        return given[0], dy

    @staticmethod
    def _held_inputs(st: ServedStage, key: str, dy: torch.Tensor) -> torch.Tensor:
        """The inputs of a backward sent without them: those its forward ran on here, checked then."""
        x = st.runtime.kept_inputs(key)
        if x is None:
            raise InputsNotHeld("the inputs of its forward are no longer held here: send them along")
        check_same_batch(("the forward's inputs", x), ("grad_outputs", dy))
        return x

    # ---- the protocol ------------------------------------------------------------------------

    async def forward(self, meta: Any, tensors: list[torch.Tensor], caller: str) -> Reply:
        call = StageCall.from_meta(meta)
        expires = Deadline.of(call)
        st = self._admit(call, new_work=True)
        key = f"{caller}/{call.req}"
        x, targets = await asyncio.to_thread(self._check_forward, st, tensors)
        if targets is not None and (cached := self._repeat(st, key)) is not None:
            return cached
        self._refuse_if_backlogged(st, call, x.shape[0])
        if targets is not None:
            self._take_receipt(st, call, key, x.shape[0])
        st.counters["samples_served"] += x.shape[0]  # a repeat answered from the cache is not counted again
        if targets is None:
            y = await self.batcher.forward(key, x, expires)
            await self._delay_reply(st, "forward")
            return {"epoch": st.runtime.epoch}, [Tagged("activations", y)]
        loss, grad = await self.gate.run(
            st.runtime.forward_backward_last, key, x, targets, call.accumulate, expires=expires,
            before=st.drop_if_lapsed, work="forward", samples=x.shape[0],
        )
        await self._delay_reply(st, "forward")
        return self._remember_gradient_reply(st, key, {"loss": loss}, grad)

    async def backward(self, meta: Any, tensors: list[torch.Tensor], caller: str) -> Reply:
        call = StageCall.from_meta(meta)
        st = self._admit(call, new_work=False)
        key = f"{caller}/{call.req}"
        x, dy = await asyncio.to_thread(self._check_backward, st, tensors)
        if (cached := self._repeat(st, key)) is not None:
            return cached
        if x is None:
            x = self._held_inputs(st, key, dy)
        self._take_receipt(st, call, key, x.shape[0])
        accumulate = call.accumulate and st.runtime.accumulates(key)
        graph = st.runtime.live_graph(key)
        grad = RECOMPUTE
        if accumulate and graph is not None and graph.size > 1:
            grad = await self.batcher.backward(graph, key, dy)
        if grad is RECOMPUTE:
            # ahead of the forwards waiting where it finishes a graph kept here; a recomputation is new work
            # (and one a peer could send at will, to keep others' forwards waiting)
            grad = await self.gate.run(
                st.runtime.backward, key, x, dy, accumulate, expires=Deadline.of(call), before=st.drop_if_lapsed,
                work="backward", samples=x.shape[0], rank=SOON if graph is not None and graph.size == 1 else IN_TURN,
            )
        await self._delay_reply(st, "backward")
        return self._remember_gradient_reply(st, key, {}, grad)

    async def evaluate(self, meta: Any, tensors: list[torch.Tensor], caller: str) -> Reply:
        """A forward for validation: admitted and checked as a forward is, but it keeps no graph and
        leaves no gradient, ledger entry or receipt, and is not counted as work (the stage's figures stay
        those of training). The last stage answers the loss, the others their outputs."""
        call = StageCall.from_meta(meta)
        st = self._admit(call, new_work=True)
        x, targets = await asyncio.to_thread(self._check_forward, st, tensors)
        out = await self.gate.run(st.runtime.evaluate, x, targets, expires=Deadline.of(call))
        if targets is None:
            return {"epoch": st.runtime.epoch}, [Tagged("activations", out)]
        return {"epoch": st.runtime.epoch, "loss": out}, []

    @staticmethod
    def _take_receipt(st: ServedStage, call: StageCall, key: str, samples: int) -> None:
        """A gradient is accumulated only with its trainer's receipt, which this replica keeps to show its
        groupmates in the round (see swarm.net.receipts)."""
        if not (call.accumulate and st.runtime.accumulates(key)):
            return  # nothing will be accumulated: the input gradient alone is sent back
        if not receipt_valid(call.receipt, key, st.index, st.peer_id, samples):
            raise BadRequest("an accumulating call needs its trainer's receipt for this server, stage and samples")
        st.runtime.book.note_receipt(key, call.receipt)

    async def state(self, meta: Any, tensors: list[torch.Tensor], caller: str) -> Reply:
        """The stage's whole state, to a replica catching up or a newcomer: at most MAX_STATE_SENDS at a time,
        one per caller, since each holds the compute gate while the state is gathered."""
        query = StageQuery.from_meta(meta)
        st = self._serving(query.stage)
        if caller in self.sending_state or len(self.sending_state) >= MAX_STATE_SENDS:
            raise Unavailable("busy sending its state to others; ask another replica or later")
        self.sending_state.add(caller)
        try:
            state, tensors = await self.gate.run(st.runtime.state)
        finally:
            self.sending_state.discard(caller)
        if query.joining:
            st.note_handed(caller, state["epoch"])
        return state, [Tagged("state", t) for t in tensors]

    async def count(self, meta: Any, tensors: list[torch.Tensor], caller: str) -> Reply:
        """Another replica's sample count near the stage's step (see `ServedStage.note_count`)."""
        note = CountNote.from_meta(meta)
        self._serving(note.stage).note_count(caller, note)
        return {}, []

    async def ledger(self, meta: Any, tensors: list[torch.Tensor], caller: str) -> Reply:
        """Where the caller's microbatches stand here: committed by a step (and at which epoch), held in
        this replica's unstepped gradient, or neither. `durable` is the newest epoch that would outlive
        this replica: on disk when the stage keeps checkpoints, else reached by a step two or more
        replicas took (or loaded from a peer)."""
        query = LedgerQuery.from_meta(meta)
        st = self._serving(query.stage)
        keys = {f"{caller}/{r}": r for r in query.ids}
        rt = st.runtime
        # read in the reverse order of a step's writes (commit, unpend, epoch; see apply_step) so that a
        # step running meanwhile cannot make a microbatch look neither pending nor committed
        epoch = rt.epoch
        pending = [r for k, r in keys.items() if k in rt.pending]
        committed = {r: e for k, r in keys.items() if (e := rt.committed.get(k)) is not None}
        return {"epoch": epoch, "committed": committed, "pending": pending, "durable": st.durable_epoch}, []

    async def backup(self, meta: Any, tensors: list[torch.Tensor], caller: str) -> Reply:
        if self.backups is None:
            raise Unavailable("this server holds no copies of other stages")
        return await self.backups.serve(StageQuery.from_meta(meta).stage)

    async def reduce(self, meta: Any, tensors: list[torch.Tensor], caller: str) -> Reply:
        self._serving(StageQuery.from_meta(meta).stage)
        return await self.reduce_with(meta, tensors, caller)

    # ---- replies -----------------------------------------------------------------------------

    def _repeat(self, st: ServedStage, key: str) -> Reply | None:
        """The reply to a repeat of a gradient call whose gradient this stage already holds or stepped
        (a call whose reply was lost). A repeat that would accumulate something new is computed."""
        return None if st.runtime.accumulates(key) else self.replies.repeat(key, st.runtime.epoch)

    def _remember_gradient_reply(self, st: ServedStage, key: str, meta: dict[str, Any],
                                 grad: torch.Tensor | None) -> Reply:
        """The reply of a call that accumulated a gradient (a backward, or the last stage's forward, which
        runs its backward too), kept so that a repeat of it costs no compute; and the stage may have just
        reached its batch size, so the step plan looks again."""
        reply = {"epoch": st.runtime.epoch, **meta}, [] if grad is None else [Tagged("gradients", grad)]
        self.replies.remember(key, reply)
        st.wake.set()
        return reply

    async def _delay_reply(self, st: ServedStage, work: str) -> None:
        """`server.reply_delay`: the reply waits, and the wait counts as time this pass took, so the
        announced throughput (and with it the share of work stochastic wiring sends here) falls."""
        delay = self.server.reply_delay
        if delay:
            st.work.count(work, 0, delay)
            await asyncio.sleep(delay)
