"""Rebalancing after losing half of one stage: throughput over time with rebalancing on and off.

    .venv/bin/python benchmarks/rebalance.py [--before 90] [--after 180] [--set section.field=value ...]

A local swarm of 2 stages x 4 servers and 2 trainers trains for `--before` seconds (counted from its
first completed microbatch); then half of stage 0's servers (2 of 4) are SIGKILLed and it trains
for `--after` seconds more. Three runs:

- `on`: rebalancing on (the defaults: a look every 5 s, 30 s cooldown, gain 1.2);
- `off`: the same with rebalancing off: the swarm stays at 2/4, bottlenecked by stage 0;
- `best`: the best layout of the 6 survivors (3/3) from the start, no kill, rebalancing off: the
  throughput the survivors can reach.

Steps are large (512 samples): a server of a stage before the last recomputes a forward whose
weights a step changed before its backward came, which with frequent steps makes those stages cost
more per sample than the last (which runs both passes in one call); with rare steps the stages cost
about the same, and 4/4 is a layout the policy keeps.

Every server is slowed 20x (`server.slowdown`: it idles 19 times the CPU time of its compute), so
the 8 servers' work fits on a 2-core machine and the pipeline is bound by server capacity (as on
real machines), not by CPU contention between the processes (without it, killing servers frees CPU
for the others and throughput hardly drops). Reported: the time from the kill until the trailing 15 s
throughput is back within 10% of `best` (and stays there for 15 s), and the on/off throughput ratio
2 minutes after the kill (mean over 105-135 s after it). `rebalance.png` plots the three runs.

Runs must be alone on the machine: anything else running skews all three.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from swarm.config import load_config  # noqa: E402
from swarm.ops.faults import FaultInjector  # noqa: E402
from swarm.ops.local import LocalSwarm, SwarmStatus  # noqa: E402
from swarm.ops.report import collect, plot, rate_between, read_moves  # noqa: E402

BASE = [
    "model.d_model=128", "model.n_heads=4", "model.d_ff=512", "model.n_layers=6", "model.seq_len=128",
    "model.num_stages=2",
    "optim.lr=1e-3", "optim.target_batch_size=512",
    # calls queue at the slowed servers for many seconds: a timeout shorter than that would send them
    # elsewhere while they still wait, doubling the work
    "trainer.microbatch_size=8", "trainer.max_inflight=8", "trainer.target_steps=1000000",
    "trainer.min_request_timeout=30",
    "local.trainers=2", "local.threads_per_peer=1",
    "local.slowdowns=[20,20,20,20,20,20,20,20]",
]
WINDOW = 15.0  # seconds of the trailing throughput


def run(run_dir: Path, before: float, after: float, layout: str, rebalance: bool, kill: bool,
        overrides: list[str]) -> dict:
    cfg = load_config(None, [*BASE, f'run_dir="{run_dir}"', f"local.layout={layout}",
                             f"rebalance.enabled={str(rebalance).lower()}", f"local.timeout={before + after + 600}",
                             *overrides])
    swarm = LocalSwarm(cfg)
    faults = FaultInjector(run_dir)
    marks: dict[str, float] = {}

    def tick(status: SwarmStatus) -> None:
        now = time.time()
        if "began" not in marks:
            if status.trainer_samples:
                marks["began"] = now
            return
        if kill and "kill" not in marks and now - marks["began"] >= before:
            marks["kill"] = now
            stage0 = swarm.serving(status, 0)
            for victim in stage0[: len(stage0) // 2]:
                faults.kill(victim)
        if "end" not in marks and now - marks["began"] >= before + after:
            marks["end"] = now
            for trainer in swarm.trainers():
                trainer.process.send_signal(signal.SIGTERM)

    try:
        swarm.start()
        swarm.wait_until_done(progress=False, on_status=tick)
    finally:
        swarm.stop()
    summary = collect(run_dir)
    plot(summary, run_dir)
    return {"completed": [(c[0], c[1]) for c in summary["_completed"]], "marks": marks,
            "moves": [(m["time"], m["source"], m["target"]) for m in read_moves(run_dir)],
            "replays": summary["replays"], "delivery": {k: v["delivery"] for k, v in summary["stages"].items()}}


def trailing(result: dict, at: float) -> float:
    return rate_between(result["completed"], at - WINDOW, at)


def recovery(result: dict, target: float, limit: float) -> float | None:
    """Seconds from the kill until the trailing throughput is within 10% of `target` for WINDOW seconds."""
    kill = result["marks"]["kill"]
    held_since = None
    for i in range(int(limit)):
        t = kill + WINDOW + i
        if trailing(result, t) >= 0.9 * target:
            held_since = t if held_since is None else held_since
            if t - held_since >= WINDOW:
                return held_since - kill
        else:
            held_since = None
    return None


def draw(results: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, result in results.items():
        zero = result["marks"].get("kill", result["marks"]["began"] + result["before"])
        first = int(result["marks"]["began"] + WINDOW - zero)
        ts = range(first, int(result["marks"]["end"] - zero))
        ax.plot(list(ts), [trailing(result, zero + t) for t in ts], label=name)
        for when, source, target in result["moves"]:
            ax.axvline(when - zero, color="tab:green", alpha=0.3, lw=1)
            ax.annotate(f"{source}->{target}", (when - zero, 0), rotation=90, fontsize=7, color="tab:green")
    ax.axvline(0, color="tab:red", lw=1, label="2 of stage 0's 4 servers killed")
    ax.set(xlabel="seconds from the kill", ylabel=f"samples/s (trailing {WINDOW:.0f} s)",
           title="throughput after losing half of one stage (green: a server moved)")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=float, default=90.0, help="seconds of training before the kill")
    parser.add_argument("--after", type=float, default=180.0, help="seconds of training after it")
    parser.add_argument("--run-dir", default="runs/rebalance")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    root = Path(args.run_dir)
    results = {}
    for name, layout, rebalance, kill in (("on", "[4,4]", True, True), ("off", "[4,4]", False, True),
                                          ("best", "[3,3]", False, False)):
        results[name] = run(root / name, args.before, args.after, layout, rebalance, kill, args.overrides)
        results[name]["before"] = args.before
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "completed"}), flush=True)
    best = results["best"]
    steady = [trailing(best, best["marks"]["began"] + args.before + t) for t in range(int(WINDOW), int(args.after))]
    best_rate = statistics.median(steady)
    on, off = results["on"], results["off"]
    at_2min = {name: rate_between(r["completed"], r["marks"]["kill"] + 105, r["marks"]["kill"] + 135)
               for name, r in (("on", on), ("off", off))}
    report = {
        "best_layout_samples_per_s": round(best_rate, 2),
        "before_kill": {name: round(rate_between(r["completed"], r["marks"]["kill"] - 30, r["marks"]["kill"]), 2)
                        for name, r in (("on", on), ("off", off))},
        "recovery_s": {name: recovery(r, best_rate, args.after - WINDOW) for name, r in (("on", on), ("off", off))},
        "at_2_min": {k: round(v, 2) for k, v in at_2min.items()},
        "ratio_on_off_at_2_min": round(at_2min["on"] / at_2min["off"], 3),
        "moves_on": [(round(t - on["marks"]["kill"], 1), s, d) for t, s, d in on["moves"]],
        "replays": {name: r["replays"] for name, r in results.items()},
        "delivery": {name: r["delivery"] for name, r in results.items()},
    }
    print(json.dumps(report, indent=1))
    draw(results, root / "rebalance.png")
    (root / "rebalance.json").write_text(json.dumps({"report": report, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
