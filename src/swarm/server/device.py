"""What a stage's compute runs with on its device.

On a GPU the defaults are the fast ones that keep training exact enough: autocast in the GPU's fastest
half precision (the matmuls of the forward and backward in it; weights, gradients and the optimizer in
fp32): bf16, which has fp32's range and needs no loss scale, or on a GPU without it fp16, whose backwards
run through a loss scale (`swarm.server.lossscale`); and TF32 for what stays in fp32. On a CPU everything
stays fp32: half precision there is slower on most processors, and CPU replicas are the ones compared bit
for bit in tests. A CPU that multiplies bf16 in hardware (AMX) is the exception in speed: there the server
says what `bf16` would give (`cpu_bf16_hint`) and leaves the choice to its operator.
"""

from __future__ import annotations

from pathlib import Path

import torch

HALVES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """The dtype `server.autocast` asks for on `device` ("auto": see `fastest_half`)."""
    if setting in HALVES:
        return HALVES[setting]
    if setting == "auto" and device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(resolve(device))
        return fastest_half(major)
    return None


def fastest_half(major: int) -> torch.dtype | None:
    """The half precision a CUDA device of compute capability `major`.x runs fastest: bf16 where its tensor
    cores have it (8: Ampere and newer), fp16 where they have fp16's alone (7: Volta, Turing), none before
    (Pascal and older lack tensor cores; most of their fp16 is slower than their fp32). torch reports bf16
    as supported on a Turing card too, emulated: several times slower than its fp16."""
    return torch.bfloat16 if major >= 8 else torch.float16 if major == 7 else None


def cpu_bf16_hint(setting: str, device: torch.device, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """What to tell the operator of a CPU stage left in fp32 by `auto` on a processor with AMX's bf16 tiles
    (Xeons from Sapphire Rapids on; `amx_bf16` among its flags): there a stage's forward and backward in
    bf16 autocast took 0.40 of fp32's time (the larger benchmark model's middle stage, one thread)."""
    if setting != "auto" or device.type != "cpu":
        return None
    try:
        flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return None
    if "amx_bf16" not in flags.split():
        return None
    return ('this CPU multiplies bf16 in hardware (AMX): with server.autocast = "bf16" a stage ran 2.5x as fast '
            "on one such CPU; auto keeps fp32, whose replicas compare bit for bit with fp32 ones")


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
