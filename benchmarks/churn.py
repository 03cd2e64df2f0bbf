"""Goodput under churn: a random server is killed every `--every` seconds and a fresh one started.

    .venv/bin/python benchmarks/churn.py [--minutes 10] [--every 30] [--correlated] [--set section.field=value ...]

Two runs of the same local swarm (the demo recipe by default: 3 stages x 2 servers, 2 trainers) for
the same time: one without faults, one where every `--every` seconds a random server's processes are
SIGKILLed and a new server of the same stage is started (it downloads the stage's state from the
survivor; a victim is always a server whose stage keeps another one serving).

With `--correlated`, every replica of a random stage is killed at once instead (one provider's
preemption wave) and as many new servers started: they restore the stage from the copies held
outside it (`backup`), and the steps the stage lost each time are reported. A third run then measures
what the copies cost when nothing fails: the no-fault run again with `backup.holders=0` (no copies),
its goodput and the megabytes the copies moved. Reported:

- goodput: samples per second that reached an optimizer step of every stage. Delivery is exactly
  once (each completed microbatch enters one step of each stage; checked here from the ledgers after
  the trainers were stopped with SIGTERM and settled), so this is the trainers' completed samples
  over the measured window;
- capacity alive: the mean fraction of the configured servers that were up (a killed server counts as
  down until its replacement logged that it serves), and goodput relative to the no-fault run divided
  by it ("counted against the capacity that was alive");
- time from each kill to full throughput: the first moment the trailing 5-second throughput is back
  to 90% of the 10 seconds before the kill (median and 95th percentile; a kill not recovered from
  before the next one counts as the full interval).

Runs must be alone on the machine: anything else running skews both.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import time
from pathlib import Path

from swarm.config import load_config
from swarm.config.recipes import DEMO
from swarm.ops.faults import FaultInjector
from swarm.ops.local import LocalSwarm, SwarmStatus
from swarm.ops.report import collect, plot, rate_between, read_steps
from swarm.results import read_jsonl


def _serving(peer) -> bool:
    return peer.alive() and " up on /" in peer.log_path.read_text(errors="replace")


def run(cfg, seconds: float, every: float | None, seed: int, correlated: bool = False) -> dict:
    swarm = LocalSwarm(cfg)
    faults = FaultInjector(cfg.run_dir)
    rng = random.Random(seed)
    began: list[float] = []
    ended: list[float] = []
    kills: list[float] = []
    losses: list[tuple[float, int]] = []  # (when, stage) of each kill
    down: dict[str, float] = {}  # replacement server -> when its predecessor was killed
    downtime: list[float] = []

    def tick(status: SwarmStatus) -> None:
        now = time.time()
        for peer in [p for p in swarm.servers() if p.name in down and _serving(p)]:
            downtime.append(now - down.pop(peer.name))
        if not began:
            if status.trainer_samples == 0:
                return  # the window starts with the first completed microbatch
            began.append(now)
        if now - began[0] > seconds:  # trainers finish what is in flight, the stages their last steps
            if not ended:
                ended.append(now)
                for trainer in swarm.trainers():
                    trainer.process.send_signal(signal.SIGTERM)
            return
        if every and now - (kills[-1] if kills else began[0]) >= every:
            serving = [p for p in swarm.servers() if _serving(p)]
            if correlated:  # every replica of one stage, together: by the DHT, since rebalancing moves servers
                members = status.members
                full = [k for k in range(cfg.model.num_stages) if len(members.get(k, [])) >= 2]
                stage = rng.choice(full) if full else None
                victims = [p for p in serving if p.name in members.get(stage, [])]
            else:  # a serving server whose stage keeps another serving one: the stage's state must survive
                victims = [rng.choice([p for p in serving if sum(q.stage == p.stage for q in serving) > 1])]
            for victim in victims:
                faults.kill(victim)
            if victims:
                kills.append(now)
                losses.append((now, stage if correlated else victims[0].stage))
            for victim in victims:  # a fresh server for the stage the victim served
                down[swarm.add_server(stage if correlated else victim.stage).name] = now

    try:
        swarm.start()
        swarm.wait_until_done(progress=False, on_status=tick)
    finally:
        swarm.stop()
    summary = collect(Path(cfg.run_dir))
    plot(summary, Path(cfg.run_dir))  # throughput.png marks every kill
    start, end = began[0], began[0] + seconds
    done = [c for c in summary["_completed"] if start <= c[0] <= end]
    downtime += [end - t for t in down.values()]  # replacements not up by the end
    servers = cfg.model.num_stages * cfg.local.servers_per_stage
    peers = [json.loads(p.read_text()) for p in Path(cfg.run_dir, "peers").glob("*.json")]
    return {
        "goodput": sum(c[1] for c in done) / seconds,
        "steps_lost": [_steps_lost(Path(cfg.run_dir), when, stage) for when, stage in losses] if correlated else [],
        "copy_megabytes": round(sum(p.get("copy_counters", {}).get("copy_megabytes", 0) for p in peers), 1),
        "copies": sum(p.get("copy_counters", {}).get("copies", 0) for p in peers),
        "copy_seconds": round(sum(p.get("copy_counters", {}).get("copy_seconds", 0) for p in peers), 1),
        "capacity_alive": 1 - sum(downtime) / (servers * seconds),
        "replacement_up_s": sorted(round(d, 1) for d in downtime),
        "recoveries": [_recovery(done, t, every or seconds) for t in kills],
        "kills": len(kills),
        "replays": summary["replays"],
        "delivery": {k: v["delivery"] for k, v in summary["stages"].items()},
    }


def _steps_lost(run_dir: Path, kill: float, stage: int) -> int | None:
    """Steps of `stage` lost when all its replicas were killed at `kill`: its newest step before, less the
    epoch the first restore after took it back to (None: not restored)."""
    before = max((s["epoch"] for steps in read_steps(run_dir)[stage] for s in steps if s["time"] <= kill),
                 default=0)
    restores = sorted((load["time"], load["epoch"]) for path in run_dir.glob(f"peers/server-s{stage}-*.loads.jsonl")
                      for load in read_jsonl(path) if load.get("restored")
                      and load["time"] > kill)
    return before - restores[0][1] if restores else None


def _recovery(done: list, kill: float, cap: float) -> float:
    """Seconds from `kill` until the trailing 5 s rate is back to 90% of the 10 s before it."""

    before = rate_between(done, kill - 10, kill)
    t = kill + 5
    while t <= kill + cap:
        if rate_between(done, t - 5, t) >= 0.9 * before:
            return t - kill
        t += 0.5
    return cap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--correlated", action="store_true", help="kill every replica of a stage together")
    parser.add_argument("--run-dir", default="runs/churn")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    seconds = args.minutes * 60
    results = {}
    runs = [("no_faults", None, ()), ("churn", args.every, ())]
    if args.correlated:
        runs.append(("no_copies", None, ("backup.holders=0",)))
    for name, every, extra in runs:
        cfg = load_config(None, [f'run_dir="{args.run_dir}/{name}"', "trainer.target_steps=1000000",
                                 f"local.timeout={seconds + 600}", *args.overrides, *extra], base=DEMO)
        results[name] = run(cfg, seconds, every, args.seed, args.correlated)
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "recoveries"}), flush=True)
    base, churn = results["no_faults"], results["churn"]
    ratio = churn["goodput"] / base["goodput"]
    rec = sorted(churn["recoveries"])
    report = {
        "goodput_no_faults": round(base["goodput"], 2),
        "goodput_churn": round(churn["goodput"], 2),
        "ratio": round(ratio, 3),
        "capacity_alive": round(churn["capacity_alive"], 3),
        "ratio_per_capacity_alive": round(ratio / churn["capacity_alive"], 3),
        "kills": churn["kills"],
        "recovery_median_s": statistics.median(rec) if rec else None,
        "recovery_p95_s": rec[min(len(rec) - 1, int(0.95 * len(rec)))] if rec else None,
        "replays": churn["replays"],
    }
    if args.correlated:
        lost = [n for n in churn["steps_lost"] if n is not None]
        report |= {
            "steps_lost_per_event": lost,
            "events_not_restored": len(churn["steps_lost"]) - len(lost),
            "goodput_without_copies": round(results["no_copies"]["goodput"], 2),
            "copies_cost": round(1 - base["goodput"] / results["no_copies"]["goodput"], 3),
            "copy_megabytes_no_faults": base["copy_megabytes"],
            "copies_no_faults": base["copies"],
            "copy_seconds_no_faults": base["copy_seconds"],
        }
    print(json.dumps(report, indent=1))
    Path(args.run_dir, "churn.json").write_text(json.dumps({"report": report, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
