"""Hugging Face `transformers` decoder-only causal LMs cut into pipeline stages: `model.spec =
"swarm.model.hf:build_stages"`, configured from a config.json or from fields (see swarm.config.hf).

The math is transformers' own: a stage holds the family's layer classes (`LlamaDecoderLayer` with its
`LlamaRotaryEmbedding` and `LlamaRMSNorm`; `GPT2Block` and `LayerNorm`) built from one transformers config.
Stage 0 holds the token embedding (and GPT-2's learned positions), every stage a contiguous run of layers,
the last stage the final norm, the lm_head and the loss; only hidden states [B, T, d_model] travel between
stages. Layers are split by `swarm.core.partition.split_layers`, the built-in GPT's rule: as even as
possible, earlier stages taking one extra layer each while any are left over (the last stage also computes
the vocabulary projection), the same on every peer. Each server builds only its own stage.

Parameter names are transformers' (`model.layers.3.mlp.up_proj.weight`, `transformer.h.3.attn.c_attn.weight`,
`lm_head.weight`): a stage's state dict is its slice of the causal LM's. That is how pretrained weights are
read (`swarm.model.hf_weights`) and how `swarm export` writes a directory `from_pretrained` loads.

Causal masking: with `attention_mask=None`, transformers' eager attention masks nothing at all; only sdpa's
`is_causal` would keep a token from seeing later ones. So every stage asks `create_causal_mask` for the mask
of the attention it runs (sdpa, transformers' default; the mask it builds is None exactly when `is_causal`
does the job), as transformers' own model classes do.

Loss: the mean cross-entropy over the targets (already shifted: inputs r[:-1], targets r[1:]), ignoring
positions marked -100 (torch's and transformers' convention for padding); logits in fp32, as transformers
computes its loss.

Tied embeddings (`tie_word_embeddings`): the lm_head starts as the token embedding (the same random draw, or
the embedding's tensor from pretrained weights). On one stage they stay one parameter. Across stages they
live on different servers and train as two copies, so what is trained is an untied model: `swarm export`
writes it with `tie_word_embeddings = false` and both matrices (a tied model when it was one stage).
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from swarm.config import ModelConfig
from swarm.config.hf import transformers_config
from swarm.core.partition import split_layers
from swarm.model.hf_weights import initialize, load_pretrained
from swarm.model.spec import Boundary


class HFStage(nn.Module):
    """One contiguous slice of a transformers causal LM. A family names where its parts live (`decoder`,
    `layer_list`, `embedding`, `final_norm`) and builds them; the rest is common."""

    decoder: str  # the attribute the causal LM keeps its decoder under
    layer_list: str  # the decoder's list of layers
    embedding: str  # the token embedding's full name, which a tied lm_head starts as
    final_norm: str  # the decoder's norm before the lm_head

    def __init__(self, cfg: ModelConfig, config: PretrainedConfig, index: int, layers: range) -> None:
        super().__init__()
        self.index, self.is_first, self.is_last = index, index == 0, index == cfg.num_stages - 1
        self.seq_len, self.width = cfg.seq_len, cfg.d_model
        self.config = config
        body = nn.Module()
        setattr(self, self.decoder, body)
        setattr(body, self.layer_list, nn.ModuleDict({str(i): self._layer(i) for i in layers}))
        self._build(body)
        if self.is_last:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if self.is_first and config.tie_word_embeddings:
                self.lm_head.weight = self.get_submodule(self.embedding.rpartition(".")[0]).weight

    @property
    def body(self) -> nn.Module:
        return getattr(self, self.decoder)

    def _layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def _build(self, body: nn.Module) -> None:
        """The family's parts besides the layers and the lm_head."""
        raise NotImplementedError

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _layer_inputs(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, object]:
        """What every layer takes besides the hidden state, the mask and the positions."""
        return {}

    def boundary(self) -> tuple[Boundary, Boundary | None]:
        """Token ids in (stage 0) or the previous stage's hidden state; hidden state out, or the loss."""
        hidden = Boundary(torch.float32, (self.seq_len, self.width))
        inputs = Boundary(torch.int64, (self.seq_len,)) if self.is_first else hidden
        return inputs, None if self.is_last else hidden

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] on the first stage, hidden [B, T, d] elsewhere; the last stage needs targets
        [B, T] (-100 where there is none) and returns their mean loss."""
        hidden = self.layers(inputs)
        if not self.is_last:
            return hidden
        if targets is None:
            raise ValueError(f"stage {self.index} is the last stage and needs targets to compute the loss")
        return F.cross_entropy(self.logits(hidden).flatten(0, 1).float(), targets.flatten())

    def layers(self, inputs: torch.Tensor) -> torch.Tensor:
        """The stage's layers over its input (embedded first on stage 0): the hidden state it sends on, or on
        the last stage the one its head reads."""
        if inputs.shape[1] > self.seq_len:
            raise ValueError(f"sequence of {inputs.shape[1]} tokens exceeds model.seq_len={self.seq_len}")
        hidden = self._embed(inputs) if self.is_first else inputs
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  past_key_values=None, position_ids=positions)
        extra = self._layer_inputs(hidden, positions)
        for layer in getattr(self.body, self.layer_list).values():
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, **extra)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's logits [B, T, vocab] from the hidden state its layers made (`layers`)."""
        return self.lm_head(getattr(self.body, self.final_norm)(hidden))


