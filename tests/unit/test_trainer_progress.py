"""The trainer's progress line: samples, recent samples/s, recent loss, servers per stage."""

from __future__ import annotations

import time

from swarm.config import load_config
from swarm.trainer.progress import Completed
from swarm.trainer.trainer import Trainer
from swarm.wire.records import ServerRecord


def test_progress_line_counts_recent_samples_only() -> None:
    trainer = Trainer(load_config(overrides=["model.num_stages=3", "trainer.progress_every=5.0"]))
    progress, now = trainer.progress, time.time()
    progress.started = now - 100.0
    progress.completed = [Completed(now - 50.0, 1000, 9.0, 0, "0")]  # long ago: counts, but not in the rate
    progress.completed += [Completed(now - 4.0 + i, 40, 2.0 + i, 1, str(i + 1)) for i in range(3)]
    trainer.view.servers[0] = [ServerRecord(p, 0, 1.0, 0, 0, 0, trainer.hash, {}) for p in ("a", "b")]
    trainer.view.servers[2] = [ServerRecord("c", 2, 1.0, 0, 0, 0, trainer.hash, {})]
    line = progress.line()
    assert line.startswith("1,120 samples (")
    assert abs(progress.recent_rate() - 120 / 5.0) < 0.5
    assert line.endswith("loss 4.500, servers/stage 2/0/1")  # the mean over the last 20 microbatches


def test_progress_before_any_sample() -> None:
    trainer = Trainer(load_config(overrides=["model.num_stages=2"]))
    trainer.progress.started = time.time()
    assert trainer.progress.line() == "0 samples (0.0/s), loss -, servers/stage 0/0"
