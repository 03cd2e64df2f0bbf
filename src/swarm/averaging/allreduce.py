"""Stage-wise gradient all-reduce whose result is bit-identical on every replica.

The flat gradient is cut into one part per group member; member j reduces part j. Each member sends
part j of its gradient sum to member j in one `reduce` call, and that same call returns the reduced
part once member j has heard from the whole group. Reduction sums contributions in the group's
sorted order and every member copies the owner's result (rather than adding a delta to its own
tensor), so all replicas end with the same bits, and so the same weights after the step. Parts travel
packed by the `allreduce` codec; the owner packs the reduced part once and decodes that same packing
for itself, so a lossy codec changes the result's bits alike on every replica.

Agreement on the group: every member derives the group from its own view of the stage (the servers
at its epoch) and sends it with each contribution; an owner refuses a contribution whose group or
epoch differs from its own. The round then fails everywhere and is retried with fresher views.
A contribution arriving before its owner began the round wakes the owner up (via `on_wake`, with the
proposed group), so the stage steps together instead of waiting for every member to notice the DHT.

A member retries a failed round with the very part it sent before (`swarm.server.gradvec.SetAside`), so
an owner whose round already reduced that part answers the repeat with its result, as it answers a member
whose reply was lost; another part from the same member is refused, since the owners' totals would differ.

Each contribution also lists the microbatches the member's gradient holds; owners answer with the
union, so every member records the same ledger for the step. A microbatch listed by two members (it
was accumulated twice) is reported: the delivery rules exist to make that impossible.

A member applies the step only if it received every part. If an owner dies after answering some
members, those members step and the rest fall one epoch behind, which the server detects (by the
epochs replicas announce) and repairs by downloading state from an up-to-date replica. If the owner
stops before it announces its own step (frozen or killed right after its last part came), the others
cannot tell that it stepped: they step without it, and its step becomes a branch the stage does not go
on from. A frozen owner that comes back finds the stage ahead and takes its state before it serves
again (stale requests are refused meanwhile); `.loads.jsonl` beside its step log records that, and
the report leaves such superseded steps out of the stage's history.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from swarm.averaging.checks import POISON, Bounds, Contribution, answer_problem, check_receipts
from swarm.averaging.failures import RefusedBy, RoundFailed, Unreachable, WeightsDiverged
from swarm.averaging.patience import Patience
from swarm.averaging.rounds import (
    POISON_FROM,
    SILENT,
    Round,
    RoundResult,
    exchange_evidence,
    named_in,
    part_bounds,
)
from swarm.core.ledger import merge_ids
from swarm.net.directory import short
from swarm.net.protocol import Tagged
from swarm.net.transport import CallFailed, StageClient
from swarm.wire import codecs
from swarm.wire.validate import BadRequest

log = logging.getLogger(__name__)
ABANDONED = "was abandoned"  # how an owner that gave up its round answers the parts still waiting
# receipts checked on the event loop (about 0.1 ms each): then every owner refuses a forged list before any
# round of the epoch can end, so every honest member names its sender. Longer lists go to a thread
RECEIPTS_INLINE = 512


DIVERGED = "diverged:"  # marks a refusal because member weights differ
# marks a refusal because replicas do not agree yet on the round (epoch, group): honest peers refuse so while
# one of them catches up, which must not count against them (see swarm.server.stepping's strikes)
NOT_READY = "not ready:"


REDUCE_ATTEMPTS = 3  # calls to one owner before it counts as unreachable (a lost reply is rare)


class StageAllReduce:
    def __init__(
        self,
        client: StageClient,
        own_id: str,
        stage: int,
        timeout: float,
        on_wake: Callable[[int, tuple[str, ...]], Awaitable[bool]],
        bounds: Bounds | None = None,
        at_epoch: Callable[[int, frozenset[str]], Awaitable[frozenset[str]]] | None = None,
        lapsed: Callable[[frozenset[str]], Awaitable[frozenset[str]]] | None = None,
    ):
        """`at_epoch`, `lapsed`: the stage's records, as `swarm.averaging.patience.Patience` reads them."""
        self.bounds = bounds or Bounds()
        self.patience = Patience(timeout, at_epoch, lapsed)
        self.client = client
        self.own_id = own_id
        self.stage = stage
        self.on_wake = on_wake
        self._rounds: dict[int, Round] = {}  # keyed by epoch: at most one round per epoch is open
        self._started: dict[int, asyncio.Event] = {}
        self._finished: dict[int, Round] = {}  # recent completed rounds, for members whose reply was lost
        self._given_up: dict[int, Round] = {}  # recent rounds given up naming poison: late parts hear why at once

    def _started_event(self, epoch: int) -> asyncio.Event:
        return self._started.setdefault(epoch, asyncio.Event())

    async def run(
        self,
        epoch: int,
        group: tuple[str, ...],
        flat_grad: torch.Tensor,
        samples: int,
        digest: str = "",
        ids: list[str] | None = None,
        receipts: list[list] | None = None,
    ) -> RoundResult:
        """Sum `flat_grad`, `samples` and the microbatch `ids` over `group`; `receipts` ([samples, receipt] per
        id) show the owners that the trainers gave us those microbatches (see swarm.net.receipts)."""
        if self.own_id not in group:
            raise ValueError("a member must belong to its own group")
        began = time.monotonic()
        bounds = part_bounds(flat_grad.numel(), len(group))
        own_part = bounds[group.index(self.own_id)]
        self._finished.pop(epoch, None)  # a new attempt: an earlier failed one's answers are void
        self._given_up.pop(epoch, None)
        rnd = self._rounds[epoch] = Round(epoch, group, own_part[1] - own_part[0], digest)
        self._started_event(epoch).set()
        # parts are views, not copies (a stage's gradient is large): nothing writes to `flat_grad` while its
        # round runs (a sync round's sum was taken out of the gradients; an async contribution is its own)
        tasks = [
            asyncio.ensure_future(self._exchange(rnd, owner, flat_grad[lo:hi], samples, ids or [], receipts or []))
            for owner, (lo, hi) in zip(group, bounds, strict=True)
        ]
        results = await self._gather_parts(rnd, tasks)
        totals = {(total, tuple(merged)) for _, total, merged in results}
        if len(totals) != 1:
            raise RoundFailed(f"owners disagree on the samples: {sorted(t for t, _ in totals)}")
        self._finished[epoch] = rnd
        self.patience.observe(time.monotonic() - began)
        for kept in (self._finished, self._given_up):
            for old in [e for e in kept if e < epoch - 2]:
                del kept[old]
        total, merged = totals.pop()
        mean = await asyncio.to_thread(torch.cat, [part for part, _, _ in results])
        return RoundResult(mean, total, list(merged))

    async def _gather_parts(self, rnd: Round, tasks: list[asyncio.Future]
                            ) -> list[tuple[torch.Tensor, int, list[str]]]:
        """Every owner's reduced part, or RoundFailed saying why not (and whom to leave out next)."""
        epoch, group = rnd.epoch, rnd.group
        gathered = asyncio.gather(*tasks)
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())  # failures are handled below
        try:
            return await self.patience.wait(rnd, self.own_id, tasks, gathered)
        except Unreachable as e:
            raise RoundFailed(f"epoch {epoch}: {e}", frozenset({e.owner})) from e
        except TimeoutError as e:  # members whose part never reached us are the ones that hang
            silent = rnd.silent = frozenset(group) - rnd.contributions.keys() - {self.own_id}
            raise RoundFailed(f"epoch {epoch}: no part from [{','.join(map(short, sorted(silent)))}] within "
                              f"{time.monotonic() - rnd.began:.0f}s", silent) from e
        except (CallFailed, BadRequest) as e:
            if DIVERGED in str(e):
                raise WeightsDiverged(str(e), group) from e
            if ABANDONED in str(e) and (named := await self._hear_out(rnd, tasks, str(e))) is not None:
                raise named from e
            if rnd.poisoned:  # left out of the next groups, like a member that does not answer
                raise RoundFailed(f"epoch {epoch}: {e}", frozenset(rnd.poisoned)) from e
            if ABANDONED in str(e) and (silent := self._silent_here(rnd, str(e))):
                raise RoundFailed(f"epoch {epoch}: {e}; no part from [{','.join(map(short, sorted(silent)))}] "
                                  "here either", silent) from e
            members = ",".join(map(short, group))
            refused_by = frozenset({e.owner}) if isinstance(e, RefusedBy) else frozenset()
            kind = "CallFailed" if isinstance(e, CallFailed) else type(e).__name__
            raise RoundFailed(f"epoch {epoch} with [{members}]: {kind} {e}".rstrip(),
                              refused_by=refused_by) from e
        finally:
            for task in tasks:
                task.cancel()
            self._rounds.pop(epoch, None)
            self._started.pop(epoch, None)
            if rnd.result is None:
                rnd.complete.set()  # release members still waiting on this round: it is abandoned
                if rnd.poisoned or rnd.poison_named:
                    self._given_up[epoch] = rnd

    async def _hear_out(self, rnd: Round, tasks: list[asyncio.Future], reason: str) -> RoundFailed | None:
        """Another owner gave up its round and named members whose part or answer was poison: wait, within
        our round's timeout, for our own evidence on each (its part to us, or our exchange with it), and
        return the failure that evidence names (None: it names no one, or our own round's poison does).
        Without the wait, a member whose poison reached that owner first went unnamed into the next group."""
        exchanges = {m: tasks[rnd.group.index(m)] for m in named_in(reason, POISON_FROM, rnd.group) - {self.own_id}}
        poisoned_here = asyncio.ensure_future(rnd.complete.wait())  # (a poisoned part ends our round)
        try:
            while (left := rnd.began + self.patience.timeout - time.monotonic()) > 0 and (open_ := [
                    t for m, t in exchanges.items() if not t.done() and m not in rnd.poisoned]):
                await asyncio.wait(open_ + ([] if poisoned_here.done() else [poisoned_here]), timeout=left,
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            poisoned_here.cancel()
        if rnd.poisoned or (named := exchange_evidence(rnd.epoch, exchanges)) is None:
            return None
        rnd.poison_named |= named.unreachable  # said in turn to the parts still waiting on our round
        return named

    def _silent_here(self, rnd: Round, abandoned: str) -> frozenset[str]:
        """The members an owner named when it gave up its round for want of their parts ("abandoned: no part
        from ..."), whose part has not reached our own part's round either.

        The owner waited its whole timeout; our round began with its, so a part still missing here is
        missing for the same reason, and we leave the member out as the owner does. Only our own evidence
        counts: a member whose part reached us is not named, whatever the owner says. (Failing without a
        name left us proposing the silent member again and again while the owner refused to join it.)"""
        return frozenset(m for m in named_in(abandoned, SILENT, rnd.group) if m != self.own_id
                         and m not in rnd.contributions and m not in rnd.poisoned)

    async def _exchange(
        self, rnd: Round, owner: str, part: torch.Tensor, samples: int, ids: list[str], receipts: list[list]
    ) -> tuple[torch.Tensor, int, list[str]]:
        meta = {
            "epoch": rnd.epoch, "group": list(rnd.group), "samples": samples, "stage": self.stage,
            "digest": rnd.digest, "ids": ids, "receipts": receipts,
        }
        if owner == self.own_id:
            reply, (answer,) = await self.contribute(meta, [part], self.own_id)
            tensors = [await asyncio.to_thread(codecs.decode, answer.value)]  # the bits the others decode
        else:
            # contributing is idempotent, so a call whose reply was lost is simply made again; an owner
            # that no call reaches has most likely died, and the round fails now rather than at its timeout
            for attempt in range(REDUCE_ATTEMPTS):
                try:
                    # (the round's own wait bounds the call: see `Patience.wait`)
                    reply, tensors = await self.client.call(owner, "reduce", meta, [Tagged("allreduce", part)],
                                                            self.patience.ceiling)
                    break
                except CallFailed as e:
                    if e.refused and not any(mark in str(e) for mark in (NOT_READY, DIVERGED, POISON)):
                        raise RefusedBy(owner, e) from e
                    if e.refused and POISON in str(e):
                        await self._refused_as_poison(rnd, meta, part)
                    if e.answered or e.timed_out:
                        raise
                    if attempt == REDUCE_ATTEMPTS - 1:
                        raise Unreachable(owner, e) from e
                    log.info("reduce call to %s failed (%s); calling again", short(owner), e)
                    await asyncio.sleep(0.1)
        return await self._check_answer(rnd, owner, part.numel(), reply, tensors)

    async def _check_answer(self, rnd: Round, owner: str, size: int, reply: dict[str, Any],
                            tensors: list[torch.Tensor]) -> tuple[torch.Tensor, int, list[str]]:
        """An owner's answer, as every member checks it before it is used: one finite float32 part of the
        size asked for, within the bound a mean of bounded contributions cannot exceed, and a sample count
        and id list of the right kinds. An owner that answers otherwise is left out of the next groups."""
        samples, ids = reply.get("samples"), reply.get("ids", [])
        problem = await asyncio.to_thread(answer_problem, tensors, size, samples, ids, self.bounds.max_norm_per_sample)
        if problem is not None:
            rnd.poison_named.add(owner)
            raise RoundFailed(f"owner {short(owner)} answered with {problem}", frozenset({owner}))
        return tensors[0], samples, ids

    async def contribute(
        self, meta: dict[str, Any], tensors: list[torch.Tensor], sender: str
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Owner side: take one member's part, answer with the reduced part once all are in. A poisoned
        part (not finite, or over the bounds) ends this owner's round at once: its result would be poison."""
        try:
            c = await self._checked(meta, tensors, sender)
        except BadRequest as e:
            epoch = meta.get("epoch") if isinstance(meta, dict) else None
            rnd = self._rounds.get(epoch) if isinstance(epoch, int) else None
            if POISON in str(e) and rnd is not None and sender in rnd.group and rnd.result is None:
                rnd.poisoned.add(sender)
                rnd.complete.set()
            raise
        done = self._finished.get(c.epoch)
        if done is not None and done.group == c.group and sender in done.contributions and done.result is not None:
            return self._answer(self._repeated(done, c))  # a repeat of a contribution to a round that completed
        given_up = self._given_up.get(c.epoch)
        if c.epoch not in self._rounds and given_up is not None and given_up.group == c.group:
            raise self._abandoned(given_up)  # no retry with this group: the member it named is in it
        rnd = await self._round_for(c)
        if rnd.result is None and not rnd.reducing:  # once reduced, a round's answer never changes
            rnd.contributions[sender] = (c.part, c.samples, c.ids)
            if len(rnd.contributions) == len(rnd.group):
                rnd.reducing = True
                result = await asyncio.to_thread(self._reduce, rnd)
                if not rnd.complete.is_set():  # (else the round was abandoned meanwhile)
                    rnd.result = result
                    rnd.complete.set()
        await rnd.complete.wait()
        if rnd.result is None:
            raise self._abandoned(rnd)
        return self._answer(self._repeated(rnd, c))

    async def _checked(self, meta: dict[str, Any], tensors: list[torch.Tensor], sender: str) -> Contribution:
        """A contribution as every owner checks it (BadRequest: refused). A whole part's checks, like its
        reduction, run off the event loop: see `_reduce`."""
        c = await asyncio.to_thread(Contribution.parse, meta, tensors, sender, self.bounds)
        if self.bounds.receipts and len(c.ids) <= RECEIPTS_INLINE:
            check_receipts(meta.get("receipts"), c, self.stage)
        elif self.bounds.receipts:  # a long list is checked off the event loop
            await asyncio.to_thread(check_receipts, meta.get("receipts"), c, self.stage)
        return c

    async def _refused_as_poison(self, rnd: Round, meta: dict[str, Any], part: torch.Tensor) -> None:
        """An owner refused our part as poison: check it as the owners do. Where it fails here too, our round,
        given up, names ourselves to the parts still coming to it, as it does where our own part reached our
        own round first: without that, whichever refusal came first decided whether our groupmates heard
        of it at once, or waited out their round for our part to some owner."""
        try:
            await self._checked(meta, [part], self.own_id)
        except BadRequest:
            if rnd.result is None:
                rnd.poisoned.add(self.own_id)

    @staticmethod
    def _repeated(rnd: Round, c: Contribution) -> tuple[codecs.Packed, int, list[str]]:
        """A reduced round's result, for a contribution that is the one it reduced: a member retries a
        failed round with the same part (`swarm.server.gradvec.SetAside`), and an answer reduced from
        another part of the member's would make the owners' totals disagree in every retry."""
        _, samples, ids = rnd.contributions[c.sender]
        if samples != c.samples or ids != c.ids:
            raise BadRequest(f"{NOT_READY} the round for epoch {c.epoch} was reduced with another part of "
                             f"{short(c.sender)}'s ({samples} samples, not {c.samples})")
        return rnd.result

    @staticmethod
    def _abandoned(rnd: Round) -> BadRequest:
        return BadRequest(f"{NOT_READY} the round for epoch {rnd.epoch} {ABANDONED}{rnd.why_abandoned()}")

    async def _round_for(self, c: Contribution) -> Round:
        """This owner's round for the contribution's epoch, once it agrees with the contribution: a
        contribution that comes first proposes the round (`on_wake`), and waits for it to begin."""
        if c.epoch not in self._rounds:
            # (the owner may begin the round itself while it judges the proposal: see ServedStage.accept_proposal)
            if not await self.on_wake(c.epoch, c.group) and c.epoch not in self._rounds:
                raise BadRequest(f"{NOT_READY} this replica is not at epoch {c.epoch}")
            started = self._started_event(c.epoch)
            try:
                async with asyncio.timeout(self.patience.timeout):  # (not wait_for: it can lose a cancellation)
                    await started.wait()
            except TimeoutError as e:
                raise BadRequest(f"{NOT_READY} no round for epoch {c.epoch} began here") from e
            finally:
                if not started.is_set():
                    self._started.pop(c.epoch, None)
        rnd = self._rounds.get(c.epoch)
        if rnd is None or rnd.group != c.group:
            theirs = ",".join(map(short, c.group))
            mine = ",".join(map(short, rnd.group)) if rnd else "none"
            raise BadRequest(f"{NOT_READY} group mismatch for epoch {c.epoch}: sender has [{theirs}], owner has "
                             f"[{mine}]")
        if c.digest != rnd.digest:
            raise BadRequest(f"{DIVERGED} weights of {short(c.sender)} differ from the owner's at epoch {c.epoch}")
        if c.part.numel() != rnd.size or c.part.dtype != torch.float32:
            raise BadRequest(f"part has {c.part.numel()} {c.part.dtype} values, expected {rnd.size} float32")
        return rnd

    def _reduce(self, rnd: Round) -> tuple[codecs.Packed, int, list[str]]:
        """Sum the members' parts in the group's order (the same bits whoever computes it), divide by the
        group's samples, pack once; merge the members' microbatch lists. On a worker thread: on a slow
        machine, summing and packing a whole part on the event loop kept it from renewing the server's
        records for seconds, and its peers took it for gone."""
        total_samples = sum(n for _, n, _ in rnd.contributions.values())
        scales, cap = self.bounds.clip_scales(rnd.contributions)
        if any(s < 1.0 for s in scales.values()):
            log.info("stage %d: contributions of %s clipped to %.3g per sample", self.stage,
                     ", ".join(short(m) for m, s in scales.items() if s < 1.0), cap)
        mean = torch.zeros(rnd.size, dtype=torch.float32)
        for member in rnd.group:
            part = rnd.contributions[member][0]
            mean += part if scales[member] == 1.0 else part * scales[member]
        mean.div_(max(total_samples, 1))
        merged, twice = merge_ids([rnd.contributions[m][2] for m in rnd.group])
        if twice:
            log.error("stage %d epoch %d: microbatches accumulated by two replicas: %s", self.stage, rnd.epoch,
                      ", ".join(twice[:5]))
        return self.client.policy.pack("allreduce", mean), total_samples, merged

    @staticmethod
    def _answer(result: tuple[codecs.Packed, int, list[str]]) -> tuple[dict[str, Any], list[Tagged]]:
        mean, total, ids = result
        return {"samples": total, "ids": ids}, [Tagged("allreduce", mean)]
