"""A swarm snapshot as a person reads it (a table per stage, the trainers, a verdict) and as a script
reads it (one JSON object). Pure: a `SwarmStatus` in, text or plain data out.

The JSON object (`status_json`), one per snapshot::

    {"run_id": "demo", "time": 1700000000.0,               # unix seconds when it was read
     "num_stages": 3,
     "stages": [{"stage": 0, "epoch": 12,                   # highest epoch of its replicas (null: no server)
                 "capacity": 52.3,                          # samples/s of its servers that take new work
                 "pending": 8,                              # samples accumulated toward its next step
                 "servers": [{"peer_id": "12D3Koo...", "name": "server-s0-1", "throughput": 51.0,
                              "capacity": 52.3, "queue": 0, "calls": 1, "epoch": 12, "pending": 8, "moving": false,
                              "tenure": 63.2, "mode": "sync"}]}, ...],
     "trainers": [{"peer_id": "12D3Koo...", "completed": 1280, "failed": 0, "loss": 2.314,  # null: none yet
                   "samples_per_second": 42.1, "done": false}],
     "verdict": {"text": "stage 1 is the bottleneck (12.3 samples/s, next 30.1)",
                 "findings": ["stage 1 is the bottleneck (12.3 samples/s, next 30.1)"], "bottleneck": 1}}
"""

from __future__ import annotations

import math
import time
from typing import Any

from swarm.net.directory import short
from swarm.ops.status import SwarmStatus, server_rate
from swarm.wire.records import ServerRecord

SERVER_FIELDS = ("name", "throughput", "capacity", "queue", "calls", "epoch", "pending", "moving", "tenure")
TRAINER_FIELDS = ("completed", "failed", "loss", "samples_per_second", "done")


def status_json(status: SwarmStatus, run_id: str) -> dict[str, Any]:
    diagnosis = status.diagnosis()
    stages = []
    for stage, records in sorted(status.servers.items()):
        stages.append({
            "stage": stage,
            "epoch": max((r.epoch for r in records), default=None),
            "capacity": diagnosis.capacity[stage],
            "pending": sum(r.pending for r in records),
            "servers": [{"peer_id": r.peer_id, **{f: getattr(r, f) for f in SERVER_FIELDS}, "mode": r.optim.get("mode")}
                        for r in _ordered(records)],
        })
    trainers = [
        {"peer_id": t.peer_id, **{f: _finite(getattr(t, f)) for f in TRAINER_FIELDS}} for t in status.trainers
    ]
    verdict = {"text": diagnosis.text, "findings": list(diagnosis.findings), "bottleneck": diagnosis.bottleneck}
    return {"run_id": run_id, "time": status.time, "num_stages": len(status.servers), "stages": stages,
            "trainers": trainers, "verdict": verdict}


def render_text(status: SwarmStatus, run_id: str) -> str:
    diagnosis = status.diagnosis()
    servers = sum(len(r) for r in status.servers.values())
    when = time.strftime("%H:%M:%S", time.localtime(status.time))
    lines = [f"swarm {run_id!r} at {when}: {_count(len(status.servers), 'stage')}, {_count(servers, 'server')}, "
             f"{_count(len(status.trainers), 'trainer')}"]
    for stage, records in sorted(status.servers.items()):
        if not records:
            lines.append(f"stage {stage}: no server")
            continue
        epoch = max(r.epoch for r in records)
        lines.append(f"stage {stage}: epoch {epoch}, capacity {diagnosis.capacity[stage]:.1f} samples/s, "
                     f"{_count(len(records), 'server')}")
        rows = [[r.name or "-", short(r.peer_id), f"{r.throughput:.1f}", f"{server_rate(r):.1f}",
                 str(r.queue), str(r.calls), str(r.epoch), str(r.pending), "moving" if r.moving else ""]
                for r in _ordered(records)]
        lines += _table(["server", "peer", "throughput", "capacity", "queue", "calls", "epoch", "pending", ""], rows,
                        left=2)
    if status.trainers:
        lines.append("trainers")
        rows = [[short(t.peer_id), f"{t.completed:,}", f"{t.samples_per_second:.1f}",
                 "-" if math.isnan(t.loss) else f"{t.loss:.3f}", str(t.failed), "done" if t.done else "training"]
                for t in sorted(status.trainers, key=lambda t: t.peer_id)]
        lines += _table(["trainer", "samples", "samples/s", "loss", "failed", ""], rows, left=1)
    lines.append(f"verdict: {diagnosis.text}")
    return "\n".join(lines)


def _ordered(records: list[ServerRecord]) -> list[ServerRecord]:
    """Servers in an order that does not change between snapshots: named ones first, by name."""
    return sorted(records, key=lambda r: (not r.name, r.name, r.peer_id))


def _table(header: list[str], rows: list[list[str]], left: int) -> list[str]:
    """Indented columns: the first `left` (names) left-aligned, figures right-aligned, the last (a note)
    left-aligned with trailing space trimmed."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    out = []
    for row in [header, *rows]:
        cells = [c.ljust(w) if i < left or i == len(row) - 1 else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        out.append(("  " + "  ".join(cells)).rstrip())
    return out


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _finite(value: Any) -> Any:
    """NaN (a trainer with no loss yet) is not JSON: it becomes null."""
    return None if isinstance(value, float) and math.isnan(value) else value
