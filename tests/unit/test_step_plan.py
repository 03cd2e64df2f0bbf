"""The step plan: when a replica's stage steps and with whom, driven look by look with a fake clock."""

from __future__ import annotations

import math
from dataclasses import replace

from swarm.core.stepping import (
    GROUPMATE_GRACES,
    CatchUp,
    PlanMemory,
    Replica,
    Step,
    StepView,
    Wait,
    accept_proposal,
    plan_step,
    suspect,
    unproven,
    unseen_in,
    worth_telling,
)

GRACE = 4.0


def view(now: float, *others: Replica, epoch: int = 3, pending: int = 16, trainers: int = 1, done: bool = False,
         proposal=None, lapsed: frozenset[str] = frozenset(), handed: dict[str, float] | None = None) -> StepView:
    return StepView(now=now, me="me", epoch=epoch, pending=pending, others=tuple(others), trainers=trainers,
                    trainers_done=done, proposal=proposal, target_batch_size=32, grace=GRACE, lapsed=lapsed,
                    handed=handed or {})


def looks(*views: StepView, memory: PlanMemory | None = None):
    """Each look's decision, the memory carried from one to the next."""
    memory = memory or PlanMemory()
    decisions = []
    for v in views:
        decision, memory = plan_step(v, memory)
        decisions.append(decision)
    return decisions, memory


def test_a_stage_steps_once_its_replicas_hold_the_target_batch_together():
    (first, second), _ = looks(view(0.0, Replica("b", 3, 8)), view(1.0, Replica("b", 3, 16)))
    assert first == Wait()
    assert second == Step(("b", "me"))


def test_a_replica_behind_catches_up_from_the_most_advanced_first():
    (decision,), _ = looks(view(0.0, Replica("b", 4, 0), Replica("c", 6, 0), Replica("d", 3, 8)))
    assert decision == CatchUp(("c", "b"))


def test_a_peer_that_looks_one_epoch_behind_is_waited_for_then_left_out_after_the_grace():
    """It is usually just late to announce the step it took with us."""
    late = Replica("b", 2, 0)
    decisions, memory = looks(view(0.0, late, pending=32), view(GRACE - 0.1, late, pending=32),
                              view(GRACE + 0.1, late, pending=32))
    assert decisions == [Wait(), Wait(), Step(("me",))]
    assert memory.behind_since == {"b": 0.0}


def test_a_member_of_the_round_that_took_us_here_is_waited_for_longer():
    """It holds that round's result and is stepping, after the job it is running (a slow one's, seconds);
    a peer that looks behind but was not in that round is left out after one grace."""
    memory = PlanMemory(groupmates=(3, frozenset({"mate"})))
    mate, other = Replica("mate", 2, 0), Replica("other", 2, 0)
    longest = GROUPMATE_GRACES * GRACE
    decisions, _ = looks(view(0.0, mate, pending=32), view(GRACE + 0.1, mate, pending=32),
                         view(longest - 0.1, mate, pending=32), view(longest + 0.1, mate, pending=32), memory=memory)
    assert decisions == [Wait(), Wait(), Wait(), Step(("me",))]
    decisions, _ = looks(view(0.0, other, pending=32), view(GRACE + 0.1, other, pending=32), memory=memory)
    assert decisions == [Wait(), Step(("me",))]
    stale = PlanMemory(groupmates=(2, frozenset({"mate"})))  # a round to an older epoch: one grace
    decisions, _ = looks(view(0.0, mate, pending=32), view(GRACE + 0.1, mate, pending=32), memory=stale)
    assert decisions == [Wait(), Step(("me",))]


def test_a_peer_caught_up_in_time_steps_with_us():
    decisions, _ = looks(view(0.0, Replica("b", 2, 0), pending=32), view(1.0, Replica("b", 3, 4), pending=32))
    assert decisions == [Wait(), Step(("b", "me"))]


def test_a_lone_replica_steps_alone_only_after_the_grace():
    """A peer that started with it may not have announced itself yet."""
    decisions, _ = looks(view(10.0, pending=32), view(10.0 + GRACE - 0.1, pending=32), view(10.0 + GRACE, pending=32))
    assert decisions == [Wait(), Wait(), Step(("me",))]


