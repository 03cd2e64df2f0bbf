"""The run's results, gathered from every peer's summary: one JSON file and two plots."""

from __future__ import annotations

import json
import logging
import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from swarm.net.directory import short
from swarm.results import read_jsonl

log = logging.getLogger(__name__)


def read_steps(run_dir: Path, superseded: bool = True) -> dict[int, list[dict[str, Any]]]:
    """Every step every server logged (killed ones too), by stage: one list per server. Without
    `superseded`, less the branches of the stage's history that the stage did not go on from: the steps a
    server later replaced by loading a peer's state of that epoch or newer, and, where every replica of
    the stage died and a server restored it from an older copy, the steps taken before the restore
    beyond the copy's epoch (lost with their replicas)."""
    paths = sorted((run_dir / "peers").glob("server-s*.steps.jsonl"))
    stage_of = {path: int(path.name.split("-")[1][1:]) for path in paths}
    loads = {path: read_jsonl(path.with_name(path.name.replace(".steps.", ".loads."))) for path in paths}
    restores: dict[int, list[dict[str, Any]]] = {}
    for path in sorted((run_dir / "peers").glob("server-s*.loads.jsonl")):
        stage = int(path.name.split("-")[1][1:])
        restores.setdefault(stage, []).extend(load for load in read_jsonl(path) if load.get("restored"))
    steps: dict[int, list[dict[str, Any]]] = {}
    for path in paths:
        records = read_jsonl(path)
        if not superseded:
            lost = restores.get(stage_of[path], [])
            records = [r for r in records
                       if not any(r["time"] <= load["time"] and r["epoch"] <= load["epoch"] for load in loads[path])
                       and not any(r["time"] <= x["time"] and r["epoch"] > x["epoch"] for x in lost)]
        steps.setdefault(stage_of[path], []).append(records)
    return steps


def read_moves(run_dir: Path) -> list[dict[str, Any]]:
    """Every move of a server between stages (see the server's rebalancing), oldest first."""
    paths = (run_dir / "peers").glob("moves-*.jsonl")
    moves = [move for path in paths for move in read_jsonl(path)]
    return sorted(moves, key=lambda m: m["time"])


def rate_between(completed: list, start: float, end: float) -> float:
    """Completed samples per second between two wall-clock times."""
    return sum(c[1] for c in completed if start <= c[0] < end) / (end - start)


