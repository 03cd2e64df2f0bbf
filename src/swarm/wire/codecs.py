"""Lossy wire codecs for floating-point tensors: fewer bytes on slow links, with a stated error bound.

A codec turns one tensor into a few plain tensors (`Packed.parts`) and a small description
(`Packed.meta`: codec, shape, dtype and the codec's parameters) that travel as they are, and back.
Decoding checks everything it is given against the description, since packed tensors come from
other peers: a malformed one raises `BadRequest` with what is wrong, never a reshape error.

- `none`: the tensor itself.
- `fp16`, `bf16`: half-precision floats (2 bytes per value). Values beyond fp16's range (65504)
  are clamped to it rather than sent as infinities.
- `uint8`: 8-bit uniform quantization over the tensor's [min, max] (1 byte per value + 8 bytes).
- `blockwise8`: 8-bit symmetric quantization with one fp32 scale (the absolute maximum) per block of
  `block` values (1 + 4/block bytes per value): an outlier costs precision only in its own block,
  which is what makes 8-bit activations and gradients train as well as full precision.

Non-float tensors (token ids, targets) always travel as they are.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.wire.validate import BadRequest

CODECS = ("none", "fp16", "bf16", "uint8", "blockwise8")
DEFAULT_BLOCK = 256
MAX_BLOCK = 1 << 16  # a larger block declared by a sender is refused: it would only buy it memory
MAX_DIMS = 8  # dimensions a tensor's declared shape may have
_FP16_MAX = 65504.0
# every dtype that may cross the wire, by the name it travels under
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
              torch.int16, torch.int32, torch.int64, torch.bool)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Packed:
    meta: dict[str, Any]
    parts: list[torch.Tensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data this takes on the wire (the description is a few dozen more)."""
        return sum(p.numel() * p.element_size() for p in self.parts)


@dataclass(frozen=True)
class Policy:
    """Which codec each tensor role travels with (roles not named travel as they are)."""

    codecs: dict[str, str] = field(default_factory=dict)
    block: int = DEFAULT_BLOCK

    def pack(self, role: str, tensor: torch.Tensor) -> Packed:
        return encode(tensor, self.codecs.get(role, "none"), self.block)


EXACT = Policy()  # every tensor as it is


