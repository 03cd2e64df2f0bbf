"""What attacks cost a running swarm, measured.

For each hostile peer of `swarm.ops.hostile`, alone and then all together, a local swarm (2 stages x 2
servers, 2 trainers) trains until its slowest stage has warmed up, is measured for `--window` seconds,
then attacked for as long: the figure is the samples per second the trainers completed in each window,
with what the run's report says of it (steps, replicas, delivery, refused gradients, the last loss). Then the
fuzzer (`swarm.net.fuzz`) sends `--fuzz-messages` random and mutated messages to a server of each stage
(to each of its calls with `--fuzz-per-call`), and reads each server's event-loop lag and peak memory.
`--set KEY=VALUE` (repeated) changes the settings of every swarm it starts, e.g. its codecs or `optim.mode`.

    .venv/bin/python benchmarks/attacks.py [--window 20] [--fuzz-messages 10000] [--set KEY=VALUE ...]
                                           [--fuzz-per-call] [--fuzz-stages K ...]
                                           [--only KIND ... | --all-at-once | --no-attacks]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import time
from pathlib import Path

from swarm.config import load_config
from swarm.net.directory import Directory
from swarm.net.fuzz import METHODS, Fuzzer, forward_targets
from swarm.net.node import start_dht
from swarm.net.transport import StageClient
from swarm.ops.hostile import ATTACKS, Attack
from swarm.ops.local import LocalSwarm
from swarm.ops.report import read_steps, write_report

SMALL = [  # a model whose step takes well under a second on 2 cores
    'net.run_id="attacks"', "model.d_model=64", "model.n_heads=2", "model.d_ff=128", "model.n_layers=2",
    "model.seq_len=64", "model.num_stages=2", "optim.lr=3e-3", "optim.warmup_steps=2", "optim.target_batch_size=16",
    "trainer.microbatch_size=4", "trainer.max_inflight=3", "trainer.target_steps=100000", "local.servers_per_stage=2",
    "local.trainers=2", "local.timeout=600.0", "rebalance.enabled=false",
]


def finish(swarm: LocalSwarm) -> None:
    for trainer in swarm.trainers():
        trainer.signal(signal.SIGTERM)


def measure(kinds: tuple[str, ...], run_dir: Path, window: float, settings: tuple[str, ...] = ()) -> dict:
    swarm = LocalSwarm(load_config(overrides=[*SMALL, *settings, f'run_dir="{run_dir}"']))
    attack = Attack(swarm, kinds, finish, window=window)
    try:
        swarm.start()
        swarm.wait_until_done(progress=False, on_status=attack)
    finally:
        swarm.stop()
    before, during = attack.rates()
    return {"attack": "+".join(kinds), "settings": list(settings), "samples/s before": round(before, 2),
            "samples/s during": round(during, 2), "ratio": round(during / before, 2) if before else None,
            **outcome(run_dir)}


def outcome(run_dir: Path) -> dict:
    """What the run's report says the attack did: the stages' steps, epochs whose replicas logged
    different parameter digests (0: bit-identical), steps whose gradient was not finite (not applied),
    the honest trainers' delivery, the hostile calls refused for their gradients' norm, and the last
    loss (finite weights give a finite loss)."""
    summary = write_report(run_dir)
    stages = summary["stages"].values()
    digests: dict[tuple[int, int], set[str]] = {}
    non_finite = 0
    for stage, servers in read_steps(run_dir, superseded=False).items():
        for step in (step for steps in servers for step in steps):
            digests.setdefault((stage, step["epoch"]), set()).add(step["digest"])
            non_finite += not math.isfinite(step["grad_norm"])
    return {"steps by stage": [st["steps"] for st in stages],
            "epochs whose digests differ": sum(len(d) > 1 for d in digests.values()),
            "non-finite steps": non_finite,
            "microbatches failed": summary["microbatches_failed"], "unresolved": summary["unresolved"],
            "missing": sum(st["delivery"]["missing"] for st in stages),
            "duplicated": sum(st["delivery"]["duplicated"] for st in stages),
            "backward calls refused for their gradient's norm": sum(  # as the hostile peers were told
                log.read_text().count("grad_outputs: norm") for log in (run_dir / "logs").glob("hostile-*.log")),
            "final loss": None if summary["final_loss"] is None else round(summary["final_loss"], 3)}


def fuzz(run_dir: Path, messages: int, settings: tuple[str, ...] = (), per_call: bool = False,
         stages: tuple[int, ...] | None = None) -> list[dict]:
    """`messages` to each stage's server (to each of its calls with `per_call`), spread at random over
    the kinds of message; then each server's event-loop lag and peak memory over its life."""
    cfg = load_config(overrides=[*SMALL, *settings, f'run_dir="{run_dir}"', "local.servers_per_stage=1"])
    swarm = LocalSwarm(cfg)
    swarm.start_bootstrap()
    for stage in range(cfg.model.num_stages):
        swarm.add_server(stage)
    async def run() -> list[dict]:
        net = load_config(overrides=[f"net.initial_peers={list(swarm.initial_peers)!r}".replace("'", '"')]).net
        dht = start_dht(net, client_mode=True)
        try:
            p2p = await dht.replicate_p2p()
            directory = Directory(dht, cfg.net.run_id, cfg.net.record_ttl)
            while not all((found := await directory.stages(cfg.model.num_stages)).values()):
                await asyncio.sleep(0.5)
            fuzzer, rows = Fuzzer(p2p, StageClient(p2p), seed=0), []
            servers = {k: records[0].peer_id for k, records in found.items() if stages is None or k in stages}
            for target, methods in ((t, m) for t in forward_targets(cfg, servers)
                                    for m in ([(m,) for m in METHODS] if per_call else [METHODS])):
                started = time.monotonic()
                report = await fuzzer.run(target, messages, methods=methods)
                seconds = round(time.monotonic() - started, 1)
                rows.append({"stage": target.stage, "calls": list(methods), "messages": report.sent, "seconds": seconds,
                             "outcomes": dict(sorted(report.outcomes.items())), "problems": report.problems[:5],
                             "slowest answer s": round(report.slowest_answer, 3),
                             "slowest good call after a batch s": round(report.slowest_alive_check, 3)})
            return rows
        finally:
            dht.shutdown()

    try:
        rows = asyncio.run(run())
        alive = {server.stage: server.alive() for server in swarm.servers()}
        for row in rows:
            row["server alive"] = alive[row["stage"]]
    finally:
        swarm.stop()
    for path in sorted((run_dir / "peers").glob("server-s*.json")):
        summary = json.loads(path.read_text())
        rows.append({"stage": summary["stage"], **{k: summary.get(k) for k in (
            "max_loop_lag_s", "loop_lags_over_100ms", "peak_rss_mb", "alive_seconds")}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--fuzz-messages", type=int, default=10_000)
    parser.add_argument("--only", nargs="+", choices=ATTACKS, help="these attacks alone (default: each, then all)")
    parser.add_argument("--all-at-once", action="store_true", help="only every attack together")
    parser.add_argument("--no-attacks", action="store_true", help="the fuzzer only")
    parser.add_argument("--fuzz-per-call", action="store_true", help="--fuzz-messages to each call, not in all")
    parser.add_argument("--fuzz-stages", type=int, nargs="+", help="fuzz these stages' servers (default: all)")
    parser.add_argument("--run-dir", default="runs/attacks")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help='a setting of every swarm it starts, e.g. optim.mode="async" (repeatable)')
    args = parser.parse_args()
    root = Path(args.run_dir)
    runs = [(k,) for k in (args.only or ATTACKS)] + ([] if args.only else [tuple(ATTACKS)])
    runs = [] if args.no_attacks else [tuple(ATTACKS)] if args.all_at_once else runs
    for kinds in runs:
        print(json.dumps(measure(kinds, root / "+".join(kinds), args.window, tuple(args.set))), flush=True)
    if args.fuzz_messages:
        stages = tuple(args.fuzz_stages) if args.fuzz_stages else None
        for row in fuzz(root / "fuzz", args.fuzz_messages, tuple(args.set), args.fuzz_per_call, stages):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
