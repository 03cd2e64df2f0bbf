"""Real faults injected into a real swarm: the run reaches its target, replicas end identical, every
completed microbatch is in exactly one step of every stage, and no process dies with a traceback."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from swarm.logs import logged_at
from swarm.ops import netlab
from swarm.ops.faults import FaultInjector
from swarm.ops.local import LocalSwarm, Peer
from swarm.results import read_jsonl

from .helpers import assert_exactly_once, assert_replicas_in_step, finish, run_swarm, server_steps, small_config

pytestmark = pytest.mark.integration


def short_id(peer: Peer) -> str:
    """The shortened peer id a server logs itself under (what trainers' log lines name it by)."""
    found = re.search(r"server (?:\S+ )?(…\S+) up on", peer.log_path.read_text())
    assert found, peer.log_tail()
    return found.group(1)


def server_summary(run_dir, peer: Peer) -> dict:
    sid = short_id(peer)[1:]
    (path,) = [p for p in (run_dir / "peers").glob(f"server-s{peer.stage}-*.json")
               if json.loads(p.read_text())["peer_id"].endswith(sid)]
    return json.loads(path.read_text())


def trainer_logs(swarm: LocalSwarm) -> str:
    return "".join(p.log_path.read_text() for p in swarm.trainers())


def assert_finished(summary: dict, cfg) -> None:
    for stage, info in summary["stages"].items():
        assert info["steps"] >= cfg.trainer.target_steps, (stage, info)
    assert summary["final_loss"] < summary["first_loss"] - 0.3, summary


def failures_on(swarm: LocalSwarm, victim: Peer) -> list[tuple[float, float]]:
    """Each call on `victim` that trainers logged as failed: (when it failed, how long it had waited)."""
    found = []
    for line in trainer_logs(swarm).splitlines():
        m = re.search(r" stage \d (?:forward|backward) on (\S+) failed after ([\d.]+)s", line)
        if m and m.group(1) == short_id(victim):
            found.append((logged_at(line), float(m.group(2))))
    return found


BAN = 0.5  # seconds a trainer first bans a server that failed it (doubling, up to 8 times as long)
DHT_RPC_WAIT = 3.0  # seconds a DHT read waits for an unresponsive node (hivemind's wait_timeout)
RECORD_FRESH = 2.0  # seconds after the hang: the victim's record (renewed every second) counts only hung calls
HOLD_AT_MOST = 10.0  # seconds calls are held at the victim before the kill: well under their 12 s timeouts


def records_of(status, server: Peer) -> list:
    return [r for records in status.servers.values() for r in records if r.name == server.name]


def steps_of(server: Peer) -> list[dict]:
    """The steps a server logged so far (also one that was killed)."""
    (path,) = server.log_path.parent.parent.glob(f"peers/server-s{server.stage}-*{short_id(server)[1:]}.steps.jsonl")
    return read_jsonl(path)


def waiting_at(failures: list[tuple[float, float]], moment: float) -> list[float]:
    """Of those failures, the calls that were already waiting at `moment`: how long after it each failed."""
    return [at - moment for at, waited in failures if at - waited < moment < at]


# in make test-slow: the suite's longest (75-100 s on 2 cores), and on a slower 2-core machine it failed 2 runs of
# 5: a start race (now excluded: local.trainers_wait), and once no call was left at the victim to be killed with
# it, as the trainer's connections to it had broken 7 s before (not understood yet)
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_calls_waiting_on_a_lost_server_are_sent_elsewhere_in_seconds(tmp_path):
    """Calls queue at a slowed stage-0 server with timeouts far longer than what follows. It is frozen
    (a stalled machine: no connection breaks): its calls are given up once its record expires, by the
    first view read after that, not at their timeouts. The stage steps on without it;
    thawed, it downloads the current state (it never serves its stale weights) and steps with its stage
    again. Then its compute hangs while it holds gradients unstepped (trainers' forwards and backwards wait
    there unanswered; its all-reduce goes on, so it steps only with its stage), and once its record shows
    calls in hand its main process alone is SIGKILLed: its helpers go with it, the connections break, and
    the calls it had are re-sent at once. Gradients it held unstepped, or may have (a backward it never
    answered), are accumulated again from what the trainers kept."""
    # (trainers start once every server is up: a stage-0 replica that got work before its peer was up would
    # take the stage's first step alone, which is not what is looked at here)
    cfg = small_config(tmp_path, "trainer.target_steps=1000", "trainer.min_request_timeout=12.0",
                       "trainer.request_timeout=14.0", f"trainer.ban_seconds={BAN}", "local.trainers_wait=true")
    swarm = LocalSwarm(cfg)
    faults = FaultInjector(tmp_path)
    victim: list[Peer] = []
    marks: dict[str, float] = {}

    def inject(status) -> None:
        now, kinds = time.time(), [e.kind for e in faults.events]
        if not victim and status.min_epoch >= 3:
            victim.append(swarm.servers(stage=0)[0])
            # both serve slowly (trainers favour the faster of two): calls are waiting at it when it freezes
            for server in swarm.servers(stage=0):
                faults.delay(server, seconds=0.5)
        elif kinds == ["delay", "delay"] and now - faults.events[-1].time > 2.0:
            faults.freeze(victim[0])
            marks["frozen_epoch"] = max(status.epochs[0])
        elif (kinds == ["delay", "delay", "freeze"] and now - faults.events[-1].time > cfg.net.record_ttl + 2
              and max(status.epochs.get(0) or [0]) >= marks["frozen_epoch"] + 2):  # it stepped on without it
            faults.thaw(victim[0])
            for server in swarm.servers(stage=0):
                faults.delay(server, seconds=0.0)
        elif kinds == ["delay", "delay", "freeze", "thaw", "delay", "delay"] and "back" not in marks:
            caught_up = re.findall(r"loaded epoch (\d+)", victim[0].log_path.read_text())
            if caught_up and any(s["epoch"] > int(caught_up[-1]) and s["group"] == 2 for s in steps_of(victim[0])):
                marks["back"] = now  # caught up, and stepped with its stage again
        # once the trainers' bans of it (for the calls it failed while frozen) have surely lapsed, and while it
        # holds gradients it has not stepped with, its compute hangs: every trainer's call sent to it from now
        # on waits there, unanswered. (Not its all-reduce: a replica that hears no part steps alone, and its
        # step would branch off the stage's with no state load to end it, as it is killed.)
        elif len(kinds) == 6 and "back" in marks and now - marks["back"] > 8 * BAN + 1:
            if any(r.pending > 0 for r in records_of(status, victim[0])):
                faults.delay(victim[0], blackhole=True, methods=("forward", "backward"))
        # the kill, once its record, renewed since the hang, shows calls in hand: they wait for the kill, as
        # their timeouts are far away
        elif len(kinds) == 7 and "killed" not in marks and now - faults.events[-1].time > RECORD_FRESH:
            if any(r.calls > 0 for r in records_of(status, victim[0])) or now - faults.events[-1].time > HOLD_AT_MOST:
                os.kill(victim[0].process.pid, signal.SIGKILL)
                marks["killed"] = time.time()
        elif "killed" in marks and "end" not in marks and now - marks["killed"] > 10:
            marks["end"] = now
            finish(swarm)

    summary = run_swarm(swarm, inject)

    assert "end" in marks, (faults.events, marks)
    failures = failures_on(swarm, victim[0])
    # every call that failed on it while frozen waited there: one in flight at the freeze, or one sent to it
    # after (the freeze comes at any moment, and the trainers still see its record then)
    frozen, thawed = faults.events[2].time, faults.events[3].time
    given_up = [at - frozen for at, waited in failures if frozen < at < thawed]
    assert given_up, "no call waited on the frozen server"
    # its record expires record_ttl after its last announcement, and the view read begun just after that
    # misses it: that read may wait out the DHT's RPC timeout on the frozen machine's DHT node once
    assert max(given_up) <= cfg.net.record_ttl + DHT_RPC_WAIT + 1, given_up
    resent = waiting_at(failures, marks["killed"])
    assert resent, "no call was waiting on the killed server"
    assert max(resent) <= 3, resent  # well under the calls' 12 s timeouts
    assert all(s["group"] == 2 for s in steps_of(victim[0]))  # it never stepped alone, stale or frozen
    assert summary["replays"] >= 1  # gradients it held, or may have, were accumulated again elsewhere
    assert summary["final_loss"] < summary["first_loss"] - 0.3, summary
    assert_exactly_once(summary)
    assert_replicas_in_step(summary, tmp_path)


@pytest.mark.timeout(300)
def test_a_trainer_killed_with_microbatches_in_flight_then_a_server_during_an_all_reduce(tmp_path):
    """A trainer dies with microbatches in flight: the other carries the run to its target, and nothing is
    counted twice, including the dead trainer's microbatches that some stages had already taken in. Then a
    stage-1 server is killed once its stage has a batch ready (its slowed messages keep the round open): the
    survivor's round fails, it steps without the dead replica, and nothing is lost or doubled."""
    cfg = small_config(tmp_path, "trainer.target_steps=12")
    swarm = LocalSwarm(cfg)
    faults = FaultInjector(tmp_path)

    def inject(status) -> None:
        if not faults.events and status.min_epoch >= 3:
            faults.kill(swarm.trainers()[1])
            faults.delay(swarm.servers(stage=1)[0], seconds=1.0)
        elif len(faults.events) == 2 and status.pending_by_stage.get(1, 0) >= cfg.optim.target_batch_size:
            faults.kill(swarm.servers(stage=1)[0])

    summary = run_swarm(swarm, inject)

    assert [e.kind for e in faults.events] == ["kill", "delay", "kill"]
    (survivor,) = summary["stages"]["1"]["replicas"]
    assert survivor["failed_rounds"] >= 1  # the round in progress died with the victim
    assert_finished(summary, cfg)
    assert_exactly_once(summary, orphans_allowed=True)
    assert_replicas_in_step(summary, tmp_path)


@pytest.mark.slow  # ~70 s: in make test-slow, keeping make test inside its time budget
@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0 or not netlab.available(), reason="network namespaces need root and iproute2")
def test_a_partitioned_server_catches_up_after_the_partition_heals(tmp_path):
    """A stage-1 server on its own network namespace is cut off (DHT included) for longer than the
    timeouts, then reconnected: it must not step alone while cut off, and it catches up after. The
    run goes on until it has stepped with its stage again (then the trainers are told to finish)."""
    cfg = small_config(tmp_path, "trainer.target_steps=200", "local.netns=true")
    swarm = LocalSwarm(cfg)
    faults = FaultInjector(tmp_path)
    cut_for = cfg.trainer.request_timeout + cfg.net.record_ttl
    isolated: list[Peer] = []
    epochs: dict[str, int] = {}  # the stage's epoch at the cut, and at the heal

    def start() -> None:  # only one server on a namespace of its own; the rest share the root one
        swarm.start_bootstrap()
        for stage in (0, 0, 1):
            swarm.add_server(stage, namespace=False)
        isolated.append(swarm.add_server(1))
        for index in range(cfg.local.trainers):
            swarm.add_trainer(index)

    shaped: list[str] = []

    def inject(status) -> None:
        stage1 = {r.name: r.epoch for r in status.servers.get(1, [])}
        if not faults.events and status.min_epoch >= 3 and len(stage1) == 2:
            epochs["cut"] = max(stage1.values())
            faults.cut(isolated[0])
        elif (len(faults.events) == 1 and time.time() - faults.events[0].time > cut_for
              and max(stage1.values(), default=0) >= epochs["cut"] + 2):  # the stage stepped on without it
            epochs["heal"] = max(stage1.values())
            faults.heal(isolated[0])
        elif len(faults.events) == 2:  # then a bandwidth limit on its link, for a moment
            faults.shape(isolated[0], mbit=20)
            shaped.append(os.popen(f"tc qdisc show dev {isolated[0].host.link}").read())
            faults.unshape(isolated[0])
        elif (len(faults.events) == 4 and "end" not in epochs and len(set(stage1.values())) == 1
              and isolated[0].name in stage1 and min(stage1.values()) >= epochs["heal"] + 2):
            epochs["end"] = min(stage1.values())  # caught up, and stepping with the other replica
            finish(swarm)

    swarm.start = start
    summary = run_swarm(swarm, inject)

    assert isolated[0].host is not None and swarm.lab is not None
    assert [e.kind for e in faults.events] == ["cut", "heal", "shape", "unshape"]
    assert "end" in epochs, epochs
    assert "tbf" in shaped[0] and "rate 20Mbit" in shaped[0]
    healed = server_summary(tmp_path, isolated[0])
    assert healed["catch_ups"] >= 1, healed
    steps = server_steps(tmp_path, healed["peer_id"])
    assert all(s["group"] == 2 for s in steps)  # it never stepped alone
    assert any(s["epoch"] > epochs["heal"] for s in steps), steps  # and it stepped with its stage again
    assert summary["final_loss"] < summary["first_loss"] - 0.3, summary
    assert_exactly_once(summary)
    assert_replicas_in_step(summary, tmp_path)
    assert not any(swarm.lab.gateway in line for line in os.popen("ip -brief addr").read().splitlines())
