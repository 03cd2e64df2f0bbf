"""Memory of serving a model no server holds whole: each server's peak RSS against its stage's state.

    PYTHONPATH=src .venv/bin/python benchmarks/bigmodel.py [--run-dir runs/bigmodel] [--set section.field=value ...]

A 0.57-billion-parameter GPT (d_model 1536, 12 heads, d_ff 6144, 20 layers, seq_len 128) cut into
4 stages, one server each, a trainer, and a bootstrap peer, all separate processes on this machine;
microbatches of 2 samples, an optimizer step every 4 samples, 4 steps, a checkpoint after every step.
Once stage 1 has stepped, a fifth server joins stage 1: it downloads the stage's state (weights and
AdamW moments) from the live replica, then steps with it.

Every 0.25 s the script reads /proc of each server's main process (VmRSS, and VmHWM: the kernel's
own peak) and of its helpers (hivemind's DHT child and the p2pd daemon, the processes below it).
Reported per server: the stage's parameters, its parameters + gradients + AdamW moments in fp32 (16
bytes per parameter), the main process's peak RSS and its ratio to that; what the helpers
add; what serving the state download added to the source replica, and what each checkpoint added
(the most RSS rose above its level just before while the checkpoint file was being written: the
sampler watches for the server's temporary checkpoint file); seconds per step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swarm.config import load_config
from swarm.logs import logged_at
from swarm.model import build_stage
from swarm.ops.local import LocalSwarm, Peer, SwarmStatus
from swarm.ops.procs import descendants
from swarm.ops.report import read_steps

BIG = [
    "model.d_model=1536", "model.n_heads=12", "model.d_ff=6144", "model.n_layers=20", "model.seq_len=128",
    "model.num_stages=4", "optim.target_batch_size=4", "optim.warmup_steps=2",
    "trainer.microbatch_size=2", "trainer.max_inflight=2", "trainer.target_steps=4",
    "trainer.request_timeout=600.0", "net.allreduce_timeout=300.0", "net.max_payload_mb=1024",
    "server.checkpoint_every=1", "rebalance.enabled=false",
    "local.servers_per_stage=1", "local.trainers=1", "local.threads_per_peer=1", "local.timeout=1500.0",
]
# net.max_payload_mb above: with two replicas, each all-reduce part of a 142M-parameter stage is 283 MB,
# which the default limit (64 MiB) refuses
JOIN_STAGE = 1
STATE_BYTES_PER_PARAM = 16  # fp32 weights, gradients, AdamW's exp_avg and exp_avg_sq
SAMPLE_SECONDS = 0.25
GIB = 2**30


@dataclass
class Memory:
    """What one server's processes took, sampled."""

    peak_hwm: int = 0  # the main process's VmHWM, last read
    peak_rss: int = 0  # the main process's largest sampled VmRSS
    helpers: dict[str, int] = field(default_factory=dict)  # helper command name -> its largest RSS
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time, main VmRSS)
    writing: list[bool] = field(default_factory=list)  # per timeline sample: a checkpoint was being written


def _status_kib(pid: int) -> dict[str, int]:
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values


def _helpers(pid: int) -> list[tuple[int, str]]:
    """(pid, command) of every process below `pid`: a server's DHT process and its p2pd daemon, which live in a
    process group of their own (`swarm.net.lifeline`), so the server's group does not list them."""
    found = []
    for below in descendants(pid):
        try:
            text = Path(f"/proc/{below}/stat").read_text()
        except OSError:
            continue
        found.append((below, text[text.index("(") + 1 : text.rindex(")")]))
    return found


class Sampler(threading.Thread):
    def __init__(self, swarm: LocalSwarm, checkpoints: Path):
        super().__init__(daemon=True)
        self.swarm = swarm
        self.checkpoints = checkpoints
        self.memory: dict[str, Memory] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(SAMPLE_SECONDS):
            for peer in [p for p in self.swarm.peers if p.role == "server"]:
                self._sample(peer)

    def _sample(self, peer: Peer) -> None:
        mem = self.memory.setdefault(peer.name, Memory())
        try:
            main = _status_kib(peer.process.pid)
            helpers = [(comm, _status_kib(pid).get("VmRSS", 0)) for pid, comm in _helpers(peer.process.pid)]
        except (OSError, ValueError):  # the process is gone (or went while being read)
            return
        if "VmRSS" not in main:  # a zombie: exited, not yet reaped
            return
        mem.peak_hwm = max(mem.peak_hwm, main["VmHWM"])
        mem.peak_rss = max(mem.peak_rss, main["VmRSS"])
        mem.timeline.append((time.time(), main["VmRSS"]))
        mem.writing.append(any(self.checkpoints.glob(f"**/.stage*.pt.{peer.process.pid}.tmp")))
        for comm, rss in helpers:
            mem.helpers[comm] = max(mem.helpers.get(comm, 0), rss)


def _log_times(peer: Peer, marker: str) -> list[float]:
    """When the peer logged lines containing `marker` (today)."""
    return [logged_at(line) for line in peer.log_path.read_text(errors="replace").splitlines() if marker in line]


def _rise(timeline: list[tuple[float, int]], start: float, end: float) -> int:
    """How far RSS rose within [start, end] above its last sample before `start`."""
    before = [rss for t, rss in timeline if t < start]
    during = [rss for t, rss in timeline if start <= t <= end]
    return max(during, default=0) - before[-1] if before and during else 0


