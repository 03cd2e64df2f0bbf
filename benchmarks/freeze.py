"""How long a stage goes without an optimizer step when one of its replicas freezes (a hung machine).

    PYTHONPATH=src .venv/bin/python benchmarks/freeze.py [--repeat 3] [--hold 20] [--set section.field=value ...]

A local swarm of 2 stages x 2 servers and 2 trainers, on a model small enough that a step takes well under
a second, with the network settings' defaults (`net.allreduce_timeout`, `net.record_ttl`, ...). Once stage
0 has taken `--after` steps, one of its servers is frozen (SIGSTOP: it keeps its connections and answers
nothing), thawed `--hold` seconds later, and the run ends 15 s after the thaw. The other replica goes on
serving forwards and backwards throughout, so its gradients pile up while its stage does not step, and
stage 1 steps on without it.

Reported per run: the longest stage 0 went without a step from the freeze on (up to its first step after the
thaw), when that began, the samples and replicas of the step that ended it, and the steps stage 1 took
meanwhile; then the median over the runs. Runs must be alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from swarm.config import load_config
from swarm.ops.faults import FaultInjector
from swarm.ops.local import LocalSwarm, SwarmStatus
from swarm.ops.report import read_steps

SMALL = ["model.d_model=64", "model.n_heads=2", "model.d_ff=128", "model.n_layers=2", "model.seq_len=64",
         "model.num_stages=2", "optim.target_batch_size=16", "trainer.microbatch_size=4", "trainer.max_inflight=3",
         "trainer.target_steps=1000", "local.servers_per_stage=2", "local.trainers=2", "rebalance.enabled=false"]
SETTLE = 15.0  # seconds the run goes on after the thaw


def run(overrides: list[str], run_dir: str, after: int, hold: float) -> dict:
    cfg = load_config(overrides=[*SMALL, f'run_dir="{run_dir}"', *overrides])
    swarm = LocalSwarm(cfg)
    faults = FaultInjector(cfg.run_dir)
    marks: dict[str, float] = {}
    victim: list[str] = []

    def tick(status: SwarmStatus) -> None:
        now = time.time()
        if "freeze" not in marks and status.min_epoch >= after:
            victim.append(swarm.servers(stage=0)[0].name)
            marks["freeze"] = now
            faults.freeze(victim[0])
        elif "freeze" in marks and "thaw" not in marks and now - marks["freeze"] >= hold:
            marks["thaw"] = now
            faults.thaw(victim[0])
        elif "thaw" in marks and "end" not in marks and now - marks["thaw"] >= SETTLE:
            marks["end"] = now
            for trainer in swarm.trainers():
                trainer.process.terminate()  # trainers finish what is in flight, then exit

    try:
        swarm.start()
        swarm.wait_until_done(progress=False, on_status=tick)
    finally:
        swarm.stop()
    return stall(read_steps(Path(cfg.run_dir)), marks["freeze"], marks["thaw"])


def stall(steps: dict[int, list[list[dict]]], freeze: float, thaw: float) -> dict:
    """The longest stage 0 went without a step from the freeze on, up to its first step after the thaw (a
    round that completed as the freeze came counts as a step): its length, the samples and replicas of the
    step that ended it, and the steps stage 1 took meanwhile."""
    firsts: dict[int, dict] = {}  # epoch -> the first server's step to it (replicas log the same step)
    for server in steps[0]:
        for s in server:
            if s["time"] > freeze and (s["epoch"] not in firsts or s["time"] < firsts[s["epoch"]]["time"]):
                firsts[s["epoch"]] = s
    ordered = sorted(firsts.values(), key=lambda s: s["time"])
    ordered = ordered[:next((i + 1 for i, s in enumerate(ordered) if s["time"] > thaw), len(ordered))]
    starts = [freeze] + [s["time"] for s in ordered[:-1]]
    begin, end = max(zip(starts, ordered, strict=True), key=lambda p: p[1]["time"] - p[0])
    stage1 = {s["epoch"] for server in steps[1] for s in server if begin < s["time"] <= end["time"]}
    return {"no_step_s": round(end["time"] - begin, 1), "from_freeze_s": round(begin - freeze, 1),
            "samples": end["samples"], "replicas": end["group"], "stage1_steps_meanwhile": len(stage1),
            "hold_s": round(thaw - freeze, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--after", type=int, default=3, help="stage 0's steps before the freeze")
    parser.add_argument("--hold", type=float, default=20.0, help="seconds the server stays frozen")
    parser.add_argument("--run-dir", default="runs/bench-freeze")
    parser.add_argument("--set", action="append", default=[], metavar="section.field=value")
    args = parser.parse_args()
    results = []
    for i in range(args.repeat):
        result = run(args.set, f"{args.run_dir}-{i + 1}", args.after, args.hold)
        results.append(result)
        print(json.dumps(result), flush=True)
    print(f"median of the longest time stage 0 went without a step after the freeze: "
          f"{statistics.median(r['no_step_s'] for r in results):.1f} "
          f"({', '.join(str(r['no_step_s']) for r in results)})")


if __name__ == "__main__":
    main()
