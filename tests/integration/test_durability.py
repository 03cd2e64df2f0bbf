"""A stage that loses every replica at once (machines of one provider preempted together, their disks
gone) comes back from a copy held outside it; with no copy anywhere, a newcomer refuses to serve the
stage's initial weights mid-run unless its operator says so, and then every peer records it."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest

from swarm.ops import netlab
from swarm.ops.faults import FaultInjector
from swarm.ops.local import LocalSwarm, Peer
from swarm.ops.pinning import core_sets
from swarm.ops.report import read_steps

from .helpers import assert_replicas_in_step, finish, run_swarm, small_config

pytestmark = pytest.mark.integration
LOOK_SECONDS = 1.0  # a backup holder's look at the stages: its DHT reads, a download and its check (small model)


def summaries(run_dir: Path, prefix: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "peers").glob(f"{prefix}*.json"))]


def in_steps(run_dir: Path) -> dict[int, Counter]:
    """Stage -> how many of the stage's steps (the history it went on from) took in each microbatch."""
    counts = {}
    for stage, servers in read_steps(run_dir, superseded=False).items():
        by_epoch = {step["epoch"]: step["ids"] for steps in servers for step in steps}
        counts[stage] = Counter(i for ids in by_epoch.values() for i in ids)
    return counts


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0 or not netlab.available(), reason="network namespaces need root and iproute2")
def test_a_stage_that_loses_every_replica_comes_back_from_its_copy(tmp_path: Path) -> None:
    """Every peer on a host of its own (a network namespace with its own IP); no server keeps checkpoints,
    so the copy held outside the stage is all that is left of it."""
    every = 3
    cfg = small_config(tmp_path, "local.netns=true", "local.layout=[1,2]", "trainer.target_steps=1000",
                       f"backup.every={every}", "backup.period=0.5", "backup.max_share=1",  # (the bound asserted)
                       "local.trainers=1", "trainer.max_inflight=4")
    swarm = LocalSwarm(cfg)
    faults = FaultInjector(tmp_path)
    newcomer: list[Peer] = []
    marks: dict[str, int] = {}

    def start() -> None:  # the swarm, and a peer that holds a copy of every stage
        LocalSwarm.start(swarm)
        swarm.add_backup()

    def inject(status) -> None:
        epochs = status.epochs.get(1) or [0]
        if not faults.events and status.min_epoch >= 2 * every + 1:
            for server in swarm.servers(stage=1):  # both replicas, within a moment (no disk survives them)
                faults.kill(server)
            # a replacement at once, on a fresh machine: it finds the dead replicas' records not yet lapsed
            newcomer.append(swarm.add_server(1))
        elif newcomer and "back" not in marks and any(r.name == newcomer[0].name for r in status.servers.get(1, [])):
            marks["back"] = max(epochs)
        elif "back" in marks and "end" not in marks and min(epochs) >= marks["back"] + 4 \
                and status.min_epoch >= marks["back"] + 4:
            finish(swarm)  # the stage stepped on from its copy: enough shown
            marks["end"] = status.min_epoch

    swarm.start = start
    summary = run_swarm(swarm, inject)

    assert [e.kind for e in faults.events] == ["kill", "kill"] and "end" in marks
    killed = faults.events[-1].time
    stepped = [step for steps in read_steps(tmp_path)[1] for step in steps]
    last = max(step["epoch"] for step in stepped if step["time"] < killed)  # the stage's last step before it died
    (restored,) = [s for s in summaries(tmp_path, "server-s1-") if (s.get("entry") or {}).get("action") == "restore"]
    entry = restored["entry"]
    # A holder's look leaves its copy fewer than `every` steps behind the epoch it read. Its last look before
    # the kill began at most a backup period (and the look's own reads and download) earlier, and read records
    # up to a period old (a read it shares) that their servers renewed once an announce period.
    read_by = killed - 2 * cfg.backup.period - cfg.net.announce_period - LOOK_SECONDS
    seen = max((step["epoch"] for step in stepped if step["time"] < read_by), default=0)
    assert seen - every < entry["epoch"] <= last, (entry, seen, last)
    assert 0 <= entry["steps_lost"] <= last - entry["epoch"], entry  # as far as the holders saw the stage go
    assert summary["stages"]["1"]["restores"] == [entry]
    # the copy came from a server of another stage or from the backup peer, which held every stage
    holders = [s for s in summaries(tmp_path, "") if s["role"] in ("server", "backup")
               and s["copy_counters"].get("served")]
    assert holders and all(s.get("stage") != 1 for s in holders)
    (backup,) = summaries(tmp_path, "backup-")
    assert set(backup["copies_held"]) == {"0", "1"}, backup
    final = {k: v["steps"] for k, v in summary["stages"].items()}
    assert all(final[k] - every - 2 <= c["epoch"] <= final[k] for k, c in backup["copies_held"].items()), backup

    # every microbatch completed after the restore is in exactly one step of every stage
    after = {f"{t['peer_id']}/{c[4]}" for t in summaries(tmp_path, "trainer-") for c in t["completed"]
             if c[0] > entry["time"]}
    assert after
    for stage, counts in in_steps(tmp_path).items():
        assert {counts[i] for i in after} == {1}, (stage, Counter(counts[i] for i in after))
    assert summary["unresolved"] == 0
    assert_replicas_in_step(summary, tmp_path)


