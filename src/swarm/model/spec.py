"""The model-spec interface: how a run names the network it trains.

`model.spec` is a "package.module:function" string rather than a class so that users can plug in
their own stage list without touching this package.

The function is called as `function(cfg)` and returns the list of `cfg.num_stages` stage modules;
that is all a simple spec has to offer. A spec that can build one stage on its own takes an optional
`stage` argument as well: `function(cfg, stage=k)` returns stage k's module alone. A server then
builds only the stage it hosts, so a model larger than one machine can still be served stage by stage.
One optional argument, rather than a second name in the config or an object with methods, keeps one
name per model, leaves every list-only spec working unchanged, and lets the loader see from the
signature alone (without building anything) which form a spec offers. A spec without it costs each
server the whole model's memory while it builds its stage (`build_stage` falls back to the list).

A stage module may also declare what crosses its boundaries: `stage.boundary()` returns
`(inputs, outputs)` as `Boundary` values (per sample, without the batch dimension; `outputs` is None
for the last stage, which returns the loss). A server then knows what its stage accepts and emits
without building any other stage; a module that does not declare them is probed (`probe_boundary`),
which builds and runs the stages before it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import nn

from swarm.config.schema import ConfigError, ModelConfig


class Boundary(NamedTuple):
    """What one sample of a stage's input or output is: its dtype and shape (batch dimension left out)."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def _resolve(spec: str) -> Callable[..., object]:
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


def _check_role(stage: nn.Module, index: int, num_stages: int, spec: str) -> None:
    """Fill in the role attributes the runtime dispatches on, and refuse a module that claims a
    different role than its position, since that would silently mis-wire the pipeline."""
    expected = {"index": index, "is_first": index == 0, "is_last": index == num_stages - 1}
    for attr, value in expected.items():
        if not hasattr(stage, attr):
            setattr(stage, attr, value)
        elif getattr(stage, attr) != value:
            found = getattr(stage, attr)
            raise ConfigError(f"model.spec: {spec!r} stage {index} has {attr}={found!r}, expected {value!r}")


def _check_module(stage: object, index: int, spec: str) -> nn.Module:
    if not isinstance(stage, nn.Module):
        raise ConfigError(f"model.spec: {spec!r} returned {type(stage).__name__} as stage {index}, expected nn.Module")
    return stage


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
    stages = [_check_module(stage, index, cfg.spec) for index, stage in enumerate(stages)]
    for index, stage in enumerate(stages):
        _check_role(stage, index, cfg.num_stages, cfg.spec)
    return stages


def builds_one_stage(cfg: ModelConfig) -> bool:
    """Whether `cfg.spec` can build a single stage (it takes a `stage` argument; see the module doc)."""
    return "stage" in inspect.signature(_resolve(cfg.spec)).parameters


def build_stage(cfg: ModelConfig, index: int) -> nn.Module:
    """The one stage a server hosts: built alone when the spec offers it, else taken from the whole list
    (that costs the whole model's memory while it is built). Either way stage k comes out as on any
    peer, provided the spec draws each stage's weights independently of the others (the GPT does)."""
    if not 0 <= index < cfg.num_stages:
        raise ConfigError(f"server.stage: must be in [0, model.num_stages={cfg.num_stages}), got {index}")
    if not builds_one_stage(cfg):
        return load_stages(cfg)[index]
    stage = _check_module(_resolve(cfg.spec)(cfg, stage=index), index, cfg.spec)
    _check_role(stage, index, cfg.num_stages, cfg.spec)
    return stage


def stage_boundary(cfg: ModelConfig, stage: nn.Module) -> tuple[Boundary, Boundary | None]:
    """What `stage` accepts and emits per sample: as the module declares it, else probed."""
    declare = getattr(stage, "boundary", None)
    return declare() if callable(declare) else probe_boundary(cfg, stage)


def probe_boundary(cfg: ModelConfig, stage: nn.Module) -> tuple[Boundary, Boundary | None]:
    """Stage `stage.index`'s boundary found by pushing one sample through the stages before it: the costly
    path for stages that do not declare theirs, as it builds every earlier stage (one at a time when the
    spec builds single stages, the whole list otherwise). Stage 0 takes `seq_len` token ids."""
    x = torch.zeros(1, cfg.seq_len, dtype=torch.int64)
    with torch.no_grad():
        for earlier in _earlier_stages(cfg, stage.index):
            x = earlier(x)
        inputs = Boundary(x.dtype, tuple(x.shape[1:]))
        if stage.is_last:
            return inputs, None
        y = stage(x)
    return inputs, Boundary(y.dtype, tuple(y.shape[1:]))


def _earlier_stages(cfg: ModelConfig, index: int) -> Iterator[nn.Module]:
    """Stages 0..index-1, each built only when needed and dropped after use where the spec allows."""
    if builds_one_stage(cfg):
        return (build_stage(cfg, k) for k in range(index))
    return iter(load_stages(cfg)[:index])


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
