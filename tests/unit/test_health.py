"""The verdict `swarm status` prints: what stops or slows a swarm, most urgent first."""

from __future__ import annotations

import pytest

from swarm.core.health import ServerFigures, diagnose, stage_capacity


def s(label: str, rate: float, epoch: int = 3, moving: bool = False) -> ServerFigures:
    return ServerFigures(label, rate, epoch, moving)


def test_a_stage_with_no_server_comes_first() -> None:
    d = diagnose({0: [s("a", 10.0)], 1: []}, active_trainers=2)
    assert d.findings == ("stage 1 has no server",)
    assert d.bottleneck is None


def test_a_stage_whose_only_server_is_moving_has_no_server() -> None:
    d = diagnose({0: [s("a", 10.0), s("b", 10.0)], 1: [s("c", 10.0, moving=True)]}, active_trainers=1)
    assert d.text == "stage 1 has no server (c moving away)"
    assert d.capacity == {0: 20.0, 1: 0.0}


def test_the_slowest_stage_is_the_bottleneck_when_the_gap_is_clear() -> None:
    stages = {0: [s("a", 20.0), s("b", 10.1)], 1: [s("c", 12.3)], 2: [s("d", 40.0)]}
    d = diagnose(stages, active_trainers=1)
    assert d.text == "stage 1 is the bottleneck (12.3 samples/s, next 30.1)"
    assert d.bottleneck == 1


def test_close_stages_are_balanced() -> None:
    d = diagnose({0: [s("a", 10.0)], 1: [s("b", 11.0)], 2: [s("c", 11.9)]}, active_trainers=1)
    assert d.text == "balanced (10.0-11.9 samples/s per stage)"
    assert d.bottleneck is None


def test_the_factor_sets_what_counts_as_a_bottleneck() -> None:
    stages = {0: [s("a", 10.0)], 1: [s("b", 11.0)]}
    assert diagnose(stages, 1, factor=1.05).bottleneck == 0
    with pytest.raises(ValueError):
        diagnose(stages, 1, factor=0.5)


def test_unmeasured_stages_are_named_rather_than_judged() -> None:
    d = diagnose({0: [s("a", 0.0)], 1: [s("b", 5.0)], 2: [s("c", 0.0)]}, active_trainers=1)
    assert d.text == "stages 0, 2 not measured yet"


def test_no_trainers_and_finished_trainers() -> None:
    stages = {0: [s("a", 10.0)], 1: [s("b", 10.0)]}
    assert diagnose(stages, active_trainers=0).findings == ("no trainers", "balanced (10.0-10.0 samples/s per stage)")
    assert diagnose(stages, active_trainers=0, finished_trainers=2).findings[0] == "no trainers (2 done)"


def test_moving_servers_and_split_epochs_are_reported() -> None:
    stages = {0: [s("a", 10.0, epoch=4), s("b", 10.0, epoch=3, moving=True)], 1: [s("c", 10.0, epoch=4)]}
    d = diagnose(stages, active_trainers=1)
    assert d.findings == (
        "b is moving away from stage 0",
        "stage 0 replicas at epochs 3, 4",
        "balanced (10.0-10.0 samples/s per stage)",
    )


def test_urgent_findings_come_first() -> None:
    d = diagnose({0: [s("a", 10.0, 1), s("b", 10.0, 2)], 1: []}, active_trainers=0)
    assert d.findings == ("stage 1 has no server", "no trainers", "stage 0 replicas at epochs 1, 2")


def test_a_single_stage_and_an_empty_swarm() -> None:
    assert diagnose({0: [s("a", 7.0)]}, 1).text == "one stage, 7.0 samples/s"
    assert diagnose({}, 0).text == "no servers found; no trainers"


def test_stage_capacity_leaves_out_servers_moving_away() -> None:
    assert stage_capacity([s("a", 3.0), s("b", 4.0, moving=True)]) == 3.0
