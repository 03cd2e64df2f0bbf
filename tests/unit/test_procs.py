"""A process's CPU time split by thread name: how the benchmarks tell the servers' compute threads from
everything else a swarm runs."""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from swarm.ops.procs import cpu_split
from swarm.server.gate import COMPUTE_THREAD, ComputeGate, name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
BURN = 0.3  # CPU seconds the named thread spends


@pytest.fixture
def peers():
    """benchmarks/peers.py, a script beside the others rather than a package."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    import peers

    return peers


def test_a_named_threads_cpu_time_is_told_from_the_rest_of_the_process() -> None:
    burnt, release = threading.Event(), threading.Event()

    def burn() -> None:
        name_os_thread("swarm-test-burn")
        while time.thread_time() < BURN:
            pass
        burnt.set()
        release.wait()  # (a thread's time can be read only while it lives)

    thread = threading.Thread(target=burn)
    thread.start()
    try:
        assert burnt.wait(30)
        named, other = cpu_split([os.getpid()], "swarm-test-burn")
        # (a name no thread of this process carries: earlier tests' compute threads may still be alive)
        nothing, everything = cpu_split([os.getpid()], "swarm-test-absent")
    finally:
        release.set()
        thread.join()
    assert BURN - 0.05 <= named <= BURN + 0.05  # (the kernel counts in clock ticks)
    assert other > 0  # this test's own thread, at least
    assert nothing == 0 and everything == pytest.approx(named + other, abs=0.05)


def test_the_servers_compute_thread_carries_its_name() -> None:
    gate = ComputeGate(slowdown=1.0, cost_by_cpu=True)
    try:
        name = asyncio.run(gate.run_locked(lambda: Path("/proc/thread-self/comm").read_text()))
    finally:
        gate.close()
    assert name.strip() == COMPUTE_THREAD


def test_a_run_is_told_with_the_machines_steal_and_one_cores_speed_before_and_after(peers) -> None:
    stolen, total = peers.cpu_jiffies()
    assert 0 <= stolen <= total

    def run() -> dict:
        start = time.thread_time()
        while time.thread_time() - start < BURN:
            pass
        return {"samples_per_second": 1.0}

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        result = peers.with_machine(run, probe_seconds=0.2)
        assert torch.get_num_threads() == 2  # (the probe runs on one thread, then gives the others back)
    finally:
        torch.set_num_threads(threads)
    assert result["samples_per_second"] == 1.0 and 0.0 <= result["steal"] < 1.0
    assert peers.cpu_jiffies()[1] > total
    assert all(speed > 0 for speed in result["core_gflops"]) and len(result["core_gflops"]) == 2


def test_each_repetition_starts_from_another_run_and_results_keep_their_order(peers) -> None:
    made: list[str] = []

    def run(name: str) -> Callable[[], dict]:
        return lambda: made.append(name) or {"samples_per_second": float(len(made))}

    runs = {name: run(name) for name in ("single", "1f1b", "swarm")}
    orders = []
    for turn in range(4):
        made.clear()
        results = peers.in_turn(runs, turn, probe_seconds=0.01)
        orders.append(list(made))
        assert list(results) == ["single", "1f1b", "swarm"]
        assert [results[name]["samples_per_second"] for name in made] == [1.0, 2.0, 3.0]
        assert all("core_gflops" in r for r in results.values())
    assert orders == [["single", "1f1b", "swarm"], ["1f1b", "swarm", "single"], ["swarm", "single", "1f1b"],
                      ["single", "1f1b", "swarm"]]


def test_runs_picked_keep_the_scenarios_order_and_its_reference(peers) -> None:
    runs = {name: (lambda: {}) for name in ("single", "gpipe", "1f1b", "swarm", "swarm+train")}
    assert peers.chosen(runs, "", "1f1b") is runs
    assert list(peers.chosen(runs, "swarm+train, single", "1f1b")) == ["single", "1f1b", "swarm+train"]
    with pytest.raises(SystemExit, match="no run swam in this scenario"):
        peers.chosen(runs, "swam,swarm", "1f1b")


def test_the_copies_scenario_runs_each_swarm_with_its_copies_and_without(peers, monkeypatch) -> None:
    started: dict[str, list[str]] = {}
    monkeypatch.setattr(peers, "swarm_run", lambda overrides, steps, run_dir: started.setdefault(run_dir, overrides))
    make, reference = peers.SCENARIOS["copies"]
    runs = make(["model.n_layers=6"], 8, "/runs")
    assert list(runs) == ["1f1b", "swarm", "swarm, no copies", "swarm+train", "swarm+train, no copies"]
    assert reference in runs
    assert "copies" not in peers.IN_ALL and set(peers.IN_ALL) <= set(peers.SCENARIOS)  # (`all` leaves it out)
    for name in list(runs)[1:]:
        runs[name]()
    without = {d for d, o in started.items() if "backup.holders=0" in o}
    hosted = {d for d, o in started.items() if set(peers.HOSTED) <= set(o)}
    assert without == {"/runs/swarm-no-copies", "/runs/swarm+train-no-copies"}
    assert hosted == {"/runs/swarm+train", "/runs/swarm+train-no-copies"}
    assert all(o[0] == "model.n_layers=6" for o in started.values())


def test_the_swarms_loss_by_step_is_the_mean_over_the_microbatches_each_epoch_computed(peers) -> None:
    completed = [[1.0, 8, 5.0, 0, "a"], [2.0, 8, 4.0, 1, "b"], [3.0, 8, 6.0, 0, "c"], [4.0, 8, 3.0, 3, "d"]]
    losses = peers.losses_by_epoch(completed)
    assert losses[:2] == [5.5, 4.0] and losses[3] == 3.0 and math.isnan(losses[2])
    assert peers.losses_by_epoch([]) == []
