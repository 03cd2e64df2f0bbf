"""Which samples a trainer takes next, so that trainers coming and going cover each pass over the data
once: none trained twice, none left behind.

Each pass over the corpus has its own seeded order of the samples, cut into blocks of
`data.block_samples` consecutive positions. A trainer leases one block at a time (a DHT record it
renews) and takes microbatches from it front to back. Before a microbatch reaches the first stage that
accumulates its gradient, its range is recorded as consumed: from then on sending it again could count
it twice, so whoever holds the block next skips it. A trainer that dies stops renewing; once its lease
lapses, the next trainer to look takes the block over and goes on from what the record says.

The records decide, not the trainers' memories: a trainer that was stalled past its lease and finds the
block taken over drops it, and the microbatches it had not yet recorded are not sent.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

Range = tuple[int, int]  # [start, end) positions within a block
BLOCKS_PER_KEY = 48  # blocks listed under one DHT key: a full key's value stays far below the DHT's 64 KiB
LEASE_MARGIN = 2.0  # seconds past a lease before another trainer takes the block: clocks differ a little


@dataclass(frozen=True)
class Claim:
    """A block's record: who holds it, until when, and which of its ranges are consumed."""

    owner: str  # peer id of the trainer that holds (or last held) the block
    lease_until: float  # DHT time after which another trainer may take the block over
    done: tuple[Range, ...]  # consumed ranges, sorted and merged
    size: int  # samples in the block

    @property
    def finished(self) -> bool:
        return self.done == ((0, self.size),)

    def free_for(self, me: str, now: float) -> bool:
        """Whether `me` may take (or keep) the block at `now`."""
        return not self.finished and (self.owner == me or self.lease_until + LEASE_MARGIN <= now)


def merged(done: Iterable[Range], more: Range) -> tuple[Range, ...]:
    """`done` with `more` added, as sorted ranges that neither overlap nor touch."""
    out: list[list[int]] = []
    for start, end in sorted([*done, more]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return tuple((s, e) for s, e in out if e > s)


def merged_all(done: Iterable[Range], more: Iterable[Range]) -> tuple[Range, ...]:
    """Both sets of consumed ranges as one (what one record lacks, another may hold: they only grow)."""
    out = tuple(done)
    for r in more:
        out = merged(out, r)
    return out


def missing(done: Iterable[Range], size: int) -> list[Range]:
    """The ranges of a block of `size` samples that `done` does not cover, in order."""
    gaps, at = [], 0
    for start, end in sorted(done):
        if start > at:
            gaps.append((at, min(start, size)))
        at = max(at, end)
    if at < size:
        gaps.append((at, size))
    return [(s, e) for s, e in gaps if e > s]


def cut(gaps: Iterable[Range], width: int) -> list[Range]:
    """Microbatch ranges of at most `width` samples covering `gaps` in order (a gap's last one may be short)."""
    return [(s, min(s + width, end)) for start, end in gaps for s in range(start, end, width)]


def block_count(num_samples: int, block_samples: int) -> int:
    return -(-num_samples // block_samples)


def block_size(block: int, num_samples: int, block_samples: int) -> int:
    return min(block_samples, num_samples - block * block_samples)


def pick_block(claims: Mapping[int, Claim], blocks: Sequence[int], me: str, now: float, rng: random.Random,
               spread: int) -> int | None:
    """Which of `blocks` (in order) `me` should hold next; None if each is finished or held by another.

    A block `me` already holds comes first (a trainer restarted with its identity picks up its own
    block), then the lowest block another trainer left unfinished (it died, or gave the block back):
    what was begun is finished first. Otherwise one of the `spread` lowest untouched blocks, at random:
    trainers looking at the same moment mostly pick different blocks, and low blocks go first so that
    none is left behind."""
    free = [b for b in blocks if b not in claims or claims[b].free_for(me, now)]
    held = [b for b in free if b in claims and claims[b].owner == me]
    left = [b for b in free if b in claims]
    if held or left:
        return (held or left)[0]
    return rng.choice(free[:max(1, spread)]) if free else None
