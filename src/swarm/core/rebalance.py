"""Which server should move to which stage, so that no stage is the pipeline's bottleneck.

A pipeline runs at the speed of its slowest stage, and a stage's capacity is the sum of its live
servers' measured throughputs (samples/s of forward+backward), so servers of different speeds count
by what they do. Every server evaluates the same plan from the same DHT figures: the single move
into the bottleneck stage that helps it most (see `plan_move`). Only the server the plan names
moves, which is the tie-break that keeps two servers from moving at once; the caller adds a cooldown
and a random delay before acting, re-checks that the plan still names it, and, once it has drained its
work, that the move still stands (`still_planned`).

A server is predicted to be as fast in another stage as in its own: stages are cut to cost about the
same per sample (`swarm.core.partition`), while servers differ widely. (Scaling by the ratio of the
stages' average speeds would mistake which servers a stage happens to hold for what it costs: a slow
server in a stage of fast ones would be predicted slower still elsewhere.) Where stage costs do
differ, the error is one-sided per direction (optimistic into a costlier stage, pessimistic back), so
it cannot make a server go back and forth, and the measured figures after the move correct it. A move
is made only when it raises the bottleneck by at least `min_gain` (a factor): measurement noise
smaller than that cannot make servers oscillate. Everything here is pure: the server, a simulator and the tests call
the same functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

Layout = Mapping[int, Mapping[str, float]]  # stage -> {server id -> throughput}


@dataclass(frozen=True)
class Seat:
    """One server as its announcement shows it."""

    peer: str
    stage: int
    throughput: float  # measured samples/s; 0 until measured
    tenure: float = 0.0  # seconds it has served this stage
    moving: bool = False  # already on its way to another stage


@dataclass(frozen=True)
class Move:
    peer: str
    source: int
    target: int
    before: float  # the target's (the bottleneck's) capacity now
    after: float  # predicted: the lesser of the target's and the source's capacities after the move


def capacities(layout: Layout) -> dict[int, float]:
    return {stage: sum(servers.values()) for stage, servers in layout.items()}


def plan_move(layout: Layout, min_gain: float) -> Move | None:
    """The best single move into the bottleneck stage, or None when none is worth making.

    Candidates are the measured servers of stages that keep another server. A move is scored by the
    lesser of the two capacities it changes (the bottleneck's after gaining the server, the giver's
    after losing it), and made only if that is at least `min_gain` times the bottleneck's capacity
    now: the bottleneck gains and the giver does not become a worse one. (With several stages tied at
    the bottleneck, the pipeline's minimum rises only after one move per tied stage; each of those
    moves passes this test.) Ties go to the smallest peer id, so every server that computes the plan
    from the same figures names the same mover.
    """
    if min_gain < 1.0:
        raise ValueError(f"min_gain must be >= 1, got {min_gain}")
    caps = capacities(layout)
    if len(caps) < 2:
        return None
    target = choose_stage(layout)
    before = caps[target]
    best: Move | None = None
    for source, servers in layout.items():
        if source == target or len(servers) < 2:
            continue
        for peer, speed in servers.items():
            if speed <= 0:
                continue
            after = min(caps[source] - speed, before + speed)
            if best is None or (after, best.peer) > (best.after, peer):
                best = Move(peer, source, target, before, after)
    if best is None or best.after <= before or best.after < before * min_gain:
        return None
    return best


def layout_of(seats: Iterable[Seat], num_stages: int) -> dict[int, dict[str, float]]:
    """Every stage (empty ones too) with its servers' throughputs. A server not measured yet (a figure
    of 0: it has not done enough work) counts like the swarm's median measured server: counting it as
    nothing would make its stage look starved and draw servers to it."""
    seats = list(seats)
    measured = sorted(seat.throughput for seat in seats if seat.throughput > 0)
    median = measured[len(measured) // 2] if measured else 0.0
    layout: dict[int, dict[str, float]] = {stage: {} for stage in range(num_stages)}
    for seat in seats:
        if seat.stage in layout:
            layout[seat.stage][seat.peer] = seat.throughput if seat.throughput > 0 else median
    return layout


def plan_for_swarm(seats: Iterable[Seat], num_stages: int, min_gain: float, cooldown: float) -> Move | None:
    """The move to make now, if any. None while a server is moving or has served its stage for less
    than `cooldown` seconds (the last move's effect is not measured yet: acting on it would move a
    second server for the same shortage), or while a server has no figure yet (a guess for it could
    name the wrong mover), unless it has gone without one for three cooldowns: it then counts like
    the median server, so that a server that gets no work cannot stall rebalancing for good."""
    seats = list(seats)
    if any(seat.moving or seat.tenure < cooldown for seat in seats):
        return None
    if any(seat.throughput <= 0 and seat.tenure < 3 * cooldown for seat in seats):
        return None
    return plan_move(layout_of(seats, num_stages), min_gain)


def still_planned(seats: Iterable[Seat], move: Move, num_stages: int, min_gain: float, cooldown: float) -> bool:
    """Whether `move`, decided before its server drained its work, is still worth making. Meanwhile others
    may have moved: a server between two stages is in neither's records (it has left the one, it has not
    yet announced itself at the other), so a plan made in that gap counts its target short of a server
    and sends a second one after it. The move still stands where the policy, looking again, moves a
    server from its source into its target and this server's own move gains as much as the policy asks
    (the policy may name another server of about its speed: figures drift while it drains). The mover's
    own record says it is moving; it counts here as where it is."""
    seats = [replace(seat, moving=False) if seat.peer == move.peer else seat for seat in seats]
    again = plan_for_swarm(seats, num_stages, min_gain, cooldown)
    if again is None or (again.source, again.target) != (move.source, move.target):
        return False
    layout = layout_of(seats, num_stages)
    if move.peer not in layout[move.source]:  # the view lacks the mover itself: it is incomplete
        return False
    caps, speed = capacities(layout), layout[move.source][move.peer]
    after = min(caps[move.source] - speed, caps[move.target] + speed)
    return after > caps[move.target] and after >= caps[move.target] * min_gain


def choose_stage(layout: Layout) -> int:
    """Where a newcomer joins: the stage with the least capacity (an empty one first), then the one with
    fewer servers (so newcomers spread over stages whose servers are not measured yet), then the lowest
    index."""
    caps = capacities(layout)
    if not caps:
        raise ValueError("no stages to choose from")
    return min(caps, key=lambda stage: (caps[stage], len(layout[stage]), stage))
