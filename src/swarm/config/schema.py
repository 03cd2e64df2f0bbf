"""Typed configuration for every role of a swarm.

Every value a peer needs lives in one frozen dataclass tree so that a run is fully described by one
file plus a few CLI overrides, and so that peers can compare the part that must agree (`agreed`: the
model, the optimizer, the protocol) by hash. Each section validates itself on construction: a bad value
fails at start with the field named.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Any

from swarm.config.checks import ConfigError, ConfigMismatch, require
from swarm.config.hf import HF_SPEC, check_hf, settings_from_dir
from swarm.config.roles import BackupConfig, LocalSwarmConfig, RebalanceConfig, ServerConfig, TrainerConfig
from swarm.wire.codecs import CODECS, DEFAULT_BLOCK, MAX_BLOCK, Policy

__all__ = [
    "BackupConfig", "ConfigError", "ConfigMismatch", "DataConfig", "LocalSwarmConfig", "ModelConfig", "NetConfig",
    "OptimConfig", "RebalanceConfig", "ServerConfig", "SwarmConfig", "TrainerConfig", "WireConfig",
]


# /ip4/ADDR/tcp/PORT, /ip6/..., /dns/NAME/tcp/PORT; the port captured
_MADDR = re.compile(r"/(?:ip4|ip6|dns|dns4|dns6)/[^/]+/tcp/(\d+)(?:/.*)?")
MAX_RECORD_TTL = 240.0  # seconds: with backup periods of up to 120 s, every signed record lives under 600 s


@dataclass(frozen=True)
class ModelConfig:
    """The network being trained. Every peer of a run must agree on it (checked by `config_hash`)."""

    spec: str = "swarm.model.gpt:build_stages"  # module:function returning the list of stage modules
    vocab_size: int = 257  # 256 byte values + one padding id
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 512
    n_layers: int = 6
    seq_len: int = 128  # tokens per sample
    num_stages: int = 3
    share_weights: bool = False  # ALBERT-style: all layers of a stage reuse one block's weights
    # width of the hidden state between stages: a learned down-projection ends every stage but the
    # last and an up-projection begins the next one, so fewer values cross the network (0: d_model, none)
    bottleneck: int = 0
    dropout: float = 0.0
    init_seed: int = 0  # every replica of a stage builds identical initial weights from it
    # Hugging Face transformers models (spec "swarm.model.hf:build_stages"; see swarm.config.hf and
    # swarm.model.hf). hf_config: a directory holding config.json, read into the fields below and into
    # vocab_size, d_model, n_heads, d_ff and n_layers when the config is loaded
    hf_config: str = ""
    # pretrained weights: a directory as from_pretrained reads it (model.safetensors, or shards listed in
    # model.safetensors.index.json); each server reads its own stage's tensors only. Empty: random weights
    hf_weights: str = ""
    hf_family: str = ""  # llama or gpt2
    hf_kv_heads: int = 0  # key/value heads (grouped-query attention; llama); 0: n_heads
    hf_max_positions: int = 0  # positions the model has (GPT-2's table, llama's rotary range); 0: seq_len
    hf_rope_theta: float = 10000.0  # rotary embedding base (llama)
    hf_norm_eps: float = 1e-5  # epsilon of the RMSNorm (llama) or LayerNorm (gpt2)
    hf_activation: str = ""  # the MLP's activation, by transformers' name; empty: the family's (silu, gelu_new)
    # the lm_head starts as the token embedding (tie_word_embeddings); the two then train as separate copies
    # when they are on different stages (see swarm.model.hf)
    hf_tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hf_config:
            self._read_hf_config()
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "seq_len", "num_stages"):
            require(getattr(self, name) > 0, f"model.{name}", f"must be positive, got {getattr(self, name)}")
        require(":" in self.spec, "model.spec", f"must look like 'package.module:function', got {self.spec!r}")
        require(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            f"must be divisible by model.n_heads ({self.d_model} % {self.n_heads} != 0)",
        )
        require(
            self.num_stages <= self.n_layers,
            "model.num_stages",
            f"cannot exceed model.n_layers ({self.num_stages} > {self.n_layers})",
        )
        require(0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}")
        require(0 <= self.bottleneck < self.d_model, "model.bottleneck",
                 f"must be in [0, model.d_model={self.d_model}), got {self.bottleneck}")
        require(not self.hf_weights or self.hf_family, "model.hf_weights",
                "pretrained weights need a Hugging Face model (model.hf_config or model.hf_family)")
        if self.hf_family or self.spec == HF_SPEC:
            check_hf(self)

    def _read_hf_config(self) -> None:
        """Fill the fields config.json sets; one given explicitly too (not at its default) must agree."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, read in settings_from_dir(self.hf_config).items():
            value, given = type(defaults[name])(read), getattr(self, name)
            if given != defaults[name] and given != value:
                raise ConfigError(f"model.{name}: {given!r} given, but {self.hf_config}/config.json says {value!r}; "
                                  f"leave model.{name} out when model.hf_config is set")
            object.__setattr__(self, name, value)  # frozen: the dataclass is being built


