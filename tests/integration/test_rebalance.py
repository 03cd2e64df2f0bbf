"""Adaptive rebalancing in a real swarm: servers move to the stage that is the pipeline's bottleneck,
the swarm keeps training through the moves, and delivery stays exactly once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from swarm.ops.faults import FaultInjector
from swarm.ops.local import LocalSwarm, SwarmStatus
from swarm.ops.report import read_moves

from .helpers import assert_exactly_once, assert_replicas_in_step, finish, run_swarm, small_config

pytestmark = pytest.mark.integration


def rebalancing_config(run_dir: Path, *extra: str):
    """The small swarm with rebalancing on, looking often and settling fast enough for a test."""
    return small_config(
        run_dir, "rebalance.enabled=true", "rebalance.period=1.0", "rebalance.cooldown=8.0", "rebalance.jitter=1.0",
        "rebalance.min_gain=1.15", *extra,
    )


class LayoutWatch:
    """Records the layout (server names by stage) every time the launcher polls the DHT."""

    def __init__(self) -> None:
        self.history: list[tuple[float, dict[int, list[str]], int]] = []  # (time, members, min epoch)
        self.came_from: dict[str, int] = {}  # server name -> the stage it announced it moved from

    def __call__(self, status: SwarmStatus) -> None:
        self.came_from |= {r.name: r.previous_stage for rs in status.servers.values() for r in rs
                           if r.previous_stage >= 0}
        members = {k: list(v) for k, v in status.members.items()}
        if not self.history or self.history[-1][1] != members:
            self.history.append((time.monotonic(), members, status.min_epoch))

    def first(self, counts: tuple[int, ...]) -> tuple[float, dict[int, list[str]], int]:
        """The first poll at which the stages had these many servers."""
        return next(h for h in self.history if tuple(len(h[1][k]) for k in sorted(h[1])) == counts)


class FinishWhen:
    """Records the layout, and tells the trainers to finish once `shown(watch, status)` holds: the run
    has shown what the test looks for (its trainers' target is set far beyond it)."""

    def __init__(self, swarm: LocalSwarm, shown) -> None:
        self.swarm, self.shown = swarm, shown
        self.watch = LayoutWatch()
        self.finished = False

    def __call__(self, status: SwarmStatus) -> None:
        self.watch(status)
        if not self.finished and self.shown(self.watch, status):
            self.finished = True
            finish(self.swarm)


def final_members(watch: LayoutWatch) -> dict[int, list[str]]:
    """The layout while the trainers still ran (as they finish, servers leave)."""
    return watch.history[-1][1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_starved_swarm_moves_servers_until_no_stage_is_the_bottleneck(tmp_path):
    """Six equal servers started 4/1/1 over three stages: two of the crowded stage's servers move, one
    to each starved stage, and the swarm trains on at 2/2/2 with nothing lost or doubled."""
    cfg = rebalancing_config(
        tmp_path, "model.num_stages=3", "model.n_layers=3", "local.layout=[4,1,1]", "trainer.target_steps=1000"
    )
    swarm = LocalSwarm(cfg)

    def trained_on_once_balanced(watch: LayoutWatch, status: SwarmStatus) -> bool:
        balanced = [h for h in watch.history if [len(h[1][k]) for k in sorted(h[1])] == [2, 2, 2]]
        return bool(balanced) and status.min_epoch >= balanced[0][2] + 10

    finishing = FinishWhen(swarm, trained_on_once_balanced)
    watch = finishing.watch
    started = time.monotonic()
    summary = run_swarm(swarm, finishing)

    made = read_moves(tmp_path)
    assert [(m["source"], m["name"].startswith("server-s0-")) for m in made] == [(0, True), (0, True)], made
    assert sorted(m["target"] for m in made) == [1, 2]
    assert watch.came_from == {m["name"]: 0 for m in made}  # what `swarm monitor` lists moves from
    balanced_at, members, epoch = watch.first((2, 2, 2))
    assert balanced_at - started < 120, watch.history
    assert summary["stages"]["0"]["steps"] >= epoch + 10  # it kept training once balanced
    assert all(m["held_samples"] == 0 for m in made)  # each mover's gradients went into a step first
    assert_exactly_once(summary)
    assert_replicas_in_step(summary, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_servers_come_to_a_stage_that_lost_all_but_one(tmp_path):
    """Once the layout has settled, every server of stage 1 but one is killed: a server of stage 0
    moves to stage 1, and training goes on with nothing lost or doubled."""
    cfg = rebalancing_config(tmp_path, "local.layout=[3,3]", "optim.target_batch_size=48",
                             "trainer.target_steps=1000")
    swarm = LocalSwarm(cfg)
    faults = FaultInjector(tmp_path)
    moved_at: list[int] = []  # the swarm's epoch when the first move after the kill was seen

    def kill_then_wait_for_a_newcomer(watch: LayoutWatch, status: SwarmStatus) -> bool:
        settled = time.monotonic() - watch.history[-1][0] > cfg.rebalance.cooldown + 2
        if not faults.events and settled and status.min_epoch >= 5:
            for victim in swarm.serving(status, 1)[:-1]:
                faults.kill(victim)
        if faults.events and not moved_at and any(m["time"] > faults.events[0].time for m in read_moves(tmp_path)):
            moved_at.append(status.min_epoch)
        # finished once the stage has a second server again and the swarm stepped on with it
        return bool(moved_at) and len(status.members.get(1, [])) >= 2 and status.min_epoch >= moved_at[0] + 3

    finishing = FinishWhen(swarm, kill_then_wait_for_a_newcomer)
    watch = finishing.watch
    summary = run_swarm(swarm, finishing)

    killed_at = faults.events[0].time
    after = [m for m in read_moves(tmp_path) if m["time"] > killed_at]
    assert faults.events and after, (faults.events, watch.history)
    assert (after[0]["source"], after[0]["target"]) == (0, 1)
    assert after[0]["time"] - killed_at < 60
    assert len(final_members(watch)[1]) >= 2
    assert_exactly_once(summary)
    assert_replicas_in_step(summary, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_unequal_servers_balance_capacity_not_counts(tmp_path):
    """Stage 0 holds a fast server and a slow one (it idles 11 times its compute's CPU time: 3-5 times
    slower on this shared host, where waiting for the CPU is most of a call's time), stage 1 two slow
    ones. Stage 1 is the bottleneck; the fast server leaving would make stage 0 one, so the slow one
    moves: one fast server ends up matching three slow ones (1/3), which a count-balancing rule would
    never do."""
    cfg = rebalancing_config(
        tmp_path, "local.layout=[2,2]", "local.slowdowns=[1,12,12,12]", "optim.target_batch_size=48",
        "trainer.target_steps=1000",
    )
    swarm = LocalSwarm(cfg)
    expected = {0: ["server-s0-1"], 1: ["server-s0-2", "server-s1-3", "server-s1-4"]}

    def trained_on_at_one_to_three(watch: LayoutWatch, status: SwarmStatus) -> bool:
        there = [h for h in watch.history if h[1] == expected]
        return bool(there) and status.min_epoch >= there[0][2] + 3

    finishing = FinishWhen(swarm, trained_on_at_one_to_three)
    watch = finishing.watch
    summary = run_swarm(swarm, finishing)

    made = read_moves(tmp_path)
    assert [(m["name"], m["source"], m["target"]) for m in made] == [("server-s0-2", 0, 1)], made
    assert final_members(watch) == expected
    assert_exactly_once(summary)
    assert_replicas_in_step(summary, tmp_path)
