"""Loss spikes of the integration tests' small model in ordinary training, and what a paused stage adds.

    PYTHONPATH=src .venv/bin/python benchmarks/pause.py [--seeds 6] [--steps 50]

One process, no network: the model of the integration tests (`tests/integration/helpers.small_config`: d_model
64, 2 layers, 2 stages, seq_len 64), 16 samples per step in microbatches of 4, AdamW with betas (0.9, 0.95),
the servers' warm-up and each stage's gradient clipped on its own, as stage servers do. A "pause" of k steps
is what a stage whose replica froze went through before `net.allreduce_timeout` was cut short by the
stage's records: stage 0 accumulates its gradients for k steps while stage 1 steps on, then takes one step
with their mean. Reported for each learning rate and pause: in how many seeds stage 0's gradient norm (before
clipping) went above 5 after the pause (it stays under 0.5 in calm training), and the highest norm of each.
"""

from __future__ import annotations

import argparse

import torch

from swarm.config import load_config
from swarm.core.schedule import warmup_lr
from swarm.data import load_samples, split_inputs_targets
from swarm.model import ComposedModel, load_stages

MODEL = ["model.d_model=64", "model.n_heads=2", "model.d_ff=128", "model.n_layers=2", "model.seq_len=64",
         "model.num_stages=2"]
MICROBATCH, PER_STEP, WARMUP, START = 4, 4, 2, 3  # samples, microbatches per step, warm-up steps, pause begins
SPIKE = 5.0


def stage0_norms(seed: int, lr: float, pause: int, steps: int) -> list[float]:
    """Stage 0's pre-clip gradient norm at each of its steps after the pause."""
    cfg = load_config(overrides=MODEL)
    torch.manual_seed(seed)
    stages = load_stages(cfg.model)
    model = ComposedModel(stages)
    optimizers = [torch.optim.AdamW(s.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01) for s in stages]
    table = load_samples(cfg.data, cfg.model)
    batches = table.stream(MICROBATCH)
    for _ in range(seed * 13):  # each seed its own stretch of the text
        next(batches)
    epochs, held, norms = [0, 0], [0, 0], []
    for step in range(steps):
        for _ in range(PER_STEP):
            inputs, targets = split_inputs_targets(next(batches), table.pad_id)
            (model(inputs, targets) * MICROBATCH).backward()  # sums over samples, as servers accumulate
        for k, (stage, optimizer) in enumerate(zip(stages, optimizers, strict=True)):
            held[k] += MICROBATCH * PER_STEP
            if k == 0 and START <= step < START + pause:
                continue  # stage 0 holds its gradients, stage 1 steps on
            for p in stage.parameters():
                if p.grad is not None:
                    p.grad /= held[k]
            norm = float(torch.nn.utils.clip_grad_norm_(list(stage.parameters()), 1.0))
            if k == 0 and step >= START + pause:
                norms.append(norm)
            for group in optimizer.param_groups:
                group["lr"] = warmup_lr(epochs[k], lr, WARMUP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            epochs[k], held[k] = epochs[k] + 1, 0
    return norms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    print("| lr | stage 0 paused for (steps) | seeds with a stage-0 grad norm > 5 | highest norm of each seed |")
    print("| --- | --- | --- | --- |")
    for lr, pause in [(3e-3, 0), (3e-3, 3), (3e-3, 10), (1e-3, 0), (1e-3, 10)]:
        peaks = [max(stage0_norms(seed, lr, pause, args.steps)) for seed in range(args.seeds)]
        print(f"| {lr:g} | {pause} | {sum(p > SPIKE for p in peaks)} of {args.seeds} | "
              f"{', '.join(f'{p:.1f}' for p in peaks)} |", flush=True)


if __name__ == "__main__":
    main()
