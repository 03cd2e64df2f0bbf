"""A real swarm of separate processes on loopback trains on real text."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest

from swarm.ops.local import LocalSwarm
from swarm.ops.report import write_report

from .helpers import fetch_stage_states, small_config, tracebacks

pytestmark = pytest.mark.integration


def _assert_replicas_in_step(summary: dict, run_dir) -> None:
    """Every step left all replicas of a stage with bit-identical weights (equal parameter digests)."""
    for path in (run_dir / "peers").glob("server-*.json"):
        server = json.loads(path.read_text())
        for other in (run_dir / "peers").glob(f"server-s{server['stage']}-*.json"):
            theirs = {s["epoch"]: s["digest"] for s in json.loads(other.read_text())["steps"]}
            for step in server["steps"]:
                if step["epoch"] in theirs:
                    assert step["digest"] == theirs[step["epoch"]], f"stage {server['stage']} diverged at {step}"


def _assert_states_equal(cfg, swarm: LocalSwarm) -> None:
    for stage in range(cfg.model.num_stages):
        states = list(fetch_stage_states(cfg, swarm.initial_peers, stage).values())
        assert len(states) >= 1
        for other in states[1:]:
            worst = max(float((a - b).abs().max()) for a, b in zip(states[0], other, strict=True))
            assert worst <= 1e-6, f"stage {stage} replicas differ by {worst}"


def _assert_exactly_once(summary: dict) -> None:
    """Every completed microbatch entered exactly one step of every stage, and nothing else did; every
    step of every stage is accounted for, and its replicas agree on what it took in."""
    assert summary["unresolved"] == 0, summary
    for stage, info in summary["stages"].items():
        delivery = info["delivery"]
        assert delivery["steps_seen"] == info["steps"], (stage, delivery)
        assert delivery == {"steps_seen": info["steps"], "conflicting_steps": 0, "duplicated": 0, "missing": 0,
                            "not_completed": 0}, (stage, delivery)
        assert info["samples_stepped"] == summary["samples_completed"], (stage, info)


def _run(swarm: LocalSwarm, on_status=None) -> dict:
    """Run the swarm to the end, check replicas' final states while they are up, and report."""
    try:
        swarm.start()
        swarm.wait_until_done(progress=False, on_status=on_status)
        _assert_states_equal(swarm.cfg, swarm)
    finally:
        swarm.stop()
    assert not tracebacks(swarm.run_dir)
    return write_report(swarm.run_dir)


@pytest.mark.timeout(300)
def test_swarm_trains_and_stages_stay_identical(tmp_path):
    cfg = small_config(tmp_path)
    summary = _run(LocalSwarm(cfg))

    assert summary["microbatches_failed"] == 0
    assert summary["final_loss"] < summary["first_loss"] - 0.5, summary
    for stage, info in summary["stages"].items():
        assert info["steps"] >= cfg.trainer.target_steps, (stage, info)
        assert len(info["replicas"]) == 2
        assert len({r["digest"] for r in info["replicas"]}) == 1
        assert sum(r["lost_samples"] for r in info["replicas"]) == 0
    _assert_exactly_once(summary)
    assert summary["replays"] == 0
    _assert_replicas_in_step(summary, tmp_path)
    assert (tmp_path / "loss.png").exists() and (tmp_path / "throughput.png").exists()


@pytest.mark.timeout(300)
def test_swarm_survives_a_server_killed_mid_run(tmp_path):
    cfg = small_config(tmp_path, "trainer.target_steps=10")
    swarm = LocalSwarm(cfg)
    killed = []

    def kill_once(status) -> None:
        if not killed and status.min_epoch >= 3:
            victim = swarm.servers(stage=1)[0]
            victim.signal(signal.SIGKILL)  # the whole group: main process, DHT child and p2pd
            killed.append(victim)

    summary = _run(swarm, kill_once)

    assert killed, "the run ended before the fault could be injected"
    assert killed[0].process.returncode == -signal.SIGKILL
    for stage, info in summary["stages"].items():
        assert info["steps"] >= cfg.trainer.target_steps, (stage, info)
    assert summary["final_loss"] < summary["first_loss"] - 0.5, summary
    _assert_exactly_once(summary)
    _assert_replicas_in_step(summary, tmp_path)


