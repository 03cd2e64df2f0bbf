"""When a stage takes an optimizer step, and who averages with whom.

All replicas of a stage step together on averaged gradients, so the decision is made from the stage's
collective progress in the current epoch, not from any single replica's. `plan_step` is the whole
decision a replica makes each time it looks (wait, catch up, or step with a group); the server only
gathers its `StepView` and carries the answer out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

MAX_WAITS = 2  # graces a replica waits, step after step, for a peer that looks behind and never catches up
# graces a replica waits for a member of the round that took it to its epoch, which looks one step behind:
# that peer holds the round's result and is stepping, but a slow one steps only after the job it is running
# (rounds let replicas compute while the parts travel), seconds on a slow machine; waiting costs nothing,
# since gradients go on accumulating meanwhile, while stepping without it would make it download the state
GROUPMATE_GRACES = 3


def worth_telling(own_samples: int, peers: int, peer_samples: int, own_rate: float, period: float,
                  target_batch_size: int) -> bool:
    """Whether a replica should announce its new sample count now rather than at its next periodic
    announcement: its stage's other replicas (`peers` of them, holding `peer_samples` as last seen) decide
    when the stage steps from the counts they read, and a count a period old makes the step overshoot.
    Only near the target does that matter: far from it, the counts decide nothing yet, and every early
    announcement is a DHT store that each node holding the stage's key serves, CPU taken from every host's
    compute. Near means within what the stage may accumulate in two periods, taking each replica to be
    as fast as this one."""
    if not peers:
        return False
    reach = own_rate * (1 + peers) * 2 * period
    return own_samples + peer_samples + reach >= target_batch_size


TRAINERS_QUIET = 5  # announcement periods between reads of the trainers' records when nothing hinges on them


def trainers_read_every(seen: bool, any_done: bool, idle: bool, held: int, period: float, look: float) -> float:
    """Seconds between a replica's reads of the trainers' records. The plan needs them when a replica is
    alone (it steps only once it sees a trainer) and at the end of a run (every trainer done: the stage
    flushes the samples it holds short of its target). So: at every `look` while none is in view; once a
    period while the stage holds samples and either a trainer says it is done or no work came for longer
    than usual (`idle`: the run may be over); else once per TRAINERS_QUIET periods. A stage that holds
    nothing has nothing to flush, and each read is served by every DHT node holding the trainers' key."""
    if not seen:
        return look
    if held and (any_done or idle):
        return period
    return TRAINERS_QUIET * period


def stage_ready(own_samples: int, peer_samples: Mapping[str, int], target_batch_size: int) -> bool:
    """Whether the stage as a whole has accumulated `target_batch_size` samples this epoch.

    `peer_samples` holds the other replicas' announced counts for the same epoch; counts from other
    epochs must be left out by the caller, since they belong to a different step.
    """
    return own_samples + sum(peer_samples.values()) >= target_batch_size


def expected_group(own_id: str, peers_at_epoch: Iterable[str]) -> tuple[str, ...]:
    """The stage members that should join this epoch's all-reduce, in an order every member agrees on."""
    return tuple(sorted({own_id, *peers_at_epoch}))


@dataclass(frozen=True)
class Replica:
    """Another replica of the stage, as its DHT record shows it."""

    peer: str
    epoch: int
    pending: int  # samples it accumulated toward its next step


@dataclass(frozen=True)
class StepView:
    """What one replica knows when it asks whether its stage steps now."""

    now: float  # seconds on a monotonic clock
    me: str
    epoch: int
    pending: int
    others: tuple[Replica, ...]  # the stage's other live replicas, suspects included
    trainers: int  # trainers in view
    trainers_done: bool  # every trainer in view has sent its last microbatch
    proposal: tuple[int, tuple[str, ...]] | None  # a round a groupmate began and we accepted (epoch, group)
    target_batch_size: int
    grace: float  # seconds a replica waits for a peer that looks behind, or for a first peer to appear
    # replicas of the stage seen before, missing from this read though it began after their records expired
    lapsed: frozenset[str] = frozenset()
    # peers that downloaded our state at this epoch: peer -> when (same clock as `now`)
    handed: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PlanMemory:
    """What the plan carries from one look to the next (the replica keeps it, the plan updates it)."""

    # peer -> (until, epoch it was at; None: whatever its epoch, for a peer that keeps refusing our rounds)
    suspects: Mapping[str, tuple[float, int | None]] = field(default_factory=dict)
    alone_since: float = math.inf  # since when no other replica has been in view
    behind_since: Mapping[str, float] = field(default_factory=dict)  # peer -> since when it looks behind
    peers_at_epoch: tuple[int, frozenset[str]] = (-1, frozenset())  # replicas last seen at our epoch
    peers_pending: int = 0  # the samples they announced then
    stragglers: Mapping[str, int] = field(default_factory=dict)  # peer -> graces it made us wait in vain
    # peers whose state could not be had (download failed, or unusable): peer -> (until, epoch it claimed)
    unproven: Mapping[str, tuple[float, int]] = field(default_factory=dict)
    # the other members of the round that took us to an epoch: (that epoch, them); see GROUPMATE_GRACES
    groupmates: tuple[int, frozenset[str]] = (-1, frozenset())
    # peer -> downloads of our state after which we stepped without it, since it was last seen at our epoch
    vain_handoffs: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Wait:
    """Not yet: too few samples, or a peer may still come."""


