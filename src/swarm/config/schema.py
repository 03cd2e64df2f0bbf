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

from swarm.wire.codecs import CODECS, DEFAULT_BLOCK, Policy


class ConfigError(ValueError):
    """A configuration value is missing, malformed or inconsistent; the message names the field."""


class ConfigMismatch(ConfigError):
    """Another peer of the same run uses other settings where all must agree (see `agreed`)."""


# /ip4/ADDR/tcp/PORT, /ip6/..., /dns/NAME/tcp/PORT; the port captured
_MADDR = re.compile(r"/(?:ip4|ip6|dns|dns4|dns6)/[^/]+/tcp/(\d+)(?:/.*)?")


def _require(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {message}")


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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "n_layers", "seq_len", "num_stages"):
            _require(getattr(self, name) > 0, f"model.{name}", f"must be positive, got {getattr(self, name)}")
        _require(":" in self.spec, "model.spec", f"must look like 'package.module:function', got {self.spec!r}")
        _require(
            self.d_model % self.n_heads == 0,
            "model.d_model",
            f"must be divisible by model.n_heads ({self.d_model} % {self.n_heads} != 0)",
        )
        _require(
            self.num_stages <= self.n_layers,
            "model.num_stages",
            f"cannot exceed model.n_layers ({self.num_stages} > {self.n_layers})",
        )
        _require(0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}")
        _require(0 <= self.bottleneck < self.d_model, "model.bottleneck",
                 f"must be in [0, model.d_model={self.d_model}), got {self.bottleneck}")


@dataclass(frozen=True)
class DataConfig:
    """Where training text comes from. `path=None` uses the Python standard library's sources."""

    path: str | None = None  # a text file, a .jsonl file (field `text`), or a directory of them
    seed: int = 0
    max_bytes: int = 32_000_000  # cap on the corpus read into memory

    def __post_init__(self) -> None:
        _require(self.max_bytes > 0, "data.max_bytes", f"must be positive, got {self.max_bytes}")


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
        _require(self.mode in ("sync", "async"), "optim.mode", f"sync or async, got {self.mode!r}")
        _require(self.optimizer in ("adamw", "nag"), "optim.optimizer", f"adamw or nag, got {self.optimizer!r}")
        _require(0 <= self.nag_momentum < 1, "optim.nag_momentum", f"must be in [0, 1), got {self.nag_momentum}")
        _require(self.lr > 0, "optim.lr", f"must be positive, got {self.lr}")
        _require(self.nag_lr >= 0, "optim.nag_lr", f"must be >= 0 (0: the default), got {self.nag_lr}")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", "need two in [0, 1)")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        _require(self.clip_grad_norm >= 0, "optim.clip_grad_norm", "must be >= 0")
        _require(self.target_batch_size > 0, "optim.target_batch_size", "must be positive")


@dataclass(frozen=True)
class NetConfig:
    """How a peer reaches the swarm."""

    run_id: str = "swarm"  # namespaces every DHT key, so several runs can share one DHT
    initial_peers: tuple[str, ...] = ()  # multiaddrs printed by `swarm dht` or by any server
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
    use_relay: bool = True  # libp2p circuit relays: reach peers behind NATs through them (hivemind's default)
    use_auto_relay: bool = False  # look for relays to be reachable through from behind a NAT (DHT traffic only)
    # seconds this peer's wall clock may differ from the swarm's before it refuses to join: DHT records
    # expire on their writer's clock (see swarm.core.joining)
    max_clock_offset: float = 2.0
    announce_period: float = 1.0  # seconds between DHT announcements
    record_ttl: float = 6.0  # seconds an announcement lives unless renewed
    max_payload_mb: float = 64.0  # requests larger than this are refused
    allreduce_timeout: float = 15.0  # seconds a stage all-reduce may take before it is retried
    # a JSON file of message delay/loss rules for this peer's stage calls (fault injection; see
    # swarm.net.faultfile); empty for none
    fault_file: str = ""
    # a round trip added to every stage call (half before the request, half before the server handles
    # it): latency for test networks on kernels without netem. DHT traffic is not delayed.
    emulated_rtt_ms: float = 0.0

    def __post_init__(self) -> None:
        _require(bool(self.run_id) and "." not in self.run_id, "net.run_id", "must be non-empty without '.'")
        _require(self.announce_period > 0, "net.announce_period", "must be positive")
        _require(
            self.record_ttl > self.announce_period,
            "net.record_ttl",
            f"must exceed net.announce_period ({self.record_ttl} <= {self.announce_period})",
        )
        _require(self.max_payload_mb > 0, "net.max_payload_mb", "must be positive")
        _require(0 <= self.port < 65536, "net.port", f"must be a port number, got {self.port}")
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ConfigError(f"net.host: must be an IP address to listen on (0.0.0.0: all), got {self.host!r}") \
                from None
        for addr in self.announce_addrs:
            port = _MADDR.fullmatch(addr)
            _require(port is not None and 0 < int(port.group(1)) < 65536, "net.announce_addrs",
                     f"need multiaddrs like /ip4/203.0.113.7/tcp/31337 with an explicit port, got {addr!r}")
        _require(
            0 < self.max_clock_offset < self.record_ttl - self.announce_period,
            "net.max_clock_offset",
            f"must be in (0, net.record_ttl - net.announce_period = {self.record_ttl - self.announce_period}): "
            f"a record from a clock further behind expires before its renewal, got {self.max_clock_offset}",
        )
        _require(self.emulated_rtt_ms >= 0, "net.emulated_rtt_ms", f"must be >= 0, got {self.emulated_rtt_ms}")


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
            _require(codec in CODECS, f"wire.{role}", f"unknown codec {codec!r}; known: {', '.join(CODECS)}")
        _require(self.block > 0, "wire.block", f"must be positive, got {self.block}")

    def policy(self) -> Policy:
        return Policy({"activations": self.activations, "gradients": self.gradients,
                       "allreduce": self.allreduce}, self.block)