@dataclass(frozen=True)
class DataConfig:
    """Where training text comes from and how it becomes tokens (see swarm.data). `path=None` uses the
    Python standard library's sources; `tokenizer=None` trains on bytes (ids 0-255, padding 256)."""

    # a text file, a .jsonl, .parquet or .arrow file, a dataset saved with `datasets`' save_to_disk, or a
    # directory of text, .jsonl, .parquet and .arrow files
    path: str | None = None
    text_field: str = "text"  # the field (column) holding the text in .jsonl, .parquet, .arrow and datasets
    split: str = "train"  # the split taken from a DatasetDict saved to disk
    # a local directory holding a Hugging Face tokenizer (tokenizer.json / tokenizer_config.json, as
    # `save_pretrained` writes it); never fetched from the hub
    tokenizer: str | None = None
    # where tokenized samples are cached, keyed by a digest of the text, the tokenizer and model.seq_len
    # (empty: $XDG_CACHE_HOME/swarm/tokens, else ~/.cache/swarm/tokens)
    cache_dir: str = ""
    seed: int = 0
    max_bytes: int = 32_000_000  # cap on the text read (before tokenizing)
    # samples held out of training, the same on every trainer, for the validation loss (trainer.eval_every)
    validation_samples: int = 0
    # trainers lease blocks of this many consecutive samples of a pass's order (see swarm.core.dataplan)
    block_samples: int = 1024
    # seconds a trainer's hold on its block lasts unless renewed: a trainer that died leaves its block to
    # the next one this long after its last renewal
    lease_seconds: float = 20.0

    def __post_init__(self) -> None:
        for name in ("max_bytes", "block_samples"):
            require(getattr(self, name) > 0, f"data.{name}", f"must be positive, got {getattr(self, name)}")
        require(self.lease_seconds >= 1.0, "data.lease_seconds", f"must be >= 1, got {self.lease_seconds}")
        require(self.validation_samples >= 0, "data.validation_samples", f"must be >= 0, got {self.validation_samples}")
        require(bool(self.text_field), "data.text_field", "must name the field holding the text")
        require(bool(self.split), "data.split", "must name a split (e.g. train)")
        require(self.tokenizer is None or bool(self.tokenizer), "data.tokenizer",
                "must be a directory, or left out for bytes")


@dataclass(frozen=True)
class OptimConfig:
    """How a stage's replicas learn together.

    `mode = "sync"`: every replica of a stage takes the same step on the stage's averaged gradient,
    once the stage has accumulated `target_batch_size` samples. `mode = "async"` (Zuo et al., 2025):
    every replica applies its optimizer to each microbatch's gradient at once (local updates), and the
    replicas average their weights every `target_batch_size` samples of the stage, in the background,
    while they go on serving (see swarm.server.runtime). In both modes an epoch is one such stage-wide
    round, and the learning-rate warm-up counts epochs, so both see the same schedule per sample.
    """

    mode: str = "sync"
    # adamw, or nag: Nesterov accelerated gradient as a weight correction (the parameters served hold
    # the look-ahead point w + momentum * (w - w_prev); see swarm.server.nag)
    optimizer: str = "adamw"
    nag_momentum: float = 0.99
    # NAG on RMS-normalized gradients: each coordinate divided by the root of its running mean square
    # (beta = betas[1]), so NAG steps on AdamW's per-coordinate scale (see swarm.server.nag); false: the
    # paper's formula on the raw gradient, whose steps are on the gradients' scale
    nag_normalize: bool = True
    lr: float = 3e-3
    # NAG's step size; 0 means lr * (1 - nag_momentum) when normalized (the per-coordinate step AdamW
    # takes at `lr`, once the velocity sums its 1 / (1 - momentum) steps), `lr` on raw gradients
    nag_lr: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.01
    warmup_steps: int = 5  # linear warm-up, in optimizer steps
    clip_grad_norm: float = 1.0  # 0 disables clipping
    target_batch_size: int = 32  # samples of the whole stage per step (sync) or between averages (async)

    @property
    def base_lr(self) -> float:
        """The learning rate after warm-up, for the configured optimizer."""
        if self.optimizer != "nag":
            return self.lr
        if self.nag_lr:
            return self.nag_lr
        return self.lr * (1 - self.nag_momentum) if self.nag_normalize else self.lr

    def __post_init__(self) -> None:
        require(self.mode in ("sync", "async"), "optim.mode", f"sync or async, got {self.mode!r}")
        require(self.optimizer in ("adamw", "nag"), "optim.optimizer", f"adamw or nag, got {self.optimizer!r}")
        require(0 <= self.nag_momentum < 1, "optim.nag_momentum", f"must be in [0, 1), got {self.nag_momentum}")
        require(self.lr > 0, "optim.lr", f"must be positive, got {self.lr}")
        require(self.nag_lr >= 0, "optim.nag_lr", f"must be >= 0 (0: the default), got {self.nag_lr}")
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", "need two in [0, 1)")
        require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        require(self.clip_grad_norm >= 0, "optim.clip_grad_norm", "must be >= 0")
        require(self.target_batch_size > 0, "optim.target_batch_size", "must be positive")


