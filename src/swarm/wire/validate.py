"""Checks on tensors that arrive from the network, before any compute touches them.

A stage knows what it accepts (dtype and per-sample shape) from a probe run at start-up; a request
that does not match is refused with a message saying what was expected, so a misconfigured trainer
learns what is wrong instead of crashing a server.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class BadRequest(ValueError):
    """The request is malformed; the message is sent back to the caller, marked so it is not retried."""

    def __str__(self) -> str:
        return f"refused: {super().__str__()}"


class Unavailable(RuntimeError):
    """The server cannot take this request now (it is leaving); the caller should go elsewhere."""


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    sample_shape: tuple[int, ...]  # shape without the leading batch dimension
    max_value: int | None = None  # exclusive upper bound for integer ids (vocabulary size)

    def describe(self) -> str:
        return f"{self.dtype} [B, {', '.join(map(str, self.sample_shape))}]"


def check_tensor(name: str, tensor: torch.Tensor, spec: TensorSpec, max_batch: int) -> None:
    if tensor.dtype != spec.dtype:
        raise BadRequest(f"{name}: expected dtype {spec.dtype}, got {tensor.dtype}")
    if tensor.dim() != len(spec.sample_shape) + 1 or tuple(tensor.shape[1:]) != spec.sample_shape:
        raise BadRequest(f"{name}: expected shape {spec.describe()}, got {list(tensor.shape)}")
    if not 0 < tensor.shape[0] <= max_batch:
        raise BadRequest(f"{name}: batch size {tensor.shape[0]} outside [1, {max_batch}]")
    if tensor.is_floating_point():
        if not torch.isfinite(tensor).all():
            raise BadRequest(f"{name}: contains NaN or Inf")
    elif spec.max_value is not None and tensor.numel() and (tensor.min() < 0 or tensor.max() >= spec.max_value):
        raise BadRequest(f"{name}: ids must lie in [0, {spec.max_value})")


def check_same_batch(*named: tuple[str, torch.Tensor]) -> int:
    sizes = {n: t.shape[0] for n, t in named}
    if len(set(sizes.values())) != 1:
        raise BadRequest(f"batch sizes differ: {sizes}")
    return next(iter(sizes.values()))
