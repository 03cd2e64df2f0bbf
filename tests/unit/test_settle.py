"""A trainer's last wait for its gradients gives one in doubt its full settle time after it can be judged."""

from __future__ import annotations

import asyncio
import time

import torch

from swarm.config import TrainerConfig
from swarm.trainer.calls import Served
from swarm.trainer.delivery import GradientKeeper

SETTLE, REQUEST = 0.3, 0.6


def _settled_after(holder: str) -> tuple[float, int]:
    async def main() -> tuple[float, int]:
        tc = TrainerConfig(settle_timeout=SETTLE, request_timeout=REQUEST)
        keeper = GradientKeeper(tc, None, None, None, 0.1, lambda: True, asyncio.Event())
        keeper.keep("r1", 0, "backward", [torch.zeros(1)], Served("answered", {}, [], holder, 0))
        started = time.monotonic()
        left = await keeper.settle()
        return time.monotonic() - started, left

    return asyncio.run(main())


def test_a_gradient_in_doubt_is_waited_for_past_its_judgement_time() -> None:
    waited, left = _settled_after("failed-server")  # the call failed there, another replica answered
    assert left == 1
    assert waited >= REQUEST + SETTLE


def test_a_confirmed_holder_gets_the_settle_time_alone() -> None:
    waited, left = _settled_after("answered")
    assert left == 1
    assert SETTLE <= waited < REQUEST + SETTLE
