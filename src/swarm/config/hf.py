"""Hugging Face `transformers` models in the swarm config: the families the adapter (`swarm.model.hf`) cuts
into stages, how a model directory's config.json becomes the typed fields of `ModelConfig`, and the one
transformers config every peer builds a model's stages from (and compares, see `math_settings`).

A model is configured in one of two ways:

* `model.hf_config = "DIR"`: DIR/config.json, as `save_pretrained` writes it. Its settings are read into the
  typed fields when the config is loaded (`d_model`, `n_layers`, ..., `hf_rope_theta`), so every part of the
  swarm sees the model's real shape; a field given explicitly as well must say the same. Settings no typed
  field carries (`head_dim`, `attention_bias`, rope scaling, ...) are taken from the file as they are.
* `model.hf_family` and the typed fields alone: every other setting is the family's default.

Dropout is the swarm's (`model.dropout`, 0 by default) whatever config.json says: a replica that recomputes a
forward for a backward must compute what the first one did.

transformers is imported only here and in the adapter, and only when a Hugging Face model is configured.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarm.config.checks import ConfigError, require

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from swarm.config.schema import ModelConfig

HF_SPEC = "swarm.model.hf:build_stages"
# settings of a transformers config that change nothing a model computes from token ids: names, token
# ids, caching and output switches; dropout is the swarm's own (model.dropout, compared as such)
NOT_MATH = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype", "use_cache", "bos_token_id",
    "eos_token_id", "pad_token_id", "sep_token_id", "output_attentions", "output_hidden_states", "return_dict",
    "id2label", "label2id", "problem_type", "tokenizer_class", "task_specific_params", "chunk_size_feed_forward",
    "attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop",
})
NOT_MATH_PREFIXES = ("summary_",)  # GPT-2's sequence-summary head, which a causal LM does not have


@dataclass(frozen=True)
class Family:
    """One transformers model family the adapter builds stages of."""

    config_class: str  # the transformers config class
    causal_lm: str  # the transformers causal LM class, named in an exported config.json
    keys: Mapping[str, str]  # typed ModelConfig field -> the family config's setting
    dropout: tuple[str, ...]  # the settings model.dropout stands for
    activation: str  # the family's default, for model.hf_activation = ""


FAMILIES: dict[str, Family] = {
    "llama": Family(
        "LlamaConfig", "LlamaForCausalLM",
        {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
         "n_heads": "num_attention_heads", "d_ff": "intermediate_size", "hf_kv_heads": "num_key_value_heads",
         "hf_max_positions": "max_position_embeddings", "hf_rope_theta": "rope_theta", "hf_norm_eps": "rms_norm_eps",
         "hf_activation": "hidden_act", "hf_tie_embeddings": "tie_word_embeddings"},
        ("attention_dropout",), "silu"),
    "gpt2": Family(
        "GPT2Config", "GPT2LMHeadModel",
        {"vocab_size": "vocab_size", "d_model": "n_embd", "n_layers": "n_layer", "n_heads": "n_head",
         "d_ff": "n_inner", "hf_max_positions": "n_positions", "hf_norm_eps": "layer_norm_epsilon",
         "hf_activation": "activation_function", "hf_tie_embeddings": "tie_word_embeddings"},
        ("attn_pdrop", "resid_pdrop", "embd_pdrop"), "gelu_new"),
}


def _read_dir(directory: str) -> PretrainedConfig:
    path = Path(directory) / "config.json"
    require(path.is_file(), "model.hf_config", f"{directory!r} holds no config.json (a directory as save_pretrained "
                                               "writes it, e.g. a downloaded Hugging Face model)")
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"model.hf_config: cannot read {path}: {e}") from e
    require(model_type in FAMILIES, "model.hf_config",
            f"{path} has model_type {model_type!r}; the adapter builds {', '.join(FAMILIES)}")
    import transformers

    return getattr(transformers, FAMILIES[model_type].config_class).from_pretrained(directory)


def _get(config: PretrainedConfig, key: str) -> Any:
    if key == "rope_theta":  # transformers 5 keeps it among the rope parameters
        return float(config.rope_parameters["rope_theta"])
    if key == "n_inner" and config.n_inner is None:  # GPT-2's "4 x n_embd"
        return 4 * config.n_embd
    return getattr(config, key)


def settings_from_dir(directory: str) -> dict[str, Any]:
    """The typed `ModelConfig` fields a model directory's config.json sets (`hf_family` among them)."""
    config = _read_dir(directory)
    family = FAMILIES[config.model_type]
    return {"hf_family": config.model_type, **{field: _get(config, key) for field, key in family.keys.items()}}