@dataclass(frozen=True)
class ServerConfig:
    """One stage server."""

    stage: int = 0
    # join where the swarm needs a server most (the stage with the least capacity) instead of `stage`
    auto_stage: bool = False
    name: str = ""  # a label for this server in logs and in the DHT (e.g. the machine's name)
    device: str = "cpu"  # cpu, cuda, cuda:N
    autocast: str = "none"  # none, bf16, fp16
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    max_request_samples: int = 64  # larger requests are refused
    # Forward requests that queue up are merged into one batch of up to this many samples (0: never).
    # Merging pays on a GPU; on a CPU it does not, and a merged batch's graph must wait for every
    # member's gradient, so the default is off.
    merge_samples: int = 0
    graph_ttl: float = 120.0  # seconds a kept forward graph waits for its backward
    batch_backward_wait: float = 1.0  # seconds a batched forward's graph waits for all its requests' gradients
    leave_timeout: float = 10.0  # seconds a leaving server spends finishing the work it accepted
    download_timeout: float = 60.0  # seconds a download of the stage's state from a replica may take
    checkpoint_dir: str | None = None  # where the stage is checkpointed, and resumed from on start
    checkpoint_every: int = 10  # optimizer steps between checkpoints
    keep_checkpoints: int = 2  # newest checkpoints kept per stage
    # compute takes this many times its CPU time (the server sleeps the difference): a slower machine,
    # for building swarms of unequal servers on one host (measured with one torch thread per server)
    slowdown: float = 1.0
    # seconds every forward and backward reply waits before it is sent (a slow or distant server). The
    # wait counts in the throughput the server announces, so stochastic wiring sends it less work.
    reply_delay: float = 0.0

    def __post_init__(self) -> None:
        _require(self.stage >= 0, "server.stage", f"must be >= 0, got {self.stage}")
        _require(self.slowdown >= 1.0, "server.slowdown", f"must be >= 1, got {self.slowdown}")
        _require(self.reply_delay >= 0, "server.reply_delay", f"must be >= 0, got {self.reply_delay}")
        _require(
            self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:"),
            "server.device",
            f"must be cpu, cuda or cuda:N, got {self.device!r}",
        )
        _require(self.autocast in ("none", "bf16", "fp16"), "server.autocast", "must be none, bf16 or fp16")
        _require(self.threads >= 0, "server.threads", "must be >= 0")
        _require(self.max_request_samples > 0, "server.max_request_samples", "must be positive")
        _require(self.merge_samples >= 0, "server.merge_samples", "must be >= 0")
        _require(self.batch_backward_wait >= 0, "server.batch_backward_wait", "must be >= 0")
        _require(self.leave_timeout >= 0, "server.leave_timeout", "must be >= 0")
        _require(self.download_timeout > 0, "server.download_timeout", "must be positive")
        _require(self.checkpoint_every > 0, "server.checkpoint_every", "must be positive")
        _require(self.keep_checkpoints > 0, "server.keep_checkpoints", "must be positive")


@dataclass(frozen=True)
class RebalanceConfig:
    """Servers move between stages so that no stage is the pipeline's bottleneck (`swarm.core.rebalance`).

    Every server looks at the swarm's layout (each stage's servers and measured throughputs) every
    `period` seconds. The move the policy names is made only once every server of the swarm has served
    its stage for `cooldown` seconds (long enough to measure its throughput there), and only by the
    server it names, after a random delay of up to `jitter` seconds and a second look.
    """

    enabled: bool = True
    period: float = 5.0
    min_gain: float = 1.2  # a move must raise the bottleneck stage's capacity by this factor
    cooldown: float = 30.0
    jitter: float = 2.0

    def __post_init__(self) -> None:
        _require(self.period > 0, "rebalance.period", "must be positive")
        _require(self.min_gain >= 1.0, "rebalance.min_gain", f"must be >= 1, got {self.min_gain}")
        _require(self.cooldown >= 0, "rebalance.cooldown", "must be >= 0")
        _require(self.jitter >= 0, "rebalance.jitter", "must be >= 0")