class LlamaStage(HFStage):
    decoder, layer_list, embedding, final_norm = "model", "layers", "model.embed_tokens.weight", "norm"

    def _layer(self, index: int) -> nn.Module:
        return LlamaDecoderLayer(self.config, index)

    def _build(self, body: nn.Module) -> None:
        config = self.config
        body.rotary_emb = LlamaRotaryEmbedding(config)  # every stage turns its layers' queries and keys
        if self.is_first:
            body.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        if self.is_last:
            body.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.body.embed_tokens(input_ids)

    def _layer_inputs(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, object]:
        return {"position_embeddings": self.body.rotary_emb(hidden, position_ids=positions)}


class GPT2Stage(HFStage):
    decoder, layer_list, embedding, final_norm = "transformer", "h", "transformer.wte.weight", "ln_f"

    def _layer(self, index: int) -> nn.Module:
        return GPT2Block(self.config, layer_idx=index)

    def _build(self, body: nn.Module) -> None:
        config = self.config
        if self.is_first:
            body.wte = nn.Embedding(config.vocab_size, config.hidden_size)
            body.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
            body.drop = nn.Dropout(config.embd_pdrop)
        if self.is_last:
            body.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.body.drop(self.body.wte(input_ids) + self.body.wpe(positions))


STAGES: dict[str, type[HFStage]] = {"llama": LlamaStage, "gpt2": GPT2Stage}


def _build(cfg: ModelConfig, config: PretrainedConfig, index: int, layers: range) -> HFStage:
    stage = STAGES[cfg.hf_family](cfg, config, index, layers)
    if cfg.hf_weights:
        load_pretrained(stage, cfg.hf_weights)
    else:
        initialize(stage, cfg.init_seed)
    return stage


@overload
def build_stages(cfg: ModelConfig) -> list[nn.Module]: ...
@overload
def build_stages(cfg: ModelConfig, stage: int) -> nn.Module: ...
def build_stages(cfg: ModelConfig, stage: int | None = None) -> list[nn.Module] | nn.Module:
    """The model's `cfg.num_stages` stages, or with `stage` that stage alone (a server builds only its own:
    its layers, and with pretrained weights only its tensors read)."""
    config = transformers_config(cfg)
    ranges = split_layers(cfg.n_layers, cfg.num_stages)
    if stage is not None:
        return _build(cfg, config, stage, ranges[stage])
    return [_build(cfg, config, index, layers) for index, layers in enumerate(ranges)]
