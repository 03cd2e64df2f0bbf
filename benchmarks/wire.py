"""Wire codecs and bottleneck layers: bytes per sample, throughput on loopback and on an emulated slow
network, and loss after a fixed number of steps, for a compute-bound and a communication-bound model.

    .venv/bin/python benchmarks/wire.py [--sizes compute,comm] [--variants none,fp16,...]
        [--networks loopback,200] [--steps 30] [--rtt-ms 50] [--run-dir runs/wire]

Each run is a local swarm (2 stages x 2 servers, 2 trainers, one thread each) trained for `--steps`
optimizer steps from the same seeds. A variant is a codec used for activations, gradients and the
all-reduce alike (`none`, `fp16`, `bf16`, `uint8`, `blockwise8`), or `blockwise8+bottleneck` (the
same with `model.bottleneck` = d_model / 4). Networks:

- `loopback`: every peer in the root namespace, no limit;
- a number (e.g. `200`): every peer (servers and trainers) on a network namespace host of its own
  whose link is limited to that many Mbit/s each way (`tc tbf` on both veth ends), and `--rtt-ms`
  added to every stage call by the transport (this kernel has no netem). Needs root and iproute2.

Model sizes (the square-cube law: compute per token grows with d_model squared, bytes with d_model):

- `compute`: d_model 256, 4 layers, seq 128: the work of a stage dwarfs its 128 KiB of activations;
- `comm`: d_model 64, 2 layers, seq 512: little work for the 128 KiB each boundary carries.

Reported per run: bytes on the wire per completed sample (all roles, and activations + gradients +
all-reduce), steady samples/s, and the mean loss of the microbatches of the last quarter of the
steps (its ratio to the `none` run of the same size and network). Results go to `results.json` and
`wire.png` in the run directory. Runs must be alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from swarm.config import load_config  # noqa: E402
from swarm.ops.report import collect  # noqa: E402
from swarm.ops.run import run_local  # noqa: E402

SIZES = {
    "compute": ["model.d_model=256", "model.n_heads=4", "model.d_ff=1024", "model.n_layers=4", "model.seq_len=128"],
    "comm": ["model.d_model=64", "model.n_heads=2", "model.d_ff=256", "model.n_layers=2", "model.seq_len=512"],
}
BASE = [
    "model.num_stages=2", "optim.lr=2e-3", "optim.warmup_steps=5", "optim.target_batch_size=32",
    "trainer.microbatch_size=4", "trainer.max_inflight=4",
    "local.servers_per_stage=2", "local.trainers=2", "local.threads_per_peer=1", "rebalance.enabled=false",
]
VARIANTS = ("none", "fp16", "bf16", "uint8", "blockwise8", "blockwise8+bottleneck")


def overrides(size: str, variant: str, network: str, args: argparse.Namespace) -> list[str]:
    codec, _, extra = variant.partition("+")
    out = [*BASE, *SIZES[size], f"trainer.target_steps={args.steps}",
           f'run_dir="{args.run_dir}/{size}-{network}-{variant}"',
           *(f'wire.{role}="{codec}"' for role in ("activations", "gradients", "allreduce"))]
    if extra == "bottleneck":
        d_model = int(next(o for o in SIZES[size] if o.startswith("model.d_model=")).split("=")[1])
        out.append(f"model.bottleneck={d_model // 4}")
    if network != "loopback":
        out += ["local.netns=true", f"local.link_mbit={float(network)}", f"net.emulated_rtt_ms={args.rtt_ms}",
                "trainer.min_request_timeout=30"]
    return [*out, *args.overrides]


def measure(cfg) -> dict:
    run_local(cfg, progress=False)
    summary = collect(Path(cfg.run_dir))
    completed = summary["_completed"]
    last_steps = max(c[3] for c in completed) * 3 // 4
    wire = summary["wire"]["bytes_per_sample"]
    return {
        "bytes_per_sample": summary["wire"]["total_bytes_per_sample"],
        "tensor_bytes_per_sample": sum(wire.get(r, 0.0) for r in ("activations", "gradients", "allreduce")),
        "by_role": wire,
        "samples_per_second": summary["steady_samples_per_second"],
        "loss": statistics.fmean(c[2] for c in completed if c[3] >= last_steps),
        "steps": min(s["steps"] for s in summary["stages"].values()),
        "delivery": {k: v["delivery"] for k, v in summary["stages"].items()},
        # backwards that had to run their forward again (stage -> [recomputed, from the kept graph])
        "backwards": {k: [sum(r[f] for r in v["replicas"]) for f in ("recomputed_backwards", "fast_backwards")]
                      for k, v in summary["stages"].items()},
    }


def draw(results: dict, path: Path) -> None:
    keys = sorted({(r["size"], r["network"]) for r in results.values()})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for size, network in keys:
        rows = [r for r in results.values() if r["size"] == size and r["network"] == network]
        axes[1].plot([r["variant"] for r in rows], [r["samples_per_second"] for r in rows], "o-",
                     label=f"{size}, {network}")
    for size in sorted({k[0] for k in keys}):
        rows = {r["variant"]: r for r in results.values() if r["size"] == size}
        axes[0].bar([f"{v}\n{size}" for v in rows], [r["tensor_bytes_per_sample"] / 1024 for r in rows.values()])
    axes[0].set(ylabel="KiB per sample", title="bytes on the wire (activations, gradients, all-reduce)")
    axes[0].tick_params(axis="x", labelsize=6, rotation=60)
    axes[1].set(ylabel="samples/s", title="throughput")
    axes[1].tick_params(axis="x", labelsize=7, rotation=30)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="compute,comm")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--networks", default="loopback,200", help="loopback, or a link rate in Mbit/s")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rtt-ms", type=float, default=50.0)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--run-dir", default="runs/wire")
    args = parser.parse_args()
    out = Path(args.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for size in args.sizes.split(","):
        for network in args.networks.split(","):
            for variant in args.variants.split(","):
                cfg = load_config(None, overrides(size, variant, network, args))
                result = measure(cfg)
                results[f"{size}/{network}/{variant}"] = {"size": size, "network": network, "variant": variant,
                                                          **result}
                results_path.write_text(json.dumps(results, indent=1))
                base = results.get(f"{size}/{network}/none")
                print(f"{size:8s} {network:8s} {variant:22s} {result['bytes_per_sample'] / 1024:8.1f} KiB/sample "
                      f"({result['tensor_bytes_per_sample'] / 1024:7.1f} in tensors) "
                      f"{result['samples_per_second']:6.2f} samples/s  loss {result['loss']:.3f}  "
                      f"stage 0 backwards recomputed {result['backwards']['0'][0]} of {sum(result['backwards']['0'])}"
                      + (f"  vs none: {base['tensor_bytes_per_sample'] / result['tensor_bytes_per_sample']:.2f}x "
                         f"fewer bytes, {result['samples_per_second'] / base['samples_per_second']:.2f}x "
                         f"throughput, loss {result['loss'] / base['loss']:.3f}" if base else ""), flush=True)
    draw(results, out / "wire.png")


if __name__ == "__main__":
    main()
