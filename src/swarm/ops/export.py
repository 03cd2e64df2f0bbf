"""`swarm export`: one model out of a swarm's stages.

Each stage's state comes from its newest checkpoint (the servers' `--resume DIR` directories, or any directory
holding them, such as a run directory: searched recursively), or, with `--initial-peers`, from the live swarm:
downloaded from its most advanced replica over the same call a newcomer joins with, and taken only where the
stage's replicas vouch for it (`swarm.core.vouching`), as a newcomer does. Stages step on their own, so while
trainers run, a live export may catch stages an epoch apart: export once they stop for one point of training.

A Hugging Face model (`swarm.model.hf`) is written as a directory `from_pretrained` loads: config.json and
model.safetensors under transformers' own parameter names, `tie_word_embeddings` as trained: true only for a
tied model trained as one stage, since across stages the lm_head and the embedding train as separate copies.
Any other model is written as model.safetensors keyed as `ComposedModel` keys it ("stages.K.NAME"), with the
run's config as swarm.toml, from which `swarm.model.load_stages` rebuilds it.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from swarm.config import SwarmConfig, agreed, config_hash, describe_mismatch, to_toml
from swarm.net.directory import short
from swarm.server.checkpoints import CheckpointStore

# what a tokenizer directory holds, as save_pretrained writes it for the tokenizers transformers knows
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                   "spiece.model", "chat_template.*")


class ExportError(ValueError):
    """The stages cannot be gathered into one model; the message says which and why."""


@dataclass
class StageState:
    epoch: int
    source: str  # the checkpoint directory, or the peer it was downloaded from
    params: dict[str, torch.Tensor]  # the stage module's state dict


def _stage_state(meta: dict[str, Any], tensors: list[torch.Tensor], source: str) -> StageState:
    """A stage's parameters out of its state as it travels and goes to disk (swarm.server.state_io)."""
    names = meta["names"]
    return StageState(int(meta["epoch"]), source, dict(zip(names, tensors[: len(names)], strict=True)))


def from_checkpoints(sources: Sequence[str | Path], num_stages: int) -> dict[int, StageState]:
    """Each stage's newest checkpoint under `sources`."""
    folders = sorted({p.parent for d in sources for p in Path(d).rglob("stage*-epoch*.pt")})
    newest: dict[int, StageState] = {}
    for folder in folders:
        for stage in range(num_stages):
            found = CheckpointStore(folder, stage, keep=1).latest()
            if found is not None and (stage not in newest or found[0]["epoch"] > newest[stage].epoch):
                newest[stage] = _stage_state(*found, source=str(folder))
    lacking = [k for k in range(num_stages) if k not in newest]
    if lacking:
        raise ExportError(f"no checkpoint of stage(s) {', '.join(map(str, lacking))} under "
                          f"{', '.join(map(str, sources))} (servers write them with --resume DIR)")
    return newest


def from_swarm(cfg: SwarmConfig) -> dict[int, StageState]:
    """Each stage's state, downloaded from its most advanced replica that the stage vouches for."""
    return asyncio.run(_download(cfg))


async def _download(cfg: SwarmConfig) -> dict[int, StageState]:
    from swarm.net.peer import join
    from swarm.net.protocol import Traffic
    from swarm.net.transport import CallFailed

    peer = await join(cfg.net, cfg.wire, Traffic(), serving=False)
    try:
        mine, states = config_hash(cfg), {}
        layout = await peer.directory.stages(cfg.model.num_stages)
        for stage in range(cfg.model.num_stages):
            records = [r for r in layout.get(stage, []) if r.config_hash == mine]
            if not records:
                others = layout.get(stage, [])
                why = f" (its servers run other settings: {describe_mismatch(agreed(cfg), others[0].agreed())})" \
                    if others else ""
                raise ExportError(f"stage {stage} has no live server{why}")
            for record in sorted(records, key=lambda r: -r.epoch):
                try:
                    meta, tensors = await peer.client.call(record.peer_id, "state", {"stage": stage}, [],
                                                           cfg.server.download_timeout)
                except CallFailed:
                    continue
                if await peer.directory.vouch(stage, mine, peer.peer_id, record.peer_id, meta, records,
                                              cfg.net.announce_period):
                    states[stage] = _stage_state(meta, tensors, source=f"peer {short(record.peer_id)}")
                    break
            else:
                raise ExportError(f"no replica of stage {stage} served its state (each call failed, or the state "
                                  "was not the one the stage's replicas announce)")
        return states
    finally:
        await peer.leave()


