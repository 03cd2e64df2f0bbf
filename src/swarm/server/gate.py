"""The compute gate: all of a server's torch work runs on one thread, entered one job at a time.

One thread, so that requests queue instead of oversubscribing the cores; one lock (`lock`, a
`swarm.server.turns.TurnLock`: a stage's step goes before queued work), held by a job from the moment
it is admitted until the thread is done with it, so that a job's ledger entry and its gradient are
never split by a step taking the gradients out. A request
whose caller has given up on it by the time its turn comes is dropped, not applied (the caller may be
retrying it elsewhere).
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import os
import sys
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from swarm.config import ConfigError
from swarm.config.checks import require
from swarm.server.backlog import Backlog
from swarm.server.turns import IN_TURN, TurnLock
from swarm.wire.calls import StageCall
from swarm.wire.validate import Unavailable

# (pass, samples, seconds as served, seconds with the server's cores to itself): forward or backward work
# done, for the throughput figures (see `ComputeGate.run_locked`)
WorkCounter = Callable[[str, int, float, float], None]
# the compute thread's name as the operating system shows it (`top -H`, /proc/PID/task/TID/comm), so that
# its CPU time can be told from the rest of the process's (swarm.ops.procs.cpu_split)
COMPUTE_THREAD = "swarm-compute"
PR_SET_NAME = 15


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` (at most 15 bytes) where the kernel shows it; Linux only."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def usable_cores(cores: Collection[int]) -> frozenset[int]:
    """`cores` as this process may run on them (empty: no pinning); `ConfigError` naming
    `server.compute_cores` where the platform cannot pin a thread or a core is not this process's."""
    if not cores:
        return frozenset()
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(f"server.compute_cores: this platform ({sys.platform}) cannot pin a thread to cores")
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cores) - allowed)
    require(not missing, "server.compute_cores",
            f"cores {missing} are not among this process's ({sorted(allowed)}): see `taskset -p`, cgroups' cpusets")
    return frozenset(cores)


@dataclass(frozen=True)
class Deadline:
    """When a request is no longer worth applying. `arrival_bound`: the caller's timeout counted from
    the request's arrival, on our clock. `wall`: the caller's own bound on the wall clock, which holds
    even for requests that sat in buffers while this process was frozen; the caller sets it well before
    it would send the work elsewhere, leaving room for clocks that disagree by seconds."""

    arrival_bound: float = math.inf
    wall: float = math.inf

    @classmethod
    def of(cls, call: StageCall) -> Deadline:
        return cls(time.monotonic() + call.timeout, call.deadline)

    def passed(self) -> bool:
        return time.monotonic() > self.arrival_bound or time.time() > self.wall


