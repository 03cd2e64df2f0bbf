"""torch.distributed.pipelining runs of the project's model, for benchmarks/peers.py to compare with.

One process per (pipeline, stage), one thread each, gloo on 127.0.0.1. With `pipelines` > 1 the run is
data-parallel over pipelines: each takes its share of every step's batch, and the replicas of a stage
average their gradients (all-reduce over the stage's group) before every one of them steps, as DDP
would. Each rank steps as a swarm server steps its stage (its gradient clipped to `optim.clip_grad_norm`,
the servers' optimizer at the step's warm-up learning rate), so the two runs' losses compare. A rank can
be slowed or killed at a step, to see what a fixed pipeline makes of a straggler or a lost peer. With
`cpus`, every rank is held to that many cores (a machine of its own) and the slow rank to `cpus /
slowdown`; without, the slow rank idles `slowdown - 1` times the CPU time it used, as a swarm server's
`server.slowdown` does. Denormals are flushed on a rank as on a swarm server (`server.flush_denormal`).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from swarm.config import OptimConfig, load_config
from swarm.core.schedule import warmup_lr
from swarm.data import load_samples, split_inputs_targets
from swarm.model import build_stage
from swarm.ops.cpushare import CpuShare
from swarm.server.nag import stage_optimizer

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


@dataclass(frozen=True)
class PipelineRun:
    schedule: str = "1f1b"
    steps: int = 5  # timed steps, after one warm-up step
    pipelines: int = 1
    slow_rank: int | None = None
    slowdown: float = 1.0
    kill_rank: int | None = None
    kill_at: int = 0  # the timed step at whose start `kill_rank` is SIGKILLed
    timeout: float = 60.0  # seconds gloo waits for a peer before it gives up
    cpus: float = 0.0  # each rank held to this many cores, a machine of its own (0: ranks share the host)


class Throttle:
    """Idle `factor - 1` times the CPU time this thread used since the last call: a slower machine."""

    def __init__(self, factor: float):
        self.factor = factor
        self.last = time.thread_time()

    def __call__(self, *_args) -> None:
        used = time.thread_time() - self.last
        time.sleep((self.factor - 1.0) * used)
        self.last = time.thread_time()


def step_stage(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, optim: OptimConfig, taken: int) -> None:
    """One stage's optimizer step as a swarm server takes it: the stage's gradient clipped to
    `optim.clip_grad_norm`, at the warm-up learning rate of the step (`taken` steps so far)."""
    torch.nn.utils.clip_grad_norm_(params, optim.clip_grad_norm or math.inf)
    for group in opt.param_groups:
        group["lr"] = warmup_lr(taken, optim.base_lr, optim.warmup_steps)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _slow_down(module: torch.nn.Module, factor: float) -> None:
    """Throttle the rank after every forward and after every backward through its stage (CPU autograd
    runs on the calling thread, so the rank's own CPU time covers both passes and what lies between)."""
    throttle = Throttle(factor)
    module.register_forward_hook(throttle)
    params = [p for p in module.parameters() if p.requires_grad]
    torch.autograd.graph.register_multi_grad_hook(params, throttle, mode="all")


def _rank(rank: int, overrides: list[str], run: PipelineRun, port: int, out: str, shares: list[CpuShare]) -> None:
    """One stage of one pipeline. Ranks read the same seeded sample stream, so each pipeline's first
    stage takes the inputs and its last stage the targets of the same share of the batch, unsent. The
    last stage is the project's own module, which returns the loss given `targets=`: the schedule passes
    it on microbatch by microbatch, and `scale_grads` (the default) averages over microbatches."""
    if shares:
        shares[rank].enter()
    torch.set_num_threads(1)
    cfg = load_config(overrides=overrides)
    torch.set_flush_denormal(cfg.server.flush_denormal)
    n_stages, mb = cfg.model.num_stages, cfg.trainer.microbatch_size
    share = cfg.optim.target_batch_size // run.pipelines
    pipeline, stage_index = divmod(rank, n_stages)
    world = n_stages * run.pipelines
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=run.timeout))
    # every rank creates every group, in the same order
    pipe_groups = [dist.new_group([p * n_stages + s for s in range(n_stages)]) for p in range(run.pipelines)]
    stage_groups = [dist.new_group([p * n_stages + s for p in range(run.pipelines)]) for s in range(n_stages)]
    module = build_stage(cfg.model, stage_index)
    if rank == run.slow_rank and not shares:  # held to a share, the slow rank has a smaller one instead
        _slow_down(module, run.slowdown)
    inputs_meta, outputs_meta = module.boundary()
    # static shapes, so no rank waits on a shape exchange; hidden states carry requires_grad, or no
    # gradient would be sent back across the boundary
    example_in = torch.zeros((mb, *inputs_meta.shape), dtype=inputs_meta.dtype, requires_grad=stage_index > 0)
    out_shape = () if outputs_meta is None else (mb, *outputs_meta.shape)  # the last stage returns the loss
    stage = PipelineStage(module, stage_index, n_stages, torch.device("cpu"), input_args=example_in,
                          output_args=torch.zeros(out_shape, requires_grad=True), group=pipe_groups[pipeline])
    schedule = SCHEDULES[run.schedule](stage, n_microbatches=share // mb, loss_fn=lambda loss, _target: loss)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = stage_optimizer(params, cfg.optim)  # as servers step
    table = load_samples(cfg.data, cfg.model)
    batches = table.stream(cfg.optim.target_batch_size)
    losses_by_step: list[float] = []
    taken = 0  # optimizer steps

    def step() -> None:
        nonlocal taken
        inputs, targets = split_inputs_targets(next(batches)[pipeline * share : (pipeline + 1) * share], table.pad_id)
        if stage.is_first:
            schedule.step(inputs)
        elif stage.is_last:
            losses: list[torch.Tensor] = []
            schedule.step(targets=targets, target=targets, losses=losses, return_outputs=False)
            losses_by_step.append(torch.stack(losses).mean().item())
        else:  # a middle stage: activations in, activations out
            schedule.step()
        if run.pipelines > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=stage_groups[stage_index])
            flat /= run.pipelines
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        step_stage(params, opt, cfg.optim, taken)
        taken += 1

    result: dict = {"rank": rank}
    start = time.perf_counter()
    try:
        step()  # warm-up
        dist.barrier()
        start, cpu = time.perf_counter(), (time.thread_time(), time.process_time())
        for i in range(run.steps):
            if rank == run.kill_rank and i == run.kill_at:
                os.kill(os.getpid(), 9)
            step()
        dist.barrier()
        # this thread computes (and waits on gloo); the rank's other threads are gloo's and torch's own
        compute, everything = time.thread_time() - cpu[0], time.process_time() - cpu[1]
        result.update(seconds=time.perf_counter() - start, losses=losses_by_step,
                      cpu={"compute": compute, "other": everything - compute})
    except Exception as e:  # a lost peer: how the run ends is the result
        result.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", at=time.perf_counter() - start,
                      steps_done=len(losses_by_step) - 1 if losses_by_step else None,
                      where=traceback.extract_tb(e.__traceback__)[-1].name)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if "error" not in result:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_pipeline(overrides: list[str], run: PipelineRun) -> dict:
    """Samples/s and first/last step loss of one run; for a run that loses a rank, how each survivor's
    run ended (its error and after how long, or still hanging `run.timeout` + 30 s after the kill)."""
    cfg = load_config(overrides=overrides)
    world = cfg.model.num_stages * run.pipelines
    shares = [CpuShare(f"swarm-torch-{os.getpid()}-{rank}", run.cpus / (run.slowdown if rank == run.slow_rank else 1))
              for rank in range(world)] if run.cpus else []
    with tempfile.TemporaryDirectory() as out:
        # not joined by spawn: it would end every rank as soon as one died, before they could tell how
        procs = mp.spawn(_rank, args=(overrides, run, _free_port(), out, shares), nprocs=world, join=False).processes
        deadline = None
        for p in procs:
            p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if run.kill_rank is not None and deadline is None:
                deadline = time.monotonic() + run.timeout + 30.0  # the first to end is the killed one
        hanging = [i for i, p in enumerate(procs) if p.is_alive()]
        for i in hanging:
            procs[i].kill()
        for p in procs:
            p.join()
        for share in shares:
            share.close()
        codes = [p.exitcode for p in procs]
        ranks = {int(p.stem[4:]): json.loads(p.read_text()) for p in Path(out).glob("rank*.json")}
    if run.kill_rank is None:
        if any(codes):
            raise RuntimeError(f"torch pipeline ranks exited with {codes}")
        last = ranks[cfg.model.num_stages - 1]
        cores = {"compute threads": sum(r["cpu"]["compute"] for r in ranks.values()) / last["seconds"],
                 "ranks' other threads": sum(r["cpu"]["other"] for r in ranks.values()) / last["seconds"],
                 "seconds": last["seconds"]}
        return {"samples_per_second": run.steps * cfg.optim.target_batch_size / last["seconds"],
                "first_loss": last["losses"][0], "final_loss": last["losses"][-1], "step_losses": last["losses"],
                "cores": cores}
    return {"exit_codes": codes, "hanging": hanging, "survivors": ranks, "run": asdict(run)}
