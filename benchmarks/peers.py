"""The local swarm against its peers: one process, and torch's own pipeline schedules, on one model.

    PYTHONPATH=src .venv/bin/python benchmarks/peers.py [--scenario fault-free|straggler|kill|copies|all]
        [--repeat 3] [--steps N] [--runs 1f1b,swarm,...] [--set section.field=value ...]

Every run trains the same model (by default GPT d_model 512, 4 layers, 8 heads, d_ff 2048, cut into 2
stages, seq_len 128) on the same text with the same microbatch (8) and optimizer step (64 samples), and
is timed after a warm-up step. Scenarios, each run back to back so that its ratios share the machine's
state, and repeated `--repeat` times (the medians of the ratios are printed last). Repetition k starts from
the scenario's k-th run and goes round: a machine that drifts over a repetition does not favour one run
every time.

- fault-free: the single process (`baseline()` of benchmarks/throughput.py, all cores in one process);
  GPipe and 1F1B (benchmarks/torchpipe.py: one process per stage, one thread each, gloo on 127.0.0.1,
  each rank building its own stage of `swarm.model` as a swarm server does); the local swarm of one
  server per stage and one trainer, twice: "swarm", the trainer in a process of its own, and
  "swarm+train", the trainer inside the stage-0 server's process (`local.trainers_in_servers`), as
  torch's first rank feeds its own data. Every run is timed after its first optimizer step (the swarm's:
  once every stage has taken it). The swarm's rate is given to its end and, besides, until its trainer
  stopped starting microbatches: what follows is the one drain of the whole run, which a pipeline
  schedule pays at every step (its bubble, counted in torch's rates).
- straggler: four workers on each side, each held to 0.45 cores as a machine of its own would be (a
  cgroup CPU quota, so needs root; the swarm's servers with their DHT and p2pd helpers), one of them 3x
  slower (a share of 0.15 cores): torch 1F1B as two data-parallel pipelines of 2 stages
  (the slow rank is pipeline 0's first stage), the swarm as 2 stages x 2 servers (the slow one is a
  stage-0 server) and one trainer, which with the DHT bootstrap peer runs outside the shares.
- kill: the same four, one stage-1 peer SIGKILLed at the start of the third timed step. How torch's run
  ends is reported as its survivors saw it; the swarm's throughput from the kill to its end is compared
  with a fault-free swarm of the servers that survive (2 + 1), run beside it.
- gpu (where torch sees a CUDA device; skipped with a line saying so elsewhere): the fault-free model in
  one process on the GPU, and the local swarm with every server on that GPU (bf16 autocast and TF32,
  the servers' GPU defaults), its trainer a process of its own ("swarm") and inside the stage-0 server
  ("swarm+train"), and that again in fp16 with the servers' loss scales ("swarm+train fp16", as a GPU
  without bf16 runs). Reference: the single process.
- copies: torch 1F1B, and the fault-free swarm with its trainer apart and inside, each with the backup copies
  its servers take of other stages by default (`backup.holders=1`: every `backup.every` steps a stage's whole
  state crosses the network) and without them (`backup.holders=0`: a stage that loses every replica starts
  over, as torch's pipeline does). Reference: 1F1B. Not in `all`.

`--runs` keeps some of a scenario's runs (its reference always among them): the same comparison, more
repetitions in the same time.

Each run's line ends with what the machine did meanwhile: the share of its CPU time a virtual machine's host
took for others (steal, from /proc/stat), and one core's matmul rate just before and just after the run. Where
either differs between the runs of one scenario, so do their rates.

Each swarm run also says where the machine's cores went in its timed part: the servers' compute threads
against everything else it runs (the servers' network threads, DHT processes, p2pd daemons, trainers,
the bootstrap peer and the launcher), read from /proc. Each torch run says the same of its ranks: their
main threads, which compute and call gloo, against their other threads (gloo's and torch's own). Both give
samples per core-second of the model's compute (of those threads): how much each side makes of the cores it
computes on, apart from how many it leaves to the rest.

Achieved GFLOP/s counts the model's training FLOPs per sample (matmuls and attention, forward and
backward: 3x the forward) times samples/s; the single process's figure is the machine's limit.

Losses (first -> last): torch's, the mean over its warm-up step's microbatches and over its last step's;
the swarm's, over its first and its last 20 microbatches (as its report gives them). Both sides clip each
stage's gradient and warm the learning rate up alike (benchmarks/torchpipe.py steps as servers step).
Each run also gives its loss step by step: torch's, the mean over each step's microbatches; the swarm's, the mean
over the microbatches its last stage computed at each of its epochs (`losses_by_epoch`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from swarm.config import ModelConfig, load_config
from swarm.ops.local import LocalSwarm
from swarm.ops.procs import cpu_split, descendants
from swarm.ops.report import collect, read_steps
from swarm.ops.run import run_local
from swarm.ops.status import SwarmStatus
from swarm.server.gate import COMPUTE_THREAD

sys.path.insert(0, str(Path(__file__).parent))
from throughput import baseline  # noqa: E402  (sibling scripts, not a package)
from torchpipe import PipelineRun, torch_pipeline  # noqa: E402

ISSUE_MODEL = [
    "model.d_model=512", "model.n_heads=8", "model.d_ff=2048", "model.n_layers=4", "model.seq_len=128",
    "model.num_stages=2", "optim.target_batch_size=64", "optim.warmup_steps=2",
    "trainer.microbatch_size=8", "trainer.max_inflight=8",
    "local.servers_per_stage=1", "local.trainers=1", "local.threads_per_peer=1",
    "local.trainers_wait=true",  # as torch's ranks meet before training: a slow server starts late
]
# four machines of CPU_PER_WORKER cores each: every worker (a torch rank, a swarm server with its helper
# processes) is held to its share, so that a slow or stalled one does not hand its cores to the others
CPU_PER_WORKER = 0.45
FOUR = ["local.layout=[2, 2]", "trainer.max_inflight=12", f"local.server_cpus={CPU_PER_WORKER}"]
# the trainer inside the stage-0 server's process, started with it (it waits for the stages it calls)
HOSTED = ["local.trainers_in_servers=true", "local.trainers_wait=false"]
SLOWDOWN = 3.0
KILL_AT = 2  # timed steps before the kill
Runs = dict[str, Callable[[], dict]]  # a scenario's runs by name, each made when called


def flops_per_sample(m: ModelConfig) -> float:
    """Training FLOPs of one sequence: 3x the forward's matmuls (projections, MLP, output head) and
    attention scores and mixing (counted in full, as a dense kernel computes them)."""
    per_token = m.n_layers * (4 * m.d_model**2 + 2 * m.d_model * m.d_ff) + m.d_model * m.vocab_size
    attention = m.n_layers * 2 * m.seq_len * m.d_model
    return 3 * 2 * m.seq_len * (per_token + attention)


def swarm_run(overrides: list[str], steps: int, run_dir: str, kill_stage: int | None = None) -> dict:
    """The local swarm's steady samples/s; with `kill_stage`, one of that stage's servers is SIGKILLed
    once the swarm has taken KILL_AT steps past its warm-up, and samples/s counts from the kill on."""
    cfg = load_config(overrides=[*overrides, f"trainer.target_steps={steps + 1}", f'run_dir="{run_dir}"'])
    killed: list[float] = []

    def follow(swarm: LocalSwarm, status: SwarmStatus) -> bool:
        """Kill the victim at its step; then the swarm is looked at as the reference run is (every look
        reads the servers' DHT records, on their cores)."""
        if kill_stage is not None and not killed and status.min_epoch >= KILL_AT + 1:
            victim = swarm.servers(stage=kill_stage)[-1]
            victim.signal(signal.SIGKILL)
            killed.append(time.time())
        return bool(killed)

    with CpuSampler() as cpu:
        summary = run_local(cfg, progress=False, on_status=follow if kill_stage is not None else None)
    collected = collect(Path(run_dir))
    completed = collected["_completed"]
    since = killed[0] if killed else warmed_up(Path(run_dir))
    after = [c for c in completed if c[0] > since]
    # from the trainer's last start on the run only drains, once at its end (a pipeline schedule drains
    # at every step: its bubble)
    fed = collected["_stopped_starting"] or since
    steady = [c for c in after if c[0] <= fed]
    result = {"first_loss": summary["first_loss"], "final_loss": summary["final_loss"],
              "step_losses": losses_by_epoch(completed),
              "samples_per_second": sum(c[1] for c in after) / (after[-1][0] - since),
              "undrained_samples_per_second": sum(c[1] for c in steady) / (fed - since) if fed > since else None,
              "given_up": collected["microbatches_given_up"],
              "recomputed_backwards": sum(r["recomputed_backwards"] for st in summary["stages"].values()
                                          for r in st["replicas"]),
              "recomputed_why": dict(sum((Counter(r["recomputed_why"]) for st in summary["stages"].values()
                                          for r in st["replicas"]), Counter())),
              "cores": cpu.cores(since, fed), "dht_ops": dht_ops(Path(run_dir))}
    if kill_stage is not None:
        if not killed:
            raise RuntimeError("the swarm ended before the kill")
        result["retries"], result["replays"] = summary["retries"], summary["replays"]
    return result


def losses_by_epoch(completed: list) -> list[float]:
    """The mean loss of the microbatches the last stage computed at each of its epochs (0: the initial weights),
    as torch's runs give the mean loss of each step's microbatches: the two sides' learning, step by step.
    `completed`: the trainers' completed microbatches (`swarm.ops.report.collect`), each [time, samples, loss,
    epoch, id]."""
    by_epoch: dict[int, list[float]] = {}
    for c in completed:
        by_epoch.setdefault(int(c[3]), []).append(float(c[2]))
    epochs = range(max(by_epoch, default=-1) + 1)
    return [statistics.fmean(by_epoch[e]) if e in by_epoch else float("nan") for e in epochs]


def dht_ops(run_dir: Path) -> dict:
    """Every peer's DHT operations over the whole run, by kind, from their summaries, and per second of the
    longest-lived server's stage. A trainer inside a server shares the server's directory: counted once."""
    summaries = [json.loads(p.read_text()) for p in (run_dir / "peers").glob("*.json")]
    servers = {s["peer_id"] for s in summaries if s["role"] == "server"}
    ops: Counter[str] = Counter()
    for s in summaries:
        if s["role"] == "server" or s["peer_id"] not in servers:
            ops.update(s.get("dht_ops", {}))
    seconds = max((s["alive_seconds"] for s in summaries if s["role"] == "server"), default=0.0)
    return {"by_kind": dict(ops), "per_second": sum(ops.values()) / seconds if seconds else None}


class CpuSampler:
    """Where the machine's cores went while the swarm trained: the servers' compute threads, and every other
    thread of the launcher and of all it started, by kind of process (the peers' own processes, the DHT
    processes hivemind forks from them, p2pd daemons). Read from /proc every EVERY seconds on a thread of
    its own (not on the launcher's looks at the run, which read the DHT and would add to what is measured)."""

    EVERY = 2.0

    def __init__(self) -> None:
        self.samples: list[tuple[float, frozenset[int], Counter[str]]] = []
        self._kinds: dict[int, str] = {}  # pid -> kind_of(pid): a process keeps its kind for life
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.EVERY):
            pids = frozenset([os.getpid(), *descendants(os.getpid())])
            used: Counter[str] = Counter()
            for pid in pids:
                compute, other = cpu_split([pid], COMPUTE_THREAD)
                used["compute threads"] += compute
                if pid not in self._kinds:
                    self._kinds[pid] = kind_of(pid)
                used[self._kinds[pid]] += other
            self.samples.append((time.time(), pids, used))

    def cores(self, since: float, until: float) -> dict[str, float] | None:
        """Cores used on average from `since` to `until` (wall clock), by kind (and `seconds`, the span
        measured): up to the last sample before any process ended or started (their time cannot be read)."""
        inside = [s for s in self.samples if since <= s[0] <= until]
        if len(inside) < 2:
            return None
        first = inside[0]
        last = [s for s in inside if s[1] == first[1]][-1]
        seconds = last[0] - first[0]
        if seconds <= 0:
            return None
        return {**{k: (v - first[2][k]) / seconds for k, v in last[2].items()}, "seconds": seconds}


