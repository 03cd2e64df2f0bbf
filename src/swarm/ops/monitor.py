"""`swarm monitor`: a live web page of a swarm, and the same data as JSON.

The monitor joins the DHT as a client and reads the same snapshot as `swarm status` (`follow`, every
`--every` seconds). It serves, from a thread of stdlib's HTTP server, the page (`monitor_page`: inline
JS and SVG, nothing fetched from elsewhere) and `/status.json`, which the page fetches and redraws from
at the same pace. The JSON is `swarm status --json`'s object (`status_view.status_json`) with, per
server, its short id, the stage it moved from and its state, per trainer every field of its record
(a validation loss among them where trainers announce one), and what the monitor has gathered since it
started: series of each stage's throughput and epoch and each trainer's figures over time, and the moves
of servers between stages.

Only live servers have a row: a server that left (its tombstone) or died (its record expired) is gone
from the next snapshot, hence from the page. The history is the monitor's own: one started late sees
the run from then on, but moves made before (the records say where each server came from).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
from collections import deque
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from swarm.config import ConfigError, SwarmConfig
from swarm.net.directory import short
from swarm.ops.monitor_page import PAGE
from swarm.ops.status import SwarmStatus, follow
from swarm.ops.status_view import _finite, status_json
from swarm.wire.records import ServerRecord

log = logging.getLogger("swarm.monitor")
MAX_POINTS = 900  # points kept per series: half an hour at one snapshot every 2 s
MAX_MOVES = 200


class History:
    """The latest snapshot and what the monitor has seen over time, as the JSON the page draws. Pure:
    snapshots in (`add`, on the DHT loop), bytes out (`latest`, read by the HTTP threads; replaced whole,
    so a reader never sees half of an update)."""

    def __init__(self, run_id: str, every: float, keep: int = MAX_POINTS):
        self.run_id, self.every, self.keep = run_id, every, keep
        self.series: dict[str, dict[str, deque[list[float]]]] = {}
        self.moves: deque[dict[str, Any]] = deque(maxlen=MAX_MOVES)
        self._stage_of: dict[str, int] = {}  # peer -> the stage it was last seen at
        self.latest = json.dumps(self.as_json(None)).encode()

    def add(self, status: SwarmStatus) -> None:
        t = status.time
        for name in ("throughput", "epoch"):  # a stage the swarm turned out not to have (see `read_status`)
            for phantom in set(self.series.get(name, {})) - {str(k) for k in status.servers}:
                del self.series[name][phantom]
        for stage, records in status.servers.items():
            self._point("throughput", str(stage), t, sum(r.throughput for r in records))
            if records:
                self._point("epoch", str(stage), t, max(r.epoch for r in records))
            for r in records:
                self._note_move(r, t)
        for trainer in status.trainers:
            for name, value in asdict(trainer).items():
                if isinstance(value, float):
                    self._point(f"trainer_{name}", short(trainer.peer_id), t, value)
        self.latest = json.dumps(self.as_json(status)).encode()

    def _point(self, series: str, key: str, t: float, value: float) -> None:
        if math.isfinite(value):
            points = self.series.setdefault(series, {}).setdefault(key, deque(maxlen=self.keep))
            points.append([round(t, 2), round(value, 4)])

    def _note_move(self, r: ServerRecord, t: float) -> None:
        """A server seen at another stage than before, or seen first already moved (the record says from
        where); it arrived `tenure` seconds before the snapshot."""
        seen = self._stage_of.get(r.peer_id)
        self._stage_of[r.peer_id] = r.stage
        if seen == r.stage or (seen is None and r.previous_stage < 0):
            return
        source = r.previous_stage if r.previous_stage >= 0 else seen
        self.moves.append({"time": round(t - r.tenure, 2), "peer_id": r.peer_id, "label": short(r.peer_id),
                           "name": r.name, "from": source, "to": r.stage})

    def as_json(self, status: SwarmStatus | None) -> dict[str, Any]:
        base = status_json(status, self.run_id) if status is not None else {
            "run_id": self.run_id, "time": None, "num_stages": 0, "stages": [], "trainers": [], "verdict": None}
        if status is not None:
            _enrich(base, status)
        return {**base, "every": self.every, "moves": list(self.moves),
                "series": {name: {key: list(points) for key, points in by_key.items()}
                           for name, by_key in self.series.items()}}


def _enrich(snapshot: dict[str, Any], status: SwarmStatus) -> None:
    """What the page shows beyond `swarm status --json`: each server's short id, previous stage and state,
    and every field of each trainer's record (those that newer trainers add too)."""
    records = {r.peer_id: r for rs in status.servers.values() for r in rs}
    for stage in snapshot["stages"]:
        for row in stage["servers"]:
            r = records[row["peer_id"]]
            state = "moving" if r.moving else "behind" if r.epoch < stage["epoch"] else "serving"
            row.update(label=short(r.peer_id), stage=r.stage, previous_stage=r.previous_stage, state=state)
    for row, trainer in zip(snapshot["trainers"], status.trainers, strict=True):
        row.update({name: _finite(value) for name, value in asdict(trainer).items()}, label=short(trainer.peer_id))


class _Handler(BaseHTTPRequestHandler):
    """`/`: the page; `/status.json`: the data it draws."""

    server: Any  # the MonitorServer, which carries the history

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        path = self.path.split("?", 1)[0]
        if path in ("/", "/index.html"):
            body, kind = PAGE, "text/html; charset=utf-8"
        elif path == "/status.json":
            body, kind = self.server.history.latest, "application/json"
        else:
            self.send_error(404, "the monitor serves / and /status.json")
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        log.debug("%s %s", self.address_string(), format % args)


def serve_page(history: History, host: str, port: int) -> ThreadingHTTPServer:
    """The page and its JSON, served from threads until `shutdown()`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("MonitorServer", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True})
    try:
        httpd = server_class((host, port), _Handler)
    except OSError as e:
        raise ConfigError(f"--port: cannot serve the page on {host}:{port} ({e.strerror or e}); "
                          "give a free port or another --host") from None
    httpd.history = history
    threading.Thread(target=httpd.serve_forever, name="monitor-http", daemon=True).start()
    return httpd


def run_monitor(cfg: SwarmConfig, host: str, port: int, every: float) -> None:
    """Serve the page until interrupted (Ctrl-C); raises `swarm.net.node.JoinError` when no initial peer
    answers, as `swarm status` does."""
    if every <= 0:
        raise ConfigError(f"--every: SECONDS must be positive, got {every}")
    history = History(cfg.net.run_id, every)
    httpd = serve_page(history, host, port)  # before joining: a port already taken fails at once
    shown = f"[{host}]" if ":" in host else host
    print(f"swarm monitor of run {cfg.net.run_id!r} on http://{shown}:{httpd.server_address[1]}/ "
          "(its data: /status.json); Ctrl-C stops it", flush=True)
    try:
        follow(cfg, history.add, every)
    except KeyboardInterrupt:  # how a monitor ends
        pass
    finally:
        httpd.shutdown()
        httpd.server_close()
