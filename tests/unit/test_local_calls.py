"""A trainer inside a server's process (`server.train`) calls that server without the network: straight into
its servicer, with the same framing, limits and checks as a call from another peer, and no bytes counted as
traffic. Over a real p2p daemon on loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P

from swarm.net.protocol import Tagged, Traffic
from swarm.net.servicer import StageServicer
from swarm.net.transport import CallFailed, StageClient
from swarm.wire import codecs
from swarm.wire.validate import BadRequest

POLICY = codecs.Policy({"activations": "blockwise8"})


class Stage:
    """Doubles every forward's input; keeps who called and what each call carried."""

    def __init__(self, max_request_bytes: int) -> None:
        self.max_request_bytes = max_request_bytes
        self.calls: list[tuple[str, list[torch.Tensor]]] = []
        self.refusals: list[str] = []

    def refused(self, method: str, caller: str, error: BadRequest) -> None:
        self.refusals.append(str(error))

    async def forward(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str):
        self.calls.append((caller, tensors))
        return {"seen": meta["n"]}, [Tagged("activations", 2 * tensors[0])]


def call_own_server(x: torch.Tensor, local: bool, max_request_bytes: int = 1 << 20):
    """One forward from a client to the servicer of its own peer: (reply or CallFailed, the stage, the
    client's traffic, the servicer's traffic, the peer id)."""

    async def scenario():
        p2p = await P2P.create()
        try:
            stage, server_traffic, client_traffic = Stage(max_request_bytes), Traffic(), Traffic()
            servicer = StageServicer(stage, policy=POLICY, traffic=server_traffic)
            await servicer.add_p2p_handlers(p2p)
            client = StageClient(p2p, policy=POLICY, traffic=client_traffic, local=servicer if local else None)
            me = p2p.peer_id.to_base58()
            try:
                reply = await client.call(me, "forward", {"n": 7}, [Tagged("activations", x)], 10)
            except CallFailed as e:
                reply = e
            return reply, stage, client_traffic, server_traffic, me
        finally:
            await p2p.shutdown()

    return asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_call_to_its_own_server_is_served_in_process_and_crosses_no_wire() -> None:
    x = torch.randn(2, 8, 32)
    reply, stage, client_traffic, server_traffic, me = call_own_server(x, local=True)
    meta, (y,) = reply
    assert meta["seen"] == 7
    caller, (received,) = stage.calls[0]
    assert caller == me
    assert torch.equal(received, codecs.decode(POLICY.pack("activations", x)))  # packed as on the wire
    assert torch.equal(y, codecs.decode(POLICY.pack("activations", 2 * received)))
    assert client_traffic.as_dict() == {} and server_traffic.as_dict() == {}


@pytest.mark.timeout(60)
def test_a_call_to_its_own_server_meets_the_servers_limits() -> None:
    reply, stage, *_ = call_own_server(torch.randn(64, 64, 64), local=True, max_request_bytes=1024)
    assert isinstance(reply, CallFailed) and reply.refused and "exceeds the limit" in str(reply)
    assert stage.calls == [] and len(stage.refusals) == 1


@pytest.mark.timeout(60)
def test_without_the_servicer_at_hand_a_peer_cannot_call_itself() -> None:
    """libp2p does not dial its own peer id: why a server's own trainer needs the in-process path."""
    reply, stage, *_ = call_own_server(torch.randn(2, 8, 32), local=False)
    assert isinstance(reply, CallFailed) and not reply.answered
    assert stage.calls == []
