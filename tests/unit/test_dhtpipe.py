"""A peer's calls to its DHT process, answered over the pipe made for them (`swarm.net.dhtpipe`)."""

from __future__ import annotations

import asyncio
import os
import signal
from multiprocessing import resource_sharer

import pytest
from hivemind.utils import get_dht_time

from swarm.config import load_config
from swarm.net.dhtpipe import CallPipe, DHTGone
from swarm.net.node import start_dht


async def _slow_answer(dht, node) -> str:
    await asyncio.sleep(60)
    return "late"


async def _fails(dht, node) -> None:
    raise KeyError("no such thing")


async def _node_id(dht, node) -> str:
    return node.node_id.to_bytes().hex()


def lent_descriptors() -> int:
    """File descriptors this process has lent so far for another to fetch (how a pickled pipe end travels)."""
    return resource_sharer._resource_sharer._key


@pytest.mark.timeout(60)
def test_calls_to_the_dht_process_are_answered_without_lending_it_a_pipe_each() -> None:
    dht = start_dht(load_config().net)
    try:
        async def scenario() -> None:
            lent = lent_descriptors()
            stored = await asyncio.gather(*(
                dht.store(f"key{i}", f"value{i}", get_dht_time() + 30, return_future=True) for i in range(20)))
            assert stored == [True] * 20
            # answers come back to the call that asked, however they interleave
            found = await asyncio.gather(*(dht.get(f"key{i}", latest=True, return_future=True) for i in range(20)))
            assert [f.value for f in found] == [f"value{i}" for i in range(20)]
            assert dht.get("key3", latest=True).value == "value3"  # (and without an event loop's help)
            assert len(await dht.run_coroutine(_node_id, return_future=True)) > 0
            with pytest.raises(KeyError, match="no such thing"):  # a failure in the DHT process reaches the caller
                await dht.run_coroutine(_fails, return_future=True)
            assert lent_descriptors() == lent  # (hivemind's futures lend one per call)

        asyncio.run(scenario())
    finally:
        dht.shutdown()


@pytest.mark.timeout(60)
def test_a_call_left_unanswered_by_a_dead_dht_process_fails_instead_of_waiting_forever() -> None:
    dht = start_dht(load_config().net)

    async def scenario() -> None:
        waiting = dht.run_coroutine(_slow_answer, return_future=True)
        os.kill(dht.pid, signal.SIGKILL)
        with pytest.raises(DHTGone):
            await asyncio.wait_for(waiting, 30)

    try:
        asyncio.run(scenario())
    finally:
        dht.join(10)


def test_a_call_opened_once_the_dht_process_has_ended_fails_at_once() -> None:
    """A call that raced the DHT process's end (its reader found the pipe closed and failed what was
    pending just before this call was opened) fails at once rather than waiting for an answer that
    cannot come."""
    calls = CallPipe()
    calls.started()  # (no DHT process holds the sending end: the reader finds the pipe closed at once)
    calls._reader.join(timeout=5)
    call, _ = calls.open()
    with pytest.raises(DHTGone):
        call.result(timeout=5)