def collect(run_dir: Path) -> dict[str, Any]:
    peers = [json.loads(p.read_text()) for p in sorted((run_dir / "peers").glob("*.json"))]
    servers = [p for p in peers if p["role"] == "server"]
    trainers = [p for p in peers if p["role"] == "trainer"]
    completed = sorted((c for t in trainers for c in t["completed"]), key=lambda c: c[0])
    logged = read_steps(run_dir, superseded=False)  # the history the stage went on from
    stages: dict[int, dict[str, Any]] = {k: {"replicas": []} for k in logged}
    for s in servers:
        stages.setdefault(s["stage"], {"replicas": []})["replicas"].append(
            {k: s[k] for k in ("peer_id", "epoch", "digest", "fast_backwards", "recomputed_backwards",
                               "recomputed_why", "throughput", "busy_seconds", "alive_seconds", "refused",
                               "failed_rounds", "catch_ups", "lost_samples", "stale_refusals", "busy_refusals",
                               "duplicates", "samples_served", "reply_delay")}
        )
    step_samples: dict[int, dict[int, int]] = {}  # stage -> epoch -> samples of the whole stage
    step_ids: dict[int, dict[int, list[list[str]]]] = {}  # stage -> epoch -> each replica's list of its ids
    for stage in stages:
        # the ledgers of the replicas' final states are the stage's history (steps of a replica that
        # later took a peer's state are superseded); steps older than the ledgers come from the step logs
        known = step_ids.setdefault(stage, {})
        for s in servers:
            if s["stage"] == stage:
                for epoch, ids in s.get("ledger", {}).items():
                    known.setdefault(int(epoch), []).append(ids)
        in_ledgers = set(known)
        samples = step_samples.setdefault(stage, {})
        for records in logged.get(stage, []):
            for step in records:
                samples.setdefault(step["epoch"], step["samples"])
                if step["epoch"] not in in_ledgers:
                    known.setdefault(step["epoch"], []).append(step["ids"])
    completed_ids = {f"{t['peer_id']}/{c[4]}" for t in trainers for c in t["completed"]}
    every_step = read_steps(run_dir)  # branches the stage did not go on from included
    for stage, st in stages.items():
        st["delivery"] = delivery(step_ids.get(stage, {}), completed_ids)
        if st["delivery"]["missing"]:  # where they went: steps of a branch later superseded, or none at all
            missing = completed_ids.difference(*(ids for lists in step_ids.get(stage, {}).values() for ids in lists))
            st["missing_stepped_at"] = sorted({r["epoch"] for records in every_step.get(stage, []) for r in records
                                               if missing.intersection(r["ids"])})
        merged = step_samples[stage]
        st["steps"] = max(merged, default=0)
        st["samples_stepped"] = sum(merged.values())
        st["samples_by_step"] = [merged.get(e, 0) for e in range(1, st["steps"] + 1)]
        # the times every replica of the stage was lost and a server took an older state: steps lost each
        st["restores"] = sorted((s["entry"] for s in servers if s["stage"] == stage and s.get("entry")
                                 and s["entry"]["action"] in ("restore", "resume")), key=lambda e: e["time"])
    start = min((t["started"] for t in trainers if t["started"]), default=None)
    end = completed[-1][0] if completed else None
    samples = sum(c[1] for c in completed)
    return {
        "samples_completed": samples,
        "microbatches_failed": sum(t["failed"] for t in trainers),
        "microbatches_given_up": sum(t.get("given_up", 0) for t in trainers),
        "trainer_call_seconds": _sum_dicts(t["call_seconds"] for t in trainers),
        "retries": sum(t["retries"] for t in trainers),
        "replays": sum(t["replays"] for t in trainers),
        "unresolved": sum(t["unresolved"] for t in trainers),
        "wall_seconds": (end - start) if start and end else None,
        "samples_per_second": samples / (end - start) if start and end and end > start else None,
        # from the first completed microbatch on: excludes waiting for servers and filling the pipeline
        "steady_samples_per_second": _steady_rate(completed),
        "first_loss": _mean([c[2] for c in completed[:20]]),
        "final_loss": _mean([c[2] for c in completed[-20:]]),
        # held-out losses of the trainers that evaluate (trainer.eval_every), in the order they were taken
        "validation": sorted(({"time": v["time"], "step": v["step"], "loss": v["loss"], "samples": v["samples"]}
                              for t in trainers for v in t.get("validation", [])), key=lambda v: v["time"]),
        "stages": {str(k): v for k, v in sorted(stages.items())},
        "wire": wire_summary(peers, samples),
        "staleness": staleness_summary(servers),
        # stages an operator started afresh mid-run (`--fresh-stage`), as any peer saw them
        "fresh_starts": sorted({(f["stage"], f["time"]) for p in peers for f in p.get("fresh_starts", [])}
                               | {(s["stage"], s["fresh_start"]) for s in servers if s.get("fresh_start")}),
        "moves": [{k: m[k] for k in ("time", "name", "peer_id", "source", "target", "before", "after")}
                  for m in read_moves(run_dir)],
        "_completed": completed,
        # when the last trainer started its last microbatch: the run's one drain follows
        "_stopped_starting": max((t.get("stopped_starting") or 0.0 for t in trainers), default=0.0) or None,
        "_start": start,
    }


def wire_summary(peers: list[dict[str, Any]], samples: int) -> dict[str, Any]:
    """Bytes on the wire by role over the whole run (each byte counted once, where it was sent: retries,
    replays and state downloads included), and per completed sample."""
    sent = _sum_dicts({role: c["sent"] for role, c in p["traffic"].items()} for p in peers)
    total = sum(sent.values())
    by_peer = []  # each peer's own bytes, sent plus received, per sample it handled
    for p in peers:
        handled = p.get("samples" if p["role"] == "trainer" else "samples_served", 0)  # a backup peer: none
        where = {"trainer": f"trainer {p.get('index')}", "server": f"stage {p.get('stage')}"}.get(p["role"], p["role"])
        by_peer.append({"peer": f"{where} {short(p['peer_id'])}", "samples": handled, "bytes_per_sample": {
            role: (c["sent"] + c["received"]) / handled for role, c in p["traffic"].items()} if handled else {}})
    return {
        "bytes_sent": {role: int(n) for role, n in sent.items()},
        "bytes_per_sample": {role: n / samples for role, n in sent.items()} if samples else {},
        "total_bytes_per_sample": total / samples if samples else None,
        "by_peer": by_peer,
    }


