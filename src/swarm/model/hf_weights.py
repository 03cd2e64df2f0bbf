"""A Hugging Face stage's starting weights (`swarm.model.hf`): a random draw the same on every peer, or its
own tensors read from pretrained weights.

Random: every parameter is drawn from a generator seeded by `model.init_seed` and the parameter's name in the
whole model, by transformers' initialisation rule (normal with `initializer_range`, GPT-2's residual
projections scaled by 1/sqrt(2 x layers), biases zero, norm scales one). A tensor thus comes out the same bits
whichever stage builds it and whatever else that peer built, and a tied lm_head, drawn under the token
embedding's name, starts equal to it on another stage.

Pretrained: a directory as `from_pretrained` reads it, `model.safetensors` or shards listed by
`model.safetensors.index.json`. A stage opens only the files holding its tensors and reads only those
tensors (safetensors maps the file and copies out the tensors asked for), so a server needs neither the
memory for the whole model nor, with shards, the files of other stages' layers.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from torch import nn
from transformers.pytorch_utils import Conv1D

from swarm.config import ConfigError

if TYPE_CHECKING:
    from swarm.model.hf import HFStage

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def source_names(stage: HFStage) -> dict[str, str]:
    """Each parameter of `stage` -> the tensor of the whole model it starts as: itself, but for an lm_head
    tied to the token embedding, the embedding."""
    tied = stage.config.tie_word_embeddings
    return {name: stage.embedding if tied and name == "lm_head.weight" else name
            for name, _ in stage.named_parameters()}


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def initialize(stage: HFStage, seed: int) -> None:
    config = stage.config
    sources = source_names(stage)
    residual = config.initializer_range / math.sqrt(2 * config.num_hidden_layers)
    with torch.no_grad():
        for module_name, module in stage.named_modules():
            for own, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{own}" if module_name else own
                if name not in sources:  # one parameter under two names (a tied lm_head): drawn once
                    continue
                if own == "bias":
                    param.zero_()
                elif isinstance(module, (nn.Linear, Conv1D, nn.Embedding)):
                    scaled = config.model_type == "gpt2" and name.endswith("c_proj.weight")
                    param.normal_(0.0, residual if scaled else config.initializer_range,
                                  generator=_generator(seed, sources[name]))
                    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                        param[module.padding_idx].zero_()
                else:  # the norms' scales
                    param.fill_(1.0)


def load_pretrained(stage: HFStage, directory: str) -> None:
    """Copy `stage`'s tensors from pretrained weights in `directory` (cast to the stage's dtype)."""
    sources = source_names(stage)
    tensors = read_tensors(directory, sources.values())
    with torch.no_grad():
        for name, param in stage.named_parameters():
            found = tensors[sources[name]]
            if found.shape != param.shape:
                raise ConfigError(f"model.hf_weights: {sources[name]} in {directory} is {list(found.shape)}, but the "
                                  f"configured model's is {list(param.shape)}")
            param.copy_(found)


def read_tensors(directory: str, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of the weights in `directory`, each file that holds some opened once, nothing else
    read."""
    root = Path(directory)
    if (root / INDEX).is_file():
        try:
            weight_map: dict[str, str] | None = json.loads((root / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"model.hf_weights: cannot read {root / INDEX}: {e}") from e
    elif (root / SINGLE).is_file():
        weight_map = None
    else:
        raise ConfigError(f"model.hf_weights: {directory!r} holds neither {SINGLE} nor {INDEX} (weights as "
                          "save_pretrained writes them; .bin weights must be saved again as safetensors)")
    wanted = sorted(set(names))
    missing = [n for n in wanted if weight_map is not None and n not in weight_map]
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        if name not in missing:
            by_file.setdefault(SINGLE if weight_map is None else weight_map[name], []).append(name)
    found: dict[str, torch.Tensor] = {}
    for file, keys in sorted(by_file.items()):
        path = root / file
        if not path.is_file():
            raise ConfigError(f"model.hf_weights: {path} is missing; it holds {len(keys)} of this stage's tensors "
                              f"({keys[0]}, ...)")
        with safe_open(str(path), framework="pt") as weights:
            held = set(weights.keys())
            missing += [k for k in keys if k not in held]
            found.update((k, weights.get_tensor(k)) for k in keys if k in held)
    if missing:
        raise ConfigError(f"model.hf_weights: {directory} lacks {len(missing)} tensor(s) this stage needs: "
                          f"{', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}")
    return found
