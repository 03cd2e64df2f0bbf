"""Hostile insiders: the project's own trainer and server, each changed in one narrow place, run by
`swarm.ops.hostile` against a swarm. Each process runs its one peer and exits, so each change is made by
swapping the class the peer's module builds from (a seam in the peer's own code would serve no honest
use).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import swarm.server.lifecycle as server_module
import swarm.trainer.trainer as trainer_module
from swarm.averaging.allreduce import StageAllReduce
from swarm.averaging.checks import Bounds
from swarm.config import SwarmConfig
from swarm.net.identity import peer_id_of
from swarm.trainer.calls import Served, StageCaller
from swarm.wire import codecs

ATTACKING = "attacking"  # what a hostile peer prints once it has joined and begins
HUGE = 3e38  # the largest gradient value a poison trainer sends: float32 holds it (up to 3.4e38), not its square


def poisoned(grad: torch.Tensor) -> torch.Tensor:
    """`grad` scaled so that its largest magnitude is `HUGE` (all `HUGE` where it is zero): every value is
    finite, so no check for NaN or infinity refuses it, while its L2 norm overflows float32."""
    peak = grad.abs().max()
    return grad / peak * HUGE if peak > 0 else torch.full_like(grad, HUGE)


class PoisonCaller(StageCaller):
    """The trainer's stage caller (`swarm.trainer.calls`), but every backward call, and every replay of
    one, carries the gradient of the stage's output `poisoned`: the narrowest change that makes the
    project's own trainer hostile, since every output gradient it sends passes through `call`.
    `began` is set at its first backward call (the attack has begun)."""

    def __init__(self, began: asyncio.Event, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.began = began

    async def call(self, stage: int, method: str, req: str, tensors: list[codecs.Carried], prefer: str | None = None,
                   accumulating: bool = False) -> Served:
        if method == "backward":
            self.began.set()
            grad = tensors[1]  # (as the next stage's reply came: packed)
            tensors = [tensors[0], poisoned(codecs.decode(grad) if isinstance(grad, codecs.Packed) else grad)]
        return await super().call(stage, method, req, tensors, prefer=prefer, accumulating=accumulating)


async def poison_trainer(cfg: SwarmConfig, seconds: float) -> None:
    """Train as any trainer does, but through a `PoisonCaller`, for `seconds` from the first poisoned
    call; then stop at once (its microbatches in flight are abandoned, as they would be on SIGINT). Bans
    of 0 s: it does not back off from the servers that refuse it, as an honest trainer would."""
    began = asyncio.Event()
    trainer_module.StageCaller = functools.partial(PoisonCaller, began)
    trainer = trainer_module.Trainer(replace(cfg, trainer=replace(cfg.trainer, ban_seconds=0.0)))
    await _attack_for("poison-trainer", trainer.train, began, lambda: trainer.peer_id, seconds)


class ForgingAllReduce(StageAllReduce):
    """The stage's all-reduce, but each contribution this replica makes with microbatches in hand claims what
    it never held, in turn: a microbatch of a trainer it never served (with one of its real receipts copied, so
    the list is well-formed), or one sample more than it holds (within every per-microbatch bound, so that
    only the receipts tell). Honest owners check every listed microbatch's receipt and the samples they add up
    to (swarm.averaging.checks.check_receipts), so they must refuse its part as poison.

    Its contributions without microbatches are honest: a replica whose every round is refused falls behind,
    catches up, and is sent no work meanwhile, so lying in those too could keep it from ever holding a
    microbatch to lie about. `began` is set once it has made both claims."""

    began: asyncio.Event

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.bounds = Bounds()  # it takes its own lies as the owner of its part: they must reach the others
        self.forged = 0

    async def run(self, epoch: int, group: tuple[str, ...], flat_grad: torch.Tensor, samples: int,
                  digest: str = "", ids: list[str] | None = None, receipts: list[list] | None = None) -> Any:
        ids, receipts = list(ids or []), list(receipts or [])
        if receipts:
            self.forged += 1
            if self.forged % 2:
                stranger = peer_id_of(Ed25519PrivateKey.generate().public_key())
                ids.append(f"{stranger}/never-held-{epoch}")
                receipts.append(list(receipts[0]))
                samples += receipts[0][0]
            else:
                samples += 1
        if self.forged >= 2:
            self.began.set()
        return await super().run(epoch, group, flat_grad, samples, digest, ids, receipts)


async def forging_replica(cfg: SwarmConfig, seconds: float) -> None:
    """Serve stage 1 as any server does, but with a `ForgingAllReduce`, for `seconds` from the contribution
    by which it has made both of its false claims."""
    ForgingAllReduce.began = asyncio.Event()
    server_module.StageAllReduce = ForgingAllReduce
    server = server_module.StageServer(replace(cfg, server=replace(cfg.server, stage=1)))
    await _attack_for("forging-replica", server.serve, ForgingAllReduce.began,
                      lambda: server.peer.peer_id if server.peer else "?", seconds)


async def _attack_for(kind: str, peer: Callable[[asyncio.Event], Awaitable[None]], began: asyncio.Event,
                      who: Callable[[], str], seconds: float) -> None:
    """Run `peer(stop)`; once `began` is set, print ATTACKING and stop it `seconds` later."""
    stop = asyncio.Event()
    running = asyncio.create_task(peer(stop))
    beginning = asyncio.create_task(began.wait())
    await asyncio.wait({running, beginning}, return_when=asyncio.FIRST_COMPLETED)
    beginning.cancel()
    if running.done():
        running.result()  # raises what ended it
        raise RuntimeError(f"the {kind} ended before it began attacking")
    print(f"hostile {kind} from {who()}: {ATTACKING}", flush=True)
    await asyncio.wait({running}, timeout=seconds)
    stop.set()
    await running


INSIDERS: dict[str, Callable[[SwarmConfig, float], Awaitable[None]]] = {
    "poison-trainer": poison_trainer,
    "forging-replica": forging_replica,
}


