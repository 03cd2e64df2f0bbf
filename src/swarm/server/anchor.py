"""Asynchronous mode's averaged state (`optim.mode = "async"`).

Every replica of an async stage updates its weights locally after each microbatch, and the replicas
average every `optim.target_batch_size` stage samples. Averaging is by deltas from the last averaged
state, the *anchor*, identical on every replica: each replica sends its progress since then weighted by
its samples, and all take `anchor + mean delta` (the same bits everywhere) plus whatever they learned
locally while the round ran. A replica's un-averaged progress is what its pending microbatches hold:
they are committed by the averaging round, and a replica that drops them (it was taken for gone, or
loads a peer's state) returns to its anchor, so a microbatch counts exactly once in the stage's
averaged weights. Newcomers and checkpoints get the anchor, not a replica's local progress.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarm.server.nag import NesterovCorrection


def averaged(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors replicas average: the parameters, and NAG's `w_t` (without it, the shift an average
    makes to the served look-ahead point would enter the next correction as velocity). AdamW's moments
    stay each replica's own: statistics of its own gradients, which only scale its steps, and averaging
    them would triple a round's traffic."""
    tensors = list(params)
    if isinstance(optimizer, NesterovCorrection):
        tensors += [optimizer.state[p]["base"] for p in params]
    return tensors


@dataclass(frozen=True)
class AverageRound:
    """What a replica brings to an averaging round, taken at one instant of its weights."""

    snapshot: torch.Tensor  # the averaged tensors then, flat
    contribution: torch.Tensor  # (snapshot - anchor) * samples: its progress, weighted by its share
    samples: int
    ids: list[str]  # the microbatches whose gradients that progress holds
    generation: int  # of the anchor it started from (see Anchor.return_to)
    version: int = 0  # the replica's count of weight changes then (local updates since are its drift)


class Anchor:
    def __init__(self, tensors: Callable[[], list[torch.Tensor]], before_change: Callable[[], None]):
        """`tensors`: the tensors replicas average, live; `before_change`: called before they are written
        in place (see StageRuntime.unshare)."""
        self._tensors = tensors
        self._before_change = before_change
        self.flat = self.current()  # the anchor itself
        self.generation = 0  # bumped whenever the anchor is replaced or the weights return to it

    def current(self) -> torch.Tensor:
        """The averaged tensors as they stand, flat."""
        return torch.cat([t.detach().float().reshape(-1).cpu() for t in self._tensors()])

    def views(self) -> list[torch.Tensor]:
        """The anchor cut into the shapes of the averaged tensors."""
        views, offset = [], 0
        for t in self._tensors():
            views.append(self.flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        return views

    @torch.no_grad()
    def _set_weights(self, flat: torch.Tensor) -> None:
        self._before_change()
        offset = 0
        for t in self._tensors():
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t).to(device=t.device, dtype=t.dtype))
            offset += n

    def begin(self, samples: int, ids: list[str], version: int = 0) -> AverageRound:
        """This replica's part of a round, as its weights stand now (it goes on updating)."""
        snapshot = self.current()
        return AverageRound(snapshot, (snapshot - self.flat) * samples, samples, ids, self.generation, version)

    def finish(self, own: AverageRound, mean_delta: torch.Tensor) -> float:
        """Move the anchor by the stage's mean delta and keep the local progress made since `own` was
        taken; the relative distance of the live weights from the new anchor (`drift`). The new anchor is
        the same bits on every replica of the round."""
        anchor = self.flat + mean_delta
        # local progress since the snapshot is kept, unless the weights were meanwhile reset to the anchor
        live = anchor + (self.current() - own.snapshot) if own.generation == self.generation else anchor
        self._set_weights(live)
        self.flat = anchor
        self.generation += 1
        return float((live - anchor).norm() / anchor.norm().clamp_min(1e-12))

    def return_to(self) -> None:
        """Drop the local progress: the weights become the anchor again."""
        self._set_weights(self.flat)
        self.generation += 1

    def retake(self) -> None:
        """The weights as they stand become the anchor (after a state was loaded)."""
        self.flat = self.current()
        self.generation += 1
