"""Exactly-once delivery of a microbatch's gradient to each stage: when a trainer may forget it, and
when it must send it again.

A trainer keeps, per microbatch and stage, what it would need to accumulate that stage's gradient
again (the stage's inputs and output gradient) until the stage's ledger says a step took it in and
that step is on disk. It asks one up-to-date replica of the stage about its open microbatches and
judges each from the answer:

- committed by a step that is durable (another replica took the same step, or it is on disk), or
  that is `keep_epochs` old (the bound on what a trainer keeps for a stage no one else can back) for the
  replica that claims it: done;
- committed, not yet durable, or still held unstepped by some replica: wait;
- neither, and the stage has stepped past the epoch the gradient was accumulated in (the replica that
  held it died, left, or dropped it to catch up), or the replica that held it is gone: send it again.

Sending again is safe even when the judgement was early: a replica never accumulates a microbatch its
ledger already holds or has committed, and a stale replica refuses to serve.

The answers change only when the stage steps, when a replica comes or goes, or for a call in doubt, so a
stage's replicas are asked again only then (`worth_asking`), and after QUIET_PERIODS in any case.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from enum import Enum

# announcement periods after which a stage's replicas are asked about our open microbatches though nothing
# in view changed: a replica restarted under its old peer id at the same epoch has lost what it held
QUIET_PERIODS = 5


class Verdict(Enum):
    DONE = "done"  # in a step that is on disk (or the run keeps no checkpoints)
    WAIT = "wait"  # on its way into a step, or in one that is not yet on disk
    REPLAY = "replay"  # lost with the replica that held it: accumulate it again


@dataclass(frozen=True)
class LedgerAnswer:
    """What the replicas asked know of one microbatch."""

    epoch: int  # the most advanced replica's epoch
    committed_at: int | None  # the epoch of the step that took the microbatch in, if a ledger has it
    pending: bool  # held in its holder's unstepped gradient
    durable: int  # the newest epoch that outlives the replica reporting the commit: taken by two or more
    # replicas, or on disk
    disputed: bool = False  # a replica that must know of the commit, had it happened, does not
    # the most advanced epoch of the replicas that claim the commit (None: `epoch`). A commit is
    # `keep_epochs` old for the history that took it, not for another: a replica that stepped alone on a
    # branch the stage's others superseded still claims it, while the others, further on, no longer check
    claimed_epoch: int | None = None


@dataclass(frozen=True)
class LedgerReply:
    """One replica's `ledger` reply, checked: a replica may lie or send garbage, and one malformed reply
    must not keep the trainer from judging on the others."""

    epoch: int
    committed: dict[str, int]
    pending: frozenset[str]
    durable: int

    @classmethod
    def parse(cls, reply: object) -> LedgerReply | None:
        """The reply's fields, typed; None if it is malformed."""
        try:
            committed, pending = reply["committed"], reply["pending"]
            if not isinstance(committed, dict) or not isinstance(pending, list):
                return None
            fields = [reply["epoch"], reply["durable"], *committed.values()]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in fields):
                return None
            if not all(isinstance(r, str) for r in [*committed, *pending]):
                return None
            return cls(reply["epoch"], dict(committed), frozenset(pending), reply["durable"])
        except (KeyError, TypeError):
            return None


def judge(
    accumulated_at: int, holder_alive: bool, answer: LedgerAnswer, keep_epochs: int = 4, need_durable: bool = True
) -> Verdict:
    """The verdict on a gradient accumulated at epoch `accumulated_at` by a replica that is (or not)
    still in the stage's directory, given what the replicas asked answered.

    `need_durable` False accepts a commit claimed at the stage's furthest epoch: at the end of a run nothing
    more is coming to make the last steps durable. A claim from behind that epoch is still waited on: its
    claimant stepped on a branch the others left (else they would list the commit, or it would be durable),
    and once it catches up the gradient is nowhere and is sent again. A disputed commit is waited on:
    neither forgetting the gradient (it may never have been stepped) nor sending it again (it may have
    been) is safe until the replicas agree.
    """
    if answer.disputed:
        return Verdict.WAIT
    if answer.committed_at is not None:
        reached = answer.epoch if answer.claimed_epoch is None else answer.claimed_epoch
        durable = answer.committed_at <= max(answer.durable, reached - keep_epochs)
        return Verdict.DONE if durable or (not need_durable and reached >= answer.epoch) else Verdict.WAIT
    if answer.pending:
        return Verdict.WAIT
    if answer.epoch > accumulated_at or not holder_alive:
        return Verdict.REPLAY
    return Verdict.WAIT


def merge_answers(answers: dict[str, LedgerReply], req: str, holder: str, keep_epochs: int) -> LedgerAnswer:
    """What the replicas asked (peer -> its reply) know of one microbatch held by `holder`.

    A replica can lie, so no single reply decides alone where another can check it:
    - a microbatch is pending only in its holder's gradient: another replica's "pending" is ignored;
    - every replica that took the step of a commit, or later loaded the state of one that did, lists it
      for `keep_epochs` epochs (see swarm.core.ledger): one at an epoch in that span that lists it
      neither committed nor pending disputes a claim of it committed;
    - the earliest commit claimed counts, with the durability its claimant reports, and is as old as the
      most advanced replica claiming it has gone past it."""
    if not answers:
        raise ValueError("no answers to merge")
    claims = {peer: (a.committed[req], a.durable) for peer, a in answers.items() if req in a.committed}
    committed_at = min(claims.values())[0] if claims else None
    claimed_epoch = max((answers[p].epoch for p, (e, _) in claims.items() if e == committed_at), default=None)
    disputed = committed_at is not None and any(
        committed_at <= a.epoch < committed_at + keep_epochs and req not in a.pending
        for peer, a in answers.items() if peer not in claims
    )
    return LedgerAnswer(
        epoch=max(a.epoch for a in answers.values()),
        committed_at=committed_at,
        pending=holder in answers and req in answers[holder].pending,
        durable=min(d for _, d in claims.values()) if claims else max(a.durable for a in answers.values()),
        disputed=disputed,
        claimed_epoch=claimed_epoch,
    )


@dataclass(frozen=True)
class Asked:
    """A stage's replicas asked about our open microbatches: what the view showed of the stage then (its live
    replicas at their epochs, the holders seen lately), when (monotonic), and which microbatches."""

    shown: Hashable
    at: float
    reqs: frozenset[str]


def worth_asking(last: Asked | None, shown: Hashable, now: float, period: float, unasked_in_doubt: bool,
                 ending: bool) -> bool:
    """Whether to ask a stage's replicas about our open microbatches now. Each question is a call to up to
    two replicas and every holder, taken from their compute, and its answers can only say "wait" again
    until the view of the stage changes: a replica stepped (a commit, or a gradient it dropped, shows), one
    came or went, a holder is no longer seen (its gradients are lost). So ask when the view changed since
    the last question, when a microbatch whose call went unanswered (in doubt: which replica holds it, if
    any) is open and was not asked about, at the run's end (a commit then need not be durable), and every
    QUIET_PERIODS periods in any case."""
    return (last is None or ending or unasked_in_doubt or shown != last.shown
            or now - last.at >= QUIET_PERIODS * period)
