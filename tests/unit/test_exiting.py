"""A peer told to stop ends within its bound: when it drains, at once; when something hangs, at the
deadline, saying where it hung."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

PEER = """
import asyncio, sys, threading
from swarm.exiting import exit_now, on_stop_signals

async def serve(drains: bool) -> None:
    stop = asyncio.Event()
    on_stop_signals(asyncio.get_running_loop(), stop.set, 1.0, "test peer")
    print("up", flush=True)
    await stop.wait()
    if not drains:
        threading.Event().wait()  # a leave that never finishes: blocks the loop's thread itself

asyncio.run(serve(sys.argv[1] == "drains"))
exit_now(0)
"""


def started(mode: str) -> subprocess.Popen:
    peer = subprocess.Popen([sys.executable, "-c", PEER, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert peer.stdout.readline() == "up\n"
    return peer


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_peer_that_drains_exits_cleanly(sig: signal.Signals) -> None:
    peer = started("drains")
    peer.send_signal(sig)
    assert peer.wait(timeout=10) == 0
    assert "still not out" not in peer.stderr.read()


def test_a_stuck_peer_ends_at_its_deadline_and_says_where() -> None:
    peer = started("hangs")
    sent = time.monotonic()
    peer.send_signal(signal.SIGTERM)
    assert peer.wait(timeout=10) == 1
    assert time.monotonic() - sent >= 1.0
    err = peer.stderr.read()
    assert "test peer is still not out 1s after it was told to stop" in err
    assert "in serve" in err  # the stuck thread's stack names the function it hung in
