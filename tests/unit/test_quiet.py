"""The rate limit on log lines strangers can provoke: a few lines per kind per interval, then one summary
line with the count of those held back, on a fake clock."""

from __future__ import annotations

import asyncio
import logging

import pytest
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from swarm.net import protocol
from swarm.net.quiet import Quiet, QuietRepeats

log = logging.getLogger("test.quiet")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == log.name]


def test_the_first_lines_pass_the_rest_are_counted_and_summed_up_after_the_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    quiet = Quiet(log, lines=3, interval=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for i in range(10):
            quiet.warning("malformed stream messages", "garbage %d", i)
            clock.now += 1.0
        assert lines(caplog) == ["garbage 0", "garbage 1", "garbage 2"]
        clock.now = 1000.0 + 59.5  # still within the interval: still held back, no summary yet
        quiet.warning("malformed stream messages", "garbage %d", 10)
        assert len(lines(caplog)) == 3
        clock.now = 1000.0 + 75.0  # the interval is over: its summary, then a fresh allowance
        quiet.warning("malformed stream messages", "garbage %d", 11)
        assert lines(caplog)[3:] == ["… and 8 more malformed stream messages in the last 75 s", "garbage 11"]


def test_kinds_have_allowances_of_their_own_and_a_quiet_interval_writes_no_summary(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    quiet = Quiet(log, lines=1, interval=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert quiet.admit("a") and not quiet.admit("a")
        assert quiet.admit("b")  # another kind is not held back by the first one's flood
        clock.now += 10.0
        assert quiet.admit("b")  # nothing of "b" was held back: no summary for it
        assert lines(caplog) == []
        assert quiet.admit("a")
        assert lines(caplog) == ["… and 1 more a in the last 10 s"]


def test_a_flood_of_malformed_stream_messages_writes_a_few_lines(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """hivemind's stream reader, as bounded, goes through the global limit: 10,000 bad messages once
    wrote 4,802 lines."""
    clock = Clock()
    monkeypatch.setattr(protocol, "_quiet", Quiet(protocol.log, lines=2, interval=60.0, clock=clock))
    protocol.bound_stream_messages()

    async def flood(count: int) -> None:
        for _ in range(count):
            reader = asyncio.StreamReader()
            reader.feed_data(b"\x07garbage")  # no such message marker
            with pytest.raises(asyncio.IncompleteReadError):
                await P2P.receive_protobuf(runtime_pb2.ExpertRequest, reader)

    with caplog.at_level(logging.WARNING, logger=protocol.log.name):
        asyncio.run(flood(50))
        messages = [r.getMessage() for r in caplog.records if r.name == protocol.log.name]
        assert messages == ["malformed stream message: TypeError"] * 2
        clock.now += 61.0
        asyncio.run(flood(1))
        messages = [r.getMessage() for r in caplog.records if r.name == protocol.log.name]
        assert messages[2:] == ["… and 48 more malformed stream messages in the last 61 s",
                                "malformed stream message: TypeError"]


def test_writes_to_a_lost_connection_log_a_few_lines_not_one_per_write(caplog: pytest.LogCaptureFixture) -> None:
    """asyncio logs a line for each write to a connection already lost (a reply streamed in chunks to a
    caller that went away): with the filter every peer installs, a few pass and the rest are counted."""
    aio = logging.getLogger("asyncio")

    async def write_after_the_connection_is_lost() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        writer.transport.abort()
        for _ in range(40):
            writer.write(b"chunk")
        server.close()
        await server.wait_closed()

    def lines_written() -> int:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            asyncio.run(write_after_the_connection_is_lost())
        return sum(r.getMessage() == "socket.send() raised exception." for r in caplog.records)

    installed = list(aio.filters)  # a peer's set-up earlier in this process installed the filter
    for f in installed:
        aio.removeFilter(f)
    repeats = QuietRepeats(aio, "socket.send() raised exception.", "writes to lost connections",
                           Quiet(aio, lines=2, interval=60.0))
    try:
        assert lines_written() > 30  # asyncio alone: one line per write past its threshold
        aio.addFilter(repeats)
        assert lines_written() == 2
    finally:
        aio.removeFilter(repeats)
        for f in installed:
            aio.addFilter(f)
