"""A request whose stream ended early on its way is answered `resend` by the server, and the caller sends it
again at once, to the same server: a dropped connection is not the caller's malformed request (which would
count as the stage refusing it) and not the server's fault (which would ban the server). Over real p2p
daemons on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P

import swarm.net.transport as transport
from swarm.net.servicer import StageServicer
from swarm.net.transport import CallFailed, StageClient
from swarm.wire.validate import BadRequest, InputsNotHeld


class Recording:
    """A stage handler that answers every forward with its tensors' sizes."""

    max_request_bytes = 1 << 26

    def __init__(self) -> None:
        self.forwards: list[list[int]] = []

    def refused(self, method: str, caller: str, error: BadRequest) -> None:
        raise AssertionError(f"nothing is refused here: {error}")

    async def forward(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str):
        self.forwards.append([t.numel() for t in tensors])
        return {"sizes": [t.numel() for t in tensors]}, []


@pytest.mark.timeout(60)
def test_a_request_cut_short_on_its_way_is_sent_again_to_the_same_server(monkeypatch):
    sent: list[int] = []  # messages each attempt put on the wire
    whole = transport.encode

    def cut_the_first(*args, **kwargs):
        messages = list(whole(*args, **kwargs))
        if not sent:
            messages = messages[:-1]  # the stream ends before the request's last part
        sent.append(len(messages))
        return iter(messages)

    monkeypatch.setattr(transport, "encode", cut_the_first)

    async def scenario() -> None:
        server = await P2P.create()
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        try:
            handler = Recording()
            await StageServicer(handler).add_p2p_handlers(server)
            reply, _ = await StageClient(client).call(server.peer_id.to_base58(), "forward", {"req": "r"},
                                                      [torch.ones(3), torch.zeros(5)], 30)
            assert reply == {"sizes": [3, 5]}
            assert sent == [1, 2] and handler.forwards == [[3, 5]]  # read whole once, the cut one never
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_server_without_the_inputs_a_backward_left_out_says_so_and_applies_nothing():
    """`InputsNotHeld` reaches the caller as such (`with_inputs`), not as a refusal of the request, which
    would count against the stage, nor as a plain failure, which would ban the server."""

    class Forgetful(Recording):
        async def backward(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str):
            if len(tensors) == 1:
                raise InputsNotHeld("the inputs of its forward are no longer held here")
            return {"sizes": [t.numel() for t in tensors]}, []

    async def scenario() -> None:
        server = await P2P.create()
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        try:
            await StageServicer(Forgetful()).add_p2p_handlers(server)
            caller = StageClient(client)
            with pytest.raises(CallFailed) as failed:
                await caller.call(server.peer_id.to_base58(), "backward", {"req": "r"}, [torch.ones(3)], 30)
            assert failed.value.with_inputs and failed.value.answered and not failed.value.refused
            reply, _ = await caller.call(server.peer_id.to_base58(), "backward", {"req": "r"},
                                         [torch.zeros(4), torch.ones(3)], 30)
            assert reply == {"sizes": [4, 3]}
        finally:
            await client.shutdown()
            await server.shutdown()

    asyncio.run(scenario())
