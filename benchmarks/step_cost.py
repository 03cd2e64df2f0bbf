"""What a stage's step costs each replica in CPU besides its forwards and backwards: packing, checking and
unpacking the all-reduce's parts, and the optimizer step; and what one microbatch's activations cost to pack,
unpack and check at a stage boundary. Every figure is the median CPU time of one thread, in isolation.

    PYTHONPATH=src .venv/bin/python benchmarks/step_cost.py [--repeat 30] [--group 2] [--set section.field=value ...]

By default the model of benchmarks/peers.py (GPT d_model 512, 4 layers, 2 stages, seq_len 128, microbatch 8),
its stage 0, and a group of two replicas: each owns half the stage's gradient. In a running swarm, where
these share the cores with the compute threads, the same work took two to six times as long.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from swarm.averaging.checks import Bounds, Contribution, answer_problem
from swarm.averaging.rounds import part_bounds
from swarm.config import load_config
from swarm.model import load_stages
from swarm.server.nag import stage_optimizer
from swarm.wire import codecs
from swarm.wire.validate import TensorSpec, check_tensor

sys.path.insert(0, str(Path(__file__).parent))
from peers import ISSUE_MODEL  # noqa: E402  (a sibling script, not a package)


def cpu_ms(work: Callable[[], object], repeat: int) -> float:
    work()  # warm-up: first-call allocations
    times = []
    for _ in range(repeat):
        began = time.thread_time()
        work()
        times.append((time.thread_time() - began) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--group", type=int, default=2, help="replicas in the stage's all-reduce")
    ap.add_argument("--set", action="append", default=[], help="config overrides after the benchmark model's")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(overrides=[*ISSUE_MODEL, *args.set])
    stage = load_stages(cfg.model)[0]
    params = [p for p in stage.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    lo, hi = part_bounds(numel, args.group)[0]
    part = torch.randn(hi - lo)
    packed = codecs.encode(part, "blockwise8")
    members = [f"peer{i}" for i in range(args.group)]
    meta = {"epoch": 1, "group": members, "samples": 32, "ids": []}
    hidden = torch.randn(cfg.trainer.microbatch_size, cfg.model.seq_len, cfg.model.d_model)
    hidden_packed = codecs.encode(hidden, "blockwise8")
    spec = TensorSpec(torch.float32, tuple(hidden.shape[1:]))

    rows: list[tuple[str, float]] = [
        (f"pack a part ({part.numel() / 1e6:.2f}M values, blockwise8)",
         cpu_ms(lambda: codecs.encode(part, "blockwise8"), args.repeat)),
        ("unpack a part", cpu_ms(lambda: codecs.decode(packed), args.repeat)),
        ("check a member's part (Contribution.parse)",
         cpu_ms(lambda: Contribution.parse(meta, [part], members[1], Bounds()), args.repeat)),
        ("check an owner's answer (answer_problem)",
         cpu_ms(lambda: answer_problem([part], part.numel(), 32, [], 0.0), args.repeat)),
    ]
    for fused in (False, True):
        opt = (stage_optimizer(params, cfg.optim) if fused else
               torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay))
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        with torch.no_grad():
            rows.append((f"AdamW step of the stage ({numel / 1e6:.2f}M parameters), "
                         f"{'fused (the servers)' if fused else 'one parameter at a time'}",
                         cpu_ms(opt.step, args.repeat)))
    rows += [
        (f"pack a microbatch's activations ({hidden.numel() / 1e6:.2f}M values)",
         cpu_ms(lambda: codecs.encode(hidden, "blockwise8"), args.repeat)),
        ("unpack them", cpu_ms(lambda: codecs.decode(hidden_packed), args.repeat)),
        ("check them as a stage's input (check_tensor)",
         cpu_ms(lambda: check_tensor("hidden", hidden, spec, cfg.trainer.microbatch_size), args.repeat)),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'work':{width}s}  CPU ms (median of {args.repeat}, one thread)")
    for name, ms in rows:
        print(f"{name:{width}s}  {ms:8.2f}")


if __name__ == "__main__":
    main()
