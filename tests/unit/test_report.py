"""Reading a run's step logs: a branch of a stage's history that a replica replaced by loading a
peer's state is not part of the history the stage went on from."""

from __future__ import annotations

import json
from pathlib import Path

from swarm.ops.report import read_steps


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