def _typed(model: ModelConfig, family: Family) -> dict[str, Any]:
    """The family config's settings as the typed fields give them (their zeros and blanks resolved)."""
    resolved = {**{field: getattr(model, field) for field in family.keys},
                "hf_kv_heads": model.hf_kv_heads or model.n_heads,
                "hf_max_positions": model.hf_max_positions or model.seq_len,
                "hf_activation": model.hf_activation or family.activation}
    return {key: resolved[field] for field, key in family.keys.items()}


def transformers_config(model: ModelConfig) -> PretrainedConfig:
    """The transformers config of `model` (a Hugging Face family): config.json's, if given, with the typed
    fields and the swarm's dropout over it; the family's defaults otherwise. Attention runs through sdpa,
    transformers' default, whose mask `create_causal_mask` knows how to build (or leave to `is_causal`)."""
    import transformers

    family = FAMILIES[model.hf_family]
    settings = _read_dir(model.hf_config).to_dict() if model.hf_config else {}
    typed = _typed(model, family)
    if "rope_theta" in typed:
        rope = settings.get("rope_parameters") or {"rope_type": "default"}
        settings["rope_parameters"] = {**rope, "rope_theta": typed.pop("rope_theta")}
    settings.update(typed)
    settings.update(dict.fromkeys(family.dropout, model.dropout))
    config_class = getattr(transformers, family.config_class)
    defaults = config_class()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # an id outside the vocabulary names no token
        value = settings.get(key, getattr(defaults, key, None))
        if isinstance(value, int) and not 0 <= value < model.vocab_size:
            settings[key] = None
    config = config_class.from_dict(settings)
    config._attn_implementation = "sdpa"
    return config


def math_settings(model: ModelConfig) -> dict[str, Any]:
    """Every setting of `model`'s transformers config that changes what the model computes, as plain JSON:
    what peers compare (swarm.config.agreement), so that a differing config.json is refused by name."""
    settings = json.loads(transformers_config(model).to_json_string(use_diff=False))
    return {k: v for k, v in sorted(settings.items())
            if k not in NOT_MATH and not k.startswith(NOT_MATH_PREFIXES)}


def check_hf(model: ModelConfig) -> None:
    """What a Hugging Face model needs of the rest of `model`."""
    require(model.hf_family in FAMILIES, "model.hf_family",
            f"unknown family {model.hf_family!r}; known: {', '.join(FAMILIES)} (or set model.hf_config)")
    require(model.spec == HF_SPEC, "model.spec",
            f"must be {HF_SPEC!r} for a Hugging Face model (model.hf_family={model.hf_family!r}), got {model.spec!r}")
    kv = model.hf_kv_heads or model.n_heads
    require(model.n_heads % kv == 0 and (model.hf_family == "llama" or kv == model.n_heads), "model.hf_kv_heads",
            f"{kv} key/value heads do not fit {model.n_heads} heads ({model.hf_family})")
    require(model.seq_len <= (model.hf_max_positions or model.seq_len), "model.seq_len",
            f"{model.seq_len} exceeds the model's {model.hf_max_positions} positions (model.hf_max_positions)")
    require(model.hf_norm_eps > 0, "model.hf_norm_eps", f"must be positive, got {model.hf_norm_eps}")
    require(model.hf_rope_theta > 0, "model.hf_rope_theta", f"must be positive, got {model.hf_rope_theta}")
    if model.hf_activation:
        from transformers.activations import ACT2FN

        require(model.hf_activation in ACT2FN, "model.hf_activation",
                f"transformers knows no activation {model.hf_activation!r}; e.g. {', '.join(sorted(ACT2FN)[:8])}")
    require(not model.bottleneck and not model.share_weights, "model.bottleneck",
            "model.bottleneck and model.share_weights are the built-in GPT's; a Hugging Face model keeps its layers")