def test_a_peer_seen_only_after_the_grace_is_stepped_with():
    decisions, memory = looks(view(0.0, pending=32), view(GRACE + 1, Replica("b", 3, 0), pending=32))
    assert decisions == [Wait(), Step(("b", "me"))]
    assert memory.alone_since == math.inf


def test_no_step_alone_while_no_trainer_is_in_view_either():
    """More likely cut off from the swarm than its stage's last replica; and once the swarm is back, the
    grace starts again, since its other replicas may take a moment more to appear."""
    decisions, memory = looks(view(0.0, pending=32, trainers=0), view(GRACE + 1, pending=32, trainers=0),
                              view(GRACE + 2, pending=32), view(2 * GRACE + 1.5, pending=32))
    assert decisions == [Wait(), Wait(), Wait(), Step(("me",))]


def test_a_groupmate_s_proposal_for_our_epoch_is_taken_as_it_is():
    (decision,), _ = looks(view(0.0, Replica("b", 3, 0), pending=0, proposal=(3, ("b", "c", "me"))))
    assert decision == Step(("b", "c", "me"))
    (stale,), _ = looks(view(0.0, Replica("b", 3, 0), pending=0, proposal=(2, ("b", "me"))))
    assert stale == Wait()


def test_when_the_trainers_are_done_the_stage_flushes_what_it_holds():
    decisions, _ = looks(view(0.0, Replica("b", 3, 3), pending=2, done=True),
                         view(0.0, Replica("b", 3, 0), pending=0, done=True))
    assert decisions == [Step(("b", "me")), Wait()]


def test_a_suspect_is_left_out_until_its_record_expires_or_moves_on():
    memory = suspect(PlanMemory(), ["b"], until=5.0, epoch=3)
    others = (Replica("b", 3, 16), Replica("c", 3, 16))
    decisions, memory = looks(view(0.0, *others), memory=memory)
    assert decisions == [Step(("c", "me"))]
    decisions, _ = looks(view(6.0, *others), memory=memory)  # expired
    assert decisions == [Step(("b", "c", "me"))]
    decisions, _ = looks(view(1.0, Replica("b", 4, 0), Replica("c", 3, 16)), memory=memory)  # moved on: alive
    assert decisions == [CatchUp(("b",))]


def test_only_suspects_left_means_stepping_alone_at_once():
    memory = suspect(PlanMemory(), ["b"], until=5.0, epoch=3)
    decisions, _ = looks(view(0.0, Replica("b", 3, 0), pending=32), memory=memory)
    assert decisions == [Step(("me",))]


def test_a_replica_whose_only_peer_lapsed_steps_alone_without_the_grace():
    """The peer froze right after a step it took with us, before it announced it: it looks one epoch
    behind, and then its record expires. Missing from a read begun after that, it is gone."""
    (first,), memory = looks(view(0.0, Replica("b", 2, 0), pending=32))
    assert first == Wait()  # a groupmate a step behind is waited for
    decisions, _ = looks(view(5.0, pending=40, lapsed=frozenset({"b"})), memory=memory)
    assert decisions == [Step(("me",))]
    decisions, _ = looks(view(5.0, pending=40), memory=memory)  # merely missing from one read
    assert decisions == [Wait()]


def test_a_replica_whose_only_peer_failed_its_round_and_lapsed_steps_alone_without_the_grace():
    """The peer froze: the round failed on it, and by the next look its record has expired. The grace is
    for peers not yet announced, not for one this replica knows is gone."""
    (first,), memory = looks(view(0.0, Replica("b", 3, 16), pending=16))
    assert first == Step(("b", "me"))
    memory = suspect(memory, ["b"], until=8.0, epoch=3)
    decisions, _ = looks(view(3.0, pending=40), memory=memory)
    assert decisions == [Step(("me",))]


def test_a_proposal_is_accepted_only_for_our_epoch_with_us_and_everyone_we_know_at_it():
    _, memory = looks(view(0.0, Replica("b", 3, 4), Replica("c", 3, 4), pending=4))
    assert accept_proposal(memory, "me", 3, 3, ("b", "c", "me"))
    assert not accept_proposal(memory, "me", 3, 3, ("b", "me"))  # c's samples would be dropped
    assert not accept_proposal(memory, "me", 3, 2, ("b", "c", "me"))
    assert not accept_proposal(memory, "me", 3, 3, ("b", "c"))
    assert not accept_proposal(suspect(memory, ["c"], 9.0, 3), "me", 3, 3, ("b", "c", "me"))
    # a peer that is no replica we have seen at this epoch cannot put itself in the stage's round
    assert not accept_proposal(memory, "me", 3, 3, ("b", "c", "me", "outsider"))
    assert not accept_proposal(memory, "me", 3, 3, ("me", "outsider"))
    # nor can anyone before our plan has looked at this epoch
    assert not accept_proposal(PlanMemory(), "me", 3, 3, ("b", "c", "me"))