@dataclass(frozen=True)
class CatchUp:
    """The stage moved on without us: download its state from one of these (most advanced first)."""

    sources: tuple[str, ...]


@dataclass(frozen=True)
class Step:
    """Step (or average) this epoch with this group, in the order every member agrees on."""

    group: tuple[str, ...]


Decision = Wait | CatchUp | Step


def plan_step(view: StepView, memory: PlanMemory) -> tuple[Decision, PlanMemory]:
    """Whether this replica's stage steps now, and with whom; and what to remember for the next look.

    A replica never steps on a partial view: a peer that looks one epoch behind is usually just late to
    announce the step it took with us, so it is waited for, and left out only once it has looked behind
    for `grace` (it is then catching up by downloading state, and would refuse the round anyway); one that
    was in the round that took us to our epoch, GROUPMATE_GRACES times as long.
    Likewise a replica steps alone only after it has seen no other replica for `grace`: a peer that
    started with it may not have announced itself yet; and never while it sees no trainer either (it is
    more likely cut off from the swarm than its stage's last replica). A suspect (a peer that failed a
    round of ours) is left out until its record expires, unless its record moves on (it is alive). A
    replica whose only peers are suspects, or have lapsed (stopped renewing their records: frozen, say,
    right after a step they took with it), steps alone at once: it knows of them, and waiting would let its
    gradients pile up unstepped while the other stages step on.
    A peer that downloaded our state at this epoch to serve the stage (`handed`) is waited for up to `grace`
    from the download, however often it kept us waiting before: it is loading that state and will be at our
    epoch. Only MAX_WAITS such waits in vain are granted (a peer that downloads and never joins must not
    hold the stage back at will); one seen at our epoch is granted them again.
    """
    if view.proposal is not None and view.proposal[0] == view.epoch:
        return Step(view.proposal[1]), memory
    now = view.now
    epochs = {r.peer: r.epoch for r in view.others}
    suspects = {p: (until, e) for p, (until, e) in memory.suspects.items()
                if until > now and (e is None or epochs.get(p, e) == e)}
    in_view = [r for r in view.others if r.peer not in suspects]
    alone_since = memory.alone_since
    if in_view:
        alone_since = math.inf
    elif alone_since == math.inf:  # no need to wait for replicas we know of but cannot reach, or know are gone
        alone_since = now - (math.inf if view.others or suspects or view.lapsed else 0.0)
    memory = replace(memory, suspects=suspects, alone_since=alone_since)
    unproven = {p: (until, e) for p, (until, e) in memory.unproven.items() if until > now and epochs.get(p) == e}
    memory = replace(memory, unproven=unproven)
    # a suspect further along still proves us behind; a peer whose claimed epoch gave us no state does not
    ahead = sorted((r for r in view.others if r.epoch > view.epoch and r.peer not in unproven), key=lambda r: -r.epoch)
    if ahead:
        return CatchUp(tuple(r.peer for r in ahead)), memory
    peers = {r.peer: r.pending for r in in_view if r.epoch == view.epoch}
    stragglers = {p: n for p, n in memory.stragglers.items() if p not in peers}  # (one that caught up is forgiven)
    vain = {p: n for p, n in memory.vain_handoffs.items() if p not in peers}
    memory = replace(memory, peers_at_epoch=(view.epoch, frozenset(peers)), peers_pending=sum(peers.values()),
                     stragglers=stragglers, vain_handoffs=vain)
    held = view.pending + sum(peers.values())
    run_over = held > 0 and view.trainers > 0 and view.trainers_done  # flush what the stage still holds
    if not (stage_ready(view.pending, peers, view.target_batch_size) or run_over):
        return Wait(), memory
    behind_since = {r.peer: memory.behind_since.get(r.peer, now) for r in in_view if r.epoch < view.epoch}
    # a peer that took our state at this epoch to serve the stage is loading it (alive, though it may have
    # failed a round of ours or its record lapsed): stepping on now would leave it a step behind again, and
    # a stage that steps faster than its state downloads would never let it in
    joining = {p: since for p, since in view.handed.items() if p not in peers and vain.get(p, 0) < MAX_WAITS}
    memory = replace(memory, behind_since=behind_since)
    if any(now - since < view.grace for since in joining.values()):
        return Wait(), memory
    # a peer that made us wait out the grace MAX_WAITS times without ever catching up is waited for no more
    stepping = memory.groupmates[1] if memory.groupmates[0] == view.epoch else frozenset()
    if any(now - since < view.grace * (GROUPMATE_GRACES if p in stepping else 1)
           for p, since in behind_since.items() if stragglers.get(p, 0) < MAX_WAITS):
        return Wait(), memory
    if behind_since:  # stepping without them: each has cost us a grace
        memory = replace(memory, stragglers={**stragglers, **{p: stragglers.get(p, 0) + 1 for p in behind_since}})
    if joining:
        memory = replace(memory, vain_handoffs={**vain, **{p: vain.get(p, 0) + 1 for p in joining}})
    if not in_view:
        if not view.trainers:
            # once the swarm is back in view, its other replicas may take a moment more to appear
            return Wait(), replace(memory, alone_since=max(alone_since, now))
        if now - alone_since < view.grace:
            return Wait(), memory
    return Step(expected_group(view.me, peers)), memory


