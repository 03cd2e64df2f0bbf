"""Bans, rate and latency estimates, backoff, layer partitioning, warm-up and stepping decisions."""

from __future__ import annotations

import random

import pytest

from swarm.core.bans import BanList
from swarm.core.partition import split_layers
from swarm.core.retry import backoff_delay
from swarm.core.schedule import warmup_lr
from swarm.core.stepping import expected_group, stage_ready
from swarm.core.throughput import LatencyTracker, RateMeter, StageRate


def test_ban_doubles_until_cap_and_forgive_resets():
    bans = BanList(base_seconds=1.0, max_seconds=5.0)
    now = 0.0
    durations = []
    for _ in range(5):
        durations.append(bans.ban("p", now))
        assert bans.is_banned("p", now)
        now += durations[-1]
        assert not bans.is_banned("p", now)
    assert durations == [1.0, 2.0, 4.0, 5.0, 5.0]
    bans.forgive("p")
    assert bans.ban("p", now) == 1.0


def test_ban_state_queries():
    bans = BanList(base_seconds=10.0, max_seconds=100.0)
    assert not bans.is_banned("p", 0.0)
    assert bans.remaining("p", 0.0) == 0.0
    bans.ban("p", 0.0)
    bans.ban("q", 5.0)
    assert bans.remaining("p", 4.0) == 6.0
    assert bans.banned(4.0) == {"p", "q"}
    assert bans.banned(12.0) == {"q"}
    assert bans.banned(15.0) == set()
    assert bans.remaining("p", 20.0) == 0.0


def test_failures_during_a_ban_are_one_outage():
    bans = BanList(base_seconds=1.0, max_seconds=60.0)
    bans.ban("p", 0.0)
    assert bans.ban("p", 0.5) == 0.5  # a concurrent request failing too does not extend the ban
    assert bans.ban("p", 1.0) == 2.0


def test_a_shorter_first_ban_stands_for_the_base_and_doubles_the_same_way():
    """A call that timed out after 3 s bans its server for 3 s, not the 15 s base; if it keeps failing, the
    ban doubles from there; never longer than the base would give."""
    bans = BanList(base_seconds=15.0, max_seconds=60.0)
    assert bans.ban("p", 0.0, base=3.0) == 3.0
    assert bans.ban("p", 3.0, base=3.0) == 6.0
    assert bans.ban("q", 0.0, base=40.0) == 15.0


def test_a_ban_for_slowness_alone_is_told_apart_until_another_failure_joins_it():
    bans = BanList(base_seconds=10.0, max_seconds=100.0)
    bans.ban("p", 0.0, slow=True)
    bans.ban("p", 1.0, slow=True)
    assert bans.only_slow("p", 2.0) and bans.is_banned("p", 2.0)
    assert not bans.only_slow("p", 11.0)  # the ban is over: nothing to tell apart
    bans.ban("p", 3.0)  # a broken connection during the ban: no longer slow alone
    assert bans.is_banned("p", 4.0) and not bans.only_slow("p", 4.0)
    bans.ban("q", 0.0)
    bans.ban("q", 1.0, slow=True)  # slowness after a failure does not clear it
    assert not bans.only_slow("q", 2.0)
    bans.ban("q", 100.0, slow=True)  # a new ban, slow from its start
    assert bans.only_slow("q", 101.0)


def test_forgive_keeps_running_ban():
    bans = BanList(base_seconds=4.0, max_seconds=60.0)
    bans.ban("p", 0.0)
    bans.forgive("p")
    assert bans.is_banned("p", 1.0)
    assert not bans.is_banned("p", 4.0)


def test_ban_survives_many_failures_and_rejects_bad_limits():
    bans = BanList(base_seconds=1.0, max_seconds=3.0)
    now = 0.0
    for _ in range(2000):
        now += bans.ban("p", now)
    assert bans.remaining("p", now - 1.0) == 1.0
    with pytest.raises(ValueError):
        BanList(base_seconds=5.0, max_seconds=1.0)
    with pytest.raises(ValueError):
        BanList(base_seconds=-1.0, max_seconds=1.0)


def test_rate_meter_converges_to_constant_rate():
    meter = RateMeter(alpha=0.2)
    assert meter.rate == 0.0
    meter.update(10, 1.0)  # a slow start
    rng = random.Random(0)
    for _ in range(200):
        seconds = rng.uniform(0.05, 0.5)
        meter.update(round(100 * seconds), seconds)
    assert meter.rate == pytest.approx(100.0, rel=0.05)