@pytest.mark.timeout(300)
def test_with_no_copy_a_newcomer_waits_and_starts_afresh_only_when_told(tmp_path: Path) -> None:
    cfg = small_config(tmp_path, "local.servers_per_stage=1", "trainer.target_steps=1000", "backup.holders=0",
                       "local.pin_compute=true")
    swarm = LocalSwarm(cfg)
    faults = FaultInjector(tmp_path)
    started: dict[str, Peer] = {}
    marks: dict[str, float] = {}

    def inject(status) -> None:
        if not faults.events and status.min_epoch >= 3:
            faults.kill(swarm.servers(stage=1)[0])
            started["waiting"] = swarm.add_server(1)  # at once: the dead server's record is still listed
        elif "waiting" in started and "fresh" not in started:
            # at no look: the dead server's record may still be listed until it lapses
            assert all(r.name != started["waiting"].name for r in status.servers.get(1, [])), \
                "a server waiting for the stage's state must not be in the DHT"
            if "is not serving" in started["waiting"].log_path.read_text():
                marks["refused"] = time.time()
                started["fresh"] = swarm.add_server(1, ("server.fresh_start=true",))
        elif "fresh" in started and "end" not in marks and min(status.epochs.get(1) or [0]) >= 2:
            marks["end"] = time.time()
            finish(swarm)

    summary = run_swarm(swarm, inject)

    assert "end" in marks, marks
    waiting_log = started["waiting"].log_path.read_text()
    assert "no replica, copy or checkpoint of the stage is reachable" in waiting_log
    assert "--fresh-stage" in waiting_log
    fresh = [s for s in summaries(tmp_path, "server-s1-") if s["fresh_start"]]
    assert len(fresh) == 1 and fresh[0]["fresh_start"] > marks["refused"]
    # every peer alive then records the fresh start: the trainers, stage 0's server, and the waiting
    # server (which joined the fresh one as its second replica)
    for peer in [*summaries(tmp_path, "trainer-"), *summaries(tmp_path, "server-s0-")]:
        assert [f["stage"] for f in peer["fresh_starts"]] == [1], peer["peer_id"]
    joined = [s for s in summaries(tmp_path, "server-s1-") if not s["fresh_start"] and s["peer_id"]
              and s.get("entry") is None and s["epoch"] > 0]
    assert joined and all([f["stage"] for f in s["fresh_starts"]] == [1] for s in joined)
    assert [stage for stage, _ in summary["fresh_starts"]] == [1]
    # each of the first two servers computed on a core of its own; the newcomer took the dead one's, and the
    # fresh server, started while both were held, was left to the OS
    sets = core_sets(os.sched_getaffinity(0), 2, 1)
    if sets:
        assert [s["compute_cores"] for s in summaries(tmp_path, "server-s0-")] == [list(sets[0])]
        assert [s["compute_cores"] for s in joined] == [list(sets[1])]
        assert fresh[0]["compute_cores"] == sorted(os.sched_getaffinity(0))
