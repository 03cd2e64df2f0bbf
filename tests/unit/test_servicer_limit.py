"""The per-peer limit on calls in flight at a stage server, driven through `StageServicer._serve` without
sockets: a peer past the limit is answered at once, its request unread, and the server forgets a peer
whose calls are all done."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hivemind.proto import runtime_pb2

from swarm.net.protocol import decode, encode
from swarm.net.quiet import Quiet
from swarm.net.secret import AUTH_KEY, SwarmSecret
from swarm.net.servicer import StageServicer
from swarm.wire.validate import BadRequest

LIMIT = 3


@dataclass(frozen=True)
class FakeId:
    name: str

    def to_base58(self) -> str:
        return self.name


@dataclass(frozen=True)
class FakeContext:
    remote_id: FakeId
    local_id: FakeId = FakeId("QmServer")


class Blocking:
    """A stage handler whose `forward` holds every call until `release` is set."""

    max_request_bytes = 1 << 20

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0

    def refused(self, method: str, caller: str, error: BadRequest) -> None:
        raise AssertionError(f"nothing is refused here: {error}")

    async def forward(self, meta: dict[str, Any], tensors: list[torch.Tensor], caller: str):
        self.entered += 1
        await self.release.wait()
        return {"ok": meta["n"]}, []


class Requests:
    """A request stream that records whether the server read any of it."""

    def __init__(self, n: int, meta: dict[str, Any] | None = None) -> None:
        self.messages = list(encode({"n": n, **(meta or {})}, [torch.ones(2)]))
        self.read = 0

    async def __aiter__(self) -> AsyncIterator[runtime_pb2.ExpertRequest]:
        for msg in self.messages:
            self.read += 1
            yield msg


async def reply_of(servicer: StageServicer, handler: Blocking, requests: Requests, caller: str) -> dict[str, Any]:
    responses = servicer._serve(handler.forward, requests.__aiter__(), FakeContext(FakeId(caller)))
    meta, _ = await decode(responses, 1 << 20)
    return meta


async def until(condition, timeout: float = 5.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)
    await asyncio.wait_for(poll(), timeout)


def test_a_peer_past_its_limit_is_answered_at_once_unread_and_forgotten_once_done(
        caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        handler = Blocking()
        servicer = StageServicer(handler, max_calls_per_peer=LIMIT)
        held = [asyncio.create_task(reply_of(servicer, handler, Requests(i), "QmGreedy")) for i in range(LIMIT)]
        await until(lambda: handler.entered == LIMIT)
        assert servicer.calls == {"QmGreedy": LIMIT}

        extra = Requests(99)
        # answered while the others are still held: nothing releases them before this returns
        reply = await asyncio.wait_for(reply_of(servicer, handler, extra, "QmGreedy"), 1.0)
        assert reply["refused"] is False and "too many calls in flight" in reply["error"]
        assert extra.read == 0 and handler.entered == LIMIT

        other = asyncio.create_task(reply_of(servicer, handler, Requests(7), "QmOther"))  # its own allowance
        await until(lambda: handler.entered == LIMIT + 1)
        assert servicer.calls == {"QmGreedy": LIMIT, "QmOther": 1}
        assert servicer.in_hand == LIMIT + 1  # what its record's `calls` says: the refused one is not in hand

        handler.release.set()
        assert [await t for t in held] == [{"ok": i} for i in range(LIMIT)]
        assert await other == {"ok": 7}
        assert servicer.calls == {} and servicer.in_hand == 0  # no entry left for a peer with nothing in flight
        # and a call within the limit goes through again
        assert await reply_of(servicer, handler, Requests(5), "QmGreedy") == {"ok": 5}

    with caplog.at_level(logging.WARNING, logger="swarm.net.servicer"):
        asyncio.run(scenario())
    assert any("refused unread: 3 calls of that peer in flight (limit 3)" in r.getMessage() for r in caplog.records)


def test_a_call_cancelled_midway_gives_its_slot_back() -> None:
    """The client closing its stream cancels the call's task: the count must come down all the same."""
    async def scenario() -> None:
        handler = Blocking()
        servicer = StageServicer(handler, max_calls_per_peer=LIMIT)
        task = asyncio.create_task(reply_of(servicer, handler, Requests(1), "QmGone"))
        await until(lambda: handler.entered == 1)
        assert servicer.calls == {"QmGone": 1}
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert servicer.calls == {}

    asyncio.run(scenario())


def test_in_a_private_swarm_a_call_past_the_limit_gets_no_answer_at_all() -> None:
    """Without reading the request the server cannot tell a member from a stranger, and strangers are
    never answered: past the limit the stream just ends."""
    secret = SwarmSecret(b"0123456789abcdef0123")

    async def scenario() -> None:
        handler = Blocking()
        servicer = StageServicer(handler, secret=secret, max_calls_per_peer=1)
        member = {AUTH_KEY: secret.token("QmMember", "QmServer")}
        held = asyncio.create_task(reply_of(servicer, handler, Requests(1, member), "QmMember"))
        await until(lambda: handler.entered == 1)
        extra = Requests(2, member)
        responses = servicer._serve(handler.forward, extra.__aiter__(), FakeContext(FakeId("QmMember")))
        assert [msg async for msg in responses] == [] and extra.read == 0
        handler.release.set()
        assert await held == {"ok": 1}
        assert servicer.calls == {}

    asyncio.run(scenario())


def test_over_limit_lines_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    """A peer hammering the server past its limit writes a few lines, not one per call."""
    quiet = Quiet(logging.getLogger("test.servicer"), lines=2, interval=60.0, clock=lambda: 0.0)

    async def scenario() -> None:
        handler = Blocking()
        servicer = StageServicer(handler, max_calls_per_peer=1, quiet=quiet)
        held = asyncio.create_task(reply_of(servicer, handler, Requests(1), "QmGreedy"))
        await until(lambda: handler.entered == 1)
        for i in range(20):
            assert "too many calls" in (await reply_of(servicer, handler, Requests(i), "QmGreedy"))["error"]
        handler.release.set()
        await held

    with caplog.at_level(logging.WARNING, logger="test.servicer"):
        asyncio.run(scenario())
    assert len([r for r in caplog.records if r.name == "test.servicer"]) == 2
