"""What a stage's compute runs with on its device.

On a GPU the defaults are the fast ones that keep training exact enough: bf16 autocast (the matmuls of
the forward and backward in bf16, weights, gradients and the optimizer in fp32; bf16 has fp32's range,
so it needs no loss scale) and TF32 for what stays in fp32. On a CPU everything stays fp32: bf16 there is
slower on most processors, and CPU replicas are the ones compared bit for bit in tests.
"""

from __future__ import annotations

import torch


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """The dtype `server.autocast` asks for on `device` ("auto": bf16 on a CUDA device that has it)."""
    if setting == "bf16":
        return torch.bfloat16
    if setting == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def resolve(device: torch.device) -> torch.device:
    """The device with its index: a plain "cuda" means the current GPU, and tensors report it as cuda:N,
    so comparisons need the index (and a worker thread's current GPU need not be the server's)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def prepare(device: torch.device) -> torch.device:
    """Make `device` current and, on a GPU, let fp32 matmuls and convolutions use TF32 (several times
    the fp32 rate on Ampere and newer, with 10-bit mantissas). The device `resolve` gives."""
    if device.type != "cuda":
        return device
    device = resolve(device)
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return device
