"""A newcomer's clock and reachability verdicts, from the greetings it exchanged (pure, fake clocks)."""

from __future__ import annotations

import pytest

from swarm.core.joining import ClockSample, judge_clock, judge_reachability


def sample(offset: float, now: float = 1000.0, rtt: float = 0.02) -> ClockSample:
    """A greeting to a peer whose clock is `offset` seconds ahead of ours."""
    return ClockSample(now, now + rtt / 2 + offset, now + rtt)


def test_offset_is_measured_against_the_round_trip_midpoint():
    s = sample(1.5, rtt=0.4)
    assert s.offset == pytest.approx(1.5)
    assert s.uncertainty == pytest.approx(0.2)


@pytest.mark.parametrize(("offsets", "verdict"), [
    ([0.01, -0.02, 0.0], "ok"),
    ([0.9, 1.0, 1.1], "warn"),
    ([-1.0], "warn"),
    ([5.0, 5.2, 4.9], "refuse"),
    ([-3.0], "refuse"),
])
def test_clock_verdicts(offsets, verdict):
    assert judge_clock([sample(o) for o in offsets], max_offset=2.0).verdict == verdict


def test_one_peer_with_a_wrong_clock_does_not_condemn_the_newcomer():
    check = judge_clock([sample(0.0), sample(0.05), sample(30.0)], max_offset=2.0)
    assert check.verdict == "ok" and check.offset == pytest.approx(0.05)


def test_a_slow_round_trip_is_given_the_benefit_of_the_doubt():
    """2.3 s measured over a 1 s round trip may be 1.8 s: not refused."""
    assert judge_clock([sample(2.3, rtt=1.0)], max_offset=2.0).verdict == "warn"


def test_the_message_says_which_way_and_how_far():
    assert "3.00s" in judge_clock([sample(3.0)], 2.0).describe()
    assert "behind" in judge_clock([sample(3.0)], 2.0).describe()
    assert "ahead of" in judge_clock([sample(-3.0)], 2.0).describe()
    assert judge_clock([], 2.0).verdict == "unknown"


def test_reachability_needs_one_peer_that_got_through():
    assert judge_reachability([False, True]) is True
    assert judge_reachability([False, False]) is False
    assert judge_reachability([]) is None
