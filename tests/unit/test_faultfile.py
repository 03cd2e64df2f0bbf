"""The message delay/loss rules a peer reads from its fault file."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import pytest

from swarm.net import faultfile
from swarm.net.faultfile import FaultFile, Rules


def write(path, **rules) -> None:
    path.write_text(json.dumps(rules))
    stamp = time.time() + len(rules)  # a distinct mtime even within the filesystem's resolution
    os.utime(path, (stamp, stamp))


def test_no_file_means_no_faults(tmp_path) -> None:
    assert FaultFile(tmp_path / "absent.json").current() == Rules()


def test_rules_follow_the_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faultfile, "RECHECK_SECONDS", 0.0)
    path = tmp_path / "peer.json"
    faults = FaultFile(path)
    write(path, delay=0.25, drop=0.5)
    assert faults.current() == Rules(0.25, 0.5, False)
    write(path, blackhole=True)
    assert faults.current() == Rules(0.0, 0.0, True)
    write(path, blackhole=True, methods=["forward", "backward"])
    assert faults.current() == Rules(0.0, 0.0, True, ("forward", "backward"))
    write(path, blackhole=True, methods="forward")  # not a list: refused whole, with a warning
    assert faults.current() == Rules()
    path.write_text("{not json")
    os.utime(path, (time.time() + 9, time.time() + 9))
    assert faults.current() == Rules()  # unreadable: no faults, and a warning
    path.unlink()
    assert faults.current() == Rules()


def test_delay_and_loss_are_applied(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faultfile, "RECHECK_SECONDS", 0.0)
    path = tmp_path / "peer.json"

    async def outcome(faults: FaultFile, method: str = "forward") -> tuple[bool, float]:
        start = time.perf_counter()
        try:
            await asyncio.wait_for(faults.apply(method), 0.5)
            return True, time.perf_counter() - start
        except TimeoutError:
            return False, time.perf_counter() - start

    write(path, delay=0.1)
    passed, took = asyncio.run(outcome(FaultFile(path)))
    assert passed and took >= 0.1
    write(path, blackhole=True)
    assert asyncio.run(outcome(FaultFile(path)))[0] is False  # never completes: the deadline ends it
    write(path, drop=0.5)
    faults = FaultFile(path, random.Random(1))
    kept = sum(asyncio.run(outcome(faults))[0] for _ in range(8))
    assert 0 < kept < 8


def test_rules_narrowed_to_methods_leave_the_others_alone(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blackhole on forward and backward (a hung compute) swallows those calls; the all-reduce's go on."""
    monkeypatch.setattr(faultfile, "RECHECK_SECONDS", 0.0)
    path = tmp_path / "peer.json"
    write(path, blackhole=True, methods=["forward", "backward"])
    faults = FaultFile(path)

    async def completes(method: str) -> bool:
        try:
            await asyncio.wait_for(faults.apply(method), 0.2)
            return True
        except TimeoutError:
            return False

    assert [asyncio.run(completes(m)) for m in ("forward", "backward", "reduce")] == [False, False, True]
