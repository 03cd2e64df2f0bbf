"""Stochastic wiring: which server of a stage gets the next request.

Two pickers share one weight, `routing_weight`: announced throughput discounted by the work already
waiting there, so a fast but congested server does not keep attracting requests.

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
from dataclasses import dataclass

# Keeps every weight positive so a pool never has zero total weight, whatever a server announced.
_MIN_WEIGHT = 1e-9
# An announced throughput counts for at most this many times the stage's (lower) median: a server that
# announces a billion samples/s gets a bounded share, not all the traffic. Real servers rarely differ more.
MAX_THROUGHPUT_RATIO = 4.0


@dataclass(frozen=True)
class Candidate:
    """One server of a stage as seen by the caller when it routes."""

    peer_id: str
    throughput: float  # samples/s the server announced
    queue: int = 0  # requests waiting at the server, as announced
    inflight: int = 0  # requests this caller has outstanding there


def unmeasured_throughput(candidates: Sequence[Candidate]) -> float:
    """Throughput to assume for a server that has not announced one yet.

    The median of the measured ones makes a newcomer look like a typical server: it gets enough
    traffic to be measured quickly, yet cannot capture everything the way an optimistic guess would.
    """
    measured = [c.throughput for c in candidates if _is_measured(c.throughput)]
    return statistics.median(measured) if measured else 1.0


def throughput_cap(candidates: Sequence[Candidate]) -> float:
    """The most throughput one server of the stage is credited with (see MAX_THROUGHPUT_RATIO). The lower
    median: with two servers, the honest one's figure bounds the other's."""
    measured = [c.throughput for c in candidates if _is_measured(c.throughput)]
    return MAX_THROUGHPUT_RATIO * statistics.median_low(measured) if len(measured) > 1 else math.inf


def routing_weight(c: Candidate, unmeasured: float = 1.0, cap: float = math.inf) -> float:
    """Throughput (at most `cap`) discounted by load; `unmeasured` stands in for a throughput of 0 (or a
    bogus one)."""
    rate = min(c.throughput, cap) if _is_measured(c.throughput) else unmeasured
    return max(rate, _MIN_WEIGHT) / (1 + max(c.queue, 0) + max(c.inflight, 0))


def choose_server(
    candidates: Sequence[Candidate], rng: random.Random, banned: Collection[str] = ()
) -> str | None:
    """Weighted random pick among the candidates that are not banned; None when none is left."""
    pool = [c for c in candidates if c.peer_id not in banned]
    if not pool:
        return None
    default, cap = unmeasured_throughput(pool), throughput_cap(pool)
    weights = [routing_weight(c, default, cap) for c in pool]
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
        default, cap = unmeasured_throughput(pool), throughput_cap(pool)
        total = 0.0
        for c in pool:
            weight = routing_weight(c, default, cap)
            self._credit[c.peer_id] = self._credit.get(c.peer_id, 0.0) + weight
            total += weight
        best = max(pool, key=lambda c: self._credit[c.peer_id]).peer_id
        self._credit[best] -= total
        return best


def _is_measured(throughput: float) -> bool:
    return math.isfinite(throughput) and throughput > 0