def write_hf(cfg: SwarmConfig, states: dict[int, StageState], out: Path) -> None:
    """A directory `from_pretrained` loads: config.json and model.safetensors under transformers' names."""
    from transformers import AutoModelForCausalLM

    from swarm.config.hf import FAMILIES, transformers_config

    config = transformers_config(cfg.model)
    config.tie_word_embeddings = cfg.model.hf_tie_embeddings and cfg.model.num_stages == 1
    config.architectures = [FAMILIES[cfg.model.hf_family].causal_lm]
    tensors = {name: t for state in states.values() for name, t in state.params.items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the embedding itself, as transformers saves a tied model
    with torch.device("meta"):
        expected = AutoModelForCausalLM.from_config(config).state_dict()
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    wrong = sorted(set(expected) ^ set(tensors)) or sorted(
        n for n in tensors if tensors[n].shape != expected[n].shape)
    if wrong:
        raise ExportError(f"the stages' states do not make up the configured model: {', '.join(wrong[:4])}"
                          f"{' ...' if len(wrong) > 4 else ''} (checkpoints of another model?)")
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    _save(tensors, out)


def write_plain(cfg: SwarmConfig, states: dict[int, StageState], out: Path) -> None:
    """model.safetensors keyed as `ComposedModel` keys the stages, and the run's config to rebuild them."""
    out.mkdir(parents=True, exist_ok=True)
    _save({f"stages.{k}.{name}": t for k, state in sorted(states.items()) for name, t in state.params.items()}, out)
    (out / "swarm.toml").write_text(to_toml(cfg))


def _save(tensors: dict[str, torch.Tensor], out: Path) -> None:
    """model.safetensors, each tensor its own copy (safetensors refuses tensors that share memory)."""
    save_file({n: t.contiguous().clone() for n, t in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def copy_tokenizer(tokenizer: Path, out: Path) -> list[str]:
    files = sorted({p for pattern in TOKENIZER_FILES for p in tokenizer.glob(pattern) if p.is_file()})
    if not files:
        raise ExportError(f"--tokenizer: {tokenizer} holds no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    for path in files:
        shutil.copy2(path, out / path.name)
    return [p.name for p in files]


def export_model(cfg: SwarmConfig, sources: Sequence[str], out: str | Path, tokenizer: str | None = None) -> str:
    """Gather the stages (from checkpoints under `sources`, else from the live swarm `cfg.net.initial_peers`
    reaches) and write the model to `out`; what was done, in a few lines for a person."""
    if not sources and not cfg.net.initial_peers:
        raise ExportError("give checkpoint or run directories to export from, or --initial-peers of a live swarm")
    states = from_checkpoints(sources, cfg.model.num_stages) if sources else from_swarm(cfg)
    out = Path(out)
    (write_hf if cfg.model.hf_family else write_plain)(cfg, states, out)
    lines = [f"stage {k}: epoch {s.epoch} from {s.source}" for k, s in sorted(states.items())]
    if tokenizer:
        lines.append(f"tokenizer: {', '.join(copy_tokenizer(Path(tokenizer), out))}")
    kind = "a Hugging Face model (from_pretrained loads it)" if cfg.model.hf_family else "the stages' weights"
    return "\n".join([*lines, f"wrote {kind} to {out}"])
