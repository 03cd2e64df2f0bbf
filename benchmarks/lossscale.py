"""What fp16's loss scale costs a stage per microbatch: forward and backward of one stage through a kept
graph, with autograd's own accumulation ("plain") and through the loss scale's path (`torch.autograd.grad`,
the unscale-and-check pass, the add into the gradients: `swarm.server.lossscale`), on the same compute, the
two alternately. The compute is fp32 unless --autocast says otherwise; fp16 is what runs the scale's path
in a swarm, the others measure its bookkeeping alone.

    PYTHONPATH=src .venv/bin/python benchmarks/lossscale.py --pairs 30
    PYTHONPATH=src .venv/bin/python benchmarks/lossscale.py --device cuda --autocast fp16 --pairs 200
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import replace

import torch

from swarm.config import ModelConfig, OptimConfig
from swarm.model import build_stage
from swarm.server.lossscale import LossScale
from swarm.server.runtime import StageRuntime

LARGER = {"d_model": 768, "n_layers": 6, "num_stages": 3, "n_heads": 12, "d_ff": 3072, "seq_len": 128}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=30, help="microbatches through each, alternately")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast", default="none", choices=["none", "bf16", "fp16"])
    parser.add_argument("--microbatch", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = replace(ModelConfig(), **LARGER)
    stage = build_stage(model, 1)  # the middle stage: inputs and outputs both hidden states
    shape = (args.microbatch, model.seq_len, model.d_model)
    x, dy = torch.randn(shape), torch.randn(shape) * 1e-3
    runs = {}
    for name in ("plain", "scaled"):
        rt = StageRuntime(copy.deepcopy(stage), OptimConfig(), args.device, args.autocast)
        rt.loss_scale = LossScale() if name == "scaled" else None
        runs[name] = rt
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.pairs + 2):  # the first two of each warm up
        for name, rt in runs.items():
            start = time.perf_counter()
            rt.forward([(f"r{i}", x)])
            rt.backward_batch(rt.graphs[f"r{i}"], {f"r{i}": dy})
            if rt.device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                seconds[name].append(time.perf_counter() - start)
    print(f"stage 1 of the larger model: {sum(p.numel() for p in stage.parameters()) / 1e6:.1f} M parameters, "
          f"microbatch {args.microbatch} x {model.seq_len}, {args.device}, autocast {args.autocast}")
    for name, s in seconds.items():
        print(f"{name:<7} median {statistics.median(s) * 1e3:8.2f} ms   min {min(s) * 1e3:8.2f} ms")
    print(f"scaled / plain: medians {statistics.median(seconds['scaled']) / statistics.median(seconds['plain']):.3f}, "
          f"minima {min(seconds['scaled']) / min(seconds['plain']):.3f}")


if __name__ == "__main__":
    main()
