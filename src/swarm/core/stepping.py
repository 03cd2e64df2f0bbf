"""When a stage takes an optimizer step, and who averages with whom.

All replicas of a stage step together on averaged gradients, so the decision is made from the stage's
collective progress in the current epoch, not from any single replica's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def stage_ready(own_samples: int, peer_samples: Mapping[str, int], target_batch_size: int) -> bool:
    """Whether the stage as a whole has accumulated `target_batch_size` samples this epoch.

    `peer_samples` holds the other replicas' announced counts for the same epoch; counts from other
    epochs must be left out by the caller, since they belong to a different step.
    """
    return own_samples + sum(peer_samples.values()) >= target_batch_size


def expected_group(own_id: str, peers_at_epoch: Iterable[str]) -> tuple[str, ...]:
    """The stage members that should join this epoch's all-reduce, in an order every member agrees on."""
    return tuple(sorted({own_id, *peers_at_epoch}))
