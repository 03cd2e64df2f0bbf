"""Hostile peers against a real swarm: each attack is a process of its own (tests/integration/hostile.py)
that joins the DHT as any stranger can. Training goes on at no less than half its rate before the attack,
replicas stay identical, and no microbatch is lost or counted twice."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.ops.local import LocalSwarm

from .helpers import assert_replicas_in_step, finish, run_swarm, small_config

pytestmark = pytest.mark.integration
ATTACK_SECONDS = 20.0
ROOT = Path(__file__).resolve().parents[2]


class Attack:
    """Starts the hostile process once the swarm has warmed up, and measures the steps of the slowest
    stage per second in equal windows before, during and after the attack."""

    def __init__(self, swarm: LocalSwarm, kind: str, warmup_epochs: int = 3):
        self.swarm, self.kind, self.warmup_epochs = swarm, kind, warmup_epochs
        self.marks: dict[str, tuple[float, int]] = {}  # phase -> (time, min epoch) when it began
        self.process: subprocess.Popen | None = None

    def __call__(self, status) -> None:
        now, epoch = time.monotonic(), status.min_epoch
        if "before" not in self.marks and epoch >= self.warmup_epochs:
            self.marks["before"] = (now, epoch)
        elif "before" in self.marks and "attack" not in self.marks and now - self.marks["before"][0] >= ATTACK_SECONDS:
            self.marks["attack"] = (now, epoch)
            log = open(self.swarm.run_dir / "logs" / "hostile.log", "w")  # noqa: SIM115  closed with the process
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.hostile", self.kind, "--config",
                 str(self.swarm.run_dir / "config.toml"), "--initial-peers", *self.swarm.initial_peers,
                 "--seconds", str(ATTACK_SECONDS)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        elif "attack" in self.marks and "after" not in self.marks and self.process.poll() is not None:
            self.marks["after"] = (now, epoch)
            finish(self.swarm)

    def rates(self) -> tuple[float, float]:
        """Steps per second of the slowest stage before the attack and while it lasted."""
        (t0, e0), (t1, e1), (t2, e2) = (self.marks[k] for k in ("before", "attack", "after"))
        return (e1 - e0) / (t1 - t0), (e2 - e1) / (t2 - t1)


@pytest.mark.timeout(240)
def test_a_forged_record_at_a_huge_epoch_and_throughput_does_not_stop_the_stage(tmp_path: Path) -> None:
    """Measured before: one forged record of stage 1 at epoch 10^9 stopped it for the whole attack and
    about 45 s after (trainers refused everywhere as stale, replicas trying to catch up from nobody)."""
    cfg = small_config(tmp_path, "trainer.target_steps=100000", "local.timeout=200.0")
    swarm = LocalSwarm(cfg)
    attack = Attack(swarm, "forged-record")
    summary = run_swarm(swarm, attack)
    assert attack.process is not None and attack.process.returncode == 0
    before, during = attack.rates()
    assert during >= 0.5 * before, (before, during)
    assert summary["unresolved"] == 0
    assert_replicas_in_step(summary, tmp_path)
