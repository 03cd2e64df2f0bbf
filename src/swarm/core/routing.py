"""Stochastic wiring: which server of a stage gets the next request.

Two pickers share one weight, `routing_weight`: announced throughput discounted by the work already
waiting there, so a fast but congested server does not keep attracting requests. The announcement is a
claim anyone can make, so it is bounded three ways, each against figures of the same stage
(`Yardsticks`): by a multiple of the stage's typical announcement (`throughput_cap`); by the typical
announcement itself while the caller has had no answer from the server (a newcomer's figure is unproven);
and by the latency the caller measured there (`ServerLatencies`), against what the announcement implies:
a server k times slower than it claims gets k times less.

* `choose_server` draws at random. Prefer it whenever many trainers route independently: each one
  sees the same announcements, and a deterministic rule would send all of them to the same server at
  the same moment (herding); independent draws spread them out in expectation.
* `SmoothWeightedRoundRobin` (nginx's smooth weighted round-robin) is deterministic and hits exact
  proportions over every cycle while interleaving servers instead of sending bursts to one. Prefer it
  for a single trainer, or for anything whose variance matters more than decorrelation from others.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

# Keeps every weight positive so a pool never has zero total weight, whatever a server announced.
_MIN_WEIGHT = 1e-9
# An announced throughput counts for at most this many times the stage's (lower) median: a server that
# announces a billion samples/s gets a bounded share, not all the traffic. Real servers rarely differ more.
MAX_THROUGHPUT_RATIO = 4.0
# Smoothing of measured latencies: a server gets only its share of a caller's calls, so its figure must
# follow it within a few of them (about 1 / alpha), yet one slow call must not halve its traffic.
LATENCY_ALPHA = 0.25
# One call, answered or failed, counts as at most this many of the stage's typical calls. A timeout
# taken while a server was frozen can be hundreds of times a typical call: folded in whole, it would
# leave that server so little traffic that it never answers enough calls to earn its share back, long
# after it recovered. Bounded, a server that keeps failing still falls to a trickle of calls (each
# failure also bans it, for longer each time), and one that recovered is back within a few answers.
MAX_LATENCY_RATIO = 16.0
# Calls one caller keeps at a server it never had an answer from: a slow start, as TCP's. Such a server's
# figure is unproven (a calibration run idle, or a claim), and a slow one given its share of a trainer's
# first burst holds those calls past their timeouts; one call at a time, its first answer measures it.
UNPROVEN_CALLS = 1


@dataclass(frozen=True)
class Candidate:
    """One server of a stage as seen by the caller when it routes."""

    peer_id: str
    throughput: float  # samples/s the server announced
    queue: int = 0  # requests waiting at the server, as announced
    inflight: int = 0  # requests this caller has outstanding there (and backwards it will send there)
    latency: float | None = None  # measured by this caller (see ServerLatencies); None: it never answered us


@dataclass(frozen=True)
class Yardsticks:
    """What each server of a pool is weighed against, worked out once per pick from the whole pool."""

    unannounced: float = 1.0  # throughput assumed for a server that announced none (or a bogus one)
    cap: float = math.inf  # the most throughput any server is credited with
    # the most credited to a server that never answered this caller: beside servers that did, all of them
    # together count as one typical server, however many identities they are (see `yardsticks`)
    unanswered_cap: float = math.inf
    latency: float | None = None  # the lower median of the measured latencies; None: none measured
    # the lower median of measured latency x credited throughput: an honest server k times slower
    # announces k times less and takes k times longer, so its product is the stage's; one slower than
    # its announcement claims has a larger one
    claim: float | None = None
    typical: float | None = None  # the stage's typical announced throughput (see `typical_throughput`)


class ServerLatencies:
    """One caller's measured latency of each server of one stage, to check announcements against.

    Under throughput-proportional routing, honest servers' latencies even out: each gets calls in
    proportion to what it can serve (and the load discount evens out the rest). A server that announces
    more than it serves attracts more calls than it can serve, and its latency shows it; one that fails
    its calls shows it too (see `failed`). Latency is evidence a server cannot fake downwards: only its
    answer ends a call. Where honest latencies do differ (a slow server's single call takes longer even
    when idle), dividing the slower one's weight moves calls to the others until their latencies rise to
    meet it, so a caller's calls wait about as long wherever they go.

    A server's figure is an EWMA of its calls' seconds (per request the call waited behind there: the
    caller divides, see `swarm.trainer.calls`), each divided by the stage's typical seconds for
    the same method (an EWMA over every answer from the stage, whichever server gave it): a forward and
    a backward then weigh alike, and the figure reads "k times as slow as usual" whatever mix of methods
    the server happened to get. Each call's ratio is bounded by MAX_LATENCY_RATIO. Only an answer creates
    a server's entry, so identities that never answer cost no memory here.
    """

    def __init__(self, alpha: float = LATENCY_ALPHA) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._typical: dict[str, float] = {}  # method -> smoothed seconds of the stage's answered calls
        self._relative: dict[str, float] = {}  # peer -> smoothed seconds per call / the typical ones

    def answered(self, peer: str, method: str, seconds: float) -> None:
        """A call to `peer` answered after `seconds`."""
        if seconds < 0:
            raise ValueError(f"latency must be >= 0, got {seconds}")
        typical = self._typical.get(method, seconds)
        self._typical[method] = typical = typical + self.alpha * (seconds - typical)
        self._fold(peer, seconds / typical if typical > 0 else 1.0)

    def failed(self, peer: str, method: str, seconds: float) -> None:
        """A call to `peer` that failed, counted as lasting `seconds`: the caller passes the longest it
        would have waited for an answer, so failing fast never reads as serving fast. Ignored for a server
        that never answered (the newcomer cap and the caller's ban already bound it) and until the stage
        has answered such a call (nothing to compare with)."""
        typical = self._typical.get(method)
        if peer in self._relative and typical:
            self._fold(peer, max(seconds, 0.0) / typical)

    def latency(self, peer: str) -> float | None:
        """`peer`'s smoothed latency relative to the stage's; None until it has answered a call."""
        return self._relative.get(peer)

    def _fold(self, peer: str, ratio: float) -> None:
        ratio = min(ratio, MAX_LATENCY_RATIO)
        old = self._relative.get(peer)
        self._relative[peer] = ratio if old is None else old + self.alpha * (ratio - old)


def awaiting_first_answer(candidates: Sequence[Candidate], limit: int = UNPROVEN_CALLS) -> set[str]:
    """Servers to send nothing more for now: those that never answered this caller and hold `limit` of
    its calls (see UNPROVEN_CALLS). The pickers pass them over as they pass over banned ones."""
    return {c.peer_id for c in candidates if c.latency is None and c.inflight >= limit}


def unmeasured_throughput(candidates: Sequence[Candidate]) -> float:
    """Throughput to assume for a server that has not announced one yet.

    The median of the announced ones makes a newcomer look like a typical server: it gets enough
    traffic to be measured quickly, yet cannot capture everything the way an optimistic guess would.
    """
    announced = [c.throughput for c in candidates if _is_announced(c.throughput)]
    return statistics.median(announced) if announced else 1.0


def typical_throughput(candidates: Sequence[Candidate]) -> float | None:
    """The stage's typical announced throughput, which the caps are multiples of: the lower median (with
    two servers, the honest one's figure bounds the other's), over all the servers and over those that
    answered this caller, whichever is lower. Identities that never answered cannot raise it however many
    of them announce big figures, and a lone server that answered cannot raise it for its untried peers.
    None when no server announced a usable figure."""
    announced = [c for c in candidates if _is_announced(c.throughput)]
    if not announced:
        return None
    answered = [c.throughput for c in announced if c.latency is not None]
    typical = statistics.median_low([c.throughput for c in announced])
    return min(typical, statistics.median_low(answered)) if answered else typical


def throughput_cap(candidates: Sequence[Candidate]) -> float:
    """The most throughput one server of the stage is credited with (see MAX_THROUGHPUT_RATIO); no bound
    when fewer than two servers announced a figure (nothing to compare with)."""
    typical = typical_throughput(candidates)
    announced = sum(_is_announced(c.throughput) for c in candidates)
    return MAX_THROUGHPUT_RATIO * typical if typical is not None and announced > 1 else math.inf


def yardsticks(candidates: Sequence[Candidate]) -> Yardsticks:
    """The yardsticks of a pool: both pickers weigh its servers against the same figures.

    Servers that never answered this caller share one typical server's weight while some have answered:
    identities cost nothing, and a flood of them announcing good figures would otherwise take nearly all
    the calls (each a failure and a ban). An honest newcomer still gets calls, and one answer lifts it out
    of the pool. With none answered (a caller that just started), each counts as a typical server."""
    typical = typical_throughput(candidates)
    unanswered = sum(c.latency is None for c in candidates)
    answered = len(candidates) - unanswered
    sticks = Yardsticks(
        typical=typical,
        unannounced=unmeasured_throughput(candidates),
        cap=throughput_cap(candidates),
        unanswered_cap=math.inf if typical is None else typical / (max(unanswered, 1) if answered else 1),
    )
    measured = [c for c in candidates if _is_latency(c.latency)]
    if not measured:
        return sticks
    return replace(sticks, latency=statistics.median_low([c.latency for c in measured]),
                   claim=statistics.median_low([c.latency * _credited(c, sticks) for c in measured]))


def _credited(c: Candidate, sticks: Yardsticks) -> float:
    """Announced throughput, at most `sticks.cap` (at most `sticks.unanswered_cap` until the server has
    answered us); a bogus announcement (0, negative, not finite) counts as `sticks.unannounced`."""
    rate = min(c.throughput, sticks.cap) if _is_announced(c.throughput) else sticks.unannounced
    return min(rate, sticks.unanswered_cap) if c.latency is None else rate


def routing_weight(c: Candidate, sticks: Yardsticks = Yardsticks()) -> float:
    """The credited throughput (see `_credited`), discounted by load and, for a server measured slower
    than the stage's median, divided by how much slower it is than its announcement implies (k times
    the stage's `claim`; k times the median latency where no claim is known). Measured faster, or as
    slow as it said, it keeps its share: latency only discounts, and only a claim it does not live up to.

    The load is counted in time, not in requests: each request queued there (announced, or ours in
    flight) as the typical server's requests it is worth at this server's rate. Counted in requests, a
    server k times slower would be sent work until it held as many requests as the others, each taking
    it k times as long: a call sent there waits k times longer, and so does the end of a run for the
    work left there. Counted in time, draws settle where a request waits as long everywhere."""
    rate = _credited(c, sticks)
    if sticks.latency is not None and _is_latency(c.latency) and c.latency > sticks.latency:
        k = c.latency / sticks.latency if not sticks.claim else c.latency * rate / sticks.claim
        rate /= max(1.0, k)
    rate = max(rate, _MIN_WEIGHT)
    per_request = sticks.typical / rate if sticks.typical else 1.0  # in the typical server's requests
    return rate / (1 + (max(c.queue, 0) + max(c.inflight, 0)) * per_request)


def choose_server(
    candidates: Sequence[Candidate], rng: random.Random, banned: Collection[str] = ()
) -> str | None:
    """Weighted random pick among the candidates that are not banned; None when none is left."""
    pool = [c for c in candidates if c.peer_id not in banned]
    if not pool:
        return None
    sticks = yardsticks(pool)
    weights = [routing_weight(c, sticks) for c in pool]
    return rng.choices(pool, weights=weights)[0].peer_id


class SmoothWeightedRoundRobin:
    """Deterministic weighted interleaving that keeps working while servers join and leave.

    Each pick every server's credit grows by its weight and the richest one is picked and pays the
    total weight. Credit is kept per peer id: a newcomer starts at zero and a vanished (or banned)
    peer's credit is dropped, so the rotation adapts without being reset.
    """

    def __init__(self) -> None:
        self._credit: dict[str, float] = {}

    def pick(self, candidates: Sequence[Candidate], banned: Collection[str] = ()) -> str | None:
        pool = [c for c in candidates if c.peer_id not in banned]
        present = {c.peer_id for c in pool}
        self._credit = {p: v for p, v in self._credit.items() if p in present}
        if not pool:
            return None
        sticks = yardsticks(pool)
        total = 0.0
        for c in pool:
            weight = routing_weight(c, sticks)
            self._credit[c.peer_id] = self._credit.get(c.peer_id, 0.0) + weight
            total += weight
        best = max(pool, key=lambda c: self._credit[c.peer_id]).peer_id
        self._credit[best] -= total
        return best


def _is_announced(throughput: float) -> bool:
    return math.isfinite(throughput) and throughput > 0


def _is_latency(latency: float | None) -> bool:
    return latency is not None and math.isfinite(latency) and latency > 0
