"""The local swarm against its peers: one process, and torch's own pipeline schedules, on one model.

    PYTHONPATH=src .venv/bin/python benchmarks/peers.py [--steps N] [--set section.field=value ...]

Every run trains the same model (by default GPT d_model 512, 4 layers, 8 heads, d_ff 2048, cut into 2
stages, seq_len 128) on the same text with the same microbatch (8) and optimizer step (64 samples), and
is timed after a warm-up step:

- single process: `baseline()` of benchmarks/throughput.py, all cores in one process;
- GPipe and 1F1B: `torch.distributed.pipelining`, one process per stage with one thread each (as many
  compute threads as the swarm's servers), gloo on 127.0.0.1, each rank building only its own stage of
  `swarm.model` exactly as a swarm server does;
- local swarm: `run_local`, as in benchmarks/throughput.py, timed from its first completed microbatch.

A swarm is only worth its overhead if it comes near what a conventional pipeline gets from the same
cores, so each figure is also given as a ratio to the single process and to 1F1B. The output is one
JSON line per run followed by a table. Fault-free only: every peer stays up and runs at full speed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from swarm.config import load_config
from swarm.config.schema import SwarmConfig
from swarm.data import SampleTable, load_documents, split_inputs_targets
from swarm.model import build_stage
from swarm.ops.run import run_local

sys.path.insert(0, str(Path(__file__).parent))
from throughput import baseline  # noqa: E402  (a sibling script, not a package)

ISSUE_MODEL = [
    "model.d_model=512", "model.n_heads=8", "model.d_ff=2048", "model.n_layers=4", "model.seq_len=128",
    "model.num_stages=2", "optim.target_batch_size=64", "optim.warmup_steps=2",
    "trainer.microbatch_size=8", "trainer.max_inflight=8",
    "local.servers_per_stage=1", "local.trainers=1", "local.threads_per_peer=1",
]
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pipeline_rank(rank: int, overrides: list[str], schedule_name: str, steps: int, port: int, out: str) -> None:
    """One stage of a torch pipeline: builds its own stage module, trains `steps + 1` optimizer steps and,
    on the last rank, writes the timing and losses to `out`.

    Every rank reads the same seeded sample stream, so the first stage takes the inputs and the last the
    targets of the same batch without sending them. The last stage is the project's own module, which
    returns the loss given `targets=`: the schedule hands keyword arguments to the last stage's forward
    microbatch by microbatch, so the loss function only passes that loss on, and `scale_grads` (the
    default) averages the gradients over microbatches as the single process does over its step."""
    torch.set_num_threads(1)
    cfg = load_config(overrides=overrides)
    n_stages, mb = cfg.model.num_stages, cfg.trainer.microbatch_size
    n_micro = cfg.optim.target_batch_size // mb
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n_stages)
    module = build_stage(cfg.model, rank)
    inputs_meta, outputs_meta = module.boundary()
    # static shapes, so no rank waits on a shape exchange; hidden states carry requires_grad, or no
    # gradient would be sent back across the boundary
    example_in = torch.zeros((mb, *inputs_meta.shape), dtype=inputs_meta.dtype, requires_grad=rank > 0)
    out_shape = () if outputs_meta is None else (mb, *outputs_meta.shape)  # the last stage returns the loss
    example_out = torch.zeros(out_shape, requires_grad=True)
    stage = PipelineStage(module, rank, n_stages, torch.device("cpu"), input_args=example_in, output_args=example_out)
    schedule = SCHEDULES[schedule_name](stage, n_microbatches=n_micro, loss_fn=lambda loss, _target: loss)
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas)
    table = SampleTable(load_documents(cfg.data), cfg.model.seq_len, cfg.data.seed)
    batches = table.stream(cfg.optim.target_batch_size)
    step_losses: list[float] = []

    def step() -> None:
        inputs, targets = split_inputs_targets(next(batches))
        if stage.is_first:
            schedule.step(inputs)
        else:
            losses: list[torch.Tensor] = []
            schedule.step(targets=targets, target=targets, losses=losses, return_outputs=False)
            step_losses.append(torch.stack(losses).mean().item())
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    elapsed = time.perf_counter() - start
    if stage.is_last:
        Path(out).write_text(json.dumps({"samples_per_second": steps * cfg.optim.target_batch_size / elapsed,
                                         "first_loss": step_losses[0], "final_loss": step_losses[-1]}))
    dist.destroy_process_group()


def torch_pipeline(overrides: list[str], schedule_name: str, steps: int, n_stages: int) -> dict[str, float]:
    """Samples/s and first/last step loss of one torch pipeline schedule, one spawned process per stage."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_pipeline_rank, args=(overrides, schedule_name, steps, _free_port(), out), nprocs=n_stages)
        return json.loads(Path(out).read_text())


def report(results: dict[str, dict[str, float]], cfg: SwarmConfig) -> None:
    """One JSON line per run, then a table; ratios to the single process and to 1F1B."""
    single, f1b = results["single"]["samples_per_second"], results["1f1b"]["samples_per_second"]
    for name, r in results.items():
        r["vs_single"], r["vs_1f1b"] = r["samples_per_second"] / single, r["samples_per_second"] / f1b
        print(json.dumps({"run": name, **r}))
    m = cfg.model
    print(f"\nGPT d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, d_ff {m.d_ff}, {m.num_stages} stages, "
          f"seq_len {m.seq_len}; microbatch {cfg.trainer.microbatch_size}, step {cfg.optim.target_batch_size} samples")
    print(f"{'run':<8} {'samples/s':>10} {'vs single':>10} {'vs 1F1B':>8}   loss")
    for name, r in results.items():
        loss = f"{r['first_loss']:.3f} -> {r['final_loss']:.3f}" if "first_loss" in r else "-"
        print(f"{name:<8} {r['samples_per_second']:>10.2f} {r['vs_single']:>10.3f} {r['vs_1f1b']:>8.3f}   {loss}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps in each run, after one warm-up")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--run-dir", default="runs/bench-peers")
    args = parser.parse_args()
    overrides = [*ISSUE_MODEL, *args.overrides]
    # the swarm's warm-up is its pipeline fill, not a whole step: one step more keeps its timed span as long
    cfg = load_config(overrides=[*overrides, f"trainer.target_steps={args.steps + 1}", f'run_dir="{args.run_dir}"'])

    results: dict[str, dict[str, float]] = {"single": {"samples_per_second": baseline(cfg, args.steps)}}
    for name in SCHEDULES:
        results[name] = torch_pipeline(overrides, name, args.steps, cfg.model.num_stages)
    summary = run_local(cfg, progress=False)
    results["swarm"] = {"samples_per_second": summary["steady_samples_per_second"],
                        "first_loss": summary["first_loss"], "final_loss": summary["final_loss"]}
    report(results, cfg)


if __name__ == "__main__":
    main()
