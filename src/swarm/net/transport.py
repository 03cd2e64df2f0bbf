"""Calling a stage on a given peer, with a deadline on the whole exchange.

hivemind's streaming calls take no timeout, and a call to a vanished peer can wait a long time, so
every call here runs under `asyncio.wait_for`. Failures are reduced to one exception type that says
whether the remote refused the request (our fault: retrying elsewhere will not help) or the call
failed (their fault or the network's: retry elsewhere).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID

from swarm.net.faultfile import FaultFile
from swarm.net.protocol import Item, Traffic, encode, packed, receive
from swarm.net.secret import AUTH_KEY, SwarmSecret
from swarm.net.servicer import StageServicer
from swarm.wire import codecs
from swarm.wire.codecs import EXACT, Policy
from swarm.wire.validate import Truncated

REPLY_LIMIT_BYTES = 1 << 34  # replies come from servers we chose; the request side is what is capped


class CallFailed(Exception):
    """The call did not produce a reply. `refused`: the server rejected the request itself (retrying will
    not help); `answered`: the server replied with an error (so it did not apply the request);
    `with_inputs`: a backward sent without its inputs found them gone there (`InputsNotHeld`)."""

    def __init__(self, message: str, refused: bool = False, timed_out: bool = False, answered: bool = False,
                 with_inputs: bool = False):
        super().__init__(message)
        self.refused = refused
        self.timed_out = timed_out
        self.answered = answered or refused or with_inputs
        self.with_inputs = with_inputs


class StageClient:
    def __init__(self, p2p: P2P, faults: FaultFile | None = None, policy: Policy = EXACT,
                 traffic: Traffic | None = None, delay: float = 0.0, secret: SwarmSecret | None = None,
                 local: StageServicer | None = None):
        """`delay`: seconds every request waits before it goes (half of an emulated round trip; the
        server waits the other half). `local`: the servicer of this very process (a trainer inside a
        server's process, `server.train`): calls to our own peer id go to it directly, as no network lies
        between them (libp2p cannot dial its own peer id either), framed and checked as any other call."""
        self.p2p = p2p
        self.faults = faults
        self.delay = delay
        self.policy = policy
        self.traffic = traffic
        self.secret = secret
        self.local = local
        self.me = p2p.peer_id.to_base58()

    def alongside(self, traffic: Traffic, local: StageServicer) -> StageClient:
        """A client for another role of this process (a trainer inside a server): the same daemon, fault
        rules, codecs, emulated delay and secret, its own traffic counts, and calls to this peer served by
        `local` in process."""
        return StageClient(self.p2p, self.faults, self.policy, traffic, self.delay, self.secret, local)

    async def call(
        self,
        peer_id: str,
        method: str,
        meta: dict[str, Any],
        tensors: Sequence[Item],
        timeout: float,
        unpack: bool = True,
    ) -> tuple[dict[str, Any], list[torch.Tensor] | list[codecs.Packed]]:
        """The reply's metadata and tensors; with `unpack` False, its tensors as they came, packed (checked as
        unpacking would check them): a trainer relays them to the next stage untouched."""
        try:
            stub = StageServicer.get_stub(self.p2p, PeerID.from_base58(peer_id))
        except Exception as e:  # a peer id read from a record can be garbage
            raise CallFailed(f"{method}: {peer_id[:60]!r} is not a peer id", refused=True) from e

        if self.secret is not None:
            meta = {**meta, AUTH_KEY: self.secret.token(self.me, peer_id)}
        tensors = await packed(tensors, self.policy)  # once, for every attempt below

        local = self.local if peer_id == self.me else None
        traffic = None if local is not None else self.traffic  # (nothing crosses the wire)

        async def exchange() -> tuple[dict[str, Any], list[torch.Tensor]]:
            requests = encode(meta, tensors, self.policy, traffic)
            if local is not None:
                stream = local.serve_local(method, _aiter(requests), self.p2p.peer_id)
            else:
                if self.delay:
                    await asyncio.sleep(self.delay)
                if self.faults is not None:
                    await self.faults.apply(method)
                stream = await getattr(stub, f"rpc_{method}")(_aiter(requests))
            received = await receive(stream, REPLY_LIMIT_BYTES, traffic)
            if unpack:
                reply = received.meta, await received.unpacked()
            else:
                for pack in received.packs:
                    codecs.check(pack)
                reply = received.meta, received.packs
            if reply[0].get("resend"):  # our request reached the server cut short: as a broken stream
                raise Truncated(reply[0].get("error", "the request's stream ended early"))
            return reply

        # A libp2p stream occasionally ends early, before the reply or before the request's end (seen
        # under load on loopback). Every call of the protocol is safe to repeat (servers answer a repeated
        # accumulating call from a cache, reduce contributions are idempotent), so a broken stream is
        # retried once within the deadline.
        deadline = asyncio.get_running_loop().time() + timeout
        for attempt in range(2):
            try:
                # asyncio.timeout rather than wait_for: on Python 3.11 wait_for loses a cancellation that
                # arrives as the call fails, and a stopping trainer would go on retrying
                async with asyncio.timeout(deadline - asyncio.get_running_loop().time()):
                    reply, received = await exchange()
                break
            except TimeoutError as e:
                raise CallFailed(f"{method} timed out after {timeout:.1f}s", timed_out=True) from e
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if attempt == 0 and asyncio.get_running_loop().time() < deadline:
                    continue
                raise CallFailed(f"{method} failed: {type(e).__name__}: {_one_line(e)}") from e
        if "error" in reply:
            raise CallFailed(str(reply["error"]), refused=bool(reply.get("refused")), answered=True,
                             with_inputs=bool(reply.get("with_inputs")))
        return reply, received



def _one_line(error: Exception, limit: int = 160) -> str:
    """libp2p errors span several lines (one per address tried); logs want one line per event."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


async def _aiter(items):
    for item in items:
        yield item
