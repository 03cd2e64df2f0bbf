"""A trainer relays a stage's reply to the next stage as it came, packed: neither decoded nor encoded
again on the way, and a malformed reply is still its sender's failure. Over real p2p daemons on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P

from swarm.net.protocol import Tagged
from swarm.net.servicer import StageServicer
from swarm.net.transport import CallFailed, StageClient
from swarm.wire import codecs
from swarm.wire.validate import BadRequest

POLICY = codecs.Policy({"activations": "blockwise8"})


class Stage:
    """Answers every forward with `reply` and keeps what each forward carried, unpacked as a server does."""

    max_request_bytes = 1 << 26

    def __init__(self, reply: list[Tagged]) -> None:
        self.reply = reply
        self.received: list[list[torch.Tensor]] = []

    def refused(self, method: str, caller: str, error: BadRequest) -> None:
        raise AssertionError(f"nothing is refused here: {error}")

    async def forward(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str):
        self.received.append(tensors)
        return {}, self.reply


def relay_through(first_reply: codecs.Packed) -> tuple[list, list[torch.Tensor] | CallFailed]:
    """A call to one stage, its reply's tensors relayed to a second: (the reply's tensors as the caller got
    them, what the second stage received; or the first call's failure)."""

    async def scenario():
        p2ps = [await P2P.create()]
        p2ps += [await P2P.create(initial_peers=await p2ps[0].get_visible_maddrs()) for _ in range(2)]
        trainer, first, second = p2ps
        try:
            stages = [Stage([Tagged("activations", first_reply)]), Stage([])]
            for p2p, stage in zip((first, second), stages, strict=True):
                await StageServicer(stage).add_p2p_handlers(p2p)
            client = StageClient(trainer, policy=POLICY)
            try:
                _, got = await client.call(first.peer_id.to_base58(), "forward", {}, [torch.zeros(2)], 30,
                                           unpack=False)
            except CallFailed as e:
                return [], e
            await client.call(second.peer_id.to_base58(), "forward", {}, [Tagged("activations", got[0])], 30)
            return got, stages[1].received[0]
        finally:
            for p2p in p2ps:
                await p2p.shutdown()

    return asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_reply_is_relayed_to_the_next_stage_bit_for_bit() -> None:
    activations = torch.randn(4, 16, 32)
    sent = POLICY.pack("activations", activations)
    got, received = relay_through(sent)
    assert isinstance(got[0], codecs.Packed) and got[0].meta == sent.meta
    assert all(torch.equal(a, b) for a, b in zip(got[0].parts, sent.parts, strict=True))
    assert codecs.rows(got[0]) == 4
    assert torch.equal(received[0], codecs.decode(sent))  # what the first stage meant, not re-quantized


@pytest.mark.timeout(60)
def test_a_malformed_reply_fails_the_call_that_got_it() -> None:
    """Scales that are not finite: the caller refuses the reply as unpacking would, so the failure is the
    replying server's, not the next stage's refusal of the relayed garbage."""
    sent = POLICY.pack("activations", torch.randn(4, 16, 32))
    sent.parts[1][0] = float("inf")
    got, failure = relay_through(sent)
    assert isinstance(failure, CallFailed) and "finite" in str(failure) and not failure.refused
