"""Stochastic wiring: shares follow throughput, bans and load are respected, WRR is exact; newcomers count
as a typical server until they answer, and servers measured slow lose share."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest

from swarm.core.bans import BanList
from swarm.core.routing import (
    MAX_LATENCY_RATIO,
    Candidate,
    ServerLatencies,
    SmoothWeightedRoundRobin,
    Yardsticks,
    choose_server,
    routing_weight,
    throughput_cap,
    typical_throughput,
    unmeasured_throughput,
)

PICKS = 20_000


def _answered(peer: str, throughput: float, latency: float = 1.0, **load: int) -> Candidate:
    """A server that has answered the caller (so its announcement counts in full, up to the cap)."""
    return Candidate(peer, throughput, latency=latency, **load)


def _shares(candidates, picks=PICKS, seed=0, banned=()):
    rng = random.Random(seed)
    counts = Counter(choose_server(candidates, rng, banned) for _ in range(picks))
    return {peer: n / picks for peer, n in counts.items()}


def test_shares_proportional_to_throughput():
    candidates = [_answered(f"s{t}", float(t)) for t in (1, 2, 3, 4)]
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


def test_load_counts_in_time_so_that_a_slow_server_holds_no_more_than_its_share():
    """A request queued at a server three times slower than another is worth three of the other's.
    Holding work worth the same time, the two draw in proportion to their throughput; holding the same
    number of requests (what counting requests settles at), the slow one draws less than that."""
    fast, slow = _answered("fast", 3.0), _answered("slow", 1.0)
    same_time = _shares([replace(fast, inflight=3), replace(slow, inflight=1)])
    assert same_time["slow"] == pytest.approx(1 / 4, abs=0.02)
    same_count = _shares([replace(fast, inflight=2), replace(slow, queue=2)])
    assert same_count["slow"] == pytest.approx((1 / 3) / (1 / 3 + 3 / (1 + 2 / 3)), abs=0.02)  # not 1/4


def test_newcomer_without_throughput_is_measured():
    """It counts as the median server (3), at most the lower median (2) until it has answered."""
    candidates = [_answered("old1", 2.0), _answered("old2", 4.0), Candidate("new", 0.0)]
    assert unmeasured_throughput(candidates) == 3.0
    assert _shares(candidates)["new"] == pytest.approx(2.0 / 8.0, abs=0.02)
    candidates[2] = _answered("new", 0.0)
    assert _shares(candidates)["new"] == pytest.approx(3.0 / 9.0, abs=0.02)


def test_weights_stay_positive_for_bogus_announcements():
    assert unmeasured_throughput([Candidate("x", 0.0)]) == 1.0
    for bogus in (0.0, -5.0, float("nan"), float("inf")):
        assert routing_weight(Candidate("x", bogus), Yardsticks(unannounced=2.0)) == 2.0
    assert routing_weight(Candidate("x", 0.0), Yardsticks(unannounced=0.0)) > 0
    assert routing_weight(_answered("x", 1.0, latency=float("nan")), Yardsticks(latency=1.0)) == 1.0
    assert choose_server([Candidate("x", 0.0), Candidate("y", float("nan"))], random.Random(0)) in {"x", "y"}


def test_wrr_exact_proportions_over_one_cycle():
    candidates = [_answered(f"s{t}", float(t)) for t in (1, 2, 3, 4)]
    wrr = SmoothWeightedRoundRobin()
    for _ in range(3):
        cycle = [wrr.pick(candidates) for _ in range(10)]
        assert Counter(cycle) == {"s1": 1, "s2": 2, "s3": 3, "s4": 4}


def test_wrr_interleaves_instead_of_bursting():
    wrr = SmoothWeightedRoundRobin()
    picks = [wrr.pick([_answered("a", 5.0), _answered("b", 1.0), _answered("c", 1.0)]) for _ in range(7)]
    assert picks == ["a", "a", "b", "a", "c", "a", "a"]


def test_wrr_survives_candidate_set_change():
    wrr = SmoothWeightedRoundRobin()
    first = [_answered("a", 1.0), _answered("b", 2.0), _answered("c", 3.0)]
    for _ in range(4):
        wrr.pick(first)
    second = [_answered("b", 2.0), _answered("c", 3.0), _answered("d", 5.0)]
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
    candidates = [_answered("honest", 20.0), _answered("liar", 1e9)]
    assert throughput_cap(candidates) == 80.0
    picks = [choose_server(candidates, rng) for _ in range(4000)]
    assert 0.75 < picks.count("liar") / len(picks) < 0.85
    assert throughput_cap([Candidate("alone", 1e9)]) == math.inf  # nothing to compare with


def _counts(candidates, seed: int) -> Counter:
    rng = random.Random(seed)
    return Counter(choose_server(candidates, rng) for _ in range(PICKS))


def _close(a: int, b: int) -> bool:
    """Whether two pick counts of one multinomial draw differ by no more than chance allows: the variance of
    their difference is at most their sum, so 4 standard deviations (a false alarm about once in 16,000)."""
    return abs(a - b) <= 4 * math.sqrt(a + b)


def test_a_newcomer_announcing_1000x_counts_as_the_median_server_until_it_answers() -> None:
    honest = [_answered("s10", 10.0), _answered("s20", 20.0), _answered("s30", 30.0)]
    newcomer = Candidate("new", 20_000.0)
    counts = _counts([*honest, newcomer], seed=3)
    assert _close(counts["new"], counts["s20"]), counts
    assert _close(counts["new"], PICKS // 4), counts  # weights 10, 20, 30 and 20: a quarter of the picks
    wrr = SmoothWeightedRoundRobin()
    cycle = Counter(wrr.pick([*honest, newcomer]) for _ in range(80))  # weights sum to 80
    assert cycle["new"] == cycle["s20"] == 20
    # once it has answered, the usual cap applies: 4 x the lower median, 80 of 140
    counts = _counts([*honest, _answered("new", 20_000.0)], seed=4)
    assert _close(counts["new"], PICKS * 80 // 140), counts


def test_unanswered_identities_cannot_raise_the_yardstick() -> None:
    """Fifty fresh identities announcing 10^9 beside three answered servers at 20: together they are
    credited with 20, as one honest server is, and a lone answered liar cannot raise the figure for an
    untried honest peer."""
    honest = [_answered(f"h{i}", 20.0) for i in range(3)]
    sybils = [Candidate(f"x{i}", 1e9) for i in range(50)]
    assert typical_throughput([*honest, *sybils]) == 20.0
    wrr = SmoothWeightedRoundRobin()
    picks = Counter(wrr.pick([*honest, *sybils]) for _ in range(400))
    assert all(abs(picks[f"h{i}"] - 100) <= 1 for i in range(3)), picks
    assert abs(sum(picks[f"x{i}"] for i in range(50)) - 100) <= 3, picks
    liar_first = [_answered("liar", 1e9), Candidate("honest", 20.0)]
    assert typical_throughput(liar_first) == 20.0
    wrr = SmoothWeightedRoundRobin()
    assert Counter(wrr.pick(liar_first) for _ in range(100)) == {"liar": 80, "honest": 20}


@pytest.mark.parametrize("latencies", [(1.0, 1.0, 1.0, 1.0), (0.5, 0.5, 0.5, 0.5), (1.0, 1.0, 1.0, 0.9)])
def test_honest_equal_servers_keep_equal_shares(latencies) -> None:
    """Equal latencies change nothing; a server measured faster than the median is not rewarded for it
    (only announcements credit a server, latency only discounts)."""
    candidates = [_answered(f"s{i}", 10.0, latency) for i, latency in enumerate(latencies)]
    counts = _counts(candidates, seed=5)
    assert all(_close(counts[c.peer_id], PICKS // 4) for c in candidates), counts
    wrr = SmoothWeightedRoundRobin()
    assert Counter(wrr.pick(candidates) for _ in range(40)) == {c.peer_id: 10 for c in candidates}


def test_a_server_measured_10x_slower_loses_most_of_its_share() -> None:
    candidates = [_answered("a", 10.0), _answered("b", 10.0), _answered("c", 10.0), _answered("slow", 10.0, 10.0)]
    counts = _counts(candidates, seed=6)
    assert _close(counts["slow"], PICKS // 31), counts  # weight 10 / 10 against 3 x 10
    assert counts["slow"] < PICKS / 25  # from a quarter of the picks
    wrr = SmoothWeightedRoundRobin()
    assert Counter(wrr.pick(candidates) for _ in range(31)) == {"a": 10, "b": 10, "c": 10, "slow": 1}
    # with two servers the lower median is the faster one's: the slow one cannot pull the yardstick up
    assert routing_weight(_answered("slow", 10.0, 10.0), Yardsticks(latency=1.0)) == pytest.approx(1.0)


def test_an_honest_slow_server_keeps_the_share_its_announcement_gives() -> None:
    """A server 3x slower that announces a third of the throughput takes 3x longer: that is what its
    announcement implies, so it is not discounted again (it keeps a quarter of the picks beside one at
    full speed, not a tenth). Announcing its peer's figure while that slow, it is discounted to a quarter."""
    honest = [_answered("fast", 30.0, 1.0), _answered("slow", 10.0, 3.0)]
    counts = _counts(honest, seed=7)
    assert _close(counts["slow"], PICKS // 4), counts
    boastful = [_answered("fast", 30.0, 1.0), _answered("slow", 30.0, 3.0)]
    counts = _counts(boastful, seed=8)
    assert _close(counts["slow"], PICKS // 4), counts  # weight 30 / 3 against 30


def test_latency_is_relative_to_the_stage_per_method() -> None:
    """A server that only ran backwards (twice a forward's time) measures as fast as one that only ran
    forwards; one twice as slow at both measures twice as slow."""
    measured = ServerLatencies()
    assert measured.latency("fwd") is None
    for _ in range(10):
        measured.answered("fwd", "forward", 0.1)
        measured.answered("bwd", "backward", 0.2)
        measured.answered("mixed", "forward", 0.1)
        measured.answered("mixed", "backward", 0.2)
    assert measured.latency("fwd") == measured.latency("bwd") == measured.latency("mixed") == pytest.approx(1.0)
    for _ in range(20):
        measured.answered("slow", "forward", 0.2)
        measured.answered("slow", "backward", 0.4)
        measured.answered("fwd", "forward", 0.1)
        measured.answered("bwd", "backward", 0.2)
    assert measured.latency("slow") > 1.5 * measured.latency("fwd")
    with pytest.raises(ValueError):
        measured.answered("fwd", "forward", -1.0)


def test_failures_count_as_the_longest_wait_once_a_server_has_answered() -> None:
    measured = ServerLatencies()
    measured.answered("liar", "forward", 0.1)
    measured.failed("liar", "forward", 1.2)  # a timeout: 12 times the stage's typical forward
    assert measured.latency("liar") == pytest.approx(1.0 + 0.25 * 11)
    measured.failed("stranger", "forward", 1.2)  # never answered: the newcomer cap and its ban bound it
    measured.failed("liar", "backward", 1.2)  # no backward answered yet: nothing to compare with
    assert measured.latency("stranger") is None
    assert measured.latency("liar") == pytest.approx(3.75)
    # beside an honest server it falls from 80% of the picks (credited 4 x 20) to 80 / 15 against 20: it
    # claims 4 times the honest one's throughput and is 3.75 times slower, 15 times slower than it claims
    candidates = [_answered("honest", 20.0), _answered("liar", 1e9, measured.latency("liar"))]
    counts = _counts(candidates, seed=7)
    assert _close(counts["liar"], round(PICKS * (80 / 15) / (80 / 15 + 20))), counts
    assert counts["liar"] < PICKS / 4
    measured.failed("liar", "forward", 5.0)  # and each further failure takes more, 16 typical calls at most
    assert measured.latency("liar") == pytest.approx(3.75 + 0.25 * (MAX_LATENCY_RATIO - 3.75))
    for _ in range(30):
        measured.failed("liar", "forward", 5.0)
    assert MAX_LATENCY_RATIO - 0.01 < measured.latency("liar") <= MAX_LATENCY_RATIO


def test_a_server_back_from_a_stall_earns_its_share_back() -> None:
    """Frozen, a server failed its calls at timeouts of hundreds of typical calls. Thawed, it still gets a
    trickle of calls (each failure counted as at most MAX_LATENCY_RATIO typical ones), and a score of answers
    at the stage's usual latency give it its share back."""
    measured = ServerLatencies()
    for _ in range(10):
        measured.answered("steady", "forward", 0.01)
        measured.answered("stalled", "forward", 0.01)
    for _ in range(5):
        measured.failed("stalled", "forward", 12.0)  # 1200 typical calls each
    candidates = [_answered("steady", 20.0), _answered("stalled", 20.0, measured.latency("stalled"))]
    trickle = _counts(candidates, seed=9)["stalled"]
    assert PICKS / (MAX_LATENCY_RATIO + 2) < trickle < PICKS / 8, trickle
    for _ in range(16):
        measured.answered("steady", "forward", 0.01)
        measured.answered("stalled", "forward", 0.01)
    candidates = [_answered("steady", 20.0), _answered("stalled", 20.0, measured.latency("stalled"))]
    assert _counts(candidates, seed=10)["stalled"] > PICKS * 0.4
