"""Data progress outlives trainers: one is SIGKILLed mid-block and a newcomer joins; the blocks it held
are taken over where its records stopped, and no sample of the pass is trained twice."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from swarm.ops.faults import FaultInjector
from swarm.ops.local import LocalSwarm, Peer
from swarm.ops.report import read_steps

from .helpers import assert_replicas_in_step, finish, run_swarm, small_config

pytestmark = pytest.mark.integration
LABEL = re.compile(r"@p(\d+)b(\d+):(\d+)-(\d+)$")  # the samples a microbatch id carries (trainer.feed.Piece)


def trained_positions(run_dir: Path) -> dict[int, Counter]:
    """Stage -> how often each (pass, block, position) is in the stage's steps."""
    out = {}
    for stage, servers in read_steps(run_dir, superseded=False).items():
        by_epoch = {step["epoch"]: step["ids"] for steps in servers for step in steps}
        counts = Counter()
        for ids in by_epoch.values():
            for i in ids:
                p, b, start, end = map(int, LABEL.search(i).groups())
                counts.update((p, b, k) for k in range(start, end))
        out[stage] = counts
    return out


def summary_trainers(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "peers").glob("trainer-*.json"))]


def blocks_taken(peer: Peer) -> list[int]:
    return [int(m) for m in re.findall(r"took (?:over )?block (\d+) of pass 0", peer.log_path.read_text())]


@pytest.mark.timeout(300)
def test_a_killed_trainers_blocks_are_taken_over_and_no_sample_is_trained_twice(tmp_path: Path) -> None:
    # a trainer takes ~25 samples/s here and a stage's first step can come after hundreds of samples: a
    # block of 2000 is still unfinished when its trainer is killed, and the survivors take a minute or
    # more to finish theirs, so the newcomer is who takes the victim's block over
    block = 2000
    cfg = small_config(tmp_path, "local.servers_per_stage=1", "trainer.target_steps=1000",
                       f"data.block_samples={block}", "data.lease_seconds=3")
    swarm = LocalSwarm(cfg)
    faults = FaultInjector(tmp_path)
    marks: dict[str, int] = {}
    newcomer: list[Peer] = []

    def inject(status) -> None:
        if not faults.events and status.min_epoch >= 3:
            victim = swarm.trainers()[1]
            faults.kill(victim)
            marks["killed"] = status.min_epoch
            newcomer.append(swarm.add_trainer(2))
        elif newcomer and "taken" not in marks:  # a block taken over, and the newcomer at work
            if any("took over block" in p.log_path.read_text() for p in swarm.trainers() if p.alive()) \
                    and " took " in newcomer[0].log_path.read_text():
                marks["taken"] = status.min_epoch
        elif "taken" in marks and "end" not in marks and status.min_epoch >= marks["taken"] + 4:
            marks["end"] = status.min_epoch
            finish(swarm)

    summary = run_swarm(swarm, inject)

    assert "end" in marks, marks
    dead = [p for p in swarm.peers if p.name == "trainer-1"][0]
    dead_id = re.search(r"trainer (…\S+) started", dead.log_path.read_text()).group(1)
    live = [s for s in summary_trainers(tmp_path) if not s["peer_id"].endswith(dead_id[1:])]
    over = [t for s in live for t in s["data"]["blocks_taken"] if t["from"] and t["from"].endswith(dead_id[1:])]
    # the dead trainer's unfinished blocks went to others, who went on where its records stopped
    assert over and any(0 < t["consumed_before"] < block for t in over), over
    joined = [t for s in live if s["index"] == 2 for t in s["data"]["blocks_taken"]]
    assert joined  # the newcomer took its share (that it did not start the pass over: no sample trained twice)

    trained = trained_positions(tmp_path)
    for stage, counts in trained.items():
        assert counts and max(counts.values()) == 1, (stage, Counter(counts.values()))
    # no block left behind: each block the dead trainer held was taken over, or it had trained all of it
    whole = Counter(b for p, b, _ in trained[0] if p == 0)
    assert all(b in {t["block"] for t in over} or whole[b] == block for b in blocks_taken(dead))
    assert summary["unresolved"] == 0
    assert_replicas_in_step(summary, tmp_path)
