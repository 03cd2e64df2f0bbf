"""The stage server's RPC surface: each `rpc_*` method is one call of the protocol.

Handlers are thin: decode, hand to the server's `StageHandler`, encode. Errors the caller caused
(`BadRequest`) travel back as the call's error text; hivemind turns a raised exception into a
`P2PHandlerError` on the caller's side carrying that text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, AsyncIterator, Protocol  # noqa: UP035  hivemind recognises streams only by typing's alias

import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.net.protocol import decode, encode

Reply = tuple[dict[str, Any], Sequence[torch.Tensor]]


class StageHandler(Protocol):
    max_request_bytes: int

    async def forward(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def backward(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def state(self, meta: dict[str, Any], caller: str) -> Reply: ...

    async def reduce(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...


class StageServicer(ServicerBase):
    def __init__(self, handler: StageHandler):
        self.handler = handler

    async def rpc_forward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        meta, tensors = await decode(requests, self.handler.max_request_bytes)
        reply = await self.handler.forward(meta, tensors, context.remote_id.to_base58())
        for msg in encode(runtime_pb2.ExpertResponse, *reply):
            yield msg

    async def rpc_backward(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        meta, tensors = await decode(requests, self.handler.max_request_bytes)
        reply = await self.handler.backward(meta, tensors, context.remote_id.to_base58())
        for msg in encode(runtime_pb2.ExpertResponse, *reply):
            yield msg

    async def rpc_reduce(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        meta, tensors = await decode(requests, self.handler.max_request_bytes)
        reply = await self.handler.reduce(meta, tensors, context.remote_id.to_base58())
        for msg in encode(runtime_pb2.ExpertResponse, *reply):
            yield msg

    async def rpc_state(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        meta, _ = await decode(requests, 1 << 16)
        reply = await self.handler.state(meta, context.remote_id.to_base58())
        for msg in encode(runtime_pb2.ExpertResponse, *reply):
            yield msg