def kind_of(pid: int) -> str:
    """A local swarm's process by role: 'server', 'trainer', 'launcher' (this process, which runs the swarm's
    bootstrap peer); a DHT process hivemind forked from one of them is 'server DHT' etc., and a p2p daemon is
    named for the process that started it ('server DHT p2pd'): the launcher's carries only the DHT's
    traffic, a server's also its stage calls."""
    def command(p: int) -> list[bytes]:
        return Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")

    def parent_of(p: int) -> int:
        return int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])

    def role(p: int) -> str:
        if p == os.getpid():
            return "launcher"
        argv = command(p)
        roles = [r.decode() for r in (b"server", b"trainer") if r in argv]
        return roles[0] if roles else "other"

    try:
        if b"p2pd" in command(pid)[0]:
            return f"{kind_of(parent_of(pid))} p2pd"
        parent = parent_of(pid)
        forked = pid != os.getpid() and command(pid) == command(parent)  # (a fork keeps its parent's command line)
        return f"{role(parent)} DHT" if forked else role(pid)
    except OSError:
        return "other"


def warmed_up(run_dir: Path) -> float:
    """When the swarm's warm-up step was over: the time the last of its stages took its first step. Torch's
    runs are timed after their first step too; the swarm's servers starting up, joining late (a slow one
    imports torch at a third of the speed) and catching up by download all fall before it."""
    first: dict[int, float] = {}
    for stage, servers in read_steps(run_dir).items():
        times = [r["time"] for records in servers for r in records if r["epoch"] == 1]
        if times:
            first[stage] = min(times)
    return max(first.values())


