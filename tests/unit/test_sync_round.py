"""A sync round takes a replica's gradients out (`begin_step`) and steps on the stage's mean when the
all-reduce is over (`apply_step(..., own)`), while backwards go on in between: what they accumulate is
left for the next step, with its ledger entries; a round that fails holds its part apart for the retry. A replica
alone in its round steps where its gradients lie (`step_alone`), to the same weights."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from tests.unit.test_runtime import accumulate, assert_within, flat, hidden, over_the_wire, runtime, tiny_cfg
from tests.unit.test_server_parts import CFG, ID, call, last_stage_request, served

from swarm.averaging.allreduce import RoundResult
from swarm.averaging.failures import RoundFailed
from swarm.core.ledger import carry
from swarm.core.stepping import TRAINERS_QUIET, Step
from swarm.model import load_stages
from swarm.net.directory import RENEW_PERIODS
from swarm.server.gate import ComputeGate
from swarm.server.gradvec import gradient_vector
from swarm.server.stage import ServedStage
from swarm.server.stepping import LOOK_EVERY, Stepper
from swarm.wire.calls import CountNote


def twins(n: int = 2):
    stage = load_stages(tiny_cfg())[1]
    return [runtime(stage) for _ in range(n)]


def test_backwards_during_a_round_go_into_the_next_step_and_the_step_is_the_rounds() -> None:
    rt, reference, alone = twins(3)
    samples = accumulate(rt, seed=1)
    assert accumulate(reference, seed=1) == samples

    own = rt.begin_step()
    assert own.samples == samples and own.ids == sorted(rt.pending)
    assert not gradient_vector(rt.params).any()  # taken out: backwards start afresh
    rt.backward("during", hidden(2, seed=2), hidden(2, seed=3))  # while the round travels
    assert rt.pending_samples == samples + 2

    record = rt.apply_step(own.flat / samples, samples, group=1, own=own)
    reference.apply_step(gradient_vector(reference.params) / samples, samples, group=1)
    assert torch.equal(flat(rt.params), flat(reference.params))  # the step is the round's alone
    assert record.ids == own.ids and rt.pending == {"during": 2} and rt.pending_samples == 2
    assert rt.committed == dict.fromkeys(own.ids, 1) and rt.accumulates("during") is False

    alone.backward("during", hidden(2, seed=2), hidden(2, seed=3))  # at the weights before the step
    assert gradient_vector(rt.params).any()
    assert_within(gradient_vector(rt.params), gradient_vector(alone.params), 1e-6)


def test_a_retry_sends_the_failed_rounds_part_again_and_what_came_meanwhile_waits_for_the_next_step() -> None:
    """Owners that reduced the part in the failed attempt answer a repeat with their old result, so every
    attempt at an epoch must send the same part: what accumulated since is not added to it."""
    rt, meanwhile = twins()
    accumulate(rt, seed=4)
    own = rt.begin_step()
    for replica in (rt, meanwhile):
        replica.backward("during", hidden(2, seed=5), hidden(2, seed=6))
    rt.return_part(own)
    assert set(rt.pending) == {*own.ids, "during"} and rt.pending_samples == own.samples + 2  # still held
    retry = rt.begin_step()
    assert retry.ids == own.ids and retry.samples == own.samples and torch.equal(retry.flat, own.flat)
    rt.return_part(retry)  # failed again: the next attempt is the same still
    again = rt.begin_step()
    assert again.ids == own.ids and torch.equal(again.flat, own.flat)
    rt.apply_step(again.flat / again.samples, again.samples, group=2, own=again)
    assert rt.epoch == 1 and rt.pending == {"during": 2} and not rt.aside.parts
    assert_within(gradient_vector(rt.params), gradient_vector(meanwhile.params), 1e-6)


def test_a_failed_rounds_part_waits_apart_while_the_replica_steps_alone_and_goes_into_the_step_after() -> None:
    """The failed round may have succeeded elsewhere (an owner that got every part steps), so a replica
    that steps alone leaves the part out; once it has stepped without it, the part counts in the next step."""
    rt, meanwhile, aside = twins(3)
    accumulate(rt, seed=4)
    accumulate(aside, seed=4)
    own = rt.begin_step()
    for replica in (rt, meanwhile):
        replica.backward("during", hidden(2, seed=5), hidden(2, seed=6))
    rt.return_part(own)
    record = rt.step_alone()
    assert record.ids == ["during"] and record.samples == 2
    assert rt.pending == dict.fromkeys(own.ids, 3) and rt.epoch == 1 and not rt.aside.parts
    assert_within(gradient_vector(rt.params), gradient_vector(aside.params), 1e-6)


def ahead_by(steps: int, ids_in_step: list[str]) -> tuple[dict, list[torch.Tensor]]:
    """The state of a replica `steps` steps on, whose last step took in `ids_in_step` (and others)."""
    (source,) = twins(1)
    for epoch in range(steps):
        accumulate(source, seed=20 + epoch)
        names = [*ids_in_step, "other"] if epoch == steps - 1 else [f"earlier{epoch}"]
        source.apply_step(gradient_vector(source.params) / 3, 3, group=2, ids=names)
    return over_the_wire(*source.state())


def failed_round(rt):
    """`rt` took part in a round that may have succeeded elsewhere, and went on accumulating: (its part,
    the gradient that came meanwhile, as a replica that held only it would have it)."""
    (meanwhile,) = twins(1)
    accumulate(rt, seed=11)
    own = rt.begin_step()
    for replica in (rt, meanwhile):
        replica.backward("during", hidden(2, seed=12), hidden(2, seed=13))
    rt.return_part(own)
    return own, gradient_vector(meanwhile.params)


def test_loading_the_step_that_took_a_failed_rounds_part_keeps_what_came_after_it() -> None:
    """The round failed here but its owner stepped with our part: the gradients that came after the
    round began are one step old, as on a replica whose round succeeded, and stay for the next step."""
    (rt,) = twins(1)
    own, since = failed_round(rt)
    assert rt.load_state(*ahead_by(1, own.ids)) == 0
    assert rt.epoch == 1 and rt.pending == {"during": 2} and not rt.aside.parts
    assert rt.committed == {**dict.fromkeys([*own.ids, "other"], 1)}
    assert_within(gradient_vector(rt.params), since, 1e-6)


def test_loading_a_step_that_did_not_take_the_part_keeps_it_too() -> None:
    (rt,) = twins(1)
    own, _ = failed_round(rt)
    assert rt.load_state(*ahead_by(1, ["elsewhere"])) == 0
    assert rt.pending == {**dict.fromkeys(own.ids, 3), "during": 2}
    assert rt.begin_step().samples == own.samples + 2


@pytest.mark.parametrize("case", ["two steps on", "a held microbatch in the step", "part of a part in the step"])
def test_what_cannot_be_told_apart_from_the_loaded_step_is_dropped(case: str) -> None:
    (rt,) = twins(1)
    if case == "part of a part in the step":  # the failed round's part holds two microbatches; the step took one
        accumulate(rt, seed=14)
    own, _ = failed_round(rt)
    state = {"two steps on": lambda: ahead_by(2, own.ids),
             "a held microbatch in the step": lambda: ahead_by(1, [*own.ids, "during"]),
             "part of a part in the step": lambda: ahead_by(1, own.ids[:1])}[case]()
    held = rt.pending_samples
    assert rt.load_state(*state) == held
    assert rt.pending == {} and not rt.aside.parts and not gradient_vector(rt.params).any()


def test_a_replica_keeps_each_set_aside_part_by_what_the_loaded_step_took() -> None:
    assert carry(["a", "b", "c"], [["a"], ["b"]], 3, 4, [(4, ["a", "x"])]) == [False, True]
    assert carry(["a", "b", "c"], [["a"], ["b"]], 3, 4, [(3, ["b"]), (4, ["x"])]) == [True, True]
    assert carry(["a", "b", "c"], [["a"], ["b"]], 3, 4, [(4, ["a", "c"])]) is None  # c was held outside the parts
    assert carry(["a", "b"], [["a", "b"]], 3, 4, [(4, ["a"])]) is None  # a part in part
    assert carry(["a"], [], 3, 5, []) is None  # two steps on


def test_a_microbatch_replayed_here_while_a_groupmate_stepped_it_keeps_its_receipt_for_the_next_round() -> None:
    """A replay reaches this replica while its round runs, and a groupmate's part brings the same
    microbatch into the step: it stays held here, for the next step, and so must its receipt (without
    it every later round refuses this replica's part as poison, and the stage never steps again)."""
    (rt,) = twins(1)
    accumulate(rt, seed=8)
    own = rt.begin_step()
    rt.book.note_receipt("replayed", "receipt-of-replayed")
    rt.backward("replayed", hidden(2, seed=9), hidden(2, seed=10))
    samples = own.samples + 2  # the groupmate's part held the replayed microbatch too
    rt.apply_step(own.flat / samples, samples, group=2, ids=sorted([*own.ids, "replayed"]), own=own)
    assert rt.pending == {"replayed": 2}
    assert rt.book.receipts_for(["replayed"]) == [[2, "receipt-of-replayed"]]
    assert all(receipt == "" for _, receipt in rt.book.receipts_for(own.ids))  # stepped: forgotten

async def holding_r1(reduce_of=lambda handlers: None):
    """A last-stage server that accumulated microbatch r1, and its step loop over `reduce_of(handlers)`."""
    gate = ComputeGate(1.0, False)
    handlers, st = served(1, gate)
    await handlers.forward(call(req="r1"), last_stage_request(), ID["caller"])
    reduce = reduce_of(handlers)
    return handlers, st, reduce, Stepper(st, "QmMe", CFG.optim, CFG.net, 0, gate, None, reduce, None, None, None,
                                         "", None)


class HeldReduce:
    """A stage all-reduce whose other member answers only once `release` is set."""

    def __init__(self) -> None:
        self.started, self.release = asyncio.Event(), asyncio.Event()

    async def run(self, epoch, group, flat, samples, digest, ids, receipts) -> RoundResult:
        self.started.set()
        await self.release.wait()
        return RoundResult(flat / samples, samples, ids)


def test_a_server_computes_while_its_round_waits_on_the_group_and_steps_on_the_round_alone() -> None:
    async def scenario() -> None:
        handlers, st, reduce, stepper = await holding_r1(lambda _: HeldReduce())
        round_ = asyncio.create_task(stepper._sync_round(0, ("QmMe", "QmOther")))
        await asyncio.wait_for(reduce.started.wait(), 5.0)
        # the round waits on its group, and the gate serves a new microbatch meanwhile
        await asyncio.wait_for(handlers.forward(call(req="r2"), last_stage_request(), ID["caller"]), 5.0)
        assert st.runtime.epoch == 0 and st.runtime.pending_samples == 4
        leaving = asyncio.create_task(stepper.finish())  # a server leaving lets the round end first
        await asyncio.sleep(0.05)
        assert not leaving.done()
        reduce.release.set()
        record = await round_
        await asyncio.wait_for(leaving, 5.0)
        assert record.epoch == 1 and record.ids == [f"{ID['caller']}/r1"]
        assert st.runtime.pending == {f"{ID['caller']}/r2": 2} and st.round_epoch is None
        assert await stepper._sync_round(1, ("QmMe",)) is None  # finishing: no new round

    asyncio.run(scenario())


class FailsOnce:
    """A stage all-reduce whose first round fails after a microbatch came in meanwhile; it records what each
    attempt sent."""

    def __init__(self, handlers) -> None:
        self.handlers = handlers
        self.sent: list[tuple[torch.Tensor, int, list[str]]] = []

    async def run(self, epoch, group, flat, samples, digest, ids, receipts) -> RoundResult:
        self.sent.append((flat.clone(), samples, list(ids)))
        if len(self.sent) == 1:
            await self.handlers.forward(call(req="r2"), last_stage_request(), ID["caller"])
            raise RoundFailed(f"epoch {epoch}: owners disagree on the samples")
        return RoundResult(flat / samples, samples, ids)


def test_a_servers_retry_sends_the_failed_rounds_part_as_it_was() -> None:
    async def scenario() -> None:
        _, st, reduce, stepper = await holding_r1(FailsOnce)
        with pytest.raises(RoundFailed):
            await stepper._sync_round(0, ("QmMe", "QmOther"))
        assert st.runtime.pending_samples == 4  # both microbatches held, toward the retry and the next step
        record = await stepper._sync_round(0, ("QmMe", "QmOther"))
        (first, samples, ids), (retried, samples_again, ids_again) = reduce.sent
        assert torch.equal(first, retried)
        assert (samples, ids) == (samples_again, ids_again) == (2, [f"{ID['caller']}/r1"])
        assert record.epoch == 1 and record.ids == ids and st.runtime.pending == {f"{ID['caller']}/r2": 2}

    asyncio.run(scenario())


def test_a_replica_alone_steps_in_place_to_the_weights_a_round_of_one_gives() -> None:
    rt, reference = twins()
    samples = accumulate(rt, seed=7)
    accumulate(reference, seed=7)
    unused = rt.params[0]
    unused.grad = reference.params[0].grad = None  # a parameter no backward reached: a zero gradient

    record = rt.step_alone()
    own = reference.begin_step()
    expected = reference.apply_step(own.flat / samples, samples, group=1, own=own)
    assert torch.equal(flat(rt.params), flat(reference.params))
    assert (record.epoch, record.samples, record.group, record.ids) == (1, samples, 1, own.ids)
    assert record.grad_norm == expected.grad_norm and record.digest == expected.digest
    assert rt.pending == {} and rt.committed == dict.fromkeys(own.ids, 1)
    assert all(p.grad is None for p in rt.params)  # the next step starts from nothing


def test_a_round_of_one_holds_the_gate_and_needs_no_all_reduce() -> None:
    async def scenario() -> None:
        _, st, _, stepper = await holding_r1()
        record = await stepper._sync_round(0, ("QmMe",))
        assert record.epoch == 1 and record.group == 1 and record.ids == [f"{ID['caller']}/r1"]
        assert st.runtime.pending == {} and st.round_epoch is None

    asyncio.run(scenario())


class _Directory:
    """A directory whose trainer and stage records are read and counted."""

    def __init__(self, trainers: list[SimpleNamespace], stage: list[SimpleNamespace] | None = None) -> None:
        self.listed, self.records = trainers, stage or []
        self.reads = {"trainers": 0, "stage": 0}
        self.fresh: list[float] = []  # how old a read of the stage each read would take
        self.expires: dict[str, float] = {}

    async def trainers(self) -> list[SimpleNamespace]:
        self.reads["trainers"] += 1
        return self.listed

    async def read_stages(self, stages, fresh: float = 0.0) -> tuple[dict, float]:
        self.reads["stage"] += 1
        self.fresh.append(fresh)
        return {k: self.records for k in stages}, self.now()

    def now(self) -> float:
        return time.time()


def stepper_reading(directory: _Directory) -> tuple[ServedStage, Stepper]:
    _, st = served(1, ComputeGate(1.0, False))
    return st, Stepper(st, "QmMe", CFG.optim, CFG.net, 0, None, directory, None, None, None, None, "", None)


def test_a_replica_that_saw_no_trainer_reads_again_at_its_next_look() -> None:
    """A replica alone steps only while it sees a trainer, and one whose first step fell due before the
    trainer's record was read waited out a grace more: with none in view, the records are read at every
    look; with one, less often."""
    async def scenario() -> list[int]:
        directory = _Directory([SimpleNamespace(done=False)])
        _, stepper = stepper_reading(directory)
        reads = []
        for seen in ([], directory.listed):
            stepper._trainers_read = (time.monotonic() - LOOK_EVERY, seen)
            await stepper._trainers()
            reads.append(directory.reads["trainers"])
        return reads

    assert LOOK_EVERY < CFG.net.announce_period
    assert asyncio.run(scenario()) == [1, 1]


@pytest.mark.parametrize("work_ago, usual_gap, done, held, read_after", [
    (0.0, 0.1, False, 40, TRAINERS_QUIET),  # work comes in: the run goes on
    (2.0, 0.1, False, 40, 1),  # no work for longer than a period, samples held: the run may be over
    (2.0, 1.0, False, 40, TRAINERS_QUIET),  # a stage whose work comes a period apart: nothing unusual
    (0.0, 0.1, True, 40, 1),  # a trainer said it is done
    (2.0, 0.1, False, 0, TRAINERS_QUIET),  # idle around a step, holding nothing: nothing to flush
])
def test_the_trainers_records_are_read_seldom_unless_the_stage_may_have_to_flush(
        work_ago: float, usual_gap: float, done: bool, held: int, read_after: int) -> None:
    """Every read of the trainers' records is served by each DHT node holding them. While calls come in,
    the run is not over and a trainer is in view: once per TRAINERS_QUIET announcement periods is enough.
    Once a trainer says it is done, or no work came for longer than a period and than a few of the stage's
    usual gaps between passes, a stage holding samples may have to flush them: once per period, so that
    the run's end is seen within one."""
    period = CFG.net.announce_period

    async def scenario() -> list[bool]:
        directory = _Directory([SimpleNamespace(done=done)])
        st, stepper = stepper_reading(directory)
        st.work.last, st.work.gap = time.monotonic() - work_ago * period, usual_gap * period
        st.plan = replace(st.plan, peers_pending=held)  # (what the other replicas last said they hold)
        read = []
        for periods in range(1, TRAINERS_QUIET + 1):
            before = directory.reads["trainers"]
            stepper._trainers_read = (time.monotonic() - periods * period - 0.01, directory.listed)
            await stepper._trainers()
            read.append(directory.reads["trainers"] > before)
        return read

    assert asyncio.run(scenario()) == [periods >= read_after for periods in range(1, TRAINERS_QUIET + 1)]


@pytest.mark.parametrize("near, told", [(False, False), (True, False), (True, True)])
def test_the_stages_records_are_read_twice_a_period_only_near_the_step(near: bool, told: bool) -> None:
    """Beside other replicas, their sample counts decide when the stage steps, but only near the step; far
    from it the records are read once per announcement period, as by a replica alone, and a read of the
    stage by this peer up to a period old (a trainer's view, in a server that trains) will do; near it, one
    up to half a look's interval old, unless every replica at our epoch told us its count within the period."""
    mate = SimpleNamespace(peer_id="QmMate", epoch=0, pending=0)
    directory = _Directory([], [mate])

    async def scenario() -> list[int]:
        st, stepper = stepper_reading(directory)
        st.plan = replace(st.plan, peers_at_epoch=(st.runtime.epoch, frozenset({"QmMate"})),
                          peers_pending=CFG.optim.target_batch_size if near else 0)
        if told:
            st.note_count("QmMate", CountNote(1, st.runtime.epoch, 8, seq=1))
        reads = []
        for ago in (LOOK_EVERY + 0.01, CFG.net.announce_period + 0.01):
            stepper._records_read = (time.monotonic() - ago, [mate])
            await stepper._records()
            reads.append(directory.reads["stage"])
        return reads

    assert LOOK_EVERY + 0.01 < CFG.net.announce_period
    twice = near and not told
    assert asyncio.run(scenario()) == ([1, 2] if twice else [0, 1])
    assert directory.fresh == ([LOOK_EVERY / 2] * 2 if twice else [CFG.net.announce_period])


def test_after_a_step_the_stage_is_read_at_every_look_until_the_rounds_other_members_show_it() -> None:
    """The members of the round that took us to our epoch stepped as we did and announce it at once, but a
    read begun before our step still shows them a step behind, and the next one a period later held the
    stage's next step back that long: the stage stepped on several times its batch while the other stages
    stepped at theirs. Until they are seen at our epoch, no read begun before the step serves, and the
    stage is read at every look; once they are, as any replica beside others far from its step."""
    mate = SimpleNamespace(peer_id="QmMate", epoch=0, pending=0)
    directory = _Directory([], [mate])

    async def scenario() -> list[int]:
        st, stepper = stepper_reading(directory)
        stepper._stepped_at = time.monotonic() - 0.1
        st.plan = replace(st.plan, groupmates=(st.runtime.epoch, frozenset({"QmMate"})),
                          peers_at_epoch=(st.runtime.epoch, frozenset()))
        reads = []
        for seen in (frozenset(), frozenset({"QmMate"})):
            st.plan = replace(st.plan, peers_at_epoch=(st.runtime.epoch, seen))
            stepper._records_read = (time.monotonic() - LOOK_EVERY - 0.01, [mate])
            await stepper._records()
            reads.append(directory.reads["stage"])
        return reads

    assert asyncio.run(scenario()) == [1, 1]
    assert LOOK_EVERY / 2 > 0.2  # (near a step, a read up to LOOK_EVERY / 2 old would serve)
    assert len(directory.fresh) == 1 and directory.fresh[0] < 0.2  # only one begun since the step


@pytest.mark.parametrize("handed", [False, True])
def test_a_replica_alone_reads_its_stage_as_often_as_records_are_renewed(handed: bool) -> None:
    """With no other replica in view nothing is decided from the stage's records: they are read every
    RENEW_PERIODS periods, which still shows a newcomer inside the grace before a replica steps alone. A
    newcomer that downloaded our state is waited for: the stage is read at every look until it shows up."""
    period = CFG.net.announce_period
    directory = _Directory([], [])

    async def scenario() -> list[int]:
        st, stepper = stepper_reading(directory)
        if handed:
            st.note_handed("QmNewcomer", st.runtime.epoch)
        reads = []
        for ago in (LOOK_EVERY + 0.01, period + 0.01, RENEW_PERIODS * period + 0.01):
            stepper._records_read = (time.monotonic() - ago, [])
            await stepper._records()
            reads.append(directory.reads["stage"])
        assert RENEW_PERIODS * period < stepper.grace
        return reads

    assert asyncio.run(scenario()) == ([1, 2, 3] if handed else [0, 0, 1])


def test_a_round_proposed_by_a_replica_the_last_read_missed_waits_for_the_stage_to_be_read_and_is_joined() -> None:
    """A replica that started a little later announced itself after our last read of the stage, gathered
    samples and proposed the round with us (at a stage's first round, each replica's plan may not have read
    the other's record yet). A peer our plan has not seen at our epoch must not get into the stage's round,
    but refused at once, the proposer's round failed and waited out a backoff: the proposal waits for the
    next look, which reads the stage again at once, though the last read is fresh, and steps with it instead
    of alone; the proposal is then accepted."""
    newcomer = SimpleNamespace(peer_id="QmLate", epoch=0, pending=8, moving=False)
    directory = _Directory([SimpleNamespace(done=False)], [])

    async def scenario() -> None:
        st, stepper = stepper_reading(directory)
        st.runtime.book.hold("mb", CFG.optim.target_batch_size)  # (the samples its backwards left)
        st.plan = replace(st.plan, alone_since=-math.inf)  # alone for longer than the grace
        decision, _ = await stepper._look()
        assert decision == Step(("QmMe",)) and directory.reads["stage"] == 1  # it would step alone
        directory.records = [newcomer]
        group = ("QmLate", "QmMe")
        st.wake.clear()
        asked = asyncio.ensure_future(st.accept_proposal(st.runtime.epoch, group))
        await st.wake.wait()  # the proposal woke the step loop
        assert not asked.done()  # and waits for its read
        decision, _ = await stepper._look()
        assert directory.reads["stage"] == 2 and directory.fresh[-1] == 0.0
        assert decision == Step(group)
        assert await asked and st.proposal == (st.runtime.epoch, group)
        await stepper._look()  # the accepted proposal is joined: no read of the stage for it
        assert directory.reads["stage"] == 2

    asyncio.run(scenario())


def test_a_round_a_groupmate_proposed_right_after_our_step_is_joined_without_reading_the_stage() -> None:
    """The other member of the round that took us to our epoch proposes the next one before its new record
    is read: the proposal is accepted, and the look that follows joins it without a read of the stage or of
    the trainers, while the proposer's part waits on us."""
    directory = _Directory([SimpleNamespace(done=False)], [SimpleNamespace(peer_id="QmMate", epoch=0, pending=0)])

    async def scenario() -> None:
        st, stepper = stepper_reading(directory)
        epoch = st.runtime.epoch
        st.plan = replace(st.plan, groupmates=(epoch, frozenset({"QmMate"})), peers_at_epoch=(epoch - 1, frozenset()))
        group = ("QmMate", "QmMe")
        assert await st.accept_proposal(epoch, group)
        decision, _ = await stepper._look()
        assert decision == Step(group)
        assert directory.reads == {"trainers": 0, "stage": 0}
        await stepper._look()  # with no proposal the stage is read as before
        assert directory.reads["stage"] == 1

    asyncio.run(scenario())


def test_a_failed_rounds_backoff_ends_when_a_groupmate_proposes_a_round_we_accept() -> None:
    """After a stage's first round failed, the replica that refused it read the stage and proposed the round
    itself; the proposal waited out the backoff of the replica whose round had failed. Joining it repeats
    nothing of ours, so the backoff ends there; without one it lasts as long as it says."""
    async def scenario() -> None:
        st, stepper = stepper_reading(_Directory([]))
        epoch, group = st.runtime.epoch, ("QmMate", "QmMe")
        st.plan = replace(st.plan, peers_at_epoch=(epoch, frozenset({"QmMate"})))
        started = time.monotonic()
        await stepper._back_off(0.05)
        assert time.monotonic() - started >= 0.05
        waiting = asyncio.create_task(stepper._back_off(60.0))
        await asyncio.sleep(0)  # (the backoff begins)
        assert not waiting.done()
        assert await st.accept_proposal(epoch, group)
        await asyncio.wait_for(waiting, 5.0)
        await asyncio.wait_for(stepper._back_off(60.0), 5.0)  # one already accepted: no wait at all
        assert st.proposal == (epoch, group)

    asyncio.run(scenario())


@pytest.mark.parametrize("case", ["waiting", "short", "past the grace"])
def test_a_replica_alone_with_a_steps_samples_reads_at_every_look_while_it_waits_for_others(case: str) -> None:
    """At a run's start a stage's replicas come up together and each first sees none of the others. One that
    holds a step's samples waits out the grace for them before it steps alone, and only their records can
    change that: it reads at every look meanwhile. Short of its samples, or alone past the grace (it steps
    at once then), it reads as seldom as records are renewed."""
    directory = _Directory([], [])

    async def scenario() -> int:
        st, stepper = stepper_reading(directory)
        st.runtime.book.hold("mb", CFG.optim.target_batch_size - (case == "short"))
        alone_for = stepper.grace + 1.0 if case == "past the grace" else 1.0
        st.plan = replace(st.plan, alone_since=time.monotonic() - alone_for)
        stepper._records_read = (time.monotonic() - LOOK_EVERY - 0.01, [])
        await stepper._records()
        assert LOOK_EVERY + 0.01 < RENEW_PERIODS * CFG.net.announce_period
        return directory.reads["stage"]

    assert asyncio.run(scenario()) == (1 if case == "waiting" else 0)


def test_a_round_proposed_with_a_member_the_new_read_does_not_show_either_is_refused() -> None:
    """A proposal with a member our plan has not seen waits for the stage to be read, but a member that read
    does not show at our epoch either (a peer outside the stage) keeps the round refused."""
    directory = _Directory([SimpleNamespace(done=False)], [SimpleNamespace(peer_id="QmMate", epoch=0, pending=0)])

    async def scenario() -> tuple[bool, tuple | None, int]:
        st, stepper = stepper_reading(directory)
        asked = asyncio.ensure_future(st.accept_proposal(0, ("QmMate", "QmMe", "QmOutsider")))
        await st.wake.wait()
        await stepper._look()
        return await asked, st.proposal, directory.reads["stage"]

    assert asyncio.run(scenario()) == (False, None, 1)
