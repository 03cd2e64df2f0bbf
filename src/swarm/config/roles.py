"""Configuration of each role a peer can take: a stage server (and how servers move between stages), a
trainer, and the launcher of a local swarm."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.config.checks import is_power_of_two, require


@dataclass(frozen=True)
class ServerConfig:
    """One stage server."""

    stage: int = 0
    # join where the swarm needs a server most (the stage with the least capacity) instead of `stage`
    auto_stage: bool = False
    name: str = ""  # a label for this server in logs and in the DHT (e.g. the machine's name)
    device: str = "cpu"  # cpu, cuda, cuda:N
    # auto: bf16 on a CUDA device with bf16 tensor cores (Ampere and newer), fp16 on one with fp16's only
    # (Volta, Turing), none on a CPU or an older GPU. In fp16 every backward runs through the replica's own
    # dynamic loss scale, the size its incoming gradient's largest value is scaled to: starting at
    # fp16_loss_scale, halved on an overflow (that backward runs again), doubled after fp16_growth_interval
    # clean backwards in a row (see swarm.server.lossscale)
    autocast: str = "auto"
    fp16_loss_scale: float = 32768.0
    fp16_growth_interval: int = 2000
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    # values too small for a float's normal range (denormals) read and computed as zero on a CPU: a matmul
    # with half of one operand denormal ran 110x slower here, and as a model learns its attention sharpens
    # until some of its probabilities underflow into that range (benchmarks/denormal.py). A stage's replicas
    # should agree on it, as on autocast: where they differ, their steps may differ in the last bits, which
    # the all-reduce's comparison of digests finds
    flush_denormal: bool = True
    # CPU ids the compute thread, and the torch threads it starts, are kept on (empty: wherever the OS puts
    # them); its network and DHT work goes wherever a core is free. For servers sharing a machine: each on
    # cores of its own (`swarm local` does so where the cores suffice: local.pin_compute)
    compute_cores: tuple[int, ...] = ()
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
    # serve the stage from its initial weights even though the run has progressed and no replica, copy or
    # checkpoint of it can be reached: the stage's training so far is lost (every peer's summary says so).
    # Without it such a server waits for a copy to appear.
    fresh_start: bool = False
    # also run a trainer (the `trainer` section's settings) in this process, as the first rank of a fixed
    # pipeline feeds the data: the machine then runs one DHT peer and one p2p daemon for both roles, not two,
    # and the trainer's calls to this server skip the network. The trainer's end does not end the server;
    # its failure does. A stopped server lets it finish its microbatches under way (up to leave_timeout more).
    # Its metrics, if any, are served on net.metrics_port + 1.
    train: bool = False
    # Bounds on what one peer may send, so that its poison never reaches the weights (0: no bound). A
    # request's grad_outputs with a larger L2 norm is refused, and so is an all-reduce contribution whose
    # norm per sample is larger; a request's activations may not hold a value of larger magnitude.
    max_grad_norm: float = 1000.0
    max_activation: float = 1e6
    # robust aggregation for untrusted swarms: each replica's contribution to a step is clipped to this
    # many times the median of its group's (norm per sample); 0 keeps the plain mean. Needs 3+ replicas.
    clip_to_median: float = 0.0

    def __post_init__(self) -> None:
        require(self.max_grad_norm >= 0, "server.max_grad_norm", f"must be >= 0, got {self.max_grad_norm}")
        require(self.max_activation >= 0, "server.max_activation", f"must be >= 0, got {self.max_activation}")
        require(self.clip_to_median == 0 or self.clip_to_median >= 1, "server.clip_to_median",
                f"must be 0 (off) or >= 1, got {self.clip_to_median}")
        require(self.stage >= 0, "server.stage", f"must be >= 0, got {self.stage}")
        require(self.slowdown >= 1.0, "server.slowdown", f"must be >= 1, got {self.slowdown}")
        require(self.reply_delay >= 0, "server.reply_delay", f"must be >= 0, got {self.reply_delay}")
        require(
            self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:"),
            "server.device",
            f"must be cpu, cuda or cuda:N, got {self.device!r}",
        )
        require(self.autocast in ("auto", "none", "bf16", "fp16"), "server.autocast",
                f"must be auto, none, bf16 or fp16, got {self.autocast!r}")
        require(is_power_of_two(self.fp16_loss_scale), "server.fp16_loss_scale",
                f"must be a power of two (scaling by it is then exact), got {self.fp16_loss_scale}")
        require(self.fp16_growth_interval > 0, "server.fp16_growth_interval", "must be positive")
        require(self.threads >= 0, "server.threads", "must be >= 0")
        require(all(c >= 0 for c in self.compute_cores) and len(set(self.compute_cores)) == len(self.compute_cores),
                "server.compute_cores", f"must be distinct CPU ids >= 0, got {list(self.compute_cores)}")
        require(self.max_request_samples > 0, "server.max_request_samples", "must be positive")
        require(self.merge_samples >= 0, "server.merge_samples", "must be >= 0")
        require(self.graph_ttl > 0, "server.graph_ttl", f"must be positive, got {self.graph_ttl}")
        require(self.batch_backward_wait >= 0, "server.batch_backward_wait", "must be >= 0")
        require(self.leave_timeout >= 0, "server.leave_timeout", "must be >= 0")
        require(self.download_timeout > 0, "server.download_timeout", "must be positive")
        require(self.checkpoint_every > 0, "server.checkpoint_every", "must be positive")
        require(self.keep_checkpoints > 0, "server.keep_checkpoints", "must be positive")


@dataclass(frozen=True)
class BackupConfig:
    """Copies of each stage's state held outside the stage (`swarm.core.backups`), so that losing every
    replica of a stage at once loses at most `every` of its steps (more where steps come faster than
    copies may be taken: see `max_share`).

    Each stage's copy is held by `holders` servers of other stages, chosen by rendezvous hashing, and by
    every `swarm backup` peer. A holder looks every `period` seconds and downloads the stage's state from
    its most advanced replica once the stage is `every` steps past its copy. Copies live in the holder's
    memory (CPU), up to `max_mb` in all: a holder refuses copies beyond that and logs so.

    Refreshing copies takes at most `max_share` of a holder's time: after a download of d seconds, the
    next refresh waits (1 / max_share - 1) d. On a GPU, a stage of 580 MiB took 7 s to copy and ten steps
    about 4: copies every `every` steps took the links the activations need, and the swarm's throughput
    fell by a third. A stage with no copy yet is not made to wait.
    """

    every: int = 10
    holders: int = 1  # 0: servers hold no copies (`swarm backup` peers still do)
    period: float = 5.0
    max_mb: float = 0.0  # 0: no limit
    download_timeout: float = 120.0  # seconds one copy's download may take
    max_share: float = 0.1  # of a holder's time spent refreshing copies, at most (1: no bound)

    def __post_init__(self) -> None:
        require(self.every > 0, "backup.every", f"must be positive, got {self.every}")
        require(self.holders >= 0, "backup.holders", f"must be >= 0, got {self.holders}")
        require(0 < self.period <= 120, "backup.period", "must be in (0, 120] s: backup records live "
                "net.record_ttl + 2 periods, and signed records 600 s at most")
        require(self.max_mb >= 0, "backup.max_mb", "must be >= 0")
        require(self.download_timeout > 0, "backup.download_timeout", "must be positive")
        require(0 < self.max_share <= 1, "backup.max_share", f"must be in (0, 1], got {self.max_share}")


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
        require(self.period > 0, "rebalance.period", "must be positive")
        require(self.min_gain >= 1.0, "rebalance.min_gain", f"must be >= 1, got {self.min_gain}")
        require(self.cooldown >= 0, "rebalance.cooldown", "must be >= 0")
        require(self.jitter >= 0, "rebalance.jitter", "must be >= 0")


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
    # a server that failed is not picked again for this long (one whose call timed out: for as long as the
    # call waited, if less), doubling while it keeps failing
    ban_seconds: float = 15.0
    max_attempts: int = 20  # per stage call, across servers, before the microbatch is given up
    index: int = 0  # tells trainers apart in summaries and logs (the data is shared out through the DHT)
    # seconds between progress lines in the log (a progress bar instead where stderr is a terminal); also
    # the window of the samples/s a trainer announces
    progress_every: float = 5.0
    # seconds a stage may have no server before the trainer gives up and exits with an error (0: wait forever)
    no_server_timeout: float = 600.0
    # optimizer steps between validation losses over data.validation_samples (0: none); one more is taken
    # when training ends. Each trainer with it set evaluates: set it on one.
    eval_every: int = 0
    # a directory the trainer logs its loss, samples/s and validation loss (when it has one) to, for
    # TensorBoard, in a subdirectory per trainer (trainer-INDEX); empty: off. Needs the `monitor` extra.
    tensorboard_dir: str = ""

    def __post_init__(self) -> None:
        for name in ("microbatch_size", "max_inflight", "target_steps", "max_attempts", "keep_epochs"):
            require(getattr(self, name) > 0, f"trainer.{name}", f"must be positive, got {getattr(self, name)}")
        for name in ("request_timeout", "min_request_timeout", "settle_timeout", "progress_every"):
            require(getattr(self, name) > 0, f"trainer.{name}", "must be positive")
        require(self.routing in ("random", "wrr"), "trainer.routing", f"must be random or wrr, got {self.routing!r}")
        require(self.ban_seconds >= 0, "trainer.ban_seconds", "must be >= 0")
        require(self.no_server_timeout >= 0, "trainer.no_server_timeout", "must be >= 0")
        require(self.index >= 0, "trainer.index", f"must be >= 0, got {self.index}")
        require(self.eval_every >= 0, "trainer.eval_every", f"must be >= 0 (0: off), got {self.eval_every}")


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
    # trainers start once every server launched is in the DHT, as the ranks of a fixed pipeline meet before
    # it trains (else at once: servers join as they come up, and the swarm rebalances around the late ones)
    trainers_wait: bool = False
    # each trainer runs inside a server's process (`server.train`; stage 0's servers first, in start order)
    # instead of in one of its own, as a fixed pipeline's first rank feeds the data: one DHT peer and one p2p
    # daemon fewer per trainer. The trainers then start with their servers.
    trainers_in_servers: bool = False
    threads_per_peer: int = 1
    # each CPU server's compute thread on `threads_per_peer` cores of its own (server.compute_cores) when the
    # machine has that many for every server the launch starts; otherwise, and for servers started later
    # while no pinned server's cores are free, the OS places them. Off: two servers on two cores made the
    # same samples/s pinned or not (BENCHMARKS.md); machines with many cores per server may differ
    pin_compute: bool = False
    # threads of each peer's libp2p daemon (Go's GOMAXPROCS; 0: Go's default, one per core). Daemons of peers
    # sharing a machine, each with a thread per core, spin for work on the cores the compute needs: the
    # fault-free local swarm of BENCHMARKS.md ran 10-23% faster at 1
    daemon_threads: int = 1
    # every server, with its helper processes, held to this many cores as a machine of its own would be
    # (0: servers share the host's cores; needs root and a cgroup CPU controller); a server's slowdown
    # then makes its share that many times smaller
    server_cpus: float = 0.0
    timeout: float = 600.0  # seconds before the launcher gives up on the run
    # every server and trainer on a network namespace host of its own, so that `swarm fault cut|shape`
    # can act on its link (needs root and iproute2)
    netns: bool = False
    # with netns: every peer's link (servers' and trainers') limited to this rate each way (0: unlimited)
    link_mbit: float = 0.0

    def __post_init__(self) -> None:
        require(self.servers_per_stage > 0, "local.servers_per_stage", "must be positive")
        require(self.daemon_threads >= 0, "local.daemon_threads", f"must be >= 0, got {self.daemon_threads}")
        require(all(n >= 0 for n in self.layout), "local.layout", f"counts must be >= 0, got {list(self.layout)}")
        require(all(f >= 1 for f in self.slowdowns), "local.slowdowns", f"must be >= 1, got {list(self.slowdowns)}")
        require(all(d >= 0 for d in self.reply_delays), "local.reply_delays",
                 f"must be >= 0, got {list(self.reply_delays)}")
        require(self.trainers > 0, "local.trainers", "must be positive")
        require(not (self.trainers_in_servers and self.trainers_wait), "local.trainers_wait",
                "trainers inside servers (local.trainers_in_servers) start with their servers: set one of the two")
        require(self.threads_per_peer > 0, "local.threads_per_peer", "must be positive")
        require(self.server_cpus >= 0, "local.server_cpus", f"must be >= 0, got {self.server_cpus}")
        require(self.link_mbit >= 0, "local.link_mbit", f"must be >= 0, got {self.link_mbit}")
        require(self.netns or not self.link_mbit, "local.link_mbit", "needs local.netns = true")