def gpu(overrides: list[str], steps: int, run_dir: str) -> Runs | None:
    """The fault-free model on one GPU: the single process, and the swarm's servers all on that GPU
    (each with the servers' GPU defaults), with its trainer in a process of its own and inside the stage-0
    server's process (whose calls to that stage then skip the p2p daemon), and the latter again in fp16
    through the servers' loss scales (what a GPU without bf16 runs). None where torch sees no CUDA device."""
    if not torch.cuda.is_available():
        return None
    cfg = load_config(overrides=overrides)
    on_gpu = [*overrides, 'server.device="cuda"']
    return {"single": lambda: {"samples_per_second": baseline(cfg, steps, "cuda")},
            "swarm": lambda: swarm_run(on_gpu, steps, f"{run_dir}/swarm"),
            "swarm+train": lambda: swarm_run([*on_gpu, *HOSTED], steps, f"{run_dir}/swarm+train"),
            "swarm+train fp16": lambda: swarm_run([*on_gpu, *HOSTED, 'server.autocast="fp16"'], steps,
                                                  f"{run_dir}/swarm+train-fp16")}


def cpu_jiffies() -> tuple[int, int]:
    """(stolen, all) CPU time of the machine so far, from /proc/stat's first line, in clock ticks."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[7], sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is in user)


PROBE_SIZE = 512  # a square fp32 matmul: 0.27 GFLOP, a few ms on one core


def core_gflops(seconds: float = 2.0) -> float:
    """One core's fp32 matmul rate now, in GFLOP/s over `seconds` on one thread. A shared host moves it
    by a fifth within minutes, with no steal to show for it (other guests' load on the caches and memory,
    the host's clock): measured before and after each run, it says whether the machine stayed the same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(PROBE_SIZE, PROBE_SIZE), torch.randn(PROBE_SIZE, PROBE_SIZE)
        torch.mm(a, b)
        done, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            torch.mm(a, b)
            done += 1
        return done * 2 * PROBE_SIZE**3 / elapsed / 1e9
    finally:
        torch.set_num_threads(threads)


def with_machine(run: Callable[[], dict], probe_seconds: float = 2.0) -> dict:
    """`run()`'s result with what the machine did meanwhile: `steal`, the share of its CPU time the host of a
    virtual machine gave to other guests (from a few percent to a third within minutes), and `core_gflops`,
    one core's speed just before and just after (`core_gflops()`). Every process of a run loses alike, so
    runs of one scenario compare best where the machine was the same for them."""
    before = core_gflops(probe_seconds)
    stolen, total = cpu_jiffies()
    result = run()
    stolen_after, total_after = cpu_jiffies()
    return {**result, "steal": (stolen_after - stolen) / max(1, total_after - total),
            "core_gflops": (before, core_gflops(probe_seconds))}


def fault_free(overrides: list[str], steps: int, run_dir: str) -> Runs:
    cfg = load_config(overrides=overrides)
    return {"single": lambda: {"samples_per_second": baseline(cfg, steps)},
            **{name: lambda name=name: torch_pipeline(overrides, PipelineRun(name, steps))
               for name in ("gpipe", "1f1b")},
            "swarm": lambda: swarm_run(overrides, steps, f"{run_dir}/swarm"),
            "swarm+train": lambda: swarm_run([*overrides, *HOSTED], steps, f"{run_dir}/swarm+train")}


def copies(overrides: list[str], steps: int, run_dir: str) -> Runs:
    """1F1B against both fault-free swarms, each with its default durability and without it."""
    runs = fault_free(overrides, steps, run_dir)
    none = [*overrides, "backup.holders=0"]
    return {"1f1b": runs["1f1b"], "swarm": runs["swarm"],
            "swarm, no copies": lambda: swarm_run(none, steps, f"{run_dir}/swarm-no-copies"),
            "swarm+train": runs["swarm+train"],
            "swarm+train, no copies": lambda: swarm_run([*none, *HOSTED], steps, f"{run_dir}/swarm+train-no-copies")}


def straggler(overrides: list[str], steps: int, run_dir: str) -> Runs:
    return {
        "1f1b 2x2": lambda: torch_pipeline(overrides, PipelineRun(
            "1f1b", steps, pipelines=2, slow_rank=0, slowdown=SLOWDOWN, cpus=CPU_PER_WORKER)),
        "swarm 2x2": lambda: swarm_run([*overrides, *FOUR, f"local.slowdowns=[{SLOWDOWN}, 1, 1, 1]"],
                                       steps, f"{run_dir}/swarm"),
    }


def kill(overrides: list[str], steps: int, run_dir: str) -> Runs:
    def torch_killed() -> dict:
        ended = torch_pipeline(overrides, PipelineRun("1f1b", steps, pipelines=2, kill_rank=3, kill_at=KILL_AT,
                                                       cpus=CPU_PER_WORKER))
        return {"samples_per_second": 0.0, "ended": ended}

    return {
        "1f1b 2x2": torch_killed,
        "swarm 2x2": lambda: swarm_run([*overrides, *FOUR], steps, f"{run_dir}/swarm", kill_stage=1),
        "swarm 2+1": lambda: swarm_run([*overrides, *FOUR, "local.layout=[2, 1]"], steps,
                                       f"{run_dir}/swarm-2+1"),
    }


def in_turn(runs: Runs, turn: int, probe_seconds: float = 2.0) -> dict[str, dict]:
    """Every run's result, in `runs`' order, the runs made starting from the `turn`-th (modulo their number):
    a machine that slows or speeds up over a repetition would otherwise favour the same run every time. Each
    result says what the machine did meanwhile (`with_machine`)."""
    names = list(runs)
    first = turn % len(names)
    done = {name: with_machine(runs[name], probe_seconds) for name in names[first:] + names[:first]}
    return {name: done[name] for name in names}


def chosen(runs: Runs, names: str, reference: str) -> Runs:
    """The runs `names` (comma-separated) picks, in the scenario's order, the reference always among them; all
    of them when `names` is empty."""
    picked = {n.strip() for n in names.split(",") if n.strip()}
    if not picked:
        return runs
    unknown = picked - set(runs)
    if unknown:
        raise SystemExit(f"--runs: no run {', '.join(sorted(unknown))} in this scenario; its runs: {', '.join(runs)}")
    return {n: run for n, run in runs.items() if n in picked | {reference}}


SCENARIOS = {"fault-free": (fault_free, "1f1b"), "straggler": (straggler, "1f1b 2x2"),
             "kill": (kill, "swarm 2+1"), "gpu": (gpu, "single"), "copies": (copies, "1f1b")}
IN_ALL = ("fault-free", "straggler", "kill", "gpu")  # what `--scenario all` runs


def report(scenario: str, results: dict[str, dict], single: float | None, flops: float) -> None:
    """One JSON line per run, then a table with ratios to the scenario's reference (and the single process)."""
    reference = results[SCENARIOS[scenario][1]]["samples_per_second"]
    print(f"\n{scenario}")
    print(f"{'run':<12} {'samples/s':>10} {'GFLOP/s':>8} {'vs single':>10} {'vs ref':>7}   loss")
    for name, r in results.items():
        r["gflops"] = r["samples_per_second"] * flops / 1e9
        r["vs_ref"] = r["samples_per_second"] / reference if reference else None
        r["vs_single"] = r["samples_per_second"] / single if single else None
        print(json.dumps({"scenario": scenario, "run": name, **r}), file=sys.stderr)
        loss = f"{r['first_loss']:.3f} -> {r['final_loss']:.3f}" if "first_loss" in r else "-"
        vs_single = f"{r['vs_single']:.3f}" if r["vs_single"] is not None else "-"
        steal = f"   steal {r['steal']:.0%}" if "steal" in r else ""
        if "core_gflops" in r:
            steal += "   one core {:.0f} -> {:.0f} GFLOP/s".format(*r["core_gflops"])
        print(f"{name:<12} {r['samples_per_second']:>10.2f} {r['gflops']:>8.2f} {vs_single:>10} "
              f"{r['vs_ref'] or 0:>7.3f}   {loss}{steal}")
        if r.get("undrained_samples_per_second"):
            undrained = r["undrained_samples_per_second"]
            r["undrained_vs_ref"] = undrained / reference if reference else None
            print(f"{'':<12} {undrained:>10.2f}   until its trainer stopped starting microbatches: "
                  f"{r['undrained_vs_ref'] or 0:.3f} x the reference")
        if r.get("step_losses"):
            print(f"{'':<12} loss by step: " + " ".join(f"{v:.2f}" for v in r["step_losses"]))
        if r.get("cores"):
            cores = {k: v for k, v in r["cores"].items() if k != "seconds"}
            rest = sorted(((k, v) for k, v in cores.items() if k != "compute threads"), key=lambda kv: -kv[1])
            print(f"{'':<12} cores ({r['cores']['seconds']:.0f}s of the timed run): "
                  f"{cores.get('compute threads', 0):.2f} compute threads, {sum(v for _, v in rest):.2f} the rest: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in rest))
            if cores.get("compute threads"):
                r["per_compute_core"] = r["samples_per_second"] / cores["compute threads"]
                print(f"{'':<12} {r['per_compute_core']:.2f} samples per core-second of the model's compute")
        if r.get("dht_ops", {}).get("per_second"):
            ops = r["dht_ops"]
            print(f"{'':<12} DHT operations of all peers: {ops['per_second']:.1f}/s over the run: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(ops["by_kind"].items(), key=lambda kv: -kv[1])))
        if "ended" in r:
            for rank, s in sorted(r["ended"]["survivors"].items()):
                ended = f"{s['error'][:90]}... {s['at']:.1f}s into the timed run, in {s['where']}"
                print(f"    rank {rank}: " + (ended if "error" in s else "finished"))
            if r["ended"]["hanging"]:
                print(f"    ranks {r['ended']['hanging']} still waiting {PipelineRun().timeout + 30:.0f}s after "
                      "the kill were ended")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="all")
    parser.add_argument("--repeat", type=int, default=1, help="times each scenario runs; medians of ratios last")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps in each run, after one warm-up")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--runs", default="", help="only these runs of each scenario, comma-separated (e.g. "
                        "1f1b,swarm,swarm+train); the scenario's reference is always among them")
    parser.add_argument("--run-dir", default="runs/bench-peers",
                        help="each swarm run's logs and summaries go to RUN_DIR/SCENARIO-REPEAT/RUN")
    args = parser.parse_args()
    overrides = [*ISSUE_MODEL, *args.overrides]
    cfg = load_config(overrides=overrides)
    flops = flops_per_sample(cfg.model)
    m = cfg.model
    print(f"GPT d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, d_ff {m.d_ff}, {m.num_stages} stages, "
          f"seq_len {m.seq_len}; microbatch {cfg.trainer.microbatch_size}, step {cfg.optim.target_batch_size} "
          f"samples; {flops / 1e9:.2f} GFLOP per sample")
    names = list(IN_ALL) if args.scenario == "all" else [args.scenario]
    ratios: dict[tuple[str, str], list[float]] = {}
    per_core: dict[tuple[str, str], list[float]] = {}
    single = None
    for repeat in range(1, args.repeat + 1):
        for name in names:
            # each run's logs and summaries kept apart, for a look at any of them afterwards
            runs = SCENARIOS[name][0](overrides, args.steps, f"{args.run_dir}/{name}-{repeat}")
            if runs is None:
                print(f"\n{name}: skipped, torch sees no CUDA device on this machine")
                continue
            results = in_turn(chosen(runs, args.runs, SCENARIOS[name][1]), repeat - 1)
            single = results.get("single", {}).get("samples_per_second", single)
            report(name, results, single, flops)
            for run, r in results.items():
                ratios.setdefault((name, run), []).append(r["vs_ref"] or 0.0)
                if r.get("undrained_vs_ref"):
                    ratios.setdefault((name, f"{run}, undrained"), []).append(r["undrained_vs_ref"])
                if r.get("per_compute_core"):
                    per_core.setdefault((name, run), []).append(r["per_compute_core"])
    if args.repeat > 1:
        print(f"\nmedians of {args.repeat} (ratio to each scenario's reference)")
        for (name, run), values in ratios.items():
            print(f"{name:<11} {run:<21} {statistics.median(values):.3f}   ({', '.join(f'{v:.3f}' for v in values)})")
        print("\nmedians of samples per core-second of the model's compute")
        for (name, run), values in per_core.items():
            print(f"{name:<11} {run:<21} {statistics.median(values):.2f}   ({', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