def _checkpoint_rises(mem: Memory) -> list[int]:
    """For each checkpoint seen being written: how far RSS rose above the sample before it began."""
    rises, start = [], None
    for i, writing in enumerate([*mem.writing, False]):
        if writing and start is None:
            start = i
        elif not writing and start is not None:
            if start > 0:
                rises.append(max(rss for _, rss in mem.timeline[start:i]) - mem.timeline[start - 1][1])
            start = None
    return rises


def stage_parameters(cfg) -> list[int]:
    """Each stage's parameter count, from modules built on the meta device (no memory for weights)."""
    with torch.device("meta"):
        return [sum(p.numel() for p in build_stage(cfg.model, k).parameters()) for k in range(cfg.model.num_stages)]


def run(cfg) -> dict:
    swarm = LocalSwarm(cfg)
    sampler = Sampler(swarm, Path(cfg.server.checkpoint_dir))
    joined: dict[str, float] = {}

    def tick(status: SwarmStatus) -> None:
        if not joined and min(status.epochs.get(JOIN_STAGE) or [0]) >= 1:
            joined["at"] = time.time()
            # a disk of its own, as on another machine: the stage's state can only come from its replica
            own_disk = f'server.checkpoint_dir="{Path(cfg.server.checkpoint_dir) / "joiner"}"'
            joined["name"] = swarm.add_server(JOIN_STAGE, (own_disk,)).name

    started = time.time()
    try:
        swarm.start()
        sampler.start()
        swarm.wait_until_done(progress=False, on_status=tick)
        finished = time.time()
    finally:
        swarm.stop()
        sampler.done.set()
        sampler.join()
    params = stage_parameters(cfg)
    servers = []
    for peer in [p for p in swarm.peers if p.role == "server"]:
        mem = sampler.memory[peer.name]
        state = params[peer.stage] * STATE_BYTES_PER_PARAM
        checkpoints = _log_times(peer, " checkpoint at epoch ")
        servers.append({
            "name": peer.name, "stage": peer.stage, "parameters": params[peer.stage], "state_bytes": state,
            "peak_hwm": mem.peak_hwm, "peak_rss_sampled": mem.peak_rss, "ratio": round(mem.peak_hwm / state, 3),
            "helpers": mem.helpers, "checkpoint_rises": _checkpoint_rises(mem), "checkpoints": len(checkpoints),
        })
    joiner = next(p for p in swarm.peers if p.name == joined["name"])
    loaded = _log_times(joiner, " loaded epoch ")
    source = next(s for s in servers if s["stage"] == JOIN_STAGE and s["name"] != joiner.name)
    window = (joined["at"], loaded[0] + 1.0) if loaded else None  # + 1: the log stamps to the second
    source_steps = [s["time"] for records in read_steps(Path(cfg.run_dir)).get(JOIN_STAGE, []) for s in records]
    download = {
        "seconds_after_join": round(loaded[0] - joined["at"], 1) if loaded else None,
        "source_rise": _rise(sampler.memory[source["name"]].timeline, *window) if window else None,
        # a step of the source within the window adds its own transient (the mean gradient) to the rise
        "source_steps_in_window": sum(window[0] <= t <= window[1] for t in source_steps) if window else None,
    }
    step_times = {stage: _epoch_times(records) for stage, records in read_steps(Path(cfg.run_dir)).items()}
    per_step = [b - a for times in step_times.values() for a, b in zip(times, times[1:], strict=False)]
    return {
        "servers": servers, "download": download, "run_seconds": round(finished - started, 1),
        "seconds_per_step_median": round(statistics.median(per_step), 1) if per_step else None,
        "steps_by_stage": {str(k): len(v) for k, v in step_times.items()},
    }


def _epoch_times(servers: list[list[dict]]) -> list[float]:
    """When the stage reached each epoch (the first of its replicas to log that step), in order."""
    first: dict[int, float] = {}
    for steps in servers:
        for step in steps:
            first[step["epoch"]] = min(first.get(step["epoch"], step["time"]), step["time"])
    return [first[epoch] for epoch in sorted(first)]


def report(result: dict) -> str:
    lines = ["| server | stage | parameters | params+grads+AdamW | peak RSS (VmHWM) | ratio | DHT child, p2pd |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in result["servers"]:
        helpers = ", ".join(f"{comm} {rss / GIB:.2f}" for comm, rss in sorted(s["helpers"].items()))
        lines.append(f"| {s['name']} | {s['stage']} | {s['parameters'] / 1e6:.1f}M | {s['state_bytes'] / GIB:.2f} GiB "
                     f"| {s['peak_hwm'] / GIB:.2f} GiB | {s['ratio']:.2f} | {helpers} GiB |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default="runs/bigmodel")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    run_dir = Path(args.run_dir)
    cfg = load_config(None, [f'run_dir="{run_dir}"', f'server.checkpoint_dir="{run_dir / "checkpoints"}"',
                             *BIG, *args.overrides])
    shutil.rmtree(cfg.server.checkpoint_dir, ignore_errors=True)  # a fresh run: nothing to resume from
    result = run(cfg)
    print(report(result))
    print(json.dumps({k: v for k, v in result.items() if k != "servers"}, indent=1))
    (run_dir / "bigmodel.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