@dataclass(frozen=True)
class TrainerConfig:
    """One trainer: feeds microbatches through the swarm."""

    microbatch_size: int = 4
    max_inflight: int = 4  # microbatches in the pipeline at once
    # how a server is picked per stage: "random" (throughput-weighted draws; keeps many trainers from
    # herding onto one server) or "wrr" (smooth weighted round-robin; lower variance for a lone trainer)
    routing: str = "random"
    target_steps: int = 20  # the run ends once every stage has taken this many optimizer steps
    # seconds before a call is abandoned and retried elsewhere; longer than net.allreduce_timeout, since
    # requests queue behind the stage's all-reduce
    request_timeout: float = 60.0
    # calls time out at their measured latency plus four deviations, but never sooner than this
    min_request_timeout: float = 5.0
    # after its last microbatch, how long a trainer waits for the stages to confirm every gradient
    settle_timeout: float = 60.0
    # a stage gradient that only one replica's step holds (no second replica, no checkpoint) is kept for
    # replay until the stage is this many steps further: memory against losing a lone replica's steps
    keep_epochs: int = 4
    ban_seconds: float = 15.0  # a server that failed is not picked again for this long
    max_attempts: int = 20  # per stage call, across servers, before the microbatch is given up
    index: int = 0  # this trainer's data shard
    num_trainers: int = 1
    # seconds between progress lines in the log (a progress bar instead where stderr is a terminal); also
    # the window of the samples/s a trainer announces
    progress_every: float = 5.0

    def __post_init__(self) -> None:
        for name in ("microbatch_size", "max_inflight", "target_steps", "max_attempts", "num_trainers", "keep_epochs"):
            _require(getattr(self, name) > 0, f"trainer.{name}", f"must be positive, got {getattr(self, name)}")
        for name in ("request_timeout", "min_request_timeout", "settle_timeout", "progress_every"):
            _require(getattr(self, name) > 0, f"trainer.{name}", "must be positive")
        _require(self.routing in ("random", "wrr"), "trainer.routing", f"must be random or wrr, got {self.routing!r}")
        _require(self.ban_seconds >= 0, "trainer.ban_seconds", "must be >= 0")
        _require(
            0 <= self.index < self.num_trainers,
            "trainer.index",
            f"must be in [0, trainer.num_trainers), got {self.index} of {self.num_trainers}",
        )


@dataclass(frozen=True)
class LocalSwarmConfig:
    """Shape of a swarm launched on this machine by `swarm demo` / `swarm local`."""

    servers_per_stage: int = 2
    layout: tuple[int, ...] = ()  # servers started for each stage, e.g. [4, 1, 1]; overrides servers_per_stage
    # server.slowdown of each server in start order (stage 0's first), for a swarm of unequal machines;
    # servers beyond the list run at full speed
    slowdowns: tuple[float, ...] = ()
    reply_delays: tuple[float, ...] = ()  # server.reply_delay of each server in start order, likewise
    trainers: int = 2
    threads_per_peer: int = 1
    timeout: float = 600.0  # seconds before the launcher gives up on the run
    # every server and trainer on a network namespace host of its own, so that `swarm fault cut|shape`
    # can act on its link (needs root and iproute2)
    netns: bool = False
    # with netns: every peer's link (servers' and trainers') limited to this rate each way (0: unlimited)
    link_mbit: float = 0.0

    def __post_init__(self) -> None:
        _require(self.servers_per_stage > 0, "local.servers_per_stage", "must be positive")
        _require(all(n >= 0 for n in self.layout), "local.layout", f"counts must be >= 0, got {list(self.layout)}")
        _require(all(f >= 1 for f in self.slowdowns), "local.slowdowns", f"must be >= 1, got {list(self.slowdowns)}")
        _require(all(d >= 0 for d in self.reply_delays), "local.reply_delays",
                 f"must be >= 0, got {list(self.reply_delays)}")
        _require(self.trainers > 0, "local.trainers", "must be positive")
        _require(self.threads_per_peer > 0, "local.threads_per_peer", "must be positive")
        _require(self.link_mbit >= 0, "local.link_mbit", f"must be >= 0, got {self.link_mbit}")
        _require(self.netns or not self.link_mbit, "local.link_mbit", "needs local.netns = true")


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
    local: LocalSwarmConfig = field(default_factory=LocalSwarmConfig)
    run_dir: str = "runs/demo"

    def __post_init__(self) -> None:
        _require(
            not self.local.layout or len(self.local.layout) == self.model.num_stages,
            "local.layout",
            f"needs one count per stage ({len(self.local.layout)} given, model.num_stages={self.model.num_stages})",
        )
        _require(
            self.server.stage < self.model.num_stages,
            "server.stage",
            f"must be below model.num_stages ({self.server.stage} >= {self.model.num_stages})",
        )
        _require(
            self.optim.target_batch_size >= self.trainer.microbatch_size,
            "optim.target_batch_size",
            "must be at least trainer.microbatch_size",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
