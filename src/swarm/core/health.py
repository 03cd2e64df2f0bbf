"""A verdict on a swarm's shape, for the operator reading `swarm status`: what stops or slows training.

A pipeline trains only while every stage has a server taking new work, and only as fast as its
slowest stage; it trains at all only with trainers feeding it. The verdict lists what an operator
should act on, most urgent first: stages with no server, no trainers, servers moving between stages,
replicas of a stage at different epochs, then the bottleneck (or "balanced"). Pure: plain figures
in, an answer out, so the same function judges a live swarm, a simulated one and a unit test's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# the slowest stage is called the bottleneck when the next slowest is at least this many times faster
# (the same factor as rebalancing's default `min_gain`: a gap a move would be made for)
BOTTLENECK_FACTOR = 1.2


@dataclass(frozen=True)
class ServerFigures:
    """One server as its announcement shows it."""

    label: str  # how the operator knows it: its name, or its short peer id
    samples_per_second: float  # its measured capacity; 0 until measured
    epoch: int  # optimizer steps its replica has applied
    moving: bool = False  # leaving for another stage: it takes no new work here


@dataclass(frozen=True)
class Diagnosis:
    findings: tuple[str, ...]  # most urgent first; never empty
    bottleneck: int | None  # the stage that limits the pipeline, if one clearly does
    capacity: dict[int, float]  # samples/s of each stage, counting only servers that take new work

    @property
    def text(self) -> str:
        return "; ".join(self.findings)


def stage_capacity(servers: Sequence[ServerFigures]) -> float:
    """A stage's samples/s: the sum over its servers that take new work (one moving away does not)."""
    return sum(s.samples_per_second for s in servers if not s.moving)


def diagnose(
    stages: Mapping[int, Sequence[ServerFigures]],
    active_trainers: int,
    finished_trainers: int = 0,
    factor: float = BOTTLENECK_FACTOR,
) -> Diagnosis:
    """Judge a swarm from its stages' servers and its trainers' count (those still sending work, and
    those that finished)."""
    if factor < 1.0:
        raise ValueError(f"factor must be >= 1, got {factor}")
    capacity = {k: stage_capacity(servers) for k, servers in sorted(stages.items())}
    findings: list[str] = []
    if not stages:
        findings.append("no servers found")
    unserved = []
    for k, servers in sorted(stages.items()):
        if all(s.moving for s in servers):
            unserved.append(k)
            leaving = [s.label for s in servers]
            findings.append(f"stage {k} has no server" + (f" ({', '.join(leaving)} moving away)" if leaving else ""))
    if active_trainers == 0:
        findings.append(f"no trainers ({finished_trainers} done)" if finished_trainers else "no trainers")
    for k, servers in sorted(stages.items()):
        if k in unserved:
            continue
        for s in servers:
            if s.moving:
                findings.append(f"{s.label} is moving away from stage {k}")
        epochs = sorted({s.epoch for s in servers})
        if len(epochs) > 1:
            findings.append(f"stage {k} replicas at epochs {', '.join(map(str, epochs))}")
    bottleneck = None
    if stages and not unserved:
        verdict, bottleneck = _balance(capacity, factor)
        findings.append(verdict)
    return Diagnosis(tuple(findings), bottleneck, capacity)


def _balance(capacity: Mapping[int, float], factor: float) -> tuple[str, int | None]:
    """Which stage limits the pipeline, when every stage has a server."""
    unmeasured = [k for k, c in capacity.items() if c <= 0]
    if unmeasured:
        plural = "s" if len(unmeasured) > 1 else ""
        return f"stage{plural} {', '.join(map(str, unmeasured))} not measured yet", None
    ranked = sorted(capacity, key=lambda k: (capacity[k], k))
    slowest = ranked[0]
    if len(ranked) == 1:
        return f"one stage, {capacity[slowest]:.1f} samples/s", slowest
    low, nxt = capacity[slowest], capacity[ranked[1]]
    if nxt >= factor * low:
        return f"stage {slowest} is the bottleneck ({low:.1f} samples/s, next {nxt:.1f})", slowest
    return f"balanced ({low:.1f}-{capacity[ranked[-1]]:.1f} samples/s per stage)", None
