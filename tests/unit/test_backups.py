"""Who holds each stage's copy, when copies refresh, and what a server entering an orphaned stage does."""

from __future__ import annotations

from swarm.core.backups import holders_of, may_drop, needs_refresh, plan_entry, stages_to_hold, stragglers

LAYOUT = {0: ["a0", "b0"], 1: ["a1", "b1"], 2: ["a2"]}


def test_holders_come_from_other_stages_and_every_stage_gets_them() -> None:
    for stage in LAYOUT:
        holders = holders_of(stage, LAYOUT, 2)
        assert len(holders) == 2 and not set(holders) & set(LAYOUT[stage])
    held = [stages_to_hold(p, LAYOUT, 2) for peers in LAYOUT.values() for p in peers]
    assert sum(len(h) for h in held) == 2 * len(LAYOUT)  # each stage held exactly twice


def test_a_peer_leaving_moves_only_the_copies_it_held() -> None:
    before = {stage: holders_of(stage, LAYOUT, 1) for stage in LAYOUT}
    gone = before[0][0]
    after_layout = {k: [p for p in peers if p != gone] for k, peers in LAYOUT.items()}
    after = {stage: holders_of(stage, after_layout, 1) for stage in LAYOUT}
    assert after[0] != before[0]
    assert all(after[s] == before[s] for s in LAYOUT if before[s] != [gone])


def test_the_copies_of_a_stage_whose_replicas_died_stay_where_they_were() -> None:
    holders = holders_of(1, LAYOUT, 1)
    assert holders_of(1, {0: LAYOUT[0], 1: [], 2: LAYOUT[2]}, 1) == holders


def test_a_straggler_holds_copies_only_where_no_other_server_can() -> None:
    """A copy costs a server the same bytes whatever its speed: a slow one pays the longest, while its
    stage's rounds wait on it."""
    rates = {0: {"a0": 30.0, "b0": 10.0}, 1: {"a1": 12.0, "b1": 9.0}, 2: {"a2": 0.0}}
    slow = stragglers(rates)
    assert slow == {"b0"}  # a third of its stage's fastest; b1 is not, and a stage of one has no yardstick
    for stage in LAYOUT:
        assert "b0" not in holders_of(stage, LAYOUT, 2, slow)
    assert holders_of(1, {0: ["b0"], 1: ["a1"]}, 1, slow) == ["b0"]  # the only candidate still holds
    held = [stages_to_hold(p, LAYOUT, 2, slow) for peers in LAYOUT.values() for p in peers]
    assert sum(len(h) for h in held) == 2 * len(LAYOUT)


def test_a_copy_refreshes_every_few_steps_once_the_stage_has_stepped() -> None:
    assert not needs_refresh(None, 0, 5)
    assert needs_refresh(None, 1, 5)
    assert not needs_refresh(10, 14, 5) and needs_refresh(10, 15, 5)


def test_the_last_copy_of_a_dead_stage_is_never_dropped() -> None:
    assert not may_drop(12, wanted=False, replica_epochs=[])
    assert not may_drop(12, wanted=False, replica_epochs=[11])
    assert may_drop(12, wanted=False, replica_epochs=[12])
    assert not may_drop(12, wanted=True, replica_epochs=[30])


def test_entry_takes_the_newest_state_reachable() -> None:
    entry = plan_entry(0, [("h1", 20, 23), ("h2", 15, 25)], progressed=True, fresh_allowed=False)
    assert (entry.action, entry.source, entry.epoch, entry.lost) == ("restore", "h1", 20, 5)
    entry = plan_entry(22, [("h1", 20, 23)], progressed=True, fresh_allowed=False)
    assert (entry.action, entry.epoch, entry.lost) == ("resume", 22, 1)


def test_initial_weights_are_served_mid_run_only_at_the_operators_word() -> None:
    assert plan_entry(0, [], progressed=False, fresh_allowed=False).action == "fresh"
    assert plan_entry(0, [], progressed=True, fresh_allowed=False).action == "wait"
    assert plan_entry(0, [], progressed=True, fresh_allowed=True).action == "fresh"
    # a copy beats a fresh start even where one is allowed
    assert plan_entry(0, [("h", 4, 4)], progressed=True, fresh_allowed=True).action == "restore"


def test_a_stage_once_seen_past_its_start_is_waited_for_whatever_the_other_stages_show() -> None:
    """A server that came as the stage's last replica died saw it at epoch 6; once the dead one's record
    lapsed, a read under that churn found no other stage stepped. The run has still progressed."""
    entry = plan_entry(0, [], progressed=False, fresh_allowed=False, stage_seen=6)
    assert (entry.action, entry.lost) == ("wait", 6)
    entry = plan_entry(0, [], progressed=False, fresh_allowed=True, stage_seen=6)
    assert (entry.action, entry.lost) == ("fresh", 6)
    assert plan_entry(0, [("h", 4, 5)], progressed=False, fresh_allowed=False, stage_seen=6).lost == 2