class ComputeGate:
    def __init__(self, slowdown: float, cost_by_cpu: bool, quota: float | None = None,
                 cores: Collection[int] = (), flush_denormal: bool = False):
        """`slowdown`: see `_slowed`. `cost_by_cpu`: this thread does all of the work (a CPU server with
        one torch thread, not held to a CPU quota), so its CPU time is what a job costs. `quota`: the cores
        a CPU quota holds this server to, where this thread does all of the work there. `cores`: the CPUs
        the thread is kept on (`server.compute_cores`; empty: any). `flush_denormal`: see
        `server.flush_denormal`."""
        self.slowdown = slowdown
        self.cost_by_cpu = cost_by_cpu
        self.quota = quota
        self.lock = TurnLock()  # steps go first (`lock.urgent()`): see swarm.server.turns
        self.backlog = Backlog()  # jobs waiting for the lock, and what they will take
        self.busy_seconds = 0.0  # wall time the thread spent on jobs
        self.count_work: WorkCounter = lambda work, samples, seconds, alone: None
        self.cores: tuple[int, ...] = ()  # the CPUs the thread may run on, as the OS reports them once it runs
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute",
                                            initializer=self._start_thread,
                                            initargs=(usable_cores(cores), flush_denormal))
        self._cost = 0.0  # what the thread's last job cost

    def _start_thread(self, cores: frozenset[int], flush_denormal: bool) -> None:
        """Name the compute thread, and keep it on `cores` (if any): Linux pins the calling thread alone,
        and threads it starts later (torch's intra-op pool) inherit its cores, while the server's other
        threads and processes go wherever a core is free: servers sharing a machine keep their compute
        off each other's cores and caches. The floating-point mode is the thread's own too, and its
        pool's, which starts from it."""
        name_os_thread(COMPUTE_THREAD)
        torch.set_flush_denormal(flush_denormal)
        if cores:
            os.sched_setaffinity(0, cores)
        if hasattr(os, "sched_getaffinity"):
            self.cores = tuple(sorted(os.sched_getaffinity(0)))

    @property
    def queued(self) -> int:
        """Jobs waiting for the thread (announced: trainers route around long queues)."""
        return self.backlog.queued

    def wait(self) -> float:
        """Seconds a job queued now would wait for the thread, as far as recent jobs' timings tell."""
        return self.backlog.wait(time.monotonic())

    async def run(self, fn, *args, expires: Deadline | None = None, before: Callable[[], Any] | None = None,
                  work: str | None = None, samples: int = 0, rank: int = IN_TURN):
        """Run `fn(*args)` once the thread is free and no turn ranked ahead of this one waits (`rank`: see
        `swarm.server.turns`); `before` runs first, under the lock."""
        token = self.backlog.enqueue(work, samples)
        try:
            async with self.lock.turn(rank):
                self.backlog.leave(token)
                if expires is not None and expires.passed():
                    raise Unavailable("the request expired while it queued")
                if before is not None:
                    before()
                return await self.run_locked(fn, *args, work=work, samples=samples)
        finally:
            self.backlog.leave(token)

    async def run_locked(self, fn, *args, work: str | None = None, samples: int = 0):
        """Run on the thread, the lock already held by the caller. Shielded: a cancelled caller must not
        release the lock while the thread still works (a step could then read gradients half accumulated).

        Only forward and backward passes (`work`) count toward the throughput figures: an optimizer step
        costs every replica of a stage the same whatever share of the samples it served, so counting it
        would make a server look slower the more replicas its stage has.

        Each job is counted twice: as served (under a CPU quota, the wall time: the server's own network
        work and helper processes take from the same quota, as they would on a machine of that size), and
        as it would take with the quota to itself (its CPU time over the quota). Routing weighs a stage's
        servers by the first; rebalancing, which predicts a server's speed in another stage, by the
        second: in the straggler benchmark the busy stage-0 servers served at 40% of their speed alone and
        the half-idle stage-1 servers at all of it, a stage-1 server moved to stage 0 on that, and the
        trainer's rate fell from 8.8 to 6.6 samples/s."""
        start = time.perf_counter()
        self.backlog.started(work, samples, time.monotonic())
        job = asyncio.get_running_loop().run_in_executor(self._executor, self._slowed, fn, *args)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            await asyncio.wait([job])
            raise
        finally:
            elapsed = time.perf_counter() - start
            self.busy_seconds += elapsed
            self.backlog.finished(work, samples, elapsed)
            if work is not None:
                served = self._cost if self.cost_by_cpu else elapsed
                self.count_work(work, samples, served, self._cost / min(self.quota, 1.0) if self.quota else served)

    def _slowed(self, fn, *args):
        """Run `fn`, then idle `slowdown - 1` times its CPU time: a slower machine, to the swarm.

        The thread's CPU time, not its wall time, so that a host shared with other servers (whose
        processes delay this one) does not slow it down further. For the same reason, when this thread
        does all of the work, its CPU time (times the slowdown) is what the work costs in the throughput
        figures: waiting for a core that other processes, or this server's own network thread, hold says
        nothing of the server's speed, and a figure that fell whenever a server got busy would move
        servers back and forth."""
        start = time.thread_time()
        try:
            return fn(*args)
        finally:
            used = time.thread_time() - start
            if self.slowdown > 1.0:
                time.sleep((self.slowdown - 1.0) * used)
            self._cost = used * self.slowdown

    async def idle(self) -> None:
        """Wait for the job in progress (if any) to finish."""
        async with self.lock:
            pass

    def close(self) -> None:
        self._executor.shutdown(wait=True)