def test_rate_meter_first_observation_and_zero_duration():
    meter = RateMeter()
    meter.update(5, 0.0)
    assert meter.rate == 0.0
    meter.update(50, 1.0)
    assert meter.rate > 0
    with pytest.raises(ValueError):
        meter.update(-1, 1.0)
    with pytest.raises(ValueError):
        RateMeter(alpha=0.0)


def test_latency_timeout_is_ceiling_before_any_observation():
    assert LatencyTracker().timeout(floor=0.5, ceiling=30.0) == 30.0


def test_latency_timeout_within_bounds_and_grows_with_jitter():
    steady, jittery = LatencyTracker(), LatencyTracker()
    rng = random.Random(0)
    for _ in range(200):
        steady.observe(1.0)
        jittery.observe(rng.uniform(0.2, 1.8))
    assert steady.timeout(0.0, 100.0) == pytest.approx(1.0, abs=0.01)
    assert jittery.timeout(0.0, 100.0) > steady.timeout(0.0, 100.0) + 0.5
    assert steady.timeout(floor=2.0, ceiling=10.0) == 2.0
    assert jittery.timeout(floor=0.0, ceiling=1.5) == 1.5
    with pytest.raises(ValueError):
        steady.timeout(floor=2.0, ceiling=1.0)


def test_backoff_bounded_non_negative_and_jittered():
    rng = random.Random(0)
    for attempt in range(0, 3000, 7):
        delays = [backoff_delay(attempt, base=0.5, cap=10.0, rng=rng) for _ in range(20)]
        assert all(0.0 <= d <= min(10.0, 0.5 * 2 ** min(attempt, 10)) for d in delays)
        assert len(set(delays)) > 1
    first = [backoff_delay(0, base=0.5, cap=10.0, rng=rng) for _ in range(1000)]
    assert max(first) <= 0.5
    late = [backoff_delay(20, base=0.5, cap=10.0, rng=rng) for _ in range(1000)]
    assert max(late) > 5.0
    with pytest.raises(ValueError):
        backoff_delay(-1, base=0.5, cap=10.0, rng=rng)


@pytest.mark.parametrize("n_layers", range(1, 25))
def test_split_layers_covers_exactly(n_layers):
    for num_stages in range(1, n_layers + 1):
        parts = split_layers(n_layers, num_stages)
        assert len(parts) == num_stages
        assert [i for part in parts for i in part] == list(range(n_layers))
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)


def test_split_layers_examples_and_errors():
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    for bad in (0, -1, 8):
        with pytest.raises(ValueError):
            split_layers(7, bad)


def test_warmup_lr():
    assert [warmup_lr(s, 1.0, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_lr(0, 3e-3, 0) == 3e-3
    assert warmup_lr(1000, 3e-3, 5) == 3e-3
    with pytest.raises(ValueError):
        warmup_lr(-1, 1.0, 4)


def test_stage_ready():
    assert not stage_ready(0, {}, 32)
    assert stage_ready(32, {}, 32)
    assert not stage_ready(8, {"b": 8, "c": 8}, 32)
    assert stage_ready(8, {"b": 8, "c": 16}, 32)


def test_expected_group():
    assert expected_group("b", ["c", "a", "c"]) == ("a", "b", "c")
    assert expected_group("b", ["b"]) == ("b",)
    assert expected_group("z", iter(["y"])) == ("y", "z")


def test_stage_rate_combines_passes_and_waits_for_all_of_them() -> None:
    """A stage doing forwards at 20 samples/s and backwards at 5 samples/s does 4 samples/s of work;
    while only forwards have run (a pipeline filling up), it is unmeasured rather than near zero."""
    rate = StageRate(("forward", "backward"), alpha=0.5)
    rate.update({"forward": (20, 1.0)})
    assert rate.rate == 0.0
    rate.update({"forward": (20, 1.0), "backward": (5, 1.0)})
    assert rate.rate == pytest.approx(4.0)
    one_call = StageRate(("forward",), alpha=0.5)
    one_call.update({"forward": (8, 2.0)})
    assert one_call.rate == pytest.approx(4.0)


def test_stage_rate_leaves_out_the_first_windows() -> None:
    rate = StageRate(("forward",), alpha=1.0, skip=2)
    rate.update({"forward": (1, 10.0)})  # first calls: slow
    rate.update({"forward": (4, 2.0)})
    assert rate.rate == 0.0
    rate.update({"forward": (10, 1.0)})
    assert rate.rate == pytest.approx(10.0)
    with pytest.raises(ValueError):
        rate.update({"backward": (1, 1.0)})