def encode(tensor: torch.Tensor, codec: str, block: int = DEFAULT_BLOCK) -> Packed:
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
    tensor = tensor.detach()
    if not tensor.is_floating_point() or codec == "none":
        return Packed({"codec": "none"}, [tensor])
    dtype = dtype_name(tensor.dtype)
    meta: dict[str, Any] = {"codec": codec, "shape": list(tensor.shape), "dtype": dtype}
    flat = tensor.reshape(-1).float()
    if codec == "fp16":
        return Packed(meta, [flat.clamp(-_FP16_MAX, _FP16_MAX).half()])
    if codec == "bf16":
        return Packed(meta, [flat.bfloat16()])
    if codec == "uint8":
        lo, hi = (flat.min().item(), flat.max().item()) if flat.numel() else (0.0, 0.0)
        step = (hi - lo) / 255 or 1.0
        codes = ((flat - lo) / step).round_().clamp_(0, 255).to(torch.uint8)
        return Packed({**meta, "lo": lo, "step": step}, [codes])
    codes = torch.empty(flat.shape, dtype=torch.int8, device=flat.device)
    scales = torch.empty(-(-flat.numel() // block), dtype=torch.float32, device=flat.device)
    for lo, hi, width in _block_spans(flat.numel(), block):
        _quantize(flat[lo:hi].view(-1, width), codes[lo:hi].view(-1, width), scales[lo // block:-(-hi // block)])
    return Packed({**meta, "block": block}, [codes, scales])


# values per slice that blockwise8 works through at once: a slice's temporaries stay in the core's cache
# (`benchmarks/step_cost.py` times a stage's all-reduce part both ways)
SLICE = 1 << 17


def _block_spans(numel: int, block: int) -> Iterator[tuple[int, int, int]]:
    """(first value, end, row width) of each run of whole blocks of about SLICE values, then of the last,
    partial block: a run is viewed as rows of its blocks."""
    whole = numel - numel % block
    step = max(SLICE // block, 1) * block
    for lo in range(0, whole, step):
        yield lo, min(whole, lo + step), block
    if whole < numel:
        yield whole, numel, numel - whole


def _quantize(rows: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Each row's absolute maximum into `scales`, its values as multiples of 1/127 of it into `codes`. The
    maximum is read as the larger of the row's max and minus its min: two plain reductions, where `abs()`
    would first write a copy of the rows (NaN still comes through, so that the receiver refuses it)."""
    torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_(), out=scales)
    codes.copy_(rows.mul((127 / torch.where(scales > 0, scales, 1.0)).unsqueeze_(1)).round_())


def on_host(policy: Policy | None, role: str, tensor: torch.Tensor) -> torch.Tensor | Packed:
    """A server's result as it leaves the compute thread: packed by its role's codec where it lies, then
    copied to the host. On a GPU it is thus quantized before the copy (a quarter of the bytes cross the
    bus with 8-bit codecs), and the event loop, which also renews the server's DHT records, does no codec
    work. Without a policy: the float tensor on the host."""
    if policy is None:
        return tensor.detach().float().cpu()
    packed = policy.pack(role, tensor.detach().float())
    return Packed(packed.meta, [part.cpu() for part in packed.parts])


Carried = torch.Tensor | Packed  # what a trainer sends: its own tensors, or a stage's reply packed as it came


def rows(value: Carried) -> int:
    """The leading dimension of a tensor, packed or not (a microbatch's samples)."""
    if not isinstance(value, Packed):
        return value.shape[0]
    return value.parts[0].shape[0] if value.meta.get("codec") == "none" else value.meta["shape"][0]


def check(packed: Packed) -> tuple[list[int], torch.dtype]:
    """A packed tensor's shape and dtype, once its description and parts are checked against each other
    (BadRequest: malformed). `decode` checks so; a trainer relaying a stage's reply to the next stage as it
    came checks so too, and a malformed one is still the replying server's failure."""
    meta, parts = packed.meta, packed.parts
    codec = meta.get("codec")
    if codec not in CODECS:
        raise BadRequest(f"malformed compressed tensor: unknown codec {codec!r}")
    if codec == "none":
        _expect(len(parts) == 1, f"codec none carries one tensor, got {len(parts)}")
        return list(parts[0].shape), parts[0].dtype
    shape, dtype = meta.get("shape"), DTYPES.get(meta.get("dtype"))
    _expect(isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape), f"bad shape {shape!r}")
    _expect(dtype is not None and dtype.is_floating_point, f"bad dtype {meta.get('dtype')!r}")
    numel = math.prod(shape)
    wanted = {"fp16": [torch.float16], "bf16": [torch.bfloat16], "uint8": [torch.uint8],
              "blockwise8": [torch.int8, torch.float32]}[codec]
    _expect([p.dtype for p in parts] == wanted, f"{codec} carries {wanted}, got {[p.dtype for p in parts]}")
    _expect(parts[0].dim() == 1 and parts[0].numel() == numel,
            f"{codec} data holds {parts[0].numel()} values for shape {shape}")
    if codec == "uint8":
        _expect(all(isinstance(meta.get(k), int | float) and math.isfinite(meta.get(k)) for k in ("lo", "step")),
                "bad uint8 range")
    elif codec == "blockwise8":
        block, scales = meta.get("block"), parts[1]
        _expect(isinstance(block, int) and not isinstance(block, bool) and 0 < block <= MAX_BLOCK,
                f"block size {block!r} outside [1, {MAX_BLOCK}]")
        _expect(scales.dim() == 1 and scales.numel() == -(-numel // block),
                f"blockwise8 needs {-(-numel // block)} scales, got {scales.numel()}")
        _expect(bool(torch.isfinite(scales).all() and (scales >= 0).all()), "blockwise8 scales must be finite and >= 0")
    return shape, dtype


def decode(packed: Packed, device: torch.device | None = None) -> torch.Tensor:
    """The tensor `packed` carries, unpacked on `device` (default: where its parts are). A GPU server's
    requests are unpacked on its GPU: a quarter of the bytes cross the bus with 8-bit codecs, and the
    host, whose cores also run the server's network side, does none of the per-value work."""
    meta, parts = packed.meta, packed.parts
    shape, dtype = check(packed)
    if device is not None:
        parts = [part.to(device) for part in parts]
    codec, numel = meta["codec"], math.prod(shape)
    if codec == "none":
        return parts[0]
    if codec in ("fp16", "bf16"):
        flat = parts[0].float()
    elif codec == "uint8":
        flat = parts[0].float() * meta["step"] + meta["lo"]
    else:  # each value times its block's scale, slice by slice, written once into the result
        flat = torch.empty(numel, dtype=torch.float32, device=parts[0].device)
        block, scales = meta["block"], parts[1] / 127
        for lo, hi, width in _block_spans(numel, block):
            torch.mul(parts[0][lo:hi].view(-1, width), scales[lo // block:-(-hi // block)].unsqueeze(1),
                      out=flat[lo:hi].view(-1, width))
    return flat.view(shape).to(dtype)


def error_bound(tensor: torch.Tensor, codec: str, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """The largest error each value of `tensor` may come back with (elementwise), for tests and docs:
    the codec's own, plus rounding back to the tensor's dtype."""
    if codec == "none" or not tensor.is_floating_point():
        return torch.zeros_like(tensor, dtype=torch.float32)
    x = tensor.detach().float()
    return _codec_bound(x, codec, block) + x.abs() * torch.finfo(tensor.dtype).eps


def _codec_bound(x: torch.Tensor, codec: str, block: int) -> torch.Tensor:
    if codec == "fp16":  # half an ulp of 11 significant bits, a subnormal's step, and the clamp
        return x.abs() * 2.0**-11 + 2.0**-24 + (x.abs() - _FP16_MAX).clamp(min=0)
    if codec == "bf16":
        return x.abs() * 2.0**-8 + 1e-38
    slack = 1e-6 * x.abs().max() if x.numel() else 0.0  # float32 rounding in scaling
    if codec == "uint8":
        return torch.full_like(x, ((x.max() - x.min()) / 255 / 2 + slack).item() if x.numel() else 0.0)
    flat = x.reshape(-1)
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(-1, block)
    per_block = padded.abs().amax(dim=1) / 127 / 2
    return (per_block.repeat_interleave(block)[: flat.numel()] + slack).view(x.shape)


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise BadRequest(f"malformed compressed tensor: {message}")
