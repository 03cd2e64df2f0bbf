"""What `swarm monitor` serves, from snapshots of a swarm: rows of live servers, series over time, moves."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from swarm.ops.monitor import History
from swarm.ops.status import SwarmStatus
from swarm.wire.records import ServerRecord, TrainerRecord

T0 = 1_700_000_000.0


def server(peer: str, stage: int, **extra: Any) -> ServerRecord:
    fields: dict[str, Any] = dict(throughput=10.0, queue=0, epoch=4, pending=2, config_hash="h",
                                  model={"num_stages": 2}, tenure=30.0)
    return ServerRecord(peer_id=f"12D3KooW{peer}", stage=stage, **{**fields, **extra})


def trainer(peer: str, **extra: Any) -> TrainerRecord:
    fields: dict[str, Any] = dict(completed=640, failed=0, loss=2.5, done=False, samples_per_second=20.0)
    return TrainerRecord(peer_id=f"12D3KooW{peer}", **{**fields, **extra})


def served(history: History) -> dict[str, Any]:
    """The JSON the page fetches, parsed strictly (NaN is no JSON)."""
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in the monitor's JSON")

    return json.loads(history.latest, parse_constant=refuse)


def rows(data: dict[str, Any]) -> list[tuple[str, int, str]]:
    return [(s["label"], s["stage"], s["state"]) for stage in data["stages"] for s in stage["servers"]]


def test_a_row_per_live_server_and_rows_of_servers_gone_leave() -> None:
    history = History("demo", every=2.0)
    assert served(history)["time"] is None and served(history)["stages"] == [] and served(history)["every"] == 2.0
    history.add(SwarmStatus({0: [server("aaaaaa", 0), server("bbbbbb", 0, throughput=5.0)],
                             1: [server("cccccc", 1, epoch=3)]}, [trainer("tttttt")], T0))
    assert rows(served(history)) == [("…aaaaaa", 0, "serving"), ("…bbbbbb", 0, "serving"), ("…cccccc", 1, "serving")]
    history.add(SwarmStatus({0: [server("aaaaaa", 0, moving=True), server("bbbbbb", 0, epoch=3)],
                             1: []}, [trainer("tttttt")], T0 + 2))
    data = served(history)
    assert rows(data) == [("…aaaaaa", 0, "moving"), ("…bbbbbb", 0, "behind")]  # …cccccc's record is gone
    assert data["stages"][1]["servers"] == [] and data["stages"][1]["epoch"] is None
    # the series behind the charts: a stage's throughput is its servers' sum, its epoch their highest
    assert data["series"]["throughput"] == {"0": [[T0, 15.0], [T0 + 2, 20.0]], "1": [[T0, 10.0], [T0 + 2, 0.0]]}
    assert data["series"]["epoch"] == {"0": [[T0, 4], [T0 + 2, 4]], "1": [[T0, 3]]}


def test_trainers_show_every_field_of_their_record_and_no_loss_before_they_have_one() -> None:
    history = History("demo", every=1.0)
    history.add(SwarmStatus({0: [server("aaaaaa", 0)]}, [trainer("tttttt", loss=math.nan, completed=0)], T0))
    history.add(SwarmStatus({0: [server("aaaaaa", 0)]}, [trainer("tttttt", loss=2.25)], T0 + 1))
    data = served(history)
    (row,) = data["trainers"]
    assert row["label"] == "…tttttt" and row["loss"] == 2.25 and row["completed"] == 640
    assert set(row) >= {"peer_id", "completed", "failed", "loss", "done", "samples_per_second"}
    assert data["series"]["trainer_loss"] == {"…tttttt": [[T0 + 1, 2.25]]}  # the NaN left no point
    assert data["series"]["trainer_samples_per_second"] == {"…tttttt": [[T0, 20.0], [T0 + 1, 20.0]]}


def test_the_trainers_validation_loss_is_shown_and_charted() -> None:
    """The page shows a column and a dashed line for `val_loss` once trainers announce one."""
    history = History("demo", every=1.0)
    history.add(SwarmStatus({0: []}, [trainer("tttttt")], T0))
    history.add(SwarmStatus({0: []}, [dataclasses.replace(trainer("tttttt"), val_loss=2.75, val_step=4)], T0 + 1))
    data = served(history)
    assert data["trainers"][0]["val_loss"] == 2.75 and data["trainers"][0]["val_step"] == 4
    assert data["series"]["trainer_val_loss"] == {"…tttttt": [[T0 + 1, 2.75]]}  # none before the first


def test_moves_seen_between_snapshots_or_told_by_the_record_are_listed_once() -> None:
    history = History("demo", every=2.0)
    history.add(SwarmStatus({0: [server("aaaaaa", 0), server("oldold", 0)],
                             1: [server("bbbbbb", 1, previous_stage=0, tenure=12.0)]}, [], T0))
    history.add(SwarmStatus({0: [], 1: [server("aaaaaa", 1, previous_stage=0, tenure=1.5),
                                        server("bbbbbb", 1, previous_stage=0, tenure=14.0),
                                        server("oldold", 1)]}, [], T0 + 2))
    history.add(SwarmStatus({0: [], 1: [server("aaaaaa", 1, previous_stage=0, tenure=3.5)]}, [], T0 + 4))
    moves = [(m["label"], m["from"], m["to"], m["time"]) for m in served(history)["moves"]]
    assert moves == [
        ("…bbbbbb", 0, 1, T0 - 12.0),  # moved before the monitor started: its record says from where
        ("…aaaaaa", 0, 1, T0 + 0.5),
        ("…oldold", 0, 1, T0 + 2 - 30.0),  # a record without the field: seen at another stage than before
    ]


def test_series_are_bounded_and_a_stage_the_swarm_turned_out_not_to_have_is_dropped() -> None:
    history = History("demo", every=1.0, keep=3)
    history.add(SwarmStatus({0: [], 1: [], 2: []}, [], T0))  # the configured stage count, before any record
    for i in range(1, 5):
        history.add(SwarmStatus({0: [server("aaaaaa", 0, throughput=float(i))], 1: []}, [], T0 + i))
    series = served(history)["series"]["throughput"]
    assert set(series) == {"0", "1"}
    assert series["0"] == [[T0 + 2, 2.0], [T0 + 3, 3.0], [T0 + 4, 4.0]]
