"""A nanoGPT-style byte-level decoder, cut into pipeline stages.

Each stage is a self-contained module so a server can host one stage without building the others'
activations or optimizer state. Stages meet only at the hidden-state boundary `[B, T, d_model]`,
which is what travels between peers; with `model.bottleneck = b`, at `[B, T, b]`: each stage but the
last ends with a learned projection down to `b` values per token and the next begins with one back up,
so a boundary costs `b / d_model` of the bytes (compression the model learns to live with).
"""

from __future__ import annotations

import math
from typing import overload

import torch
import torch.nn.functional as F
from torch import nn

from swarm.config.schema import ModelConfig
from swarm.core.partition import split_layers
from swarm.model.spec import Boundary
from swarm.wire.validate import IGNORE_INDEX


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # [B, T, C] -> [B, heads, T, C / heads]: the layout scaled_dot_product_attention expects.
        q, k, v = (t.view(batch, seq, self.n_heads, width // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: normalising before each sublayer keeps the residual stream's scale
    stable, which lets deep stacks train without warm-up tricks."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTStage(nn.Module):
    """One contiguous slice of the decoder.

    The first stage owns the embeddings, the last owns the final norm, LM head and loss, so only
    hidden states (never logits or token ids, except at the ends) cross the network.
    """

    def __init__(self, cfg: ModelConfig, index: int, n_layers: int) -> None:
        super().__init__()
        self.index = index
        self.is_first = index == 0
        self.is_last = index == cfg.num_stages - 1
        self.n_layers = n_layers
        self.share_weights = cfg.share_weights
        self.seq_len = cfg.seq_len
        self.boundary_width = cfg.bottleneck or cfg.d_model  # values per token between stages
        if self.is_first:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.emb_drop = nn.Dropout(cfg.dropout)
        # With sharing, one block is applied n_layers times: the stage keeps its depth (and compute)
        # while storing, sending and averaging a single block's parameters.
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(1 if cfg.share_weights else n_layers))
        if self.is_last:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.bottleneck and not self.is_first:
            self.up = nn.Linear(cfg.bottleneck, cfg.d_model)
        if cfg.bottleneck and not self.is_last:
            self.down = nn.Linear(cfg.d_model, cfg.bottleneck)
        self._init_weights(cfg)
        self._init_bottlenecks(cfg)

    def _init_weights(self, cfg: ModelConfig) -> None:
        """GPT-2 init from a generator private to this stage, so any peer that builds stage k gets the
        same bits regardless of the global RNG or of which other stages it built first."""
        gen = torch.Generator().manual_seed(cfg.init_seed * 1000 + self.index)
        # Residual projections are scaled down so the residual stream's variance does not grow with depth.
        resid_std = 0.02 / math.sqrt(2 * cfg.n_layers)
        with torch.no_grad():
            for name, module in self.named_modules():
                if isinstance(module, nn.Linear):
                    std = resid_std if name.endswith(".proj") else 0.02
                    module.weight.normal_(0.0, std, generator=gen)
                    if module.bias is not None:
                        module.bias.zero_()
                elif isinstance(module, nn.Embedding):
                    module.weight.normal_(0.0, 0.02, generator=gen)
                elif isinstance(module, nn.LayerNorm):
                    module.weight.fill_(1.0)
                    module.bias.zero_()

    def _init_bottlenecks(self, cfg: ModelConfig) -> None:
        """The two ends of a boundary start as each other's transpose, with orthonormal rows: together an
        orthogonal projection onto a random `bottleneck`-wide subspace, which keeps the residual stream's
        scale instead of shrinking it by two small random matrices. Each end draws the boundary's matrix
        from a generator of its own, so the stages on both sides agree without seeing each other."""
        with torch.no_grad():
            if hasattr(self, "up"):
                self.up.weight.copy_(_boundary_basis(cfg, self.index - 1))
                self.up.bias.zero_()
            if hasattr(self, "down"):
                self.down.weight.copy_(_boundary_basis(cfg, self.index).t())
                self.down.bias.zero_()

    def boundary(self) -> tuple[Boundary, Boundary | None]:
        """Per sample: token ids in, or the previous stage's hidden state; hidden state out, or (the last
        stage) the loss. Declared so a server knows them without building the stages before its own."""
        hidden = Boundary(torch.float32, (self.seq_len, self.boundary_width))
        inputs = Boundary(torch.int64, (self.seq_len,)) if self.is_first else hidden
        return inputs, None if self.is_last else hidden

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq = input_ids.shape[1]
        if seq > self.seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds model.seq_len={self.seq_len}")
        positions = torch.arange(seq, device=input_ids.device)
        return self.emb_drop(self.tok_emb(input_ids) + self.pos_emb(positions))

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.ln_f(hidden))
        # padded positions carry IGNORE_INDEX as their target: the model needs no pad id of its own
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] on the first stage, hidden [B, T, d] elsewhere; the last stage needs
        targets [B, T] and returns the mean loss over targets other than IGNORE_INDEX (padding)."""
        hidden = self._embed(inputs) if self.is_first else inputs
        if hasattr(self, "up"):
            hidden = self.up(hidden)
        for layer in range(self.n_layers):
            hidden = self.blocks[0 if self.share_weights else layer](hidden)
        if not self.is_last:
            return self.down(hidden) if hasattr(self, "down") else hidden
        if targets is None:
            raise ValueError(f"stage {self.index} is the last stage and needs targets to compute the loss")
        return self._loss(hidden, targets)


def _boundary_basis(cfg: ModelConfig, boundary: int) -> torch.Tensor:
    """[d_model, bottleneck] with orthonormal columns, the same on every peer for one boundary."""
    gen = torch.Generator().manual_seed(cfg.init_seed * 1000 + 500 + boundary)
    q, _ = torch.linalg.qr(torch.randn(cfg.d_model, cfg.bottleneck, generator=gen))
    return q


@overload
def build_stages(cfg: ModelConfig) -> list[nn.Module]: ...
@overload
def build_stages(cfg: ModelConfig, stage: int) -> nn.Module: ...
def build_stages(cfg: ModelConfig, stage: int | None = None) -> list[nn.Module] | nn.Module:
    """The default `model.spec`: the decoder split into `cfg.num_stages` contiguous stages, or with
    `stage` that stage alone (each stage draws its weights from a generator of its own, so it comes out
    the same bits either way)."""
    ranges = split_layers(cfg.n_layers, cfg.num_stages)
    if stage is not None:
        return GPTStage(cfg, stage, len(ranges[stage]))
    return [GPTStage(cfg, index, len(layers)) for index, layers in enumerate(ranges)]
