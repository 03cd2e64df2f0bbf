"""The stage server's RPC surface: each `rpc_*` method is one call of the protocol.

Handlers are thin: decode (the codecs on a worker thread, off the loop that renews the server's DHT
records), hand to the server's `StageHandler`, encode. A failure becomes an error reply
(`{"error": ..., "refused": ...}` in the metadata) rather than an exception crossing hivemind:
the caller learns whether the server refused the request itself (`BadRequest`: retrying elsewhere
will not help) or failed to serve it (retry elsewhere), and the server keeps serving.

One peer may have at most `max_calls_per_peer` calls in flight here: hivemind and libp2p bound nothing per
peer, and every call holds a stream and, once read, up to `net.max_payload_mb` of request. A call past the
limit is answered at once, before a byte of its request is read. Honest peers stay far below it: a trainer
has at most `trainer.max_inflight` microbatches in flight (each at one stage at a time; 4 by default, 16 in
the largest setting used here), plus replays of lost gradients and a ledger query; a replica makes one
`reduce` call per owner per round and downloads states one at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, AsyncIterator, Protocol  # noqa: UP035  hivemind recognises streams only by typing's alias

import torch
from hivemind.p2p import P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from swarm.net.directory import short
from swarm.net.faultfile import FaultFile
from swarm.net.join import NotMember
from swarm.net.protocol import Item, Traffic, decode, encode, packed
from swarm.net.quiet import Quiet
from swarm.net.secret import AUTH_KEY, SwarmSecret
from swarm.wire.codecs import EXACT, Policy
from swarm.wire.validate import BadRequest, Unavailable

log = logging.getLogger(__name__)
MAX_STRANGERS_LOGGED = 1024  # callers without the secret named in the log (each once); beyond, silence
# calls one peer may have in flight: well above an honest peer's (see the module's docstring), and a bound of
# this many times `net.max_payload_mb` on what one peer can make the server hold
MAX_CALLS_PER_PEER = 64
# kinds of log line a peer can provoke at will, a few per minute each (`Quiet`)
OVER_LIMIT, STRANGERS, FAILURES = "calls over the per-peer limit", "callers without the secret", "handler failures"

Reply = tuple[dict[str, Any], Sequence[Item]]
Handler = Callable[[dict[str, Any], list[torch.Tensor], str], Awaitable[Reply]]
Requests = AsyncIterator[runtime_pb2.ExpertRequest]
Responses = AsyncIterator[runtime_pb2.ExpertResponse]


class StageHandler(Protocol):
    max_request_bytes: int

    def refused(self, method: str, caller: str, error: BadRequest) -> None: ...

    async def forward(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def backward(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def evaluate(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def state(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def reduce(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def ledger(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def backup(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...

    async def count(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str) -> Reply: ...


class StageServicer(ServicerBase):
    def __init__(self, handler: StageHandler, faults: FaultFile | None = None, policy: Policy = EXACT,
                 traffic: Traffic | None = None, delay: float = 0.0, secret: SwarmSecret | None = None,
                 max_calls_per_peer: int = MAX_CALLS_PER_PEER, quiet: Quiet | None = None,
                 device: torch.device | None = None):
        self.handler = handler
        # where the stage computes: its calls' tensors are unpacked there (see codecs.decode); the other
        # calls' (all-reduce parts, states, copies) stay on the host, where their handlers use them
        self.device = device
        self.secret = secret
        self._strangers: set[str] = set()  # callers refused for want of the secret (each logged once)
        self.max_calls_per_peer = max_calls_per_peer
        # caller -> its calls in flight; an entry goes when its count returns to 0, so the dict never
        # holds more entries than there are calls in flight
        self.calls: dict[str, int] = {}
        self.quiet = quiet or Quiet(log)
        self.faults = faults
        self.delay = delay  # seconds before serving a request: half of an emulated round trip
        self.policy = policy
        self.traffic = traffic

    @property
    def in_hand(self) -> int:
        """Calls received and not yet answered, from every caller: the load a record's `queue` misses
        while calls wait on anything but compute (the network, a step, a stalled peer)."""
        return sum(self.calls.values())

    async def _serve(self, handler: Handler, requests: Requests, context: P2PContext,
                     onto: torch.device | None = None) -> Responses:
        caller = context.remote_id.to_base58()
        name = getattr(handler, "__name__", str(handler))
        in_flight = self.calls.get(caller, 0)
        if in_flight >= self.max_calls_per_peer:
            self.quiet.warning(OVER_LIMIT, "%s from %s refused unread: %d calls of that peer in flight (limit %d)",
                               name, short(caller), in_flight, self.max_calls_per_peer)
            if self.secret is not None:
                # in a private swarm a stranger gets no answer at all, and telling one from a member would
                # mean reading its request: past the limit nobody is answered (the stream just ends)
                return
            # refused False: the server is busy, the request itself is fine. The trainer then bans this
            # server for a while and sends the call elsewhere (an accumulating call is retried until it
            # lands); refused True would count as the stage refusing the request, which gives up the
            # microbatch once as many servers as the stage has refused it, and an all-reduce member would
            # take this owner for one that refuses its part
            reply: Reply = {"error": f"too many calls in flight from {short(caller)} (limit "
                                     f"{self.max_calls_per_peer}); try again later or elsewhere",
                            "refused": False}, []
            for msg in encode(*reply, self.policy, self.traffic):
                yield msg
            return
        self.calls[caller] = in_flight + 1
        try:
            async for msg in self._serve_admitted(handler, name, requests, context, caller, onto):
                yield msg
        finally:
            left = self.calls.pop(caller) - 1
            if left:
                self.calls[caller] = left

    async def _serve_admitted(self, handler: Handler, name: str, requests: Requests, context: P2PContext,
                              caller: str, onto: torch.device | None) -> Responses:
        """One call within its caller's limit: decode, handle, encode the reply or the error."""
        me = context.local_id.to_base58()
        remote = caller != me  # else a call of this process's own trainer (`serve_local`): no network between
        traffic = self.traffic if remote else None
        if remote and self.delay:
            await asyncio.sleep(self.delay)
        if remote and self.faults is not None:
            await self.faults.apply(name)
        try:
            admit = None if self.secret is None else partial(self._admit, caller, me)
            # codec work, both ways, on worker threads: the event loop also renews this server's DHT records
            meta, tensors = await decode(requests, self.handler.max_request_bytes, traffic, admit, onto)
            meta, items = await handler(meta, tensors, caller)
            reply: Reply = meta, await packed(items, self.policy)
        except NotMember:
            if caller not in self._strangers and len(self._strangers) < MAX_STRANGERS_LOGGED:
                self._strangers.add(caller)
                self.quiet.warning(STRANGERS, "calls from %s refused: it does not hold this private swarm's secret",
                                   short(caller))
            return  # nothing at all is answered
        except BadRequest as e:
            self.handler.refused(name, caller, e)
            reply = {"error": str(e), "refused": True}, []
        except Unavailable as e:  # a `reply_flag` has the caller send it again, here (cut short, or without inputs)
            reply = {"error": str(e), "refused": False, **({e.reply_flag: True} if e.reply_flag else {})}, []
        except Exception as e:
            if self.quiet.admit(FAILURES):  # a bug a peer can trigger at will: its traceback, a few a minute
                log.exception("handler %s failed", name)
            reply = {"error": f"{type(e).__name__}: {e}", "refused": False}, []
        for msg in encode(*reply, self.policy, traffic):
            yield msg

    def serve_local(self, method: str, requests: Requests, me: PeerID) -> Responses:
        """A call from this process's own trainer (peer id `me`, the server's), served as one from the network
        would be (the same limits, checks and framing), minus the network: no p2p daemon in between."""
        return getattr(self, f"rpc_{method}")(requests, P2PContext(f"{type(self).__name__}.rpc_{method}", me, me))

    def _admit(self, caller: str, me: str, meta: dict[str, Any]) -> None:
        if not self.secret.admits(caller, me, meta.pop(AUTH_KEY, None)):
            raise NotMember(caller)

    async def rpc_forward(self, requests: Requests, context: P2PContext) -> Responses:
        async for msg in self._serve(self.handler.forward, requests, context, self.device):
            yield msg

    async def rpc_backward(self, requests: Requests, context: P2PContext) -> Responses:
        async for msg in self._serve(self.handler.backward, requests, context, self.device):
            yield msg

    async def rpc_evaluate(self, requests: Requests, context: P2PContext) -> Responses:
        async for msg in self._serve(self.handler.evaluate, requests, context, self.device):
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

    async def rpc_count(self, requests: Requests, context: P2PContext) -> Responses:
        async for msg in self._serve(self.handler.count, requests, context):
            yield msg
