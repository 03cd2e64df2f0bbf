"""`swarm status` output from DHT records: the table a person reads and the JSON a script reads."""

from __future__ import annotations

import json
import math
from typing import Any

from swarm.ops.status import SwarmStatus, announced_num_stages
from swarm.ops.status_view import render_text, status_json
from swarm.wire.records import ServerRecord, TrainerRecord


def server(peer: str, stage: int, **extra: Any) -> ServerRecord:
    fields: dict[str, Any] = dict(throughput=10.0, queue=0, epoch=4, pending=2, config_hash="h",
                                  model={"num_stages": 3}, optim={"mode": "sync"}, capacity=12.5, name=f"srv-{peer}")
    return ServerRecord(peer_id=f"12D3KooW{peer}", stage=stage, **{**fields, **extra})


def trainer(peer: str, **extra: Any) -> TrainerRecord:
    fields: dict[str, Any] = dict(completed=1280, failed=0, loss=2.3141, done=False, samples_per_second=42.13)
    return TrainerRecord(peer_id=f"12D3KooW{peer}", **{**fields, **extra})


def swarm() -> SwarmStatus:
    """Stage 0 with two servers (one moving away, one a step behind), stage 1 empty, stage 2 with one."""
    return SwarmStatus(
        servers={
            0: [server("aaaaaa", 0), server("bbbbbb", 0, epoch=3, moving=True, name="")],
            1: [],
            2: [server("cccccc", 2, throughput=7.0, capacity=0.0, queue=3, calls=5)],
        },
        trainers=[trainer("tttttt"), trainer("uuuuuu", done=True, loss=math.nan, completed=0)],
        time=1_700_000_000.0,
    )


def test_the_table_has_a_row_per_server_and_a_verdict() -> None:
    lines = render_text(swarm(), "demo").splitlines()
    assert lines[0].startswith("swarm 'demo' at ") and lines[0].endswith(": 3 stages, 3 servers, 2 trainers")
    assert lines[1] == "stage 0: epoch 4, capacity 12.5 samples/s, 2 servers"
    assert lines[2].split() == ["server", "peer", "throughput", "capacity", "queue", "calls", "epoch", "pending"]
    assert lines[3].split() == ["srv-aaaaaa", "…aaaaaa", "10.0", "12.5", "0", "0", "4", "2"]
    assert lines[4].split() == ["-", "…bbbbbb", "10.0", "12.5", "0", "0", "3", "2", "moving"]
    assert lines[5] == "stage 1: no server"
    assert lines[6] == "stage 2: epoch 4, capacity 7.0 samples/s, 1 server"
    assert lines[8].split() == ["srv-cccccc", "…cccccc", "7.0", "7.0", "3", "5", "4", "2"]  # throughput stands in
    assert lines[9] == "trainers"
    assert lines[11].split() == ["…tttttt", "1,280", "42.1", "2.314", "0", "training"]
    assert lines[12].split() == ["…uuuuuu", "0", "42.1", "-", "0", "done"]
    assert lines[13] == ("verdict: stage 1 has no server; …bbbbbb is moving away from stage 0; "
                         "stage 0 replicas at epochs 3, 4")


def test_columns_line_up() -> None:
    lines = render_text(swarm(), "demo").splitlines()
    header, row = lines[2], lines[3]
    assert header.index("capacity") + len("capacity") == row.index("12.5") + len("12.5")
    assert header.index("throughput") + len("throughput") == row.index("10.0") + len("10.0")  # figures right-aligned


def test_json_carries_every_record_and_the_verdict() -> None:
    out = json.loads(json.dumps(status_json(swarm(), "demo"), allow_nan=False))  # valid strict JSON
    assert out["run_id"] == "demo" and out["time"] == 1_700_000_000.0 and out["num_stages"] == 3
    stage0, stage1, stage2 = out["stages"]
    assert stage0["epoch"] == 4 and stage0["capacity"] == 12.5 and stage0["pending"] == 4
    assert [s["peer_id"] for s in stage0["servers"]] == ["12D3KooWaaaaaa", "12D3KooWbbbbbb"]
    assert stage0["servers"][1] == {
        "peer_id": "12D3KooWbbbbbb", "name": "", "throughput": 10.0, "capacity": 12.5, "queue": 0, "calls": 0,
        "epoch": 3, "pending": 2, "moving": True, "tenure": 0.0, "mode": "sync",
    }
    assert stage1 == {"stage": 1, "epoch": None, "capacity": 0.0, "pending": 0, "servers": []}
    assert stage2["capacity"] == 7.0
    assert out["trainers"][1] == {"peer_id": "12D3KooWuuuuuu", "completed": 0, "failed": 0, "loss": None,
                                  "samples_per_second": 42.13, "done": True}
    assert out["verdict"]["findings"][0] == "stage 1 has no server"
    assert out["verdict"]["bottleneck"] is None


def test_a_healthy_swarm_names_its_bottleneck() -> None:
    status = SwarmStatus({0: [server("a", 0, capacity=30.1)], 1: [server("b", 1, capacity=12.3)]}, [trainer("t")])
    assert render_text(status, "x").splitlines()[-1] == "verdict: stage 1 is the bottleneck (12.3 samples/s, next 30.1)"
    assert status_json(status, "x")["verdict"]["bottleneck"] == 1


def test_the_stage_count_comes_from_what_most_servers_announce() -> None:
    assert announced_num_stages({0: [server("a", 0)], 1: []}) == 3
    odd = {0: [server("a", 0), server("b", 0, model={"num_stages": 2}), server("c", 0, model={"num_stages": 2})]}
    assert announced_num_stages(odd) == 2
    junk = {0: [server("a", 0, model={"num_stages": True}), server("b", 0, model={"num_stages": 10**9}),
                server("c", 0, model={})]}
    assert announced_num_stages(junk) is None
    assert announced_num_stages({}) is None