@dataclass(frozen=True)
class NetConfig:
    """How a peer reaches the swarm."""

    run_id: str = "swarm"  # namespaces every DHT key, so several runs can share one DHT
    initial_peers: tuple[str, ...] = ()  # multiaddrs printed by `swarm dht` or by any server
    # seconds a starting peer keeps trying to reach its initial peers (a link just up, a bootstrap restarting)
    # before it gives up and says so
    join_timeout: float = 30.0
    # the address this peer listens on: all interfaces by default, so peers on other hosts can connect;
    # 127.0.0.1 keeps a peer reachable from its own host only
    host: str = "0.0.0.0"
    port: int = 0  # TCP port to listen on; 0 picks a free one (give `swarm dht` a fixed one)
    # multiaddrs to announce instead of the listening ones, e.g. "/ip4/PUBLIC_IP/tcp/PORT" for a host behind a
    # port forward; each with an explicit port
    announce_addrs: tuple[str, ...] = ()
    # a private key file that keeps this peer's id across restarts (created on first use), so that the
    # --initial-peers others were given stay valid; empty: a new id every start
    identity_path: str = ""
    # a file holding a secret every member of a private swarm shares (at least 16 bytes, e.g. from
    # `head -c 32 /dev/urandom`): DHT values are sealed with it and calls without proof of it are refused.
    # Empty: an open swarm. See swarm.net.secret and SECURITY.md.
    secret_path: str = ""
    use_relay: bool = True  # libp2p circuit relays: reach peers behind NATs through them (hivemind's default)
    use_auto_relay: bool = False  # look for relays to be reachable through from behind a NAT (DHT traffic only)
    # seconds this peer's wall clock may differ from the swarm's before it refuses to join: DHT records
    # expire on their writer's clock (see swarm.core.joining)
    max_clock_offset: float = 2.0
    announce_period: float = 1.0  # seconds between DHT announcements
    record_ttl: float = 6.0  # seconds an announcement lives unless renewed
    max_payload_mb: float = 64.0  # requests larger than this are refused
    # seconds a stage all-reduce waits for its parts before it is retried; longer (up to 4x) where this
    # replica's rounds have been taking longer, where only owners' answers are missing, or, before any
    # round completed, while the late members' records show them live; shorter where a member it waits
    # on is seen gone from those records (see swarm.averaging.patience)
    allreduce_timeout: float = 15.0
    # a JSON file of message delay/loss rules for this peer's stage calls (fault injection; see
    # swarm.net.faultfile); empty for none
    fault_file: str = ""
    # a round trip added to every stage call (half before the request, half before the server handles
    # it): latency for test networks on kernels without netem. DHT traffic is not delayed.
    emulated_rtt_ms: float = 0.0
    # this peer's own network stack (its DHT process and p2pd daemon) is probed every health_every seconds;
    # after health_misses failed probes in a row the peer exits with an error instead of waiting forever
    health_every: float = 2.0
    health_misses: int = 3
    # a server or trainer serves Prometheus metrics over HTTP at http://net.host:metrics_port/metrics (0: off;
    # needs prometheus_client, the `monitor` extra); one port per peer, so peers sharing a host need their own
    metrics_port: int = 0

    def __post_init__(self) -> None:
        require(bool(self.run_id) and "." not in self.run_id, "net.run_id", "must be non-empty without '.'")
        require(self.join_timeout >= 0, "net.join_timeout", f"must be >= 0, got {self.join_timeout}")
        require(self.announce_period > 0, "net.announce_period", "must be positive")
        require(
            self.record_ttl > self.announce_period,
            "net.record_ttl",
            f"must exceed net.announce_period ({self.record_ttl} <= {self.announce_period})",
        )
        require(self.record_ttl <= MAX_RECORD_TTL, "net.record_ttl",
                f"must be at most {MAX_RECORD_TTL:.0f} s: announcements are signed records, which every DHT node "
                f"keeps for 600 s at most (got {self.record_ttl})")
        require(self.max_payload_mb > 0, "net.max_payload_mb", "must be positive")
        require(0 <= self.port < 65536, "net.port", f"must be a port number, got {self.port}")
        require(0 <= self.metrics_port < 65536, "net.metrics_port",
                f"must be a port number (0: off), got {self.metrics_port}")
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ConfigError(f"net.host: must be an IP address to listen on (0.0.0.0: all), got {self.host!r}") \
                from None
        for addr in self.announce_addrs:
            port = _MADDR.fullmatch(addr)
            require(port is not None and 0 < int(port.group(1)) < 65536, "net.announce_addrs",
                     f"need multiaddrs like /ip4/203.0.113.7/tcp/31337 with an explicit port, got {addr!r}")
        require(
            0 < self.max_clock_offset < self.record_ttl - self.announce_period,
            "net.max_clock_offset",
            f"must be in (0, net.record_ttl - net.announce_period = {self.record_ttl - self.announce_period}): "
            f"a record from a clock further behind expires before its renewal, got {self.max_clock_offset}",
        )
        require(self.health_every > 0, "net.health_every", f"must be positive, got {self.health_every}")
        require(self.health_misses > 0, "net.health_misses", f"must be positive, got {self.health_misses}")
        require(self.emulated_rtt_ms >= 0, "net.emulated_rtt_ms", f"must be >= 0, got {self.emulated_rtt_ms}")


