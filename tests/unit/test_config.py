"""Configuration: defaults, TOML files, overrides, validation messages, model hashing."""

from __future__ import annotations

import dataclasses

import pytest

from swarm.config import (
    ConfigError,
    ModelConfig,
    OptimConfig,
    SwarmConfig,
    agreed,
    config_hash,
    describe_mismatch,
    load_config,
    replace,
    to_toml,
)
from swarm.config.recipes import ASYNC_EXPERIMENT, TRAINING_MODES
from swarm.wire import PROTOCOL_VERSION

OVERRIDES = (
    "model.d_model=256",
    'net.initial_peers=["/ip4/1.2.3.4/tcp/5/p2p/Qm"]',
    "optim.betas=[0.8, 0.9]",
)


def test_defaults_validate():
    cfg = load_config()
    assert cfg == SwarmConfig()
    assert cfg.server.stage < cfg.model.num_stages


def test_file_and_overrides_load_with_right_types(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('run_dir = "runs/x"\n\n[model]\nn_layers = 8\nnum_stages = 4\n\n[optim]\nlr = 1\n')
    cfg = load_config(path, OVERRIDES)
    assert cfg.run_dir == "runs/x"
    assert cfg.model.n_layers == 8 and cfg.model.num_stages == 4
    assert cfg.model.d_model == 256 and type(cfg.model.d_model) is int
    assert cfg.net.initial_peers == ("/ip4/1.2.3.4/tcp/5/p2p/Qm",)
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float


def test_overrides_win_over_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\nd_model = 64\n")
    assert load_config(path, ["model.d_model=32"]).model.d_model == 32


def test_to_toml_round_trips(tmp_path):
    cfg = load_config(None, [*OVERRIDES, "data.path=corpus.txt", "optim.lr=1e-5", "server.device=cuda:1"])
    path = tmp_path / "out.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg
    default_path = tmp_path / "default.toml"
    default_path.write_text(to_toml(SwarmConfig()))
    assert load_config(default_path) == SwarmConfig()


def test_to_toml_round_trips_awkward_strings(tmp_path):
    awkward = 'a "quoted"\\path\nwith\ttabs, \x7f and \u00e9'
    cfg = replace(SwarmConfig(), run_dir=awkward, data={"path": awkward})
    path = tmp_path / "out.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["model.d_model=130", "model.n_heads=4"], "model.d_model"),
        (["optim.lr=-0.1"], "optim.lr"),
        (["model.colour=3"], "colour"),
        (["colour=3"], "colour"),
        (['model.d_model="abc"'], "model.d_model"),
        (["model.d_model=abc"], "model.d_model"),
        (["optim.betas=[0.9]"], "optim.betas"),
        (["server.stage=3", "model.num_stages=3"], "server.stage"),
        (["model=3"], "model"),
        (["model.d_model"], "model.d_model"),
        (['trainer.routing="nearest"'], "trainer.routing"),
        (["trainer.progress_every=0"], "trainer.progress_every"),
        (["server.merge_samples=-1"], "server.merge_samples"),
        (['server.device="tpu"'], "server.device"),
        (['server.autocast="fp8"'], "server.autocast: must be auto, none, bf16 or fp16"),
        (["server.fp16_loss_scale=1000"], "server.fp16_loss_scale: must be a power of two"),
        (["server.fp16_growth_interval=0"], "server.fp16_growth_interval"),
        (["server.slowdown=0.5"], "server.slowdown"),
        (["rebalance.min_gain=0.9"], "rebalance.min_gain"),
        (["local.link_mbit=200"], "local.link_mbit"),
        (['optim.optimizer="sgd"'], "optim.optimizer"),
        (["optim.nag_momentum=1.0"], "optim.nag_momentum"),
        (['optim.mode="eventual"'], "optim.mode"),
        (["server.reply_delay=-0.5"], "server.reply_delay"),
        (["local.reply_delays=[0.5, -1]"], "local.reply_delays"),
        (["net.emulated_rtt_ms=-1"], "net.emulated_rtt_ms"),
        (["model.bottleneck=128"], "model.bottleneck"),
        (['wire.activations="zip"'], "wire.activations"),
        (["wire.block=0"], "wire.block"),
        (["rebalance.period=0"], "rebalance.period"),
        (["local.layout=[4,1]", "model.num_stages=3"], "local.layout"),
        (["local.layout=[2,-1]", "model.num_stages=2"], "local.layout"),
        (["trainer.eval_every=10"], "trainer.eval_every: needs held-out samples to evaluate on"),
        (["trainer.eval_every=-1", "data.validation_samples=8"], "trainer.eval_every"),
        (["data.validation_samples=-1"], "data.validation_samples"),
        (['data.text_field=""'], "data.text_field"),
        (['data.tokenizer=""'], "data.tokenizer"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, overrides)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def test_training_modes_change_nothing_else_in_the_resolved_config():
    """The asynchrony experiment's runs, sync against async against async with NAG, differ in the
    training mode alone, with whatever settings a run adds (here those of the delay runs)."""
    extra = ["local.reply_delays=[1.0, 0, 1.0, 0, 1.0, 0, 1.0, 0]", "optim.warmup_steps=5"]
    resolved = {mode: _flatten(load_config(base=[ASYNC_EXPERIMENT, recipe], overrides=extra).to_dict())
                for mode, recipe in TRAINING_MODES.items()}
    sync = resolved.pop("sync")
    for mode, cfg in resolved.items():
        differing = {key for key in sync if sync[key] != cfg[key]}
        assert differing and differing <= {"optim.mode", "optim.optimizer"}, (mode, differing)
    assert resolved["async"]["optim.mode"] == resolved["async-nag"]["optim.mode"] == "async"
    assert (sync["optim.optimizer"], resolved["async"]["optim.optimizer"]) == ("adamw", "adamw")
    assert resolved["async-nag"]["optim.optimizer"] == "nag"
    assert sync["optim.warmup_steps"] == 5 and sync["local.reply_delays"] == (1.0, 0, 1.0, 0, 1.0, 0, 1.0, 0)


def test_nag_step_size_defaults_to_adamw_s_per_coordinate_step():
    """Normalized NAG sums about 1 / (1 - momentum) steps once its velocity has built up, so by default
    it steps lr * (1 - momentum); the raw-gradient form takes lr as it is; an explicit nag_lr wins."""
    def base_lr(*overrides: str) -> float:
        return load_config(None, ["optim.lr=1e-3", *overrides]).optim.base_lr

    assert base_lr() == 1e-3  # AdamW
    assert base_lr('optim.optimizer="nag"') == pytest.approx(1e-3 * (1 - 0.99))
    assert base_lr('optim.optimizer="nag"', "optim.nag_momentum=0.9") == pytest.approx(1e-4)
    assert base_lr('optim.optimizer="nag"', "optim.nag_normalize=false") == 1e-3
    assert base_lr('optim.optimizer="nag"', "optim.nag_lr=3e-5") == 3e-5
    assert base_lr("optim.nag_lr=3e-5") == 1e-3  # nag_lr is NAG's only


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="nope.toml"):
        load_config(missing)


