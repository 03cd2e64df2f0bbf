"""What denormals cost a CPU's training, and what flushing them (`server.flush_denormal`) gives back.

    PYTHONPATH=src .venv/bin/python benchmarks/denormal.py block [--set section.field=value ...]
    PYTHONPATH=src .venv/bin/python benchmarks/denormal.py train --steps 20 [--flush] [--set ...]

`block`: a matmul of the model's width with half its rows denormal, and one transformer block's forward
and backward (a microbatch) with its attention made sharper step by step (query and key weights scaled),
each timed with denormals kept and flushed, beside the share of the attention's probabilities that are
denormal. `train`: ordinary single-process training of the configured model (one thread), each step timed,
and after it the share of denormal attention probabilities in each stage's blocks on one microbatch
(counted outside the timing, with denormals kept: in a run that flushes them, how many it flushed).
Attention sharpens as a model learns, and its smallest probabilities underflow.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from swarm.config import load_config
from swarm.data import load_samples, split_inputs_targets
from swarm.model import ComposedModel, load_stages
from swarm.model.gpt import Block
from swarm.server.nag import fusable

TINY = torch.finfo(torch.float32).tiny


def denormal_share(t: torch.Tensor) -> float:
    return float(((t != 0) & (t.abs() < TINY)).float().mean())


def attention_probs(block: Block, x: torch.Tensor, heads: int) -> torch.Tensor:
    """The causal attention probabilities `block` computes for `x` (scaled_dot_product_attention keeps them)."""
    batch, seq, width = x.shape
    q, k, _ = block.attn.qkv(block.ln1(x)).split(width, dim=2)
    q, k = (t.view(batch, seq, heads, width // heads).transpose(1, 2) for t in (q, k))
    logits = q @ k.transpose(-1, -2) / (width // heads) ** 0.5
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    return F.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


def timed(work, repeats: int, flush: bool) -> float:
    """Milliseconds per call of `work`, after one untimed call, with denormals flushed or kept."""
    torch.set_flush_denormal(flush)
    try:
        work()
        started = time.perf_counter()
        for _ in range(repeats):
            work()
        return (time.perf_counter() - started) / repeats * 1000
    finally:
        torch.set_flush_denormal(False)


def block(cfg) -> None:
    m = cfg.model
    a = torch.randn(1024, m.d_model)
    w = torch.randn(m.d_model, m.d_ff) * 0.02
    half = a.clone()
    half[::2] = 1e-39
    print(f"matmul [1024, {m.d_model}] x [{m.d_model}, {m.d_ff}]: normal {timed(lambda: a @ w, 10, False):.1f} ms; "
          f"half its rows denormal {timed(lambda: half @ w, 3, False):.1f} ms, flushed "
          f"{timed(lambda: half @ w, 10, True):.1f} ms")
    torch.manual_seed(0)
    base = Block(m)
    x = torch.randn(cfg.trainer.microbatch_size, m.seq_len, m.d_model)
    for scale in (1.0, 4.0, 8.0, 10.0, 12.0):
        b = Block(m)
        b.load_state_dict(base.state_dict())
        with torch.no_grad():
            b.attn.qkv.weight[:2 * m.d_model] *= scale  # queries and keys: logits scale by its square
            share = denormal_share(attention_probs(b, x, m.n_heads))
        inputs = x.clone().requires_grad_()

        def step(b=b, inputs=inputs) -> None:
            b(inputs).sum().backward()

        kept, flushed = timed(step, 5, False), timed(step, 5, True)
        print(f"block, query and key weights x{scale:g}: {share:.3%} of attention probabilities denormal; "
              f"forward+backward {kept:.0f} ms kept, {flushed:.0f} ms flushed ({kept / flushed:.2f}x)")


def train(cfg, steps: int, flush: bool) -> None:
    torch.set_flush_denormal(flush)
    m = cfg.model
    model = ComposedModel(load_stages(m))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas,
                            fused=fusable(list(model.parameters())))
    table = load_samples(cfg.data, m)
    batches = table.stream(cfg.trainer.microbatch_size)
    per_step = cfg.optim.target_batch_size // cfg.trainer.microbatch_size
    print(f"{'flushed' if flush else 'kept'}: step, loss, seconds, denormal attention probabilities by stage")
    for step in range(steps):
        started, loss_sum = time.perf_counter(), 0.0
        for _ in range(per_step):
            inputs, targets = split_inputs_targets(next(batches), table.pad_id)
            loss = model(inputs, targets)
            (loss * inputs.shape[0] / cfg.optim.target_batch_size).backward()
            loss_sum += loss.item() / per_step
        opt.step()
        opt.zero_grad()
        seconds = time.perf_counter() - started
        print(f"{step:3d}  {loss_sum:.3f}  {seconds:6.2f}  " + "  ".join(
            f"{share:.3%}" for share in probe(model, inputs, targets, m.n_heads, flush)), flush=True)


@torch.no_grad()
def probe(model: ComposedModel, inputs: torch.Tensor, targets: torch.Tensor, heads: int, flushed: bool
          ) -> list[float]:
    """Each stage's share of denormal attention probabilities over its blocks, for one microbatch, computed
    with denormals kept (where they are flushed, the share says how many were)."""
    torch.set_flush_denormal(False)
    shares: list[list[float]] = [[] for _ in model.stages]
    hooks = [b.register_forward_pre_hook(lambda b, args, k=k: shares[k].append(denormal_share(
        attention_probs(b, args[0], heads)))) for k, stage in enumerate(model.stages) for b in stage.blocks]
    try:
        model(inputs, targets)
    finally:
        for h in hooks:
            h.remove()
        torch.set_flush_denormal(flushed)
    return [sum(s) / max(1, len(s)) for s in shares]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("block", "train"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--flush", action="store_true", help="train with denormals flushed")
    parser.add_argument("--set", action="append", default=[], metavar="section.field=value")
    args = parser.parse_args()
    cfg = load_config(overrides=args.set)
    torch.set_num_threads(1)
    if args.what == "block":
        block(cfg)
    else:
        train(cfg, args.steps, args.flush)


if __name__ == "__main__":
    main()
