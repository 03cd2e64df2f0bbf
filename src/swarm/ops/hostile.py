"""A hostile peer, to try a swarm's defences (the adversarial tests and benchmarks/attacks.py use it):

    python -m swarm.ops.hostile ATTACK --config RUN/config.toml --initial-peers ADDR... --seconds N

It joins the swarm's DHT as any stranger can, attacks for N seconds, then exits. `Attack` starts it
against a `LocalSwarm` once the swarm has warmed up, and measures the steps before and during. Attacks:

- `forged-record`: announces itself as a server of stage 1 at epoch 10^9 with a throughput of 10^9
  samples/s, renewed every second, and serves nothing;
- `wrong-hash`: announces a server of every stage with other settings (another config hash);
- `junk-records`: writes records under subkeys that are no peer ids, and records of its own full of
  garbage, under every stage's key;
- `refuser`: serves stage 1 with a record like an honest server's and refuses every call it gets;
- `poison-trainer`: the project's own trainer (same config, same initial peers), but the gradient of the
  stage output that each of its backward calls carries is scaled so that its largest value is 3e38:
  finite in float32, so only the servers' bounds stop it;
- `forging-replica`: the project's own server of stage 1, whose all-reduce contributions with microbatches
  in hand list one it never held (with a receipt copied from another) or one sample more than it holds, in
  turn.

The last two run the project's own peers (swarm.ops.insiders), their results in RUN_DIR/hostile so that
the run's report counts the honest peers only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from swarm import logs
from swarm.config import agreed, config_hash, load_config
from swarm.exiting import exit_now
from swarm.net.directory import Directory
from swarm.net.node import start_dht
from swarm.net.servicer import StageServicer
from swarm.ops.insiders import ATTACKING, INSIDERS
from swarm.wire import PROTOCOL_VERSION
from swarm.wire.records import ServerRecord, stage_key
from swarm.wire.validate import BadRequest

ATTACKS = ("forged-record", "wrong-hash", "junk-records", "refuser", *INSIDERS)


class Refuser:
    """A stage server's surface that refuses every call (see swarm.net.servicer.StageHandler)."""

    max_request_bytes = 1 << 20

    def refused(self, method: str, caller: str, error: BadRequest) -> None:
        pass

    async def forward(self, meta: Any, tensors: list, caller: str):
        raise BadRequest("refused by a hostile server")

    backward = state = reduce = ledger = backup = count = forward


def server_record(cfg, me: str, stage: int, **fields: Any) -> ServerRecord:
    """A server record of `stage` as an honest replica of this config would write it, `fields` changed."""
    shared = agreed(cfg)
    base = dict(peer_id=me, stage=stage, throughput=20.0, queue=0, epoch=0, pending=0, config_hash=config_hash(cfg),
                model=shared["model"], optim=shared["optim"], protocol=PROTOCOL_VERSION, capacity=20.0, tenure=60.0)
    return ServerRecord(**{**base, **fields})


async def attack(kind: str, dht, cfg) -> None:
    """Attack until cancelled."""
    directory = Directory(dht, cfg.net.run_id, cfg.net.record_ttl)
    me = dht.peer_id.to_base58()
    if kind == "refuser":
        p2p = await dht.replicate_p2p()
        await StageServicer(Refuser()).add_p2p_handlers(p2p)
    while True:
        if kind == "forged-record":
            await directory.announce_server(server_record(cfg, me, 1, throughput=1e9, capacity=1e9, epoch=10**9))
        elif kind == "wrong-hash":
            for stage in range(cfg.model.num_stages):
                await directory.announce_server(server_record(cfg, me, stage, config_hash="0" * 16))
        elif kind == "junk-records":
            for stage in range(cfg.model.num_stages):
                key = stage_key(cfg.net.run_id, stage)
                for subkey, value in (("not a peer", {"epoch": 10**9}), (me, {"stage": "x"}), (me + "x", 7)):
                    await dht.store(key, value, directory.now() + 5, subkey=subkey, return_future=True)
        else:  # refuser: look like the stage's other replicas, so that trainers call it as often
            others = [r for r in await directory.stage(1) if r.peer_id != me]
            epoch = statistics.median_low([r.epoch for r in others]) if others else 0
            rate = statistics.median_low([r.throughput for r in others]) if others else 20.0
            await directory.announce_server(server_record(cfg, me, 1, epoch=epoch, throughput=rate, capacity=rate))
        await asyncio.sleep(1.0)