def suspect(memory: PlanMemory, peers: Iterable[str], until: float, epoch: int | None) -> PlanMemory:
    """Peers that failed a round of ours at `epoch`: left out of the next groups until `until`, or until
    their record moves past `epoch` (with `epoch` None, whatever their record says)."""
    return replace(memory, suspects={**memory.suspects, **{p: (until, epoch) for p in peers}})


def unproven(memory: PlanMemory, claims: Mapping[str, int], until: float) -> PlanMemory:
    """Peers that announced an epoch ahead of ours but gave no usable state for it: their claim does not
    make us wait to catch up until `until`, unless their record moves on (a real replica steps on)."""
    return replace(memory, unproven={**memory.unproven, **{p: (until, e) for p, e in claims.items()}})


def accept_proposal(memory: PlanMemory, me: str, epoch: int, proposed_epoch: int, group: tuple[str, ...]) -> bool:
    """Whether to join a round a groupmate began: for our epoch, with us in it, none of our suspects, no
    replica left out that we know is at this epoch (its samples would be dropped later), and no member we
    do not know at this epoch (a peer outside the stage must not get in). We know at our epoch the replicas
    the stage's records showed there, and the other members of the round that took us to it: they stepped
    with us, and one of them proposing the next round before our plan has read their new records (its
    samples came first) would otherwise fail that round and wait out a backoff. Until our plan knows
    anyone at this epoch, a proposal waits: the proposer retries."""
    if not _for_us(memory, me, epoch, proposed_epoch, group) or not set(group) - {me}:
        return False
    seen_epoch, seen = memory.peers_at_epoch
    left_out = seen - set(group) if seen_epoch == epoch else frozenset()
    return not left_out and not _unknown(memory, me, epoch, group)


def unseen_in(memory: PlanMemory, me: str, epoch: int, proposed_epoch: int, group: tuple[str, ...]) -> frozenset[str]:
    """The members of a proposed round for our epoch that our plan does not know at it, where nothing else
    in the proposal is amiss: a replica that announced itself since our last read of the stage, whose round
    we would refuse, and then step without it (its samples dropped when it catches up), unless we read
    the stage again before our plan decides."""
    if not _for_us(memory, me, epoch, proposed_epoch, group):
        return frozenset()
    return _unknown(memory, me, epoch, group)


def _unknown(memory: PlanMemory, me: str, epoch: int, group: tuple[str, ...]) -> frozenset[str]:
    """The members of `group` other than us that neither the stage's records nor our last round put at `epoch`."""
    seen_epoch, seen = memory.peers_at_epoch
    mates_epoch, mates = memory.groupmates
    known = (seen if seen_epoch == epoch else frozenset()) | (mates if mates_epoch == epoch else frozenset())
    return frozenset(group) - {me} - known


def _for_us(memory: PlanMemory, me: str, epoch: int, proposed_epoch: int, group: tuple[str, ...]) -> bool:
    """A proposed round for our epoch, with us in it and none of our suspects."""
    return proposed_epoch == epoch and me in group and not memory.suspects.keys() & set(group)
