"""Hugging Face models as stages (swarm.model.hf): transformers' own math, cut into stages; weights read stage
by stage; the model config read from config.json and compared between peers; export back to transformers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from swarm.config import (
    ConfigError,
    ModelConfig,
    SwarmConfig,
    config_hash,
    describe_mismatch,
    model_fingerprint,
    replace,
)
from swarm.config.hf import HF_SPEC
from swarm.config.loader import load_config
from swarm.model import ComposedModel, build_stage, load_stages
from swarm.model.hf import build_stages
from swarm.ops.export import ExportError, StageState, export_model, write_hf, write_plain
from swarm.server.checkpoints import CheckpointStore
from swarm.server.state_io import StateLayout

SEQ = 16


def tiny_llama(directory: Path, **settings: object) -> LlamaForCausalLM:
    """Grouped-query attention (2 key/value heads for 4), untied, a rope base other than the default."""
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=5,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e5}, tie_word_embeddings=False,
                         **settings)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return model


def tiny_gpt2(directory: Path) -> GPT2LMHeadModel:
    """GPT-2 as transformers builds it: learned positions, tied embeddings, dropout 0.1 in its config."""
    torch.manual_seed(2)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    model.save_pretrained(directory)
    return model


def hf_cfg(directory: Path, num_stages: int = 2, weights: bool = True, **fields: object) -> ModelConfig:
    return ModelConfig(**{"spec": HF_SPEC, "hf_config": str(directory), "hf_weights": str(directory) if weights else "",
                          "seq_len": SEQ, "num_stages": num_stages, **fields})


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample rows cut as the data layer cuts them (inputs r[:-1], targets r[1:]), some targets padding (-100)."""
    rows = torch.randint(0, 257, (3, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    inputs, targets = rows[:, :-1], rows[:, 1:].clone()
    targets[0, -5:] = -100
    return inputs, targets


@pytest.mark.parametrize(("make", "num_stages"), [(tiny_llama, 2), (tiny_llama, 3), (tiny_gpt2, 2)])
def test_loss_at_step_zero_is_transformers_own(tmp_path: Path, make, num_stages: int) -> None:
    """The stages chained at pretrained weights give the loss transformers' own model gives on the same batch
    (its labels are shifted inside: labels = inputs, and the targets' last position ignored to match)."""
    make(tmp_path)
    stages = build_stages(hf_cfg(tmp_path, num_stages))
    inputs, targets = batch()
    targets[:, -1] = -100  # transformers predicts no token after the last input
    labels = torch.cat([inputs[:, :1], targets[:, :-1]], dim=1)  # it predicts labels[i + 1] at position i
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ours = ComposedModel(stages).eval()(inputs, targets)
        theirs = reference(input_ids=inputs, labels=labels).loss
    assert abs(float(ours) - float(theirs)) < 1e-5, (float(ours), float(theirs))


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
def test_no_position_sees_a_later_token(tmp_path: Path, make) -> None:
    """Changing the last tokens changes no earlier position's hidden state, at any stage."""
    make(tmp_path)
    first, second, _ = build_stages(hf_cfg(tmp_path, 3))
    inputs, _ = batch()
    changed = inputs.clone()
    changed[:, -3:] = (changed[:, -3:] + 1) % 257
    with torch.no_grad():
        a, b = second(first(inputs)), second(first(changed))
    assert torch.equal(a[:, :-3], b[:, :-3])
    assert not torch.allclose(a[:, -3:], b[:, -3:])


def test_stages_declare_their_boundaries(tmp_path: Path) -> None:
    tiny_llama(tmp_path)
    first, last = build_stages(hf_cfg(tmp_path))
    assert first.boundary() == ((torch.int64, (SEQ,)), (torch.float32, (SEQ, 32)))
    assert last.boundary() == ((torch.float32, (SEQ, 32)), None)
    # transformers' names, each layer under its index in the whole model: layers split 3 + 2
    assert {n.split(".")[2] for n in last.state_dict() if n.startswith("model.layers.")} == {"3", "4"}
    assert {"model.norm.weight", "lm_head.weight"} <= set(last.state_dict())
    assert "model.embed_tokens.weight" in first.state_dict()


def test_random_weights_are_the_same_on_every_peer_and_a_tied_head_starts_as_the_embedding() -> None:
    cfg = ModelConfig(spec=HF_SPEC, hf_family="gpt2", vocab_size=257, d_model=32, d_ff=64, n_heads=4, n_layers=3,
                      seq_len=SEQ, num_stages=2, hf_tie_embeddings=True)
    torch.manual_seed(5)
    alone = build_stage(cfg, 1)
    torch.manual_seed(6)
    first, last = build_stages(cfg)
    assert all(torch.equal(a, b) for a, b in zip(alone.state_dict().values(), last.state_dict().values(), strict=True))
    assert torch.equal(last.lm_head.weight, first.transformer.wte.weight)
    assert last.lm_head.weight is not first.transformer.wte.weight  # two copies, on two stages
    (single,) = build_stages(replace(SwarmConfig(model=cfg), model={"num_stages": 1}).model)
    assert single.lm_head.weight is single.transformer.wte.weight  # one stage: one parameter


def test_a_stage_reads_only_its_own_tensors(tmp_path: Path) -> None:
    """Weights sharded by stage: a server with only its own stage's shard builds its stage, at the
    pretrained values; the shard of another stage is never opened."""
    model = tiny_llama(tmp_path / "whole")
    cfg = hf_cfg(tmp_path / "whole", num_stages=2)
    shards = tmp_path / "sharded"
    shards.mkdir()
    (shards / "config.json").write_text((tmp_path / "whole" / "config.json").read_text())
    weight_map = {}
    for k, stage in enumerate(build_stages(replace(SwarmConfig(model=cfg), model={"hf_weights": ""}).model)):
        names = list(stage.state_dict())
        save_file({n: model.state_dict()[n].contiguous() for n in names}, str(shards / f"stage{k}.safetensors"))
        weight_map.update(dict.fromkeys(names, f"stage{k}.safetensors"))
    (shards / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (shards / "stage0.safetensors").unlink()  # this machine serves stage 1 only
    sharded = replace(SwarmConfig(model=cfg), model={"hf_config": str(shards), "hf_weights": str(shards)}).model
    stage = build_stage(sharded, 1)
    for name, value in stage.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
    with pytest.raises(ConfigError, match="stage0.safetensors is missing"):
        build_stage(sharded, 0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_stage_layout_built_without_weights_is_the_one_its_replicas_check_states_against(
        tmp_path: Path, family: str) -> None:
    """A backup holder of a stage it does not serve checks a copy against the stage's layout, built without
    reading the pretrained weights: the same names, shapes, dtypes and trainable
    parameters as the stage a replica builds."""
    (tiny_llama if family == "llama" else tiny_gpt2)(tmp_path)
    cfg = hf_cfg(tmp_path, num_stages=3)
    for k in range(3):
        assert StateLayout.of_stage(cfg, k) == StateLayout.of(build_stage(cfg, k))


def test_config_json_fills_the_model_fields(tmp_path: Path) -> None:
    tiny_llama(tmp_path)
    cfg = hf_cfg(tmp_path, weights=False)
    assert (cfg.hf_family, cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.n_layers) == \
        ("llama", 257, 32, 4, 64, 5)
    assert (cfg.hf_kv_heads, cfg.hf_max_positions, cfg.hf_rope_theta, cfg.hf_norm_eps, cfg.hf_tie_embeddings) == \
        (2, 64, 5e5, 1e-6, False)
    same = ModelConfig(spec=HF_SPEC, hf_family="llama", vocab_size=257, d_model=32, n_heads=4, d_ff=64, n_layers=5,
                       hf_kv_heads=2, hf_max_positions=64, hf_rope_theta=5e5, hf_norm_eps=1e-6, seq_len=SEQ,
                       num_stages=2)
    assert model_fingerprint(same) == model_fingerprint(cfg)  # the same model, however configured


@pytest.mark.parametrize(("fields", "message"), [
    ({"d_model": 64}, "model.d_model: 64 given, but .*config.json says 32"),
    ({"num_stages": 6}, "model.num_stages: cannot exceed model.n_layers"),
    ({"seq_len": 65}, "model.seq_len: 65 exceeds the model's 64 positions"),
    ({"spec": "swarm.model.gpt:build_stages"}, "model.spec: must be 'swarm.model.hf:build_stages'"),
    ({"bottleneck": 8}, "model.bottleneck"),
])
def test_bad_settings_are_named(tmp_path: Path, fields: dict, message: str) -> None:
    tiny_llama(tmp_path)
    with pytest.raises(ConfigError, match=message):
        hf_cfg(tmp_path, weights=False, **fields)


def test_bad_directories_and_families_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model.hf_config: .* holds no config.json"):
        hf_cfg(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ConfigError, match="model_type 'mamba'; the adapter builds llama, gpt2"):
        hf_cfg(tmp_path)
    with pytest.raises(ConfigError, match="model.hf_family: unknown family 'bert'"):
        ModelConfig(spec=HF_SPEC, hf_family="bert")
    with pytest.raises(ConfigError, match="model.hf_activation: transformers knows no activation 'swish-ish'"):
        ModelConfig(spec=HF_SPEC, hf_family="llama", hf_activation="swish-ish")
    with pytest.raises(ConfigError, match="model.hf_weights: pretrained weights need a Hugging Face model"):
        ModelConfig(hf_weights=str(tmp_path))
    tiny_llama(tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="holds neither model.safetensors nor model.safetensors.index.json"):
        build_stage(hf_cfg(tmp_path / "model"), 0)


def test_peers_with_other_config_json_are_refused_by_name(tmp_path: Path) -> None:
    """Every setting that changes the math counts, typed field or not; where the files are does not."""
    tiny_llama(tmp_path / "a")
    tiny_llama(tmp_path / "b", attention_bias=True)
    tiny_llama(tmp_path / "c")
    a, b, c = (model_fingerprint(hf_cfg(tmp_path / d)) for d in "abc")
    assert a == c
    assert describe_mismatch({"model": a}, {"model": b}) == "model.hf.attention_bias: False here, True there"
    theta = model_fingerprint(replace(SwarmConfig(model=hf_cfg(tmp_path / "a", weights=False)),
                                      model={"hf_config": "", "hf_rope_theta": 1e4}).model)
    assert "model.hf.rope_parameters.rope_theta: 500000.0 here, 10000.0 there" in describe_mismatch(
        {"model": a}, {"model": theta})
    assert "model.hf_pretrained: True here, False there" in describe_mismatch({"model": a}, {"model": theta})


def test_every_hf_setting_but_the_directories_changes_the_hash(tmp_path: Path) -> None:
    base = SwarmConfig(model=ModelConfig(spec=HF_SPEC, hf_family="llama", d_model=32, n_heads=4, d_ff=64, n_layers=4,
                                         seq_len=SEQ, num_stages=2))
    changed = {"hf_family": "gpt2", "hf_kv_heads": 2, "hf_max_positions": 32, "hf_rope_theta": 5e5,
               "hf_norm_eps": 1e-6, "hf_activation": "gelu", "hf_tie_embeddings": True, "hf_weights": str(tmp_path)}
    assert set(changed) | {"hf_config"} == {f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("hf_")}
    for name, value in changed.items():
        assert config_hash(replace(base, model={name: value})) != config_hash(base), name
    tiny_llama(tmp_path / "a")
    tiny_llama(tmp_path / "b")
    a, b = (SwarmConfig(model=hf_cfg(tmp_path / d)) for d in "ab")
    assert config_hash(a) == config_hash(b)


@pytest.mark.parametrize(("make", "num_stages"), [(tiny_llama, 2), (tiny_gpt2, 2), (tiny_gpt2, 1)])
def test_export_from_checkpoints_loads_in_transformers(tmp_path: Path, make, num_stages: int) -> None:
    """Checkpoints of trained stages become a directory from_pretrained loads, whose logits are the stages'
    own; a tied model trained across stages comes out untied (its two copies trained apart)."""
    make(tmp_path / "model")
    cfg = SwarmConfig(model=hf_cfg(tmp_path / "model", num_stages))
    stages = build_stages(cfg.model)
    with torch.no_grad():  # stand-in for training: the tied copies part ways
        stages[-1].lm_head.weight.mul_(1.5)
    for k, stage in enumerate(stages):
        state = stage.state_dict()
        CheckpointStore(tmp_path / "ckpt" / f"server{k}", k, 2).save(
            {"epoch": 7 + k, "names": list(state)}, list(state.values()))
    report = export_model(cfg, [str(tmp_path / "ckpt")], tmp_path / "out", str(tiny_tokenizer(tmp_path / "tok")))
    assert f"stage {num_stages - 1}: epoch {6 + num_stages} from {tmp_path / 'ckpt'}" in report
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert exported.config.tie_word_embeddings is (cfg.model.hf_tie_embeddings and num_stages == 1)
    inputs, _ = batch()
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=inputs).logits, chained_logits(stages, inputs), atol=1e-5, rtol=0)
    assert AutoTokenizer.from_pretrained(tmp_path / "out").encode("b a") == [1, 0]


def tiny_tokenizer(directory: Path) -> Path:
    tokenizer = Tokenizer(WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(directory)
    return directory


def chained_logits(stages: list, inputs: torch.Tensor) -> torch.Tensor:
    hidden = inputs
    for stage in stages:
        hidden = stage.layers(hidden)
    return stages[-1].logits(hidden)


def test_export_refuses_states_of_another_model(tmp_path: Path) -> None:
    tiny_llama(tmp_path / "model")
    cfg = SwarmConfig(model=hf_cfg(tmp_path / "model"))
    first, last = build_stages(cfg.model)
    states = {0: StageState(1, "here", first.state_dict()), 1: StageState(1, "here", {})}
    with pytest.raises(ValueError, match="do not make up the configured model: lm_head.weight"):
        write_hf(cfg, states, tmp_path / "out")


def test_export_names_what_is_missing(tmp_path: Path) -> None:
    cfg = SwarmConfig()
    with pytest.raises(ExportError, match="give checkpoint or run directories"):
        export_model(cfg, [], tmp_path / "out")
    stage = build_stage(cfg.model, 0)
    CheckpointStore(tmp_path, 0, 1).save({"epoch": 3, "names": list(stage.state_dict())},
                                         list(stage.state_dict().values()))
    with pytest.raises(ExportError, match=f"no checkpoint of stage.s. 1, 2 under {tmp_path}"):
        export_model(cfg, [str(tmp_path)], tmp_path / "out")


def test_the_built_in_gpt_exports_as_its_composed_stages(tmp_path: Path) -> None:
    cfg = SwarmConfig(model=ModelConfig(d_model=32, n_heads=2, d_ff=64, n_layers=2, seq_len=SEQ, num_stages=2))
    stages = load_stages(cfg.model)
    with torch.no_grad():  # stand-in for training: weights other than the initial ones
        for param in ComposedModel(stages).parameters():
            param.mul_(1.1)
    states = {k: StageState(1, "here", s.state_dict()) for k, s in enumerate(stages)}
    write_plain(cfg, states, tmp_path)
    rebuilt = load_config(tmp_path / "swarm.toml")
    assert rebuilt == cfg
    model = ComposedModel(load_stages(rebuilt.model))
    model.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
    inputs, targets = batch()
    targets[targets < 0] = 0
    assert torch.equal(model(inputs, targets), ComposedModel(stages)(inputs, targets))
