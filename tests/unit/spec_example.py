"""A user-supplied model spec, loaded by name through `model.spec` in test_model.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swarm.config import ModelConfig


class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab_size, cfg.d_model)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.emb(input_ids)


class Mix(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.lin = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.lin(hidden))


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.out(hidden).flatten(0, 1), targets.flatten())  # skips IGNORE_INDEX


def tiny_spec(cfg: ModelConfig) -> list[nn.Module]:
    """Stages without is_first/is_last/index attributes: the loader must add them."""
    torch.manual_seed(cfg.init_seed)
    return [Embed(cfg)] + [Mix(cfg) for _ in range(cfg.num_stages - 2)] + [Head(cfg)]


BUILT: list[int | None] = []  # what `per_stage` was asked for: a stage index, or None for the list


def per_stage(cfg: ModelConfig, stage: int | None = None) -> list[nn.Module] | nn.Module:
    """A spec that builds single stages (each from a seed of its own) but declares no boundary."""
    BUILT.append(stage)
    if stage is None:
        return [per_stage(cfg, k) for k in range(cfg.num_stages)]
    torch.manual_seed(cfg.init_seed * 100 + stage)
    return Embed(cfg) if stage == 0 else Head(cfg) if stage == cfg.num_stages - 1 else Mix(cfg)


def not_a_list(cfg: ModelConfig) -> nn.Module:
    return Embed(cfg)


def too_few(cfg: ModelConfig) -> list[nn.Module]:
    return [Embed(cfg)]


def not_modules(cfg: ModelConfig) -> list[object]:
    return ["stage"] * cfg.num_stages


def wrong_roles(cfg: ModelConfig) -> list[nn.Module]:
    stages = tiny_spec(cfg)
    stages[0].is_last = True
    return stages


NOT_CALLABLE = 3
