"""The stage server's RPC surface: each `rpc_*` method is one call of the protocol.

Handlers are thin: decode, hand to the server's `StageHandler`, encode. A failure becomes an error
reply (`{"error": ..., "refused": ...}` in the metadata) rather than an exception crossing hivemind:
the caller learns whether the server refused the request itself (`BadRequest`: retrying elsewhere
will not help) or failed to serve it (retry elsewhere), and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, AsyncIterator, Protocol  # noqa: UP035  hivemind recognises streams only by typing's alias

import torch
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.net.directory import short
from swarm.net.faultfile import FaultFile
from swarm.net.join import NotMember
from swarm.net.protocol import Item, Traffic, decode, encode
from swarm.net.secret import AUTH_KEY, SwarmSecret
from swarm.wire.codecs import EXACT, Policy
from swarm.wire.validate import BadRequest, Unavailable

log = logging.getLogger(__name__)
MAX_STRANGERS_LOGGED = 1024  # callers without the secret named in the log (each once); beyond, silence

Reply = tuple[dict[str, Any], Sequence[Item]]
Handler = Callable[[dict[str, Any], list[torch.Tensor], str], Awaitable[Reply]]
Requests = AsyncIterator[runtime_pb2.ExpertRequest]
Responses = AsyncIterator[runtime_pb2.ExpertResponse]


class StageHandler(Protocol):
    max_request_bytes: int

    def refused(self, method: str, caller: str, error: BadRequest) -> None: ...

    async def forward(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def backward(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def state(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def reduce(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def ledger(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def backup(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...


class StageServicer(ServicerBase):
    def __init__(self, handler: StageHandler, faults: FaultFile | None = None, policy: Policy = EXACT,
                 traffic: Traffic | None = None, delay: float = 0.0, secret: SwarmSecret | None = None):
        self.handler = handler
        self.secret = secret
        self._strangers: set[str] = set()  # callers refused for want of the secret (each logged once)
        self.faults = faults
        self.delay = delay  # seconds before serving a request: half of an emulated round trip
        self.policy = policy
        self.traffic = traffic

    async def _serve(self, handler: Handler, requests: Requests, context: P2PContext) -> Responses:
        caller = context.remote_id.to_base58()
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.faults is not None:
            await self.faults.apply()
        try:
            admit = None if self.secret is None else partial(self._admit, caller, context.local_id.to_base58())
            meta, tensors = await decode(requests, self.handler.max_request_bytes, self.traffic, admit)
            reply: Reply = await handler(meta, tensors, caller)
        except NotMember:
            if caller not in self._strangers and len(self._strangers) < MAX_STRANGERS_LOGGED:
                self._strangers.add(caller)
                log.warning("calls from %s refused: it does not hold this private swarm's secret", short(caller))
            return  # nothing at all is answered
        except BadRequest as e:
            self.handler.refused(handler.__name__, caller, e)
            reply = {"error": str(e), "refused": True}, []
        except Unavailable as e:
            reply = {"error": str(e), "refused": False}, []
        except Exception as e:
            log.exception("handler %s failed", getattr(handler, "__name__", handler))
            reply = {"error": f"{type(e).__name__}: {e}", "refused": False}, []
        for msg in encode(runtime_pb2.ExpertResponse, *reply, self.policy, self.traffic):
            yield msg

    def _admit(self, caller: str, me: str, meta: dict[str, Any]) -> None:
        if not self.secret.admits(caller, me, meta.pop(AUTH_KEY, None)):
            raise NotMember(caller)

    async def rpc_forward(self, requests: Requests, context: P2PContext) -> Responses:
        async for msg in self._serve(self.handler.forward, requests, context):
            yield msg

    async def rpc_backward(self, requests: Requests, context: P2PContext) -> Responses:
        async for msg in self._serve(self.handler.backward, requests, context):
            yield msg

    async def rpc_reduce(self, requests: Requests, context: P2PContext) -> Responses:
        async for msg in self._serve(self.handler.reduce, requests, context):
            yield msg

    async def rpc_state(self, requests: Requests, context: P2PContext) -> Responses:
        async for msg in self._serve(self.handler.state, requests, context):
            yield msg

    async def rpc_ledger(self, requests: Requests, context: P2PContext) -> Responses:
        async for msg in self._serve(self.handler.ledger, requests, context):
            yield msg

    async def rpc_backup(self, requests: Requests, context: P2PContext) -> Responses:
        async for msg in self._serve(self.handler.backup, requests, context):
            yield msg
