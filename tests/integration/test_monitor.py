"""Watching a live local swarm: `swarm monitor`'s page in headless Chromium, the peers' Prometheus
/metrics, and a trainer's TensorBoard files."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from swarm.ops.faults import FaultInjector
from swarm.ops.local import LocalSwarm

from .browser import CHROMIUM, HeadlessPage
from .helpers import interrupt, small_config, tracebacks

pytestmark = pytest.mark.integration
T = TypeVar("T")
# the page's server rows: peer id, stage and state of each
ROWS = "[...document.querySelectorAll('#servers tr.server')].map(r => [r.dataset.peer, +r.cells[2].textContent, " \
       "r.cells[8].textContent]).sort()"


def free_ports(count: int) -> list[int]:
    """`count` consecutive ports free now (what `swarm local` hands out from net.metrics_port)."""
    for base in range(20000 + os.getpid() % 20000, 65000 - count, count):
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return list(range(base, base + count))
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports")


def until(read: Callable[[], T], wanted: Callable[[T], bool], timeout: float, what: str) -> T:
    """The first value `read` returns that is `wanted`, polled until `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if wanted(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen within {timeout:.0f}s; last: {value!r}")
        time.sleep(0.5)


def scrape(port: int) -> dict[str, Any]:
    """One scrape of a peer's /metrics: metric sample name (with its labels, if any) -> value; the peer
    info's labels under `info`."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels and s.name != "swarm_peer_info" else s.name] = s.value
            if s.name == "swarm_peer_info":
                out["info"] = s.labels
    return out


def scalars(board: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every scalar `tag` in the TensorBoard event files under `board`."""
    events = EventAccumulator(str(board))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


class Monitor:
    """`swarm monitor` as a user runs it, on a port of its own choosing; its page's address."""

    def __init__(self, swarm: LocalSwarm):
        cmd = [sys.executable, "-m", "swarm.cli.main", "monitor", "--initial-peers", *swarm.initial_peers,
               "--set", f'net.run_id="{swarm.cfg.net.run_id}"', "--port", "0", "--every", "1"]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert found, (line, self.process.stderr.read() if self.process.poll() is not None else "")
        self.url = found[0]

    def data(self) -> dict[str, Any]:
        return json.loads(urllib.request.urlopen(self.url + "status.json", timeout=10).read())



@pytest.mark.timeout(300)
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed: the page is checked in a headless browser")
def test_monitor_page_metrics_and_tensorboard(tmp_path: Path) -> None:
    ports = free_ports(4)  # three servers', then the trainer's: the local swarm counts up from the first
    board = tmp_path / "board"
    cfg = small_config(tmp_path / "run", "trainer.target_steps=1000", f"net.metrics_port={ports[0]}",
                       f'trainer.tensorboard_dir="{board}"')
    swarm = LocalSwarm(cfg)
    monitor = page = None
    try:
        swarm.start_bootstrap()
        servers = [swarm.add_server(stage) for stage in (0, 0, 1)]
        swarm.add_trainer(0)
        registry = json.loads((tmp_path / "run" / "peers.json").read_text())
        assert [p["metrics_port"] for p in registry.values() if p["role"] != "dht"] == ports
        monitor = Monitor(swarm)
        page = HeadlessPage(monitor.url, tmp_path / "chromium")

        # the page, as its script drew it: one row per live server, a trainer training, lines in the charts
        ids = [until(lambda p=p: _peer_id(p), bool, 90, "the server's metrics") for p in ports[:3]]
        rows = until(lambda: page.evaluate(ROWS), lambda rows: [r[0] for r in rows] == sorted(ids), 90,
                     "a row for each server")
        assert sorted(r[:2] for r in rows) == sorted([[ids[0], 0], [ids[1], 0], [ids[2], 1]])
        assert {r[2] for r in rows} <= {"serving", "behind"}  # behind: for a moment around a step
        # (no row yet reads as nothing trained: the page may not have drawn the trainers' table)
        trained = ("(document.querySelector('#trainers tr.trainer td:nth-child(2)')?.textContent ?? '')"
                   ".replace(/,/g, '') > 0")
        page.wait_for(trained, 60)
        lines = ("[...document.querySelectorAll('polyline.series')].map(p => "
                 "[p.closest('svg').id, p.dataset.name, p.getAttribute('points').split(' ').length])")
        drawn = until(lambda: page.evaluate(lines), lambda ls: sum(n >= 2 for *_, n in ls) == 5, 60, "lines drawn")
        assert sorted(chart for chart, *_ in drawn) == ["chart-epoch"] * 2 + ["chart-loss"] + ["chart-throughput"] * 2
        # what the page fetches: the same servers, and the history behind the charts
        data = until(monitor.data, lambda d: sorted(s["peer_id"] for st in d["stages"] for s in st["servers"])
                     == sorted(ids) and d["trainers"], 30, "the servers and the trainer in status.json")
        assert set(data["series"]["throughput"]) == {"0", "1"} and data["trainers"][0]["completed"] > 0

        # /metrics of a server and of the trainer: the figures move as the run goes on
        served = "swarm_server_samples_served_total"
        first = scrape(ports[2])
        assert first["swarm_server_stage"] == 1 and first["info"]["role"] == "server"
        later = until(lambda: scrape(ports[2]), lambda m: m[served] > first[served], 60, "stage 1 serving more")
        assert later["swarm_server_epoch"] >= first["swarm_server_epoch"]
        assert later["swarm_wire_bytes_total{direction=received,role=activations}"] > 0
        for name in ("swarm_server_queue", "swarm_server_pending_samples", "swarm_server_refused_total",
                     "swarm_server_failed_rounds_total", "swarm_server_throughput_samples_per_second"):
            assert name in later, name
        trainer = scrape(ports[3])
        assert trainer["info"]["role"] == "trainer" and trainer["swarm_trainer_loss"] > 0
        grown = until(lambda: scrape(ports[3]), lambda m: m["swarm_trainer_samples_total"]
                      > trainer["swarm_trainer_samples_total"], 60, "the trainer completing samples")
        assert grown["swarm_wire_bytes_total{direction=sent,role=activations}"] > 0

        # TensorBoard: the trainer's loss and samples/s, at growing sample counts
        loss = until(lambda: scalars(board / "trainer-0", "loss"), lambda s: len(s) >= 2, 60, "two loss scalars")
        assert [step for step, _ in loss] == sorted({step for step, _ in loss}) and all(v > 0 for _, v in loss)
        assert scalars(board / "trainer-0", "samples_per_second")

        # a server killed outright: its record expires and its row leaves the page
        FaultInjector(swarm.run_dir).kill(servers[1])
        until(lambda: [r[0] for r in page.evaluate(ROWS)], lambda peers: peers == sorted([ids[0], ids[2]]), 60,
              "the killed server's row gone")
        assert page.evaluate("document.getElementById('error').textContent") == ""
        assert interrupt(monitor.process) == 0
        monitor = None
    finally:
        if page is not None:
            page.close()
        if monitor is not None:
            interrupt(monitor.process)
        swarm.stop()
    assert not tracebacks(swarm.run_dir)


def _peer_id(port: int) -> str | None:
    """The peer id a server's /metrics names, once it serves its stage."""
    try:
        metrics = scrape(port)
    except OSError:  # not listening yet
        return None
    return metrics["info"]["peer_id"] if "swarm_server_stage" in metrics else None
