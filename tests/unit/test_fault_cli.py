"""`swarm fault` against a local swarm's registry (no process is signalled here)."""

from __future__ import annotations

import json

import pytest

from swarm.cli.main import main
from swarm.ops.faults import FaultInjector


@pytest.fixture
def run_dir(tmp_path):
    registry = {
        "server-s0-1": {"role": "server", "stage": 0, "pid": 999999999, "host": None},
        "server-s1-2": {"role": "server", "stage": 1, "pid": 999999998,
                        "host": {"name": "server-s1-2", "netns": "sw9h2", "ip": "10.77.9.2", "link": "sw9v2",
                                 "inner": "sw9i2"}},
    }
    (tmp_path / "peers.json").write_text(json.dumps(registry))
    return tmp_path


def test_delay_writes_the_peers_fault_file_and_logs_the_event(run_dir, capsys) -> None:
    assert main(["fault", "delay", "server-s0-1", "--run-dir", str(run_dir), "--seconds", "0.2", "--drop", "0.1"]) == 0
    rules = json.loads((run_dir / "faults" / "server-s0-1.json").read_text())
    assert rules == {"delay": 0.2, "drop": 0.1, "blackhole": False, "methods": []}
    (event,) = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    assert (event["kind"], event["peer"]) == ("delay", "server-s0-1")
    assert "delay server-s0-1: done" in capsys.readouterr().out
    assert main(["fault", "delay", "server-s0-1", "--run-dir", str(run_dir), "--blackhole",
                 "--methods", "forward,backward"]) == 0
    rules = json.loads((run_dir / "faults" / "server-s0-1.json").read_text())
    assert rules == {"delay": 0.0, "drop": 0.0, "blackhole": True, "methods": ["forward", "backward"]}


def test_a_peer_already_gone_is_not_an_error(run_dir) -> None:
    faults = FaultInjector(run_dir)
    faults.kill("server-s0-1")  # no such process any more
    assert [e.kind for e in faults.events] == ["kill"]


def test_unknown_peers_and_missing_namespaces_are_explained(run_dir, capsys) -> None:
    assert main(["fault", "kill", "server-s9-9", "--run-dir", str(run_dir)]) == 2
    assert "no peer named 'server-s9-9'" in capsys.readouterr().err
    assert main(["fault", "cut", "server-s0-1", "--run-dir", str(run_dir)]) == 2
    assert "local.netns = true" in capsys.readouterr().err
    assert not (run_dir / "faults.jsonl").exists()
