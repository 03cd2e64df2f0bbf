"""A server's compute thread reads and computes denormals as zero (`server.flush_denormal`), and so do the
threads it starts (torch's intra-op pool), while the rest of the process keeps IEEE arithmetic."""

import asyncio
import threading

import pytest
import torch

from swarm.config import load_config
from swarm.server.gate import ComputeGate

DENORMAL = 1e-39  # below float32's smallest normal value (1.18e-38)


def _product() -> float:
    return (torch.tensor([DENORMAL]) * 1.0).item()


def _in_a_thread_started_here() -> float:
    seen: list[float] = []
    worker = threading.Thread(target=lambda: seen.append(_product()))
    worker.start()
    worker.join()
    return seen[0]


@pytest.mark.parametrize("flush", [True, False])
def test_the_compute_thread_and_the_threads_it_starts_flush_denormals_as_configured(flush: bool):
    gate = ComputeGate(slowdown=1.0, cost_by_cpu=True, flush_denormal=flush)
    try:
        own, started = asyncio.run(gate.run_locked(lambda: (_product(), _in_a_thread_started_here())))
    finally:
        gate.close()
    expected = 0.0 if flush else pytest.approx(DENORMAL, rel=1e-6)
    assert own == expected and started == expected
    assert _product() == pytest.approx(DENORMAL, rel=1e-6)  # this thread (the event loop's) is left as it was


def test_servers_flush_denormals_unless_told_not_to():
    assert load_config().server.flush_denormal is True
    assert load_config(overrides=["server.flush_denormal=false"]).server.flush_denormal is False
