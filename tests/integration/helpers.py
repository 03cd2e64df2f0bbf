"""Shared pieces of the integration tests: a small swarm config and reading state off live servers."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import torch

from swarm.config import SwarmConfig, config_hash, load_config
from swarm.net.directory import Directory
from swarm.net.node import start_dht
from swarm.net.transport import StageClient
from swarm.ops.local import LocalSwarm
from swarm.ops.report import read_steps, write_report
from swarm.results import read_jsonl


def small_config(run_dir: Path, *extra: str) -> SwarmConfig:
    """2 stages x 2 servers, 2 trainers, a model small enough that a step takes well under a second."""
    return load_config(
        overrides=[
            f'run_dir="{run_dir}"',
            'net.run_id="itest"',
            "net.allreduce_timeout=8.0",
            "model.d_model=64", "model.n_heads=2", "model.d_ff=128", "model.n_layers=2", "model.seq_len=64",
            "model.num_stages=2",
            "optim.lr=3e-3", "optim.warmup_steps=2", "optim.target_batch_size=16",
            "trainer.microbatch_size=4", "trainer.max_inflight=3", "trainer.target_steps=8",
            "trainer.request_timeout=10.0", "trainer.ban_seconds=3.0",
            "local.servers_per_stage=2", "local.trainers=2", "local.timeout=240.0",
            "rebalance.enabled=false",  # servers stay on their stage unless a test turns it on
            *extra,
        ]
    )


def fetch_stage_states(cfg: SwarmConfig, initial_peers: tuple[str, ...]) -> dict[int, dict[str, list[torch.Tensor]]]:
    """Download every live replica's parameters of every stage: stage -> peer id -> tensors."""

    async def fetch() -> dict[int, dict[str, list[torch.Tensor]]]:
        net = load_config(overrides=[f"net.initial_peers={list(initial_peers)!r}".replace("'", '"')]).net
        dht = start_dht(net, client_mode=True)
        try:
            client = StageClient(await dht.replicate_p2p())
            layout = await Directory(dht, cfg.net.run_id, cfg.net.record_ttl).stages(cfg.model.num_stages)
            states: dict[int, dict[str, list[torch.Tensor]]] = {}
            for stage, records in layout.items():
                for r in records:
                    meta, tensors = await client.call(
                        r.peer_id, "state", {"stage": stage, "config": config_hash(cfg)}, [], 30.0
                    )
                    states.setdefault(stage, {})[r.peer_id] = tensors[: len(meta["names"])]
            return states
        finally:
            dht.shutdown()

    return asyncio.run(fetch())


def tracebacks(run_dir: Path) -> dict[str, str]:
    """Log files of the swarm's peers that contain a Python traceback, with the text around it (a hostile
    peer's own log, swarm.ops.hostile, is not the swarm's)."""
    found = {}
    for log in sorted(p for p in (run_dir / "logs").glob("*.log") if not p.name.startswith("hostile-")):
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            found[log.name] = text[text.index("Traceback") - 200 :][:2000]
    return found


def assert_replicas_in_step(summary: dict, run_dir) -> None:
    """Every step left all replicas of a stage with bit-identical weights (equal parameter digests),
    as every replica logged its steps (killed ones too), but for steps a replica later replaced by
    loading a peer's state of that epoch or a newer one: a member frozen or killed right after it got
    a round's last part steps, while the others, whose answer it never sent, step without it; the
    stage goes on from theirs, and the frozen one takes it when it comes back (its `.loads.jsonl`)."""
    for stage, servers in read_steps(run_dir, superseded=False).items():
        digests: dict[int, str] = {}
        for steps in servers:
            for step in steps:
                assert digests.setdefault(step["epoch"], step["digest"]) == step["digest"], (stage, step)


def server_steps(run_dir, peer_id: str) -> list[dict]:
    """The steps one server logged."""
    path = next((run_dir / "peers").glob(f"server-s*-{peer_id[-8:]}.steps.jsonl"))
    return read_jsonl(path)


def assert_states_equal(cfg, swarm: LocalSwarm) -> None:
    """Every stage's live replicas hold the same weights, all finite."""
    fetched = fetch_stage_states(cfg, swarm.initial_peers)
    for stage in range(cfg.model.num_stages):
        states = list(fetched.get(stage, {}).values())
        assert len(states) >= 1
        assert all(bool(torch.isfinite(t).all()) for state in states for t in state), f"stage {stage} not finite"
        for other in states[1:]:
            worst = max(float((a - b).abs().max()) for a, b in zip(states[0], other, strict=True))
            assert worst <= 1e-6, f"stage {stage} replicas differ by {worst}"


def assert_exactly_once(summary: dict, orphans_allowed: bool = False) -> None:
    """Every completed microbatch entered exactly one step of every stage, and nothing else did (but
    microbatches of a killed trainer, with `orphans_allowed`); every step of every stage is accounted
    for, and its replicas agree on what it took in."""
    assert summary["unresolved"] == 0, summary
    for stage, info in summary["stages"].items():
        delivery = dict(info["delivery"])
        if orphans_allowed:
            delivery.pop("not_completed")
        expected = {"steps_seen": info["steps"], "conflicting_steps": 0, "duplicated": 0, "missing": 0}
        assert delivery == {**expected, **({} if orphans_allowed else {"not_completed": 0})}, (
            stage, delivery, info.get("missing_stepped_at"))


def finish(swarm: LocalSwarm) -> None:
    """Tell every trainer to finish, as an operator would (SIGTERM to its process group: it lets its
    microbatches in flight complete and their gradients settle, then exits): a run that has shown what a
    test looks for need not train on to a fixed target."""
    for trainer in swarm.trainers():
        trainer.signal(signal.SIGTERM)


def run_swarm(swarm: LocalSwarm, on_status=None) -> dict:
    """Run the swarm to the end, check replicas' final states while they are up, and report."""
    try:
        swarm.start()
        swarm.wait_until_done(progress=False, on_status=on_status)
        assert_states_equal(swarm.cfg, swarm)
    finally:
        swarm.stop()
    assert not tracebacks(swarm.run_dir)
    return write_report(swarm.run_dir)


def running(pids: list[int]) -> list[int]:
    """Those of `pids` that still exist and are not zombies."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


async def wait_for_stages(directory: Directory, num_stages: int, timeout: float) -> dict[int, str]:
    """A server of each stage, once each has announced itself."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stages = await directory.stages(num_stages)
        if all(stages.values()):
            return {k: v[0].peer_id for k, v in stages.items()}
        await asyncio.sleep(0.2)
    raise TimeoutError("servers did not announce themselves")


def interrupt(process: subprocess.Popen) -> int:
    """Ctrl-C, as a person ends a command that follows the swarm: its exit code (leaving the DHT takes
    seconds, more on a loaded 2-core host; killed if it has not ended within a minute)."""
    process.send_signal(signal.SIGINT)
    try:
        return process.wait(timeout=60)
    finally:
        process.kill()