async def main(args: argparse.Namespace) -> None:
    cfg = load_config(args.config)
    overrides = [f"net.initial_peers={list(args.initial_peers)!r}".replace("'", '"'), 'net.host="127.0.0.1"']
    if args.attack in INSIDERS:  # runs the project's own peer; its results go apart from the honest ones'
        overrides.append(f'run_dir="{cfg.run_dir}/hostile"')
        await INSIDERS[args.attack](load_config(args.config, overrides=overrides), args.seconds)
        print(f"hostile {args.attack} done", flush=True)
        return
    dht = start_dht(load_config(overrides=overrides).net, client_mode=args.attack != "refuser")
    try:
        print(f"hostile {args.attack} from {dht.peer_id.to_base58()}: {ATTACKING}", flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(attack(args.attack, dht, cfg), args.seconds)
        print(f"hostile {args.attack} done", flush=True)
    finally:
        dht.shutdown()


class Attack:
    """An `on_status` hook for `LocalSwarm.wait_until_done`: once the slowest stage reaches
    `warmup_epochs`, it measures `window` seconds of training, then starts one hostile peer per kind in
    `kinds`; once every one of them has joined and begun, they attack for `window` seconds; then it tells
    the trainers to finish (`finish`). `rates()`: samples per second the trainers completed (through
    every stage) before the attack and during it: what the servers' records say of epochs is what the
    attackers forge. (A hostile peer takes a while to start where the swarm keeps the cores busy.)"""

    def __init__(self, swarm, kinds: tuple[str, ...], finish, window: float = 20.0, warmup_epochs: int = 3):
        self.swarm, self.kinds, self.finish, self.window, self.warmup_epochs = (
            swarm, kinds, finish, window, warmup_epochs)
        self.marks: dict[str, tuple[float, int]] = {}  # phase -> (time, samples completed) when it began
        self.processes: list[subprocess.Popen] = []

    def __call__(self, status) -> None:
        now, samples = time.monotonic(), status.trainer_samples
        if "before" not in self.marks and status.min_epoch >= self.warmup_epochs:
            self.marks["before"] = (now, samples)
        elif "before" in self.marks and "launch" not in self.marks and now - self.marks["before"][0] >= self.window:
            self.marks["launch"] = (now, samples)
            self.processes = [self._start(kind) for kind in self.kinds]
        elif "launch" in self.marks and "attack" not in self.marks and all(
                ATTACKING in self._log(kind).read_text() for kind in self.kinds):
            self.marks["attack"] = (now, samples)
        elif "attack" in self.marks and "after" not in self.marks and all(p.poll() is not None for p in self.processes):
            self.marks["after"] = (now, samples)
            self.finish(self.swarm)

    def _log(self, kind: str) -> Path:
        return Path(self.swarm.run_dir) / "logs" / f"hostile-{kind}.log"

    def _start(self, kind: str) -> subprocess.Popen:
        run_dir = Path(self.swarm.run_dir)
        log = open(self._log(kind), "w")  # noqa: SIM115  the child's
        command = [sys.executable, "-m", "swarm.ops.hostile", kind, "--config", str(run_dir / "config.toml"),
                   "--initial-peers", *self.swarm.initial_peers, "--seconds", str(self.window)]
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def rates(self) -> tuple[float, float]:
        (t0, n0), (t1, n1), (t2, n2), (t3, n3) = (self.marks[k] for k in ("before", "launch", "attack", "after"))
        return (n1 - n0) / (t1 - t0), (n3 - n2) / (t3 - t2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("attack", choices=ATTACKS)
    parser.add_argument("--config", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    logs.setup(verbose=False)  # the poison trainer's lines, refusals included, go to its log
    asyncio.run(main(parser.parse_args()))
    exit_now(0)
