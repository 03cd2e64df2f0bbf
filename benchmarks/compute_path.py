"""What a server's compute thread spends on a microbatch beyond the model's own forward and backward.

    PYTHONPATH=src .venv/bin/python benchmarks/compute_path.py [--rounds 12] [--set section.field=value ...]

For each stage of the configured model (the benchmark model of `benchmarks/peers.py` plus the overrides),
one microbatch's forward and backward is timed two ways, in turn: the bare module on the main thread, as a
rank of torch's pipeline runs it, and the server's runtime (`StageRuntime`: saved-tensor hooks for weight
stashing, the kept graph and its ledger, the result packed by the wire's codecs) on a thread of its own, as
a server's compute thread runs it. Minor page faults are counted beside the time: a thread other than the
main one gets its memory from a malloc arena of its own, which hands large blocks back once they are free.
The pieces a server adds around that are timed alone: packing and unpacking a microbatch's activations, and
at each step the weights' digest. Times are the thread's CPU time (medians), with denormals flushed as
servers flush them.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from swarm.config import load_config
from swarm.model import build_stage
from swarm.server.runtime import StageRuntime
from swarm.wire.codecs import decode

sys.path.insert(0, str(Path(__file__).parent))
from peers import ISSUE_MODEL  # noqa: E402  (a sibling script, not a package)


def cpu_ms(work: Callable[[], object]) -> float:
    started = time.thread_time()
    work()
    return (time.thread_time() - started) * 1000


def cost(work: Callable[[], object]) -> tuple[float, int]:
    """The calling thread's CPU ms and minor page faults for `work`."""
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    ms = cpu_ms(work)
    return ms, resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults


def stage_rounds(cfg, index: int, rounds: int, compute: ThreadPoolExecutor) -> list[tuple[tuple, tuple]]:
    """Each round's microbatch (CPU ms, faults), bare and through the runtime on `compute`, taken in turn."""
    m, batch = cfg.model, cfg.trainer.microbatch_size
    torch.manual_seed(index)
    bare = build_stage(m, index)
    runtime = StageRuntime(build_stage(m, index), cfg.optim, wire=cfg.wire.policy())
    first, last = index == 0, index == m.num_stages - 1
    x = torch.randint(0, m.vocab_size, (batch, m.seq_len)) if first else torch.randn(batch, m.seq_len, m.d_model)
    targets = torch.randint(0, m.vocab_size, (batch, m.seq_len))
    grad = torch.randn(batch, m.seq_len, m.d_model) * 1e-3

    def plain() -> None:
        inputs = x if first else x.clone().requires_grad_(True)
        if last:
            (bare(inputs, targets) * batch).backward()
        else:
            bare(inputs).backward(grad)

    def served(req: str) -> None:
        if last:
            runtime.forward_backward_last(req, x, targets)
        else:
            runtime.forward([(req, x)])
            runtime.backward(req, x, grad)

    out = []
    for r in range(rounds + 2):  # the first two of each: warm-up
        pair = cost(plain), compute.submit(cost, partial(served, f"r{r}")).result()
        if r >= 2:
            out.append(pair)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    cfg = load_config(overrides=[*ISSUE_MODEL, *args.overrides])
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    m = cfg.model
    print(f"model d_model {m.d_model}, {m.n_layers} layers, {m.num_stages} stages, microbatch "
          f"{cfg.trainer.microbatch_size} x {m.seq_len}; CPU ms per microbatch (median of {args.rounds})")
    with ThreadPoolExecutor(1, thread_name_prefix="compute") as compute:
        for index in range(m.num_stages):
            rounds = stage_rounds(cfg, index, args.rounds, compute)
            ratios = [served[0] / bare[0] for bare, served in rounds]
            (bare_ms, served_ms), (bare_faults, served_faults) = (
                [statistics.median(pair[side][k] for pair in rounds) for side in (0, 1)] for k in (0, 1))
            print(f"stage {index}: bare {bare_ms:7.1f} ({bare_faults:.0f} faults)   runtime {served_ms:7.1f} "
                  f"({served_faults:.0f} faults)   runtime / bare {statistics.median(ratios):.3f} "
                  f"(rounds {min(ratios):.3f}-{max(ratios):.3f})")
    policy = cfg.wire.policy()
    activations = torch.randn(cfg.trainer.microbatch_size, m.seq_len, m.d_model)
    packed = policy.pack("activations", activations)
    pack_ms = statistics.median(cpu_ms(lambda: policy.pack("activations", activations)) for _ in range(20))
    unpack_ms = statistics.median(cpu_ms(lambda: decode(packed)) for _ in range(20))
    print(f"activations {packed.meta['codec']}: pack {pack_ms:.2f} ms, unpack {unpack_ms:.2f} ms a microbatch")
    runtime = StageRuntime(build_stage(m, 0), cfg.optim, wire=policy)
    params = sum(p.numel() for p in runtime.params)
    digest_ms = statistics.median(cpu_ms(runtime.digest) for _ in range(5))
    print(f"digest of stage 0's weights ({params / 1e6:.1f} M parameters): {digest_ms:.1f} ms a step")


if __name__ == "__main__":
    main()
