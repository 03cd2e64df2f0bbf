"""Stochastic wiring: shares follow throughput, bans and load are respected, WRR is exact."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from swarm.core.bans import BanList
from swarm.core.routing import (
    Candidate,
    SmoothWeightedRoundRobin,
    choose_server,
    routing_weight,
    throughput_cap,
    unmeasured_throughput,
)

PICKS = 20_000


def _shares(candidates, picks=PICKS, seed=0, banned=()):
    rng = random.Random(seed)
    counts = Counter(choose_server(candidates, rng, banned) for _ in range(picks))
    return {peer: n / picks for peer, n in counts.items()}


def test_shares_proportional_to_throughput():
    candidates = [Candidate(f"s{t}", float(t)) for t in (1, 2, 3, 4)]
    shares = _shares(candidates)
    for c in candidates:
        assert shares[c.peer_id] == pytest.approx(c.throughput / 10, abs=0.02), shares


def test_same_seed_same_picks():
    candidates = [Candidate("a", 1.0), Candidate("b", 3.0)]
    picks = [[choose_server(candidates, random.Random(7)) for _ in range(5)] for _ in range(2)]
    assert picks[0] == picks[1]


def test_banned_never_picked_and_returns_after_expiry():
    candidates = [Candidate("a", 1.0), Candidate("b", 1.0), Candidate("c", 1.0)]
    bans = BanList(base_seconds=10.0, max_seconds=60.0)
    rng = random.Random(1)
    bans.ban("b", now=100.0)
    during = {choose_server(candidates, rng, bans.banned(now)) for now in range(100, 110) for _ in range(200)}
    assert during == {"a", "c"}
    after = {choose_server(candidates, rng, bans.banned(110.0)) for _ in range(500)}
    assert after == {"a", "b", "c"}


def test_all_banned_or_empty_gives_none():
    candidates = [Candidate("a", 1.0), Candidate("b", 2.0)]
    assert choose_server(candidates, random.Random(0), banned={"a", "b"}) is None
    assert choose_server([], random.Random(0)) is None
    assert SmoothWeightedRoundRobin().pick(candidates, banned={"a", "b"}) is None


@pytest.mark.parametrize("load", [{"queue": 3}, {"inflight": 3}])
def test_load_lowers_share(load):
    idle = _shares([Candidate("a", 1.0), Candidate("b", 1.0)])
    loaded = _shares([Candidate("a", 1.0, **load), Candidate("b", 1.0)])
    assert loaded["a"] < idle["a"] - 0.2
    # 1 / (1 + 3) of b's weight: a gets 1/5 of the picks.
    assert loaded["a"] == pytest.approx(0.2, abs=0.02)


def test_newcomer_without_throughput_is_measured():
    candidates = [Candidate("old1", 2.0), Candidate("old2", 4.0), Candidate("new", 0.0)]
    assert unmeasured_throughput(candidates) == 3.0
    shares = _shares(candidates)
    assert shares["new"] == pytest.approx(3.0 / 9.0, abs=0.02)


def test_weights_stay_positive_for_bogus_announcements():
    assert unmeasured_throughput([Candidate("x", 0.0)]) == 1.0
    for bogus in (0.0, -5.0, float("nan"), float("inf")):
        assert routing_weight(Candidate("x", bogus), unmeasured=2.0) == 2.0
    assert routing_weight(Candidate("x", 0.0), unmeasured=0.0) > 0
    assert choose_server([Candidate("x", 0.0), Candidate("y", float("nan"))], random.Random(0)) in {"x", "y"}


def test_wrr_exact_proportions_over_one_cycle():
    candidates = [Candidate(f"s{t}", float(t)) for t in (1, 2, 3, 4)]
    wrr = SmoothWeightedRoundRobin()
    for _ in range(3):
        cycle = [wrr.pick(candidates) for _ in range(10)]
        assert Counter(cycle) == {"s1": 1, "s2": 2, "s3": 3, "s4": 4}


def test_wrr_interleaves_instead_of_bursting():
    wrr = SmoothWeightedRoundRobin()
    picks = [wrr.pick([Candidate("a", 5.0), Candidate("b", 1.0), Candidate("c", 1.0)]) for _ in range(7)]
    assert picks == ["a", "a", "b", "a", "c", "a", "a"]


def test_wrr_survives_candidate_set_change():
    wrr = SmoothWeightedRoundRobin()
    first = [Candidate("a", 1.0), Candidate("b", 2.0), Candidate("c", 3.0)]
    for _ in range(4):
        wrr.pick(first)
    second = [Candidate("b", 2.0), Candidate("c", 3.0), Candidate("d", 5.0)]
    picks = Counter(wrr.pick(second) for _ in range(100))
    assert set(picks) == {"b", "c", "d"}
    for c in second:
        assert abs(picks[c.peer_id] - 100 * c.throughput / 10) <= 2, picks
    assert wrr.pick(second, banned={"b", "c", "d"}) is None
    assert wrr.pick([Candidate("b", 1.0), Candidate("e", 1.0)]) in {"b", "e"}


def test_a_huge_announced_throughput_buys_a_bounded_share() -> None:
    """A peer announcing 10^9 samples/s beside an honest server at 20 is credited with 4 x 20 at most: it
    gets ~80% of the picks, not all of them (and failing calls get it banned besides)."""
    rng = random.Random(0)
    candidates = [Candidate("honest", 20.0), Candidate("liar", 1e9)]
    assert throughput_cap(candidates) == 80.0
    picks = [choose_server(candidates, rng) for _ in range(4000)]
    assert 0.75 < picks.count("liar") / len(picks) < 0.85
    assert throughput_cap([Candidate("alone", 1e9)]) == math.inf  # nothing to compare with
