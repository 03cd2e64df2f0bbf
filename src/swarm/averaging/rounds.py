"""The state of one stage all-reduce round (see swarm.averaging.allreduce), and how an owner that gave
up its round says why: the members it names, by what it saw of each. A member that hears the reason
names no one on the owner's word alone; it looks for the same evidence of its own."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch

from swarm.averaging.failures import RoundFailed
from swarm.core.partition import split_evenly
from swarm.net.directory import short
from swarm.net.transport import CallFailed
from swarm.wire import codecs

# what an owner that gave up its round saw of the members it names
SILENT = "no part from"  # no part within the owner's timeout
POISON_FROM = "poison from"  # a part or an answer refused as poison, or a member's word that its own part was


def part_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal slices of a vector of `total` elements."""
    return [(r.start, r.stop) for r in split_evenly(total, parts)]


@dataclass
class Round:
    """One member's round for one epoch, as owner of its part: what came in, and how it ended."""

    epoch: int
    group: tuple[str, ...]
    size: int
    digest: str  # the owner's weights: contributions computed on other weights are refused
    contributions: dict[str, tuple[torch.Tensor, int, list[str]]] = field(default_factory=dict)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    result: tuple[codecs.Packed, int, list[str]] | None = None
    reducing: bool = False  # every part came, and the reduction is under way
    poisoned: set[str] = field(default_factory=set)  # members whose contribution was refused as poison
    # owners whose answer to our part was refused as poison, or that said their own part was poison
    poison_named: set[str] = field(default_factory=set)
    silent: frozenset[str] = frozenset()  # members whose part never came (why the round was given up)
    began: float = field(default_factory=time.monotonic)
    waited_longer: bool = False  # its wait past the timeout was logged

    def why_abandoned(self) -> str:
        """The reason an abandoned round gives the parts still waiting on it (empty: none it can name)."""
        named = [f"{label} {' '.join(sorted(members))}" for label, members in
                 ((SILENT, self.silent), (POISON_FROM, self.poisoned | self.poison_named)) if members]
        return f": {'; '.join(named)}" if named else ""


def named_in(reason: str, label: str, group: tuple[str, ...]) -> frozenset[str]:
    """The members of `group` an abandoned round's reason lists after `label`."""
    at = reason.find(label)
    listed = reason[at + len(label):].split(";")[0].split() if at >= 0 else []
    return frozenset(m for m in group if m in listed)


@dataclass
class RoundResult:
    mean: torch.Tensor  # the stage's mean gradient
    samples: int  # over the whole stage
    ids: list[str]  # microbatches the step takes in, stage-wide


def exchange_evidence(epoch: int, exchanges: dict[str, asyncio.Future]) -> RoundFailed | None:
    """What our finished exchanges with owners say against them: an answer refused as poison, or an
    owner that gave up its own round because its own part was poison (a member's word about itself is
    the one word taken from it)."""
    for owner, task in exchanges.items():
        failure = task.exception() if task.done() and not task.cancelled() else None
        if isinstance(failure, RoundFailed) and owner in failure.unreachable:
            return failure
        if isinstance(failure, CallFailed) and owner in named_in(str(failure), POISON_FROM, (owner,)):
            return RoundFailed(f"epoch {epoch}: {short(owner)} refused its own part as poison", frozenset({owner}))
    return None
