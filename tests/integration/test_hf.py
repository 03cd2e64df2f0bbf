"""A transformers model trained on a local swarm through the adapter (swarm.model.hf), then exported from the
live swarm and from the servers' checkpoints into a directory transformers loads and generates with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from swarm.cli.main import main
from swarm.config.hf import HF_SPEC
from swarm.model.hf import build_stages
from swarm.ops.export import from_checkpoints
from swarm.ops.local import LocalSwarm
from swarm.ops.report import write_report

from .helpers import assert_exactly_once, assert_replicas_in_step, assert_states_equal, small_config, tracebacks

pytestmark = pytest.mark.integration


def llama(directory: Path) -> None:
    """small_config's shape (d_model 64, 2 heads, d_ff 128, 2 layers) with one key/value head, untied."""
    LlamaForCausalLM(LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(directory)


def gpt2(directory: Path) -> None:
    GPT2LMHeadModel(GPT2Config(vocab_size=257, n_embd=64, n_inner=128, n_layer=2, n_head=2, n_positions=64,
                               bos_token_id=0, eos_token_id=0)).save_pretrained(directory)


@pytest.mark.timeout(240)
# GPT-2 through a live swarm is in make test-slow (~50 s on 2 cores), keeping make test inside its time budget:
# the unit tests take its stages' loss to transformers' own and export it from checkpoints
@pytest.mark.parametrize("make", [llama, pytest.param(gpt2, marks=pytest.mark.slow)])
def test_a_transformers_model_trains_on_a_swarm_and_exports(tmp_path: Path, make) -> None:
    model, checkpoints, run_dir = tmp_path / "model", tmp_path / "checkpoints", tmp_path / "run"
    torch.manual_seed(0)
    make(model)
    cfg = small_config(run_dir, f'model.spec="{HF_SPEC}"', f'model.hf_config="{model}"', f'model.hf_weights="{model}"',
                       "local.layout=[2,1]", "local.trainers=1", "trainer.target_steps=6",
                       f'server.checkpoint_dir="{checkpoints}"')
    swarm = LocalSwarm(cfg)
    try:
        swarm.start()
        swarm.wait_until_done(progress=False)
        assert_states_equal(cfg, swarm)
        peers = ["--initial-peers", *swarm.initial_peers]
        assert main(["export", "--config", str(run_dir / "config.toml"), *peers, "--out", str(tmp_path / "live")]) == 0
    finally:
        swarm.stop()
    assert not tracebacks(run_dir)
    summary = write_report(run_dir)
    assert summary["final_loss"] < summary["first_loss"] - 0.3, summary
    assert_exactly_once(summary)
    assert_replicas_in_step(summary, run_dir)

    # every server checkpointed its stage as it left: the same weights the live swarm served last
    config = ["--config", str(run_dir / "config.toml")]
    assert main(["export", *config, str(checkpoints), "--out", str(tmp_path / "saved")]) == 0
    live, saved = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("live", "saved"))
    assert live.keys() == saved.keys() and all(torch.equal(live[k], saved[k]) for k in live)

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert exported.config.tie_word_embeddings is False  # tied or not, the two copies trained apart
    stages, states = build_stages(cfg.model), from_checkpoints([checkpoints], cfg.model.num_stages)
    for k, stage in enumerate(stages):
        stage.load_state_dict(states[k].params)
    ids = torch.randint(0, 256, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = exported(input_ids=ids).logits
        ours = stages[1].logits(stages[1].layers(stages[0].layers(ids)))
        generated = exported.generate(ids[:, :8], max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert (theirs - ours).abs().max() < 1e-5
    assert generated.shape == (2, 14) and bool((generated < 257).all())
