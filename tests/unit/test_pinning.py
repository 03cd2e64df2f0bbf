"""Servers' compute threads kept on cores of their own: which cores a local swarm hands out, and the
compute thread pinned by the OS while the rest of its process is not."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from swarm.config import ConfigError, load_config
from swarm.ops.pinning import core_sets, free_set
from swarm.server.gate import ComputeGate

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity is Linux's")


def test_servers_get_disjoint_cores_only_where_every_server_of_the_launch_gets_its_own():
    assert core_sets({3, 0, 2, 1}, 2, 1) == [(0,), (1,)]
    assert core_sets(range(8), 3, 2) == [(0, 1), (2, 3), (4, 5)]
    assert core_sets([5, 7], 2, 1) == [(5,), (7,)]  # the cores this process may use, not 0..n-1
    # one core short: nobody is pinned (a pinned half would leave the rest an unequal share)
    assert core_sets(range(2), 3, 1) == []
    assert core_sets(range(4), 3, 2) == []
    assert core_sets(range(4), 0, 1) == []


def test_a_server_started_later_takes_the_cores_of_one_gone_and_none_while_all_are_held():
    sets = [(0,), (1,)]
    assert free_set(sets, {(0,)}) == (1,)
    assert free_set(sets, set()) == (0,)
    assert free_set(sets, {(0,), (1,)}) is None
    assert free_set([], set()) is None


def test_compute_cores_must_be_distinct_cpu_ids():
    assert load_config(overrides=["server.compute_cores=[1, 0]"]).server.compute_cores == (1, 0)
    for bad in ("[0, 0]", "[-1]"):
        with pytest.raises(ConfigError, match="server.compute_cores"):
            load_config(overrides=[f"server.compute_cores={bad}"])


@linux
def test_the_compute_thread_alone_is_kept_on_its_cores():
    core = max(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    gate = ComputeGate(slowdown=1.0, cost_by_cpu=True, cores=[core])
    try:
        seen = asyncio.run(gate.run_locked(lambda: (os.sched_getaffinity(0),
                                                    Path("/proc/thread-self/status").read_text())))
    finally:
        gate.close()
    affinity, status = seen
    assert affinity == {core} and gate.cores == (core,)
    assert f"Cpus_allowed_list:\t{core}\n" in status  # as the kernel schedules it
    assert os.sched_getaffinity(0) == before  # the calling thread (the event loop's) is not pinned


@linux
def test_an_unpinned_compute_thread_runs_on_every_core_of_the_process():
    gate = ComputeGate(slowdown=1.0, cost_by_cpu=True)
    try:
        asyncio.run(gate.run_locked(lambda: None))
    finally:
        gate.close()
    assert gate.cores == tuple(sorted(os.sched_getaffinity(0)))


@linux
def test_a_core_the_process_may_not_use_is_refused_at_start_by_name():
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match=rf"server.compute_cores: cores \[{outside}\] are not among"):
        ComputeGate(slowdown=1.0, cost_by_cpu=True, cores=[outside])