def test_malformed_file_names_the_path(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[model\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(path)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_replace_revalidates():
    cfg = replace(SwarmConfig(), model={"d_model": 64})
    assert cfg.model.d_model == 64
    with pytest.raises(ConfigError, match="model.d_model"):
        replace(cfg, model={"d_model": 65})


def test_config_hash_stable_and_sensitive_to_every_agreed_field():
    """Every model and optim field, and the protocol version, changes the hash; settings that may differ
    between peers (codecs, devices, the peer's own address) do not."""
    base = SwarmConfig()
    assert config_hash(base) == config_hash(SwarmConfig())
    assert config_hash(base) == config_hash(load_config())
    changed_model = {
        "spec": "other.module:build",
        "vocab_size": 300,
        "d_model": 256,
        "n_heads": 8,
        "d_ff": 1024,
        "n_layers": 12,
        "seq_len": 64,
        "num_stages": 2,
        "share_weights": True,
        "bottleneck": 32,
        "dropout": 0.1,
        "init_seed": 7,
    }
    # a Hugging Face model's hf_* settings are compared through its transformers config (tests/unit/test_hf.py)
    assert set(changed_model) == {f.name for f in dataclasses.fields(ModelConfig) if not f.name.startswith("hf_")}
    for name, value in changed_model.items():
        assert config_hash(replace(base, model={name: value})) != config_hash(base), name
    changed_optim = {
        "mode": "async", "optimizer": "nag", "nag_momentum": 0.9, "nag_normalize": False, "lr": 1e-3,
        "nag_lr": 1e-4, "betas": (0.8, 0.9), "weight_decay": 0.1, "warmup_steps": 9, "clip_grad_norm": 2.0,
        "target_batch_size": 64,
    }
    assert set(changed_optim) == {f.name for f in dataclasses.fields(OptimConfig)}
    for name, value in changed_optim.items():
        assert config_hash(replace(base, optim={name: value})) != config_hash(base), name
    for section, values in (("wire", {"activations": "fp16"}), ("server", {"device": "cuda"}),
                            ("net", {"port": 31337, "host": "127.0.0.1"}), ("trainer", {"max_inflight": 9})):
        assert config_hash(replace(base, **{section: values})) == config_hash(base), section
    assert agreed(base)["protocol"] == PROTOCOL_VERSION


def test_describe_mismatch_lists_differing_fields():
    mine = agreed(SwarmConfig())
    theirs = agreed(replace(SwarmConfig(), model={"d_model": 256, "n_layers": 8}, optim={"lr": 0.01}))
    message = describe_mismatch(mine, theirs)
    assert "model.d_model: 128 here, 256 there" in message
    assert "model.n_layers: 6 here, 8 there" in message
    assert "optim.lr: 0.003 here, 0.01 there" in message
    assert "n_heads" not in message
    assert describe_mismatch(mine, {**mine, "protocol": 1}) == f"protocol: {PROTOCOL_VERSION} here, 1 there"
    assert describe_mismatch(mine, mine) == "no field differs"


@pytest.mark.parametrize(("flag", "auto", "stage"), [("auto", True, 0), ("2", False, 2)])
def test_server_stage_flag_takes_a_number_or_auto(flag: str, auto: bool, stage: int) -> None:
    from swarm.cli.main import _config, _parser

    cfg = _config(_parser().parse_args(["server", "--stage", flag, "--set", "model.num_stages=3"]))
    assert (cfg.server.auto_stage, cfg.server.stage) == (auto, stage)


def test_server_train_flag_runs_a_trainer_in_the_servers_process() -> None:
    from swarm.cli.main import _config, _parser

    cfg = _config(_parser().parse_args(["server", "--stage", "0", "--train", "--index", "3"]))
    assert cfg.server.train and cfg.trainer.index == 3
    assert not _config(_parser().parse_args(["server", "--stage", "0"])).server.train


def test_trainers_inside_servers_cannot_also_wait_for_the_servers() -> None:
    with pytest.raises(ConfigError, match="local.trainers_wait"):
        load_config(overrides=["local.trainers_in_servers=true", "local.trainers_wait=true"])