@dataclass(frozen=True)
class WireConfig:
    """How tensors travel, by role: a codec each (see swarm.wire.codecs). Peers need not agree: every
    tensor says how it was packed. The state a joining server downloads always travels exact."""

    activations: str = "blockwise8"  # stage inputs and outputs, both directions
    gradients: str = "blockwise8"  # gradients of stage outputs and inputs (backward)
    allreduce: str = "blockwise8"  # a stage's gradient parts and their averages
    block: int = DEFAULT_BLOCK  # values per fp32 scale for blockwise8

    def __post_init__(self) -> None:
        for role in ("activations", "gradients", "allreduce"):
            codec = getattr(self, role)
            require(codec in CODECS, f"wire.{role}", f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
        require(0 < self.block <= MAX_BLOCK, "wire.block", f"must lie in [1, {MAX_BLOCK}], got {self.block}")

    def policy(self) -> Policy:
        return Policy({"activations": self.activations, "gradients": self.gradients,
                       "allreduce": self.allreduce}, self.block)


@dataclass(frozen=True)
class SwarmConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    net: NetConfig = field(default_factory=NetConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    backup: BackupConfig = field(default_factory=BackupConfig)
    local: LocalSwarmConfig = field(default_factory=LocalSwarmConfig)
    run_dir: str = "runs/demo"

    def __post_init__(self) -> None:
        require(
            not self.local.layout or len(self.local.layout) == self.model.num_stages,
            "local.layout",
            f"needs one count per stage ({len(self.local.layout)} given, model.num_stages={self.model.num_stages})",
        )
        require(
            self.server.stage < self.model.num_stages,
            "server.stage",
            f"must be below model.num_stages ({self.server.stage} >= {self.model.num_stages})",
        )
        require(
            not self.trainer.eval_every or self.data.validation_samples > 0,
            "trainer.eval_every",
            "needs held-out samples to evaluate on: set data.validation_samples",
        )
        require(
            self.optim.target_batch_size >= self.trainer.microbatch_size,
            "optim.target_batch_size",
            "must be at least trainer.microbatch_size",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
