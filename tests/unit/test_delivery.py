"""When a trainer forgets a stage gradient, waits for it, or accumulates it again."""

from __future__ import annotations

import asyncio

import pytest

from swarm.config import TrainerConfig
from swarm.core import LedgerAnswer, LedgerReply, Verdict, judge, merge_answers
from swarm.core.delivery import QUIET_PERIODS
from swarm.trainer import delivery as delivery_module
from swarm.trainer.calls import Served
from swarm.trainer.delivery import GradientKeeper
from swarm.trainer.view import SwarmView
from swarm.wire.records import ServerRecord


def answer(epoch: int = 5, committed_at: int | None = None, pending: bool = False, durable: int = 5) -> LedgerAnswer:
    return LedgerAnswer(epoch, committed_at, pending, durable)


@pytest.mark.parametrize(
    ("accumulated_at", "holder_alive", "reply", "expected"),
    [
        # a step took it in, and that step is on disk
        (4, True, answer(committed_at=5), Verdict.DONE),
        (4, False, answer(committed_at=5), Verdict.DONE),
        # committed by a step no second replica took and not on disk: the stage could still lose it
        (4, True, answer(committed_at=5, durable=2), Verdict.WAIT),
        # ... until it is old enough that keeping it longer would cost too much memory
        (4, True, answer(epoch=9, committed_at=5, durable=2), Verdict.DONE),
        # still held, unstepped, by a replica of the stage
        (5, True, answer(pending=True), Verdict.WAIT),
        (5, False, answer(pending=True), Verdict.WAIT),
        # the stage stepped past its epoch without it: the holder dropped it (died, left, caught up)
        (4, True, answer(epoch=5), Verdict.REPLAY),
        # the holder is gone before the stage stepped: its gradient went with it
        (5, False, answer(epoch=5), Verdict.REPLAY),
        # the holder is alive and the stage has not stepped yet: it will come
        (5, True, answer(epoch=5), Verdict.WAIT),
        # the stage lost steps (all its replicas died; a newcomer resumed from an older checkpoint)
        (7, False, answer(epoch=3, durable=3), Verdict.REPLAY),
    ],
)
def test_verdicts(accumulated_at: int, holder_alive: bool, reply: LedgerAnswer, expected: Verdict) -> None:
    assert judge(accumulated_at, holder_alive, reply) is expected


def test_keep_epochs_bounds_what_is_kept() -> None:
    reply = answer(epoch=12, committed_at=10, durable=0)
    assert judge(9, True, reply, keep_epochs=2) is Verdict.DONE
    assert judge(9, True, reply, keep_epochs=3) is Verdict.WAIT


def test_at_the_end_of_a_run_a_commit_is_enough() -> None:
    """The last steps reach the disk only when servers stop, so a settling trainer accepts a commit."""
    reply = answer(committed_at=9, durable=5)
    assert judge(8, True, reply) is Verdict.WAIT
    assert judge(8, True, reply, need_durable=False) is Verdict.DONE


def reply(epoch: int, committed: dict | None = None, pending: list | None = None, durable: int = 0) -> LedgerReply:
    parsed = LedgerReply.parse({"epoch": epoch, "committed": committed or {}, "pending": pending or [],
                                "durable": durable})
    assert parsed is not None
    return parsed


def test_answers_of_several_replicas_merge() -> None:
    """The most advanced replica has not heard of it, the holder still has it: wait, not replay."""
    answers = {"advanced": reply(7, {"m2": 6}, durable=6), "holder": reply(6, {"m2": 6}, ["m1"], durable=5)}
    assert merge_answers(answers, "m1", "holder", 4) == LedgerAnswer(7, None, True, 6)
    assert merge_answers(answers, "m2", "holder", 4) == LedgerAnswer(7, 6, False, 5, claimed_epoch=7)
    assert judge(6, True, merge_answers(answers, "m1", "holder", 4)) is Verdict.WAIT


def test_only_the_holder_can_say_a_microbatch_is_pending() -> None:
    """A replica claiming another's microbatch pending would keep the trainer waiting for ever."""
    answers = {"liar": reply(7, pending=["m1"]), "holder": reply(7)}
    merged = merge_answers(answers, "m1", "holder", 4)
    assert not merged.pending and judge(6, True, merged) is Verdict.REPLAY


def test_a_commit_that_a_replica_past_it_does_not_know_of_is_disputed_and_waited_on() -> None:
    """A lying replica claims a microbatch committed (and durable) so that the trainer forgets it; a replica
    that took the steps since, and would list it, says otherwise: neither forget it nor send it again."""
    liar, honest = reply(9, {"m1": 8}, durable=8), reply(8)
    merged = merge_answers({"liar": liar, "honest": honest}, "m1", "dead holder", 4)
    assert merged.disputed and judge(7, False, merged) is Verdict.WAIT
    # one that has not reached the step, or has forgotten it (keep_epochs later), cannot dispute it
    for epoch in (7, 12):
        merged = merge_answers({"liar": liar, "other": reply(epoch)}, "m1", "dead holder", 4)
        assert not merged.disputed and judge(7, False, merged) is Verdict.DONE
    # replicas that agree settle it
    merged = merge_answers({"a": liar, "b": reply(8, {"m1": 8}, durable=8)}, "m1", "dead holder", 4)
    assert not merged.disputed and judge(7, False, merged) is Verdict.DONE


