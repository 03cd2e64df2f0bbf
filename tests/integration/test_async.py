"""Async mode on a real swarm: local updates per microbatch, weights averaged in the background."""

from __future__ import annotations

import json

import pytest

from swarm.ops.local import LocalSwarm
from swarm.ops.report import read_steps

from .helpers import assert_exactly_once, run_swarm, small_config
from .test_swarm import LEARNED_LOSS

pytestmark = pytest.mark.integration
# Right after a round a replica's weights are the stage's average plus the local updates it made while
# the round ran, and nothing else: no update, no distance. Each update moves them by at most this much
# (L2 norm, relative to the average's): at this config's lr (3e-3), 0.005-0.026 per update were
# measured. How many updates a round spans depends on the load; the distance per update does not.
DRIFT_PER_UPDATE = 0.05


@pytest.mark.timeout(300)
def test_async_swarm_learns_and_its_replicas_agree_after_each_average(tmp_path):
    """One server of stage 1 delays its replies by 0.5 s: stochastic wiring sends it less work, and the
    gradients of stage 0 (whose forwards wait longest for their backward) come most updates late."""
    cfg = small_config(tmp_path, 'optim.mode="async"', "local.reply_delays=[0, 0, 0.5]")
    summary = run_swarm(LocalSwarm(cfg))

    assert summary["microbatches_failed"] == 0
    # the untrained model's loss (its first microbatches) is near the uniform 5.55; local updates
    # make the loss fall within the first 20 microbatches already, so their mean is not a baseline
    assert summary["final_loss"] < LEARNED_LOSS < first_loss(tmp_path), summary
    assert_exactly_once(summary)
    rounds = 0
    for stage, servers in read_steps(tmp_path, superseded=False).items():
        averages: dict[int, set[str]] = {}
        for steps in servers:
            for step in steps:
                averages.setdefault(step["epoch"], set()).add(step["digest"])
                assert step["drift"] <= DRIFT_PER_UPDATE * step["local_updates"], (stage, step)
                rounds += step["group"] > 1
        assert all(len(digests) == 1 for digests in averages.values()), (stage, averages)
        assert len(averages) >= cfg.trainer.target_steps
    assert rounds >= 2 * cfg.trainer.target_steps  # the replicas averaged together, not each alone

    fast, delayed = sorted(summary["stages"]["1"]["replicas"], key=lambda r: r["reply_delay"])
    assert delayed["reply_delay"] == 0.5
    assert delayed["samples_served"] < fast["samples_served"] / 2, (delayed, fast)
    staleness = summary["staleness"]
    assert staleness["1"]["max"] == 0  # the last stage's forward and backward are one call
    assert staleness["0"]["mean"] > 0 and staleness["0"]["gradients"] > 0



def first_loss(run_dir) -> float:
    """The loss of the first microbatch any trainer completed."""
    trainers = [json.loads(p.read_text()) for p in (run_dir / "peers").glob("trainer-*.json")]
    return min((c for t in trainers for c in t["completed"]), key=lambda c: c[0])[2]
