"""Exactly-once delivery of a microbatch's gradient to each stage: when a trainer may forget it, and
when it must send it again.

A trainer keeps, per microbatch and stage, what it would need to accumulate that stage's gradient
again (the stage's inputs and output gradient) until the stage's ledger says a step took it in and
that step is on disk. It asks one up-to-date replica of the stage about its open microbatches and
judges each from the answer:

- committed by a step that is durable (another replica took the same step, or it is on disk), or
  that is `keep_epochs` old (the bound on what a trainer keeps for a stage no one else can back): done;
- committed, not yet durable, or still held unstepped by some replica: wait;
- neither, and the stage has stepped past the epoch the gradient was accumulated in (the replica that
  held it died, left, or dropped it to catch up), or the replica that held it is gone: send it again.

Sending again is safe even when the judgement was early: a replica never accumulates a microbatch its
ledger already holds or has committed, and a stale replica refuses to serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Verdict(Enum):
    DONE = "done"  # in a step that is on disk (or the run keeps no checkpoints)
    WAIT = "wait"  # on its way into a step, or in one that is not yet on disk
    REPLAY = "replay"  # lost with the replica that held it: accumulate it again


@dataclass(frozen=True)
class LedgerAnswer:
    """One replica's answer about one microbatch."""

    epoch: int  # the replica's epoch
    committed_at: int | None  # the epoch of the step that took the microbatch in, if its ledger has it
    pending: bool  # held in this replica's unstepped gradient
    durable: int  # the newest epoch that outlives this replica: taken by two or more replicas, or on disk


def judge(
    accumulated_at: int, holder_alive: bool, answer: LedgerAnswer, keep_epochs: int = 4, need_durable: bool = True
) -> Verdict:
    """The verdict on a gradient accumulated at epoch `accumulated_at` by a replica that is (or not)
    still in the stage's directory, given an answer from the most advanced replica of the stage.

    `need_durable` False accepts any commit: at the end of a run nothing more is coming to make the
    last steps durable.
    """
    if answer.committed_at is not None:
        durable = answer.committed_at <= max(answer.durable, answer.epoch - keep_epochs) or not need_durable
        return Verdict.DONE if durable else Verdict.WAIT
    if answer.pending:
        return Verdict.WAIT
    if answer.epoch > accumulated_at or not holder_alive:
        return Verdict.REPLAY
    return Verdict.WAIT


def merge_answers(answers: list[dict], req: str) -> LedgerAnswer:
    """What the replicas asked (their `ledger` replies) know of one microbatch: the most advanced
    epoch, a commit or a hold anywhere, and the durability of the replica that reported the commit."""
    committed = [(int(a["committed"][req]), int(a["durable"])) for a in answers if req in a.get("committed", {})]
    return LedgerAnswer(
        epoch=max(int(a["epoch"]) for a in answers),
        committed_at=min(committed)[0] if committed else None,
        pending=any(req in a.get("pending", []) for a in answers),
        durable=max((d for _, d in committed), default=max(int(a["durable"]) for a in answers)),
    )