def test_the_members_of_the_round_that_took_us_to_our_epoch_may_propose_the_next_before_we_read_them():
    """Right after a step our plan has seen no one at the new epoch; a groupmate whose samples came first
    proposes the next round at once. Its round goes ahead, and no one else gets in with it."""
    _, memory = looks(view(0.0, Replica("b", 3, 4), Replica("c", 3, 4), pending=4))
    memory = replace(memory, groupmates=(4, frozenset({"b", "c"})))  # the round for epoch 3 took us to 4
    assert accept_proposal(memory, "me", 4, 4, ("b", "c", "me"))
    assert unseen_in(memory, "me", 4, 4, ("b", "c", "me")) == frozenset()
    assert not accept_proposal(memory, "me", 4, 4, ("b", "c", "me", "outsider"))
    assert unseen_in(memory, "me", 4, 4, ("b", "c", "me", "outsider")) == {"outsider"}
    assert accept_proposal(memory, "me", 4, 4, ("b", "me"))  # c may not have stepped: it is not known at 4
    assert not accept_proposal(memory, "me", 5, 5, ("b", "c", "me"))  # groupmates of another epoch
    assert not accept_proposal(replace(memory, groupmates=(4, frozenset())), "me", 4, 4, ("b", "c", "me"))
    # once our plan has seen a replica at this epoch, a round that leaves it out is refused
    _, looked = looks(view(1.0, Replica("b", 4, 4), Replica("c", 4, 4), Replica("d", 4, 4), pending=4, epoch=4),
                      memory=memory)
    assert not accept_proposal(looked, "me", 4, 4, ("b", "c", "me"))
    assert accept_proposal(looked, "me", 4, 4, ("b", "c", "d", "me"))


def test_the_members_of_a_proposal_our_plan_has_not_seen_are_named_only_where_nothing_else_is_amiss():
    """They are why the stage is read again before the plan decides (a replica that announced itself
    since the last read); a proposal refused for another reason reads nothing."""
    _, memory = looks(view(0.0, Replica("b", 3, 4), pending=4))
    assert unseen_in(memory, "me", 3, 3, ("b", "me")) == frozenset()
    assert unseen_in(memory, "me", 3, 3, ("b", "me", "new")) == {"new"}
    assert unseen_in(PlanMemory(), "me", 3, 3, ("b", "me")) == {"b"}  # the plan has not looked at epoch 3
    assert unseen_in(memory, "me", 3, 2, ("b", "me", "new")) == frozenset()  # another epoch
    assert unseen_in(memory, "me", 3, 3, ("b", "new")) == frozenset()  # without us
    assert unseen_in(suspect(memory, ["b"], 9.0, 3), "me", 3, 3, ("b", "me", "new")) == frozenset()


def test_an_epoch_claim_that_gave_no_state_stops_holding_the_stage_back_until_the_record_moves():
    """A forged record at epoch 10^9 made every replica try to catch up, look after look, and never step.
    Once its download failed, its claim is set aside; a record that moves on (a real replica stepping)
    counts again at once, and so does one whose time ran out."""
    liar = Replica("liar", 10**9, 0)
    (decision,), memory = looks(view(0.0, liar, pending=32))
    assert decision == CatchUp(("liar",))
    memory = unproven(memory, {"liar": 10**9}, until=10.0)
    decisions, memory = looks(view(1.0, liar, pending=32), memory=memory)
    assert decisions == [Step(("me",))]
    (moved,), _ = looks(view(2.0, Replica("liar", 10**9 + 1, 0), pending=32), memory=memory)
    assert moved == CatchUp(("liar",))
    (expired,), _ = looks(view(11.0, liar, pending=32), memory=memory)
    assert expired == CatchUp(("liar",))


