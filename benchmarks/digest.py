"""What the per-step digest of a stage's weights costs, by where it is computed.

    PYTHONPATH=src .venv/bin/python benchmarks/digest.py [--params 25e6 100e6] [--device cpu|cuda]
        [--repeat 5]

A stage announces the digest of its weights at every step (`swarm.server.weights_hash`). For a stage of
N fp32 parameters (tensors shaped as a GPT stage's: d_model 1024 matrices and their biases) on the given
device, it times, as medians of `--repeat`:

- `copy+sha256`: every parameter copied to the host and hashed with SHA-256 (the digest before BLAKE3);
- `copy+blake3`: the same copy, hashed with the `blake3` package;
- `digest`: `swarm.server.weights_hash.digest` as a server runs it (on a GPU: BLAKE3 on the device with
  Triton, no copy of the weights; on a CPU: the `blake3` package over the tensors' memory).

Each line also checks that the device's digest equals the host's.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import blake3
import torch

from swarm.server import weights_hash


def stage_tensors(params: float, device: str) -> list[torch.Tensor]:
    """Random fp32 tensors of about `params` values, in the shapes of transformer blocks (d_model 1024)."""
    d = 1024
    gen = torch.Generator(device=device).manual_seed(0)
    shapes, total = [], 0
    while total < params:
        for shape in ((d, 3 * d), (3 * d,), (d, d), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)):
            shapes.append(shape)
            total += torch.Size(shape).numel()
    return [torch.randn(s, generator=gen, device=device) for s in shapes]


def timed(fn, device: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_hash(tensors: list[torch.Tensor], make) -> str:
    h = make()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def measure(tensors: list[torch.Tensor], device: str, repeat: int) -> dict[str, float]:
    return {"copy+sha256": timed(lambda: host_hash(tensors, hashlib.sha256), device, repeat),
            "copy+blake3": timed(lambda: host_hash(tensors, blake3.blake3), device, repeat),
            "digest": timed(lambda: weights_hash.digest(tensors), device, repeat)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, nargs="+", default=[25e6, 100e6])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for params in args.params:
        tensors = stage_tensors(params, args.device)
        n = sum(t.numel() for t in tensors)
        weights_hash.digest(tensors)  # warm-up (on a GPU: the kernels' compilation)
        row = measure(tensors, args.device, args.repeat)
        same = weights_hash.digest(tensors) == weights_hash.digest([t.cpu() for t in tensors])
        cells = "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in row.items())
        print(f"{args.device} {n / 1e6:.0f}M params ({4 * n / 2**20:.0f} MiB): {cells}  same as host: {same}",
              flush=True)


if __name__ == "__main__":
    main()
