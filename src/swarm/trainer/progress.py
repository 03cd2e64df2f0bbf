"""What a trainer has completed, and the progress line (or bar) it shows the person watching."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

from swarm.trainer.view import SwarmView

log = logging.getLogger("swarm.trainer")


@dataclass
class Completed:
    """A microbatch whose backward reached stage 0."""

    time: float
    samples: int
    loss: float
    epoch: int  # the last stage's epoch when it computed this loss
    req: str


class Progress:
    def __init__(self, view: SwarmView, every: float, target_steps: int):
        self.view = view
        self.every = every
        self.target_steps = target_steps
        self.completed: list[Completed] = []
        self.started = time.time()

    def samples(self) -> int:
        return sum(c.samples for c in self.completed)

    def recent_loss(self) -> float:
        recent = self.completed[-20:]
        return sum(c.loss for c in recent) / len(recent) if recent else float("nan")

    def recent_rate(self) -> float:
        """Samples/s completed over the last `every` seconds (since the start, before)."""
        now = time.time()
        since = max(now - self.every, self.started)
        samples = sum(c.samples for c in itertools.takewhile(lambda c: c.time >= since, reversed(self.completed)))
        return samples / max(now - since, 1e-9)

    def line(self) -> str:
        loss = self.recent_loss()
        return (f"{self.samples():,} samples ({self.recent_rate():.1f}/s), loss "
                + ("-" if math.isnan(loss) else f"{loss:.3f}")
                + ", servers/stage " + "/".join(str(len(self.view.servers[k])) for k in range(self.view.num_stages)))

    async def loop(self, label: str) -> None:
        """Every `every` seconds, a log line (a progress bar of the stages' steps where stderr is a
        terminal): a trainer is what an operator watches to see that the swarm trains."""
        bar = None
        if sys.stderr.isatty():
            bar = tqdm(total=self.target_steps, desc=f"trainer {label}", unit="step", dynamic_ncols=True)
        try:
            while True:
                await asyncio.sleep(self.every)
                step = min(self.view.settled_epoch(k) for k in range(self.view.num_stages))
                if bar is None:
                    log.info("trainer %s: %s, step %d", label, self.line(), step)
                else:
                    bar.update(min(step, bar.total) - bar.n)
                    bar.set_postfix_str(self.line())
        finally:
            if bar is not None:
                bar.close()
