"""What a joining peer concludes from the peers it greeted: how far its clock is off, and whether the
swarm can reach it.

Clocks matter because DHT records expire on their writer's wall clock (`net.record_ttl` after it
wrote them): a writer whose clock runs d seconds behind everyone else's writes records that live
`ttl - d` seconds in their eyes, so past `ttl - announce_period` it vanishes between two renewals;
one running ahead lingers d seconds after it died. Requests also carry wall-clock deadlines. The
offset to each greeted peer is measured by one round trip (their time against the midpoint of ours,
give or take half the round trip), and the median over the peers is taken, so that one peer with a
wrong clock does not make a newcomer look wrong.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

WARN_OFFSET = 0.5  # seconds: worth a warning, harmless to records renewed every second


@dataclass(frozen=True)
class ClockSample:
    """One greeting: our clock when we asked, theirs when they answered, ours when the answer came."""

    sent: float
    theirs: float
    received: float

    @property
    def offset(self) -> float:
        """How far our clock is behind theirs (negative: ahead)."""
        return self.theirs - (self.sent + self.received) / 2

    @property
    def uncertainty(self) -> float:
        return (self.received - self.sent) / 2


@dataclass(frozen=True)
class ClockCheck:
    offset: float  # median seconds our clock is behind the swarm's (negative: ahead)
    uncertainty: float  # half the median round trip
    verdict: str  # "ok", "warn" or "refuse"; "unknown" without samples

    def describe(self) -> str:
        if self.verdict == "unknown":
            return "no peer answered, clock not compared"
        direction = "behind" if self.offset > 0 else "ahead of"
        return f"this clock is {abs(self.offset):.2f}s (±{self.uncertainty:.2f}s) {direction} the swarm's"


def judge_clock(samples: list[ClockSample], max_offset: float) -> ClockCheck:
    """Refuse past `max_offset`, where records would vanish or linger and deadlines misfire; warn past
    `WARN_OFFSET`. The round trip's uncertainty is given the benefit of the doubt."""
    if not samples:
        return ClockCheck(0.0, 0.0, "unknown")
    offset = statistics.median(s.offset for s in samples)
    uncertainty = statistics.median(s.uncertainty for s in samples)
    excess = abs(offset) - uncertainty
    verdict = "refuse" if excess > max_offset else "warn" if excess > WARN_OFFSET else "ok"
    return ClockCheck(offset, uncertainty, verdict)


def judge_reachability(answers: list[bool]) -> bool | None:
    """Whether the swarm can open connections to us: any peer that dialled back through our listening
    port proves it (others may sit behind the same firewall); None when nobody could check."""
    return any(answers) if answers else None