def test_a_peer_that_always_looks_one_behind_is_waited_for_twice_then_no_more():
    """A stranger announcing itself one epoch behind, step after step, made every step wait the grace.
    After MAX_WAITS graces in vain it is not waited for; once seen at our epoch, it is again."""
    memory, now, epoch = PlanMemory(), 0.0, 3
    waits = []
    for _ in range(4):
        lagging = Replica("lag", epoch - 1, 0)
        (first,), memory = looks(view(now, lagging, epoch=epoch, pending=32), memory=memory)
        waits.append(first == Wait())
        (decision,), memory = looks(view(now + GRACE + 0.1, lagging, epoch=epoch, pending=32), memory=memory)
        assert decision == Step(("me",))
        memory = replace(memory, behind_since={})  # what a round that opens does (server.stepping._opens)
        now, epoch = now + GRACE + 1.0, epoch + 1
    assert waits == [True, True, False, False]
    (caught_up,), memory = looks(view(now, Replica("lag", epoch, 8), epoch=epoch, pending=8), memory=memory)
    assert "lag" not in memory.stragglers


def test_a_replica_loading_our_state_is_waited_for_though_it_kept_us_waiting_in_vain_before():
    """A replica frozen, then thawed, failed our round and looked behind for many steps: it is a suspect, and
    waited for no more as a straggler. Once it downloads our state, stepping on before it has loaded it
    would leave it behind again, for good where the stage steps faster than its state downloads: it is
    waited for, up to the grace from the download, and stepped with as soon as it shows at our epoch."""
    lagging = Replica("b", 2, 0)
    memory = suspect(PlanMemory(stragglers={"b": 5}), ["b"], until=100.0, epoch=2)
    (alone,), memory = looks(view(0.0, lagging, pending=32), memory=memory)
    assert alone == Step(("me",))
    handed = {"b": 10.0}
    (waiting, still), memory = looks(view(10.5, lagging, pending=32, handed=handed),
                                     view(10.0 + GRACE - 0.1, lagging, pending=32, handed=handed), memory=memory)
    assert waiting == still == Wait()
    (joined,), memory = looks(view(12.0, Replica("b", 3, 0), pending=32, handed=handed), memory=memory)
    assert joined == Step(("b", "me"))


def test_a_peer_that_downloads_our_state_and_never_joins_holds_the_stage_back_twice_then_no_more():
    memory, now, epoch = PlanMemory(), 0.0, 3
    waits = []
    for _ in range(4):
        taker = Replica("taker", epoch - 1, 0)
        handed = {"taker": now}
        (first,), memory = looks(view(now, taker, epoch=epoch, pending=32, handed=handed), memory=memory)
        waits.append(first == Wait())
        (decision,), memory = looks(view(now + 3 * GRACE, taker, epoch=epoch, pending=32, handed=handed),
                                    memory=memory)
        assert decision == Step(("me",))
        now, epoch = now + 3 * GRACE + 1.0, epoch + 1
    assert waits == [True, True, False, False]
    (caught_up,), memory = looks(view(now, Replica("taker", epoch, 8), epoch=epoch, pending=8), memory=memory)
    assert "taker" not in memory.vain_handoffs


def test_a_replica_loading_our_state_is_waited_for_though_its_record_lapsed():
    """Frozen long enough for its record to lapse, it took our state once thawed: it is waited for until its
    new record shows it at our epoch."""
    (waiting, joined), _ = looks(view(0.5, Replica("b", 3, 16), handed={"c": 0.0}),
                                 view(1.0, Replica("b", 3, 16), Replica("c", 3, 0), handed={"c": 0.0}))
    assert waiting == Wait()
    assert joined == Step(("b", "c", "me"))


def test_a_count_is_worth_telling_early_only_to_replicas_and_near_the_step() -> None:
    """Two replicas at 4 samples/s each accumulate 16 in two periods of 1 s: a count of 40 (with 8 seen
    at the other) is worth telling toward a step of 64, one of 30 is not yet; nor is any count to no one,
    and a replica with no rate measured yet tells only once the count it sees reaches the target."""
    assert worth_telling(40, 1, 8, 4.0, 1.0, 64)
    assert not worth_telling(30, 1, 8, 4.0, 1.0, 64)
    assert not worth_telling(63, 0, 0, 4.0, 1.0, 64)
    assert not worth_telling(50, 1, 10, 0.0, 1.0, 64) and worth_telling(54, 1, 10, 0.0, 1.0, 64)

