"""JSON-lines logs read while their peer still appends to them."""

from __future__ import annotations

import json

from swarm.results import PeerResults, read_jsonl


def test_a_record_still_being_written_is_left_for_a_later_read(tmp_path) -> None:
    results = PeerResults(tmp_path)
    results.append("s.steps.jsonl", {"epoch": 1})
    results.append("s.steps.jsonl", {"epoch": 2})
    path = results.path("s.steps.jsonl")
    whole = json.dumps({"epoch": 3, "ids": ["x" * 100] * 100}) + "\n"
    with open(path, "a") as out:
        out.write(whole[:5000])  # a long record, its first write only
    assert read_jsonl(path) == [{"epoch": 1}, {"epoch": 2}]
    with open(path, "a") as out:
        out.write(whole[5000:])
    assert [r["epoch"] for r in read_jsonl(path)] == [1, 2, 3]
    assert read_jsonl(tmp_path / "none.jsonl") == []
