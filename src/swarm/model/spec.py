"""The model-spec interface: how a run names the network it trains.

`model.spec` is a "package.module:function" string rather than a class so that users can plug in
their own stage list without touching this package; everything else (servers, trainers, baseline)
only ever sees the list of stage modules this returns.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from swarm.config.schema import ConfigError, ModelConfig


def _resolve(spec: str) -> Callable[[ModelConfig], object]:
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name or ":" in func_name:
        raise ConfigError(f"model.spec: must look like 'package.module:function', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a user module can fail to import in any way; all mean the spec is unusable
        raise ConfigError(f"model.spec: cannot import module {module_name!r} from {spec!r}: {exc}") from exc
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ConfigError(f"model.spec: module {module_name!r} has no function {func_name!r} (from {spec!r})")
    return fn


def _check_roles(stages: list[nn.Module], spec: str) -> None:
    """Fill in the role attributes the runtime dispatches on, and refuse modules that claim a
    different role than their position, since that would silently mis-wire the pipeline."""
    last = len(stages) - 1
    for index, stage in enumerate(stages):
        expected = {"index": index, "is_first": index == 0, "is_last": index == last}
        for attr, value in expected.items():
            if not hasattr(stage, attr):
                setattr(stage, attr, value)
            elif getattr(stage, attr) != value:
                found = getattr(stage, attr)
                raise ConfigError(
                    f"model.spec: {spec!r} stage {index} has {attr}={found!r}, expected {value!r}"
                )


def load_stages(cfg: ModelConfig) -> list[nn.Module]:
    """All stages named by `cfg.spec`, validated against `cfg.num_stages`."""
    stages = _resolve(cfg.spec)(cfg)
    if not isinstance(stages, (list, tuple)):
        raise ConfigError(
            f"model.spec: {cfg.spec!r} must return a list of nn.Module, got {type(stages).__name__}"
        )
    if len(stages) != cfg.num_stages:
        raise ConfigError(
            f"model.spec: {cfg.spec!r} returned {len(stages)} stages, but model.num_stages={cfg.num_stages}"
        )
    for index, stage in enumerate(stages):
        if not isinstance(stage, nn.Module):
            kind = type(stage).__name__
            raise ConfigError(
                f"model.spec: {cfg.spec!r} returned {kind} as stage {index}, expected nn.Module"
            )
    stages = list(stages)
    _check_roles(stages, cfg.spec)
    return stages


def build_stage(cfg: ModelConfig, index: int) -> nn.Module:
    """The one stage a server hosts. All stages are built so that stage k's weights come out exactly as
    on any peer that builds the whole list, whatever the spec does with shared RNG state."""
    if not 0 <= index < cfg.num_stages:
        raise ConfigError(f"server.stage: must be in [0, model.num_stages={cfg.num_stages}), got {index}")
    return load_stages(cfg)[index]


class ComposedModel(nn.Module):
    """All stages in one process: the single-machine baseline and the reference the tests compare
    the distributed pipeline against."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if len(self.stages) == 1:
            return self.stages[0](input_ids, targets)
        hidden = self.stages[0](input_ids)
        for stage in self.stages[1:-1]:
            hidden = stage(hidden)
        return self.stages[-1](hidden, targets)
