"""Local swarm throughput against plain single-process training of the same model and batch.

    .venv/bin/python benchmarks/throughput.py [--steps N] [--set section.field=value ...]

Both runs train the same model with the same microbatch size and optimizer batch on the same
machine, and both are timed after a warm-up: the baseline after its first optimizer step, the swarm
from its first completed microbatch (before it, trainers wait for servers and fill the pipeline).
The baseline is one process using every core; the swarm is the configured local swarm
(by default 2 stages x 1 server, 1 trainer, one thread per peer: as many compute threads as the
baseline has). The script prints samples/s of each, their ratio, and where the swarm's time goes:
server compute (busy fraction), tensor serialization (measured here on the same tensors), and the
rest of each call (RPC, queueing).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torchpipe import step_stage  # (a sibling script: this one's folder is on the path)

from swarm.config import load_config
from swarm.data import load_samples, split_inputs_targets
from swarm.model import ComposedModel, load_stages
from swarm.net.protocol import encode
from swarm.ops.run import run_local
from swarm.server.device import autocast_dtype, prepare
from swarm.server.nag import stage_optimizer

COMPUTE_BOUND = [
    "model.d_model=512", "model.n_heads=8", "model.d_ff=2048", "model.n_layers=4", "model.seq_len=256",
    "model.num_stages=2", "optim.target_batch_size=128", "optim.warmup_steps=2",
    "trainer.microbatch_size=8", "trainer.max_inflight=8",
    "local.servers_per_stage=1", "local.trainers=1", "local.threads_per_peer=1",
]


def baseline(cfg, steps: int, device: str = "cpu") -> float:
    """Samples/s of ordinary training: one process, all cores (or one GPU, with the servers' GPU defaults:
    bf16 autocast and TF32), same model, microbatch and step size, denormals flushed as the servers'
    compute is (`server.flush_denormal`). Each stage steps as a server steps it, and as a torch rank does
    (`torchpipe.step_stage`): the servers' optimizer, its gradient clipped, the warm-up learning rate."""
    torch.set_num_threads(torch.get_num_threads())
    torch.set_flush_denormal(cfg.server.flush_denormal)
    dev = prepare(torch.device(device))
    model = ComposedModel(load_stages(cfg.model)).to(dev)
    stages = [list(stage.parameters()) for stage in model.stages]
    opts = [stage_optimizer(params, cfg.optim) for params in stages]
    taken = 0
    table = load_samples(cfg.data, cfg.model)
    batches = table.stream(cfg.trainer.microbatch_size)
    per_step = cfg.optim.target_batch_size // cfg.trainer.microbatch_size
    dtype = autocast_dtype(cfg.server.autocast, dev)

    def step() -> None:
        nonlocal taken
        for _ in range(per_step):
            inputs, targets = (t.to(dev) for t in split_inputs_targets(next(batches), table.pad_id))
            with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
                loss = model(inputs, targets)
            (loss * inputs.shape[0] / cfg.optim.target_batch_size).backward()
        for params, opt in zip(stages, opts, strict=True):
            step_stage(params, opt, cfg.optim, taken)
        taken += 1

    step()  # warm-up
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return steps * per_step * cfg.trainer.microbatch_size / (time.perf_counter() - start)


def serialization_seconds(cfg, repeats: int = 20) -> float:
    """Encode + decode time of one microbatch's boundary activation (what each hop pays twice)."""
    import asyncio

    from swarm.net.protocol import decode

    x = torch.randn(cfg.trainer.microbatch_size, cfg.model.seq_len, cfg.model.d_model)

    async def roundtrip() -> None:
        async def stream():
            for m in encode({"req": "1"}, [x]):
                yield m

        await decode(stream(), 1 << 30)

    start = time.perf_counter()
    for _ in range(repeats):
        asyncio.run(roundtrip())
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in each run")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--run-dir", default="runs/bench-throughput")
    args = parser.parse_args()
    cfg = load_config(overrides=[*COMPUTE_BOUND, f"trainer.target_steps={args.steps}",
                                 f'run_dir="{args.run_dir}"', *args.overrides])

    single = baseline(cfg, args.steps)
    print(f"single process : {single:7.2f} samples/s ({torch.get_num_threads()} threads)", flush=True)
    summary = run_local(cfg, progress=False)
    swarm = summary["steady_samples_per_second"]
    print(f"local swarm    : {swarm:7.2f} samples/s from the first completed microbatch on "
          f"({summary['samples_per_second']:.2f} counting the wait for servers and the pipeline fill)")
    print(f"ratio          : {swarm / single:.3f}")

    wall = summary["wall_seconds"]
    mbs = summary["samples_completed"] / cfg.trainer.microbatch_size
    ser = serialization_seconds(cfg)
    print(f"\nwhere the swarm's time goes ({wall:.1f}s of training, {mbs:.0f} microbatches):")
    for stage, info in summary["stages"].items():
        for r in info["replicas"]:
            print(f"  stage {stage} server busy {r['busy_seconds']:.1f}s = {r['busy_seconds'] / wall:.0%} of the run; "
                  f"fast/recomputed backwards {r['fast_backwards']}/{r['recomputed_backwards']}")
    hops = 2 * (cfg.model.num_stages - 1)  # activations forward and gradients back across each boundary
    print(f"  serialization: {ser * 1e3:.1f} ms per boundary tensor (encode+decode), "
          f"{hops} per microbatch -> {ser * hops * mbs:.1f}s in total, spread over peers")
    for key, seconds in summary["trainer_call_seconds"].items():
        print(f"  trainer waited on stage/method {key}: {seconds:.1f}s ({seconds / mbs * 1e3:.0f} ms per microbatch)")
    out = Path(args.run_dir) / "benchmark.json"
    out.write_text(json.dumps({"single": single, "swarm": swarm, "ratio": swarm / single,
                               "swarm_including_start": summary["samples_per_second"],
                               "serialization_s": ser, "overrides": [*COMPUTE_BOUND, *args.overrides]}, indent=1))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
