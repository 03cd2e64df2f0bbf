"""Values the stage runtime hands to the rest of the server: a kept forward graph, a step's record."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class StepPart:
    """What a replica brings to a sync round: its gradient sum, taken out of its parameters' gradients
    (which go on accumulating for the next step while the round runs), and the microbatches it holds."""

    flat: torch.Tensor
    samples: int
    ids: list[str]


@dataclass(eq=False)
class BatchGraph:
    """The autograd graph of one forward batch, awaiting its requests' output gradients."""

    inputs: torch.Tensor
    outputs: torch.Tensor
    created: float
    rows: dict[str, slice]  # request id -> its rows in the batch
    version: int = 0  # of the weights the forward ran at
    stash: dict[str, torch.Tensor] | None = None  # async: the copy of the weights it ran at

    @property
    def size(self) -> int:
        return len(self.rows)


@dataclass
class StepRecord:
    epoch: int  # the epoch this step produced
    samples: int  # samples of the whole stage that went into it
    group: int  # replicas that took part
    lr: float
    grad_norm: float
    digest: str  # hash of the parameters after the step: equal digests mean bit-identical replicas
    ids: list[str] = field(default_factory=list)  # the microbatches the step took in, stage-wide
    time: float = field(default_factory=time.time)
    # async: how far this replica's weights are from the average right after the round (relative L2
    # norm): the local progress it made while the round ran, which it keeps
    drift: float = 0.0
    local_updates: int = 0  # async: the local updates it made while the round ran (what the drift is made of)