def test_a_commit_on_a_superseded_branch_is_not_taken_for_old_enough_by_the_others_epochs() -> None:
    """A replica stepped alone to epoch 8 with m1 (it struck its groupmate out, or finished a round its
    groupmate failed); the stage went on without that step. Once the others are keep_epochs past 8 they no
    longer dispute the claim, and its age must then be the claimant's: counted from the others' epochs the
    trainer would forget m1, which no step of the stage's history took."""
    forked, stage = reply(9, {"m1": 8}, durable=7), reply(12)
    merged = merge_answers({"forked": forked, "stage": stage}, "m1", "forked", 4)
    assert not merged.disputed and merged.claimed_epoch == 9
    assert judge(7, True, merged) is Verdict.WAIT
    # the forked replica catches up: its ledger is the stage's, m1 is nowhere, and the stage is past it
    merged = merge_answers({"forked": reply(12), "stage": stage}, "m1", "forked", 4)
    assert judge(7, True, merged) is Verdict.REPLAY
    # a lone replica's own commit still becomes old enough as that replica goes on
    assert judge(7, True, merge_answers({"alone": reply(12, {"m1": 8}, durable=7)}, "m1", "alone", 4)) is Verdict.DONE
    # at the end of a run a commit need not be durable, but a claim from behind the stage is still waited on
    merged = merge_answers({"forked": reply(9, {"m1": 9}, durable=7), "stage": reply(13)}, "m1", "forked", 4)
    assert not merged.disputed and judge(8, True, merged, need_durable=False) is Verdict.WAIT
    merged = merge_answers({"last": reply(10, {"m1": 10}, durable=7), "behind": reply(9)}, "m1", "last", 4)
    assert judge(9, True, merged, need_durable=False) is Verdict.DONE


@pytest.mark.parametrize("bad", [
    None, [], {"epoch": 1}, {"epoch": "7", "committed": {}, "pending": [], "durable": 0},
    {"epoch": 7, "committed": [], "pending": [], "durable": 0},
    {"epoch": 7, "committed": {"m": 1.5}, "pending": [], "durable": 0},
    {"epoch": 7, "committed": {}, "pending": [3], "durable": 0},
    {"epoch": True, "committed": {}, "pending": [], "durable": 0},
])
def test_a_malformed_ledger_reply_is_dropped(bad: object) -> None:
    assert LedgerReply.parse(bad) is None


class _Client:
    """Answers `ledger` calls as a replica at `epoch` holding every microbatch asked about; counts them."""

    def __init__(self) -> None:
        self.epoch, self.asked = 3, []

    async def call(self, peer, method, meta, tensors, timeout):
        assert method == "ledger"
        self.asked.append(peer)
        return {"epoch": self.epoch, "committed": {}, "pending": list(meta["ids"]), "durable": 0}, []


class _Caller:
    """Replays that are still under way."""

    async def call(self, *args, **kwargs):
        await asyncio.Event().wait()


class _Stages:
    """The DHT's stage records as a trainer's view reads them."""

    def __init__(self) -> None:
        self.records: list[ServerRecord] = []
        self.expires: dict[str, float] = {}

    async def stages(self, num_stages: int) -> dict[int, list[ServerRecord]]:
        return {0: list(self.records)}

    def now(self) -> float:
        return 0.0


def test_a_stage_is_asked_about_open_gradients_only_when_its_answers_may_have_changed(monkeypatch) -> None:
    """While the stage's replicas stay where they were, a second question would only hear "wait" again:
    the stage is asked once, then again when a replica steps, when one in doubt is open and unasked, after
    QUIET_PERIODS periods, when a replica comes or goes, once a holder is no longer seen, and at every pass
    at the run's end."""
    now, period, ending = [100.0], 1.0, [False]
    monkeypatch.setattr(delivery_module.time, "monotonic", lambda: now[0])
    client, stages = _Client(), _Stages()
    view = SwarmView(1, "hash", {}, period)
    keeper = GradientKeeper(TrainerConfig(request_timeout=0.5), client, _Caller(), view, period,
                            lambda: ending[0], asyncio.Event())

    def serve(**epochs: int) -> None:
        stages.records = [ServerRecord(p, 0, 1.0, 0, e, 0, "hash", {}) for p, e in epochs.items()]

    async def asks() -> list[str]:
        await view.refresh(stages)
        before = len(client.asked)
        await keeper._judge_all()
        return sorted(client.asked[before:])

    async def main() -> tuple[list[list[str]], int]:
        serve(A=3)
        keeper.keep("r1", 0, "backward", [], Served("A", {}, [], "A", 3))
        seen = [await asks(), await asks()]  # asked once: the answer stays "pending at A"
        now[0] += 1.0
        serve(A=4)  # A stepped
        client.epoch = 4
        seen.append(await asks())
        keeper.keep("r2", 0, "backward", [], Served("B", {}, [], "A", 4))  # its call to B went unanswered
        now[0] += 0.6  # past request_timeout: r2 may be judged
        seen += [await asks(), await asks()]
        now[0] += QUIET_PERIODS * period
        seen += [await asks(), await asks()]
        ending[0] = True
        seen += [await asks(), await asks()]
        ending[0] = False
        now[0] += 4 * period
        serve(B=4)  # A left, B came: both asked (A, the holder, is still seen in the last views)
        seen += [await asks(), await asks()]
        seen.append(await asks())  # A is no longer seen: its gradients are lost (sent again), and B is asked
        replaying = len(keeper._replaying)
        for task in keeper._replaying:
            task.cancel()
        return seen, replaying

    assert asyncio.run(main()) == ([["A"], [], ["A"], ["A"], [], ["A"], [], ["A"], ["A"], ["A", "B"], [], ["B"]], 2)
    assert keeper.questions == len(client.asked)
