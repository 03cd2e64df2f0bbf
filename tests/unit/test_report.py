"""Reading a run's step logs: a branch of a stage's history that a replica replaced by loading a
peer's state is not part of the history the stage went on from."""

from __future__ import annotations

import json
from pathlib import Path

from swarm.ops.report import collect, read_steps


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _step(epoch: int, digest: str, time: float) -> dict:
    return {"epoch": epoch, "samples": 4, "group": 2, "lr": 1e-3, "grad_norm": 1.0, "digest": digest, "ids": [],
            "time": time}


def test_steps_a_replica_replaced_by_loading_a_peers_state_are_superseded(tmp_path: Path) -> None:
    peers = tmp_path / "peers"
    peers.mkdir()
    # the frozen replica stepped to epoch 2 on its own branch, then loaded the stage's epoch 5 and went on
    _write(peers / "server-s1-AAAAAAAA.steps.jsonl", [_step(1, "x1", 10.0), _step(2, "branch", 11.0),
                                                     _step(6, "x6", 30.0)])
    _write(peers / "server-s1-AAAAAAAA.loads.jsonl", [{"time": 20.0, "epoch": 5, "source": "BBBBBBBB"}])
    _write(peers / "server-s1-BBBBBBBB.steps.jsonl", [_step(e, f"x{e}", 10.0 + e) for e in range(1, 7)])

    everything = read_steps(tmp_path)
    assert [[s["digest"] for s in steps] for steps in everything[1]] == [
        ["x1", "branch", "x6"], ["x1", "x2", "x3", "x4", "x5", "x6"]]
    history = read_steps(tmp_path, superseded=False)
    assert [[s["digest"] for s in steps] for steps in history[1]] == [["x6"], ["x1", "x2", "x3", "x4", "x5", "x6"]]


def test_a_completed_microbatch_missing_from_the_history_is_traced_to_the_branch_that_took_it(tmp_path: Path) -> None:
    """The report counts microbatches a trainer completed that no step of the stage's history took in, and
    says at which epochs a step of a branch later superseded took them (none: no step ever did)."""
    peers = tmp_path / "peers"
    peers.mkdir()
    trainer = {"role": "trainer", "peer_id": "T", "index": 0, "started": 1.0, "failed": 0, "retries": 0, "replays": 0,
               "unresolved": 0, "call_seconds": {}, "traffic": {}, "samples": 12,
               "completed": [[12.0 + i, 4, 0.0, 1.0, f"m{i}"] for i in range(3)]}
    (peers / "trainer-0-TTTTTTTT.json").write_text(json.dumps(trainer))
    # the branch's epoch-2 step took m1; the replica then loaded the stage's epoch 3, which never took it
    _write(peers / "server-s0-AAAAAAAA.steps.jsonl", [{**_step(1, "x1", 10.0), "ids": ["T/m0"]},
                                                     {**_step(2, "branch", 11.0), "ids": ["T/m1"]}])
    _write(peers / "server-s0-AAAAAAAA.loads.jsonl", [{"time": 20.0, "epoch": 3, "source": "BBBBBBBB"}])
    _write(peers / "server-s0-BBBBBBBB.steps.jsonl", [{**_step(1, "x1", 10.0), "ids": ["T/m0"]},
                                                     {**_step(2, "x2", 12.0), "ids": ["T/m2"]},
                                                     {**_step(3, "x3", 13.0), "ids": []}])
    stage = collect(tmp_path)["stages"]["0"]
    assert stage["delivery"]["missing"] == 1
    assert stage["missing_stepped_at"] == [2]
