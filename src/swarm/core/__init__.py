"""Pure decision logic of the swarm: routing, bans, measurements, retries, partitioning, stepping,
delivery, rebalancing, the verdict on a swarm's health.

Purity rule: modules here import only the Python standard library and other `swarm.core` modules;
no torch, numpy, asyncio, hivemind or sockets, and no global clock or global random state. Time is
passed in as `now: float` and randomness as a `random.Random`, so unit tests and a simulator can drive
every decision with fake clocks and seeded generators. `tests/unit/test_layering.py` enforces this.
"""

from swarm.core.bans import BanList
from swarm.core.delivery import Asked, LedgerAnswer, LedgerReply, Verdict, judge, merge_answers, worth_asking
from swarm.core.health import Diagnosis, ServerFigures, diagnose
from swarm.core.partition import split_layers
from swarm.core.rebalance import (
    Move,
    Seat,
    capacities,
    choose_stage,
    layout_of,
    plan_for_swarm,
    plan_move,
    still_planned,
)
from swarm.core.retry import backoff_delay
from swarm.core.routing import (
    Candidate,
    SmoothWeightedRoundRobin,
    choose_server,
    routing_weight,
    unmeasured_throughput,
)
from swarm.core.schedule import warmup_lr
from swarm.core.stepping import expected_group, stage_ready
from swarm.core.throughput import LatencyTracker, RateMeter, StageRate

__all__ = [
    "Asked",
    "BanList",
    "Candidate",
    "Diagnosis",
    "LatencyTracker",
    "LedgerAnswer",
    "LedgerReply",
    "Move",
    "Seat",
    "ServerFigures",
    "RateMeter",
    "SmoothWeightedRoundRobin",
    "StageRate",
    "Verdict",
    "backoff_delay",
    "capacities",
    "choose_server",
    "choose_stage",
    "diagnose",
    "layout_of",
    "expected_group",
    "judge",
    "merge_answers",
    "plan_for_swarm",
    "plan_move",
    "routing_weight",
    "split_layers",
    "stage_ready",
    "still_planned",
    "unmeasured_throughput",
    "warmup_lr",
    "worth_asking",
]