def staleness_summary(servers: list[dict[str, Any]]) -> dict[str, Any]:
    """How many weight updates each gradient came after the forward it belongs to, as the update that
    took it in found it (`swarm.server.staleness`), per stage and over the run: a histogram and its mean,
    median, 90th percentile and maximum."""
    by_stage: dict[int, Counter[int]] = {}
    for s in servers:
        by_stage.setdefault(s["stage"], Counter()).update({int(k): n for k, n in s.get("staleness", {}).items()})
    summary = {str(k): _distribution(h) for k, h in sorted(by_stage.items())}
    summary["all"] = _distribution(sum(by_stage.values(), Counter()))
    return summary


def _distribution(histogram: Counter[int]) -> dict[str, Any]:
    total = sum(histogram.values())
    if not total:
        return {"gradients": 0}
    ordered = sorted(histogram.items())

    def quantile(q: float) -> int:
        seen = 0
        for value, n in ordered:
            seen += n
            if seen >= q * total:
                return value
        return ordered[-1][0]

    return {"gradients": total, "mean": sum(v * n for v, n in ordered) / total, "median": quantile(0.5),
            "p90": quantile(0.9), "max": ordered[-1][0], "histogram": {str(v): n for v, n in ordered}}


def delivery(ledger: dict[int, list[list[str]]], completed: set[str]) -> dict[str, int]:
    """How a stage's steps account for the completed microbatches: each should be in exactly one step.

    `ledger` maps each epoch to the id lists its replicas recorded for that step (one list per replica
    that took part; they must agree). `not_completed` counts microbatches a step took in that no trainer
    reported complete (a trainer killed mid-run reports nothing).
    """
    counts: Counter[str] = Counter()
    conflicting = 0
    for lists in ledger.values():
        conflicting += any(ids != lists[0] for ids in lists)
        counts.update(lists[0])
    return {
        "steps_seen": len(ledger),
        "conflicting_steps": conflicting,
        "duplicated": sum(1 for n in counts.values() if n > 1),
        "missing": len(completed - counts.keys()),
        "not_completed": len(counts.keys() - completed),
    }


def _steady_rate(completed: list) -> float | None:
    if len(completed) < 2 or completed[-1][0] <= completed[0][0]:
        return None
    return sum(c[1] for c in completed[1:]) / (completed[-1][0] - completed[0][0])


def _sum_dicts(dicts) -> dict[str, float]:
    total: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            total[k] = total.get(k, 0.0) + v
    return dict(sorted(total.items()))


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def gather(sources: list[Path], run_dir: Path) -> None:
    """Copy what each peer wrote under its own run directory (on its own machine) into `run_dir`, so one
    report covers them all. Every file a peer writes is named after its peer id, so nothing collides."""
    dest = run_dir / "peers"
    dest.mkdir(parents=True, exist_ok=True)
    for source in sources:
        found = list((source / "peers").glob("*"))
        if not found:
            raise FileNotFoundError(f"{source} has no peers/ directory of a swarm peer's results")
        for path in found:
            shutil.copy2(path, dest / path.name)


def write_report(run_dir: Path) -> dict[str, Any]:
    summary = collect(run_dir)
    try:
        from swarm.ops.plots import plot
    except ImportError:  # matplotlib is an extra: a peer host need not carry it
        log.info("no plots: matplotlib is not installed (pip install 'swarm-parallel[plots]')")
    else:
        plot(summary, run_dir)
    public = {k: v for k, v in summary.items() if not k.startswith("_")}
    (run_dir / "summary.json").write_text(json.dumps(public, indent=1, default=_json_safe))
    return public


def _json_safe(v: Any) -> Any:
    return None if isinstance(v, float) and math.isnan(v) else str(v)
