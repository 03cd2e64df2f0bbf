"""The transformers Llama adapter (swarm.model.hf) against the built-in GPT of the same size, each trained on a
local swarm of the same layout, back to back in one run.

    .venv/bin/python benchmarks/hf.py [--steps N] [--set section.field=value ...]

Both models have the same d_model, heads, d_ff, layers, seq_len and stages, and train with the same
microbatch, optimizer batch and swarm: 2 stages x 1 server, 1 trainer, one torch thread per peer. The Llama
is configured from fields (`model.hf_family = "llama"`, random weights). It is not the same network: its MLP
has three matrices (gate, up, down) where the GPT's has two, RMSNorm and rotary positions instead of
LayerNorm and a position table, no biases; so both parameter counts are printed with the throughputs.
Throughput is the swarm's steady rate, counted from its first completed microbatch.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from swarm.config import load_config
from swarm.config.hf import HF_SPEC
from swarm.model import load_stages
from swarm.ops.run import run_local

SHAPE = [
    "model.d_model=256", "model.n_heads=4", "model.d_ff=1024", "model.n_layers=4", "model.seq_len=128",
    "model.num_stages=2", "optim.target_batch_size=32", "optim.warmup_steps=2",
    "trainer.microbatch_size=8", "trainer.max_inflight=8",
    "local.servers_per_stage=1", "local.trainers=1", "local.threads_per_peer=1",
]
MODELS = {"gpt": [], "llama": [f'model.spec="{HF_SPEC}"', 'model.hf_family="llama"']}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps in each run")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--run-dir", default="runs/bench-hf")
    args = parser.parse_args()
    results = {}
    for name, model in MODELS.items():
        cfg = load_config(overrides=[*SHAPE, *model, f"trainer.target_steps={args.steps}",
                                     f'run_dir="{args.run_dir}/{name}"', *args.overrides])
        params = sum(p.numel() for stage in load_stages(cfg.model) for p in stage.parameters())
        summary = run_local(cfg, progress=False)
        results[name] = {"parameters": params, "samples_per_second": summary["steady_samples_per_second"],
                         "first_loss": summary["first_loss"], "final_loss": summary["final_loss"]}
        print(f"{name:6s}: {params / 1e6:5.2f}M parameters, {summary['steady_samples_per_second']:6.2f} samples/s "
              f"steady, loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}", flush=True)
    ratio = results["llama"]["samples_per_second"] / results["gpt"]["samples_per_second"]
    print(f"llama / gpt: {ratio:.3f} of the samples/s with "
          f"{results['llama']['parameters'] / results['gpt']['parameters']:.2f}x the parameters")
    out = Path(args.run_dir) / "benchmark.json"
    out.write_text(json.dumps({**results, "ratio": ratio, "overrides": [*SHAPE, *args.overrides]}, indent=1))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
