"""The validation loss: the held-out samples (`data.validation_samples`, never trained on) pushed forward
through the swarm every `trainer.eval_every` steps of the stages, and once more when training ends.

Every stage is called with `evaluate`, a forward that changes nothing on the server: no graph kept, no
gradient, ledger entry or receipt (swarm.server.handlers). Its microbatches go through stochastic wiring
and retries like training's, while training goes on, so the weights may take a step in the middle of an
evaluation; the loss is reported at the step the evaluation began.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from swarm.data import SampleTable, split_inputs_targets
from swarm.trainer.calls import MicrobatchFailed, StageCaller
from swarm.wire.validate import IGNORE_INDEX

log = logging.getLogger("swarm.trainer")


@dataclass(frozen=True)
class Validation:
    step: int  # the least step of the stages when the evaluation began
    loss: float  # mean over every held-out target token
    samples: int
    tokens: int  # targets counted (padding left out)
    seconds: float  # how long the evaluation took
    time: float  # unix time it ended


def mean_over_tokens(parts: list[tuple[float, int]]) -> float:
    """The mean loss over all tokens, from each microbatch's mean loss and its count of counted targets."""
    tokens = sum(n for _, n in parts)
    return sum(loss * n for loss, n in parts) / tokens if tokens else math.nan


class Validator:
    def __init__(self, table: SampleTable, caller: StageCaller, num_stages: int, microbatch: int, every: int,
                 max_inflight: int, step: Callable[[], int], poll: float):
        """`step`: the stages' current step, as the trainer sees it; `poll`: seconds between looks at it."""
        held_out = table.validation()
        self.batches = held_out.split(microbatch) if len(held_out) else ()
        self.pad_id = table.pad_id
        self.caller, self.num_stages = caller, num_stages
        self.every, self.max_inflight = every, max_inflight
        self.step, self.poll = step, poll
        self.results: list[Validation] = []
        self._tried: int | None = None  # the step of the last evaluation begun (a failed one waits for the next)
        self._ids = itertools.count()

    @property
    def latest(self) -> Validation | None:
        return self.results[-1] if self.results else None

    def due(self, step: int) -> bool:
        """At the first look (a baseline), then once the step reaches the next multiple of `every`."""
        return self._tried is None or step // self.every > self._tried // self.every

    async def loop(self) -> None:
        while True:
            if self.due(step := self.step()):
                await self.evaluate(step)
            await asyncio.sleep(self.poll)

    async def final(self) -> None:
        """The validation loss where training ended, unless one was just taken there."""
        if self.latest is None or self.latest.step != self.step():
            await self.evaluate(self.step())

    async def evaluate(self, step: int) -> Validation | None:
        """Every held-out sample through the swarm, `max_inflight` microbatches at a time; None (and a
        warning) if a microbatch failed on every server it was tried on."""
        started, self._tried = time.monotonic(), step
        slots = asyncio.Semaphore(self.max_inflight)

        async def one(batch: torch.Tensor) -> tuple[float, int]:
            async with slots:
                return await self._microbatch(batch)

        failure = None
        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels the rest
                tasks = [group.create_task(one(batch)) for batch in self.batches]
        except* MicrobatchFailed as failed:
            failure = failed.exceptions[0]
        if failure is not None:
            log.warning("validation at step %d abandoned: %s", step, failure)
            return None
        parts = [task.result() for task in tasks]
        result = Validation(step, mean_over_tokens(parts), sum(len(b) for b in self.batches),
                            sum(n for _, n in parts), time.monotonic() - started, time.time())
        self.results.append(result)
        log.info("validation loss %.4f over %d samples at step %d (%.1fs)", result.loss, result.samples, step,
                 result.seconds)
        return result

    async def _microbatch(self, batch: torch.Tensor) -> tuple[float, int]:
        """The last stage's mean loss over the microbatch's counted targets, and how many there are."""
        inputs, targets = split_inputs_targets(batch, self.pad_id)
        req, last = f"val{next(self._ids)}", self.num_stages - 1
        x = inputs
        for k in range(last):
            x = (await self.caller.call(k, "evaluate", req, [x])).tensors[0]
        served = await self.caller.call(last, "evaluate", req, [x, targets])
        return float(served.meta["loss"]), int((targets != IGNORE_INDEX).sum())

    def summary(self) -> list[dict]:
        return [asdict(v) for v in self.results]