@pytest.mark.timeout(300)
def test_a_late_server_loads_the_stage_state_and_joins_its_steps(tmp_path):
    cfg = small_config(tmp_path, "trainer.target_steps=12")
    swarm = LocalSwarm(cfg)
    late = []

    def add_late_server(status) -> None:
        # freeze the trainers while the newcomer starts, so the run cannot end before it joins
        if not late and status.min_epoch >= 3:
            for trainer in swarm.trainers():
                trainer.signal(signal.SIGSTOP)
            late.append(swarm.add_server(1))
        elif late and len(status.epochs.get(1, [])) == 3:
            for trainer in swarm.trainers():
                trainer.signal(signal.SIGCONT)

    summary = _run(swarm, add_late_server)

    assert late, "the run ended before the late server could be added"
    stage1 = summary["stages"]["1"]
    assert len(stage1["replicas"]) == 3
    newcomer = max(stage1["replicas"], key=lambda r: r["catch_ups"])
    assert newcomer["catch_ups"] >= 1  # it downloaded parameters and optimizer state before serving
    assert len({r["digest"] for r in stage1["replicas"]}) == 1
    late_log = late[0].log_path.read_text()
    assert "loaded epoch" in late_log
    assert "from 3 replica(s)" in late_log  # it took part in the stage's all-reduce afterwards
    _assert_exactly_once(summary)
    _assert_replicas_in_step(summary, tmp_path)


@pytest.mark.timeout(300)
def test_a_swarm_restarted_from_checkpoints_continues(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    first = _run(LocalSwarm(small_config(tmp_path / "run1", "trainer.target_steps=6",
                                         f'server.checkpoint_dir="{checkpoints}"', "server.checkpoint_every=2")))
    stopped_at = {stage: info["steps"] for stage, info in first["stages"].items()}
    assert sorted(p.name for p in checkpoints.glob("stage0-*.pt"))  # at most keep_checkpoints remain
    assert len(list(checkpoints.glob("stage0-*.pt"))) <= 2

    second_cfg = small_config(tmp_path / "run2", f"trainer.target_steps={max(stopped_at.values()) + 4}",
                              f'server.checkpoint_dir="{checkpoints}"')
    second = _run(LocalSwarm(second_cfg))

    for stage, epoch in stopped_at.items():
        for log in (tmp_path / "run2" / "logs").glob(f"server-s{stage}-*.log"):
            assert f"resumed from checkpoint at epoch {epoch}" in log.read_text()
        first_step = min(json.loads(p.read_text())["steps"][0]["epoch"]
                         for p in (tmp_path / "run2" / "peers").glob(f"server-s{stage}-*.json"))
        assert first_step == epoch + 1  # the step count continues
    # the loss continues too: the restarted run starts no worse than where the first one ended (it keeps
    # falling), far below a fresh start
    assert second["first_loss"] < first["first_loss"] - 0.5
    assert second["first_loss"] < first["final_loss"] + 0.2, (first, second)


@pytest.mark.timeout(300)
def test_a_server_sent_sigterm_leaves_cleanly_and_the_run_goes_on(tmp_path):
    cfg = small_config(tmp_path, "trainer.target_steps=12")
    swarm = LocalSwarm(cfg)
    leaving = []

    def terminate_once(status) -> None:
        if not leaving and status.min_epoch >= 3:
            leaving.append(swarm.servers(stage=0)[0])
            os.kill(leaving[0].process.pid, signal.SIGTERM)

    summary = _run(swarm, terminate_once)

    assert leaving, "the run ended before the server could be stopped"
    assert leaving[0].process.returncode == 0
    log = leaving[0].log_path.read_text()
    left = re.search(r"left after ([\d.]+)s", log)
    assert left and float(left.group(1)) <= cfg.server.leave_timeout + 1
    assert summary["microbatches_failed"] == 0
    for stage, info in summary["stages"].items():
        assert info["steps"] >= cfg.trainer.target_steps, (stage, info)
    _assert_exactly_once(summary)
    _assert_replicas_in_step(summary, tmp_path)
