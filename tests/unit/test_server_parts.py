"""The stage server's parts that need no sockets: admission and staleness, the reply cache, the compute
gate's deadlines, on a real stage runtime of a tiny model."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from swarm.config import load_config
from swarm.core.stepping import Replica
from swarm.net.identity import peer_id_of
from swarm.net.receipts import sign_receipt
from swarm.server.batching import Batcher
from swarm.server.gate import ComputeGate, Deadline
from swarm.server.handlers import StageHandlers
from swarm.server.replies import ReplyCache
from swarm.server.stage import MAX_TOLD, ServedStage, WorkMeter
from swarm.server.stepping import heard
from swarm.wire.calls import CountNote, StageCall, StageQuery
from swarm.wire.records import ServerRecord
from swarm.wire.validate import IGNORE_INDEX, BadRequest, InputsNotHeld, Unavailable

CFG = load_config(overrides=["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.n_layers=2",
                             "model.seq_len=16", "model.num_stages=2"])


def served(index: int, gate: ComputeGate, stopping=lambda: False) -> tuple[StageHandlers, ServedStage]:
    st = ServedStage.build(CFG.model, CFG.optim, CFG.server, index, "QmMe", "me")
    st.serving = True
    handlers = StageHandlers(CFG.model, CFG.server, "hash", 1 << 20, gate, stopping)

    async def no_reduce(meta, tensors, caller):
        raise AssertionError("no all-reduce here")

    handlers.enter(st, Batcher(st.runtime, gate, 0, 1.0), no_reduce)
    return handlers, st


KEYS = {name: Ed25519PrivateKey.generate() for name in ("caller", "another caller")}
ID = {name: peer_id_of(key.public_key()) for name, key in KEYS.items()}


def call(stage: int = 1, req: str = "r1", caller: str = "caller", samples: int = 2, **fields) -> dict:
    """A trainer's call, with its receipt for this server ("QmMe")."""
    receipt = sign_receipt(KEYS[caller], f"{ID[caller]}/{req}", stage, "QmMe", samples)
    return StageCall(req, stage, fields.pop("config", "hash"), **fields, receipt=receipt).to_meta()


def last_stage_request(batch: int = 2) -> list[torch.Tensor]:
    return [torch.randn(batch, 16, 32), torch.randint(0, 256, (batch, 16))]


def run(coro):
    return asyncio.run(coro)


def test_admission_sends_callers_with_a_lagging_view_elsewhere_and_refuses_strangers():
    async def scenario():
        handlers, st = served(1, ComputeGate(1.0, False))
        with pytest.raises(Unavailable, match="hosts stage 1, not 0"):
            await handlers.forward(call(stage=0), last_stage_request(), ID["caller"])
        with pytest.raises(BadRequest, match="config hash"):
            await handlers.forward(call(config="other"), last_stage_request(), ID["caller"])
        with pytest.raises(BadRequest, match="stage: expected int"):
            await handlers.forward({"req": "r", "stage": "1", "config": "hash"}, last_stage_request(), ID["caller"])
        with pytest.raises(BadRequest, match="request id"):
            await handlers.forward(call(req=""), last_stage_request(), ID["caller"])
        st.serving = False
        with pytest.raises(Unavailable, match="between stages"):
            await handlers.forward(call(), last_stage_request(), ID["caller"])
    run(scenario())


def test_a_stale_replica_refuses_and_wakes_its_step_loop_to_catch_up():
    async def scenario():
        handlers, st = served(1, ComputeGate(1.0, False))
        with pytest.raises(Unavailable, match="stale replica: at epoch 0, the stage is at 3"):
            await handlers.forward(call(epoch=3), last_stage_request(), ID["caller"])
        assert st.counters["stale_refusals"] == 1 and st.wake.is_set()
        st.round_epoch = 0  # our own step to that epoch is under way: the request waits for it instead
        await handlers.forward(call(epoch=1), last_stage_request(), ID["caller"])
    run(scenario())


def test_a_moving_server_takes_no_new_microbatch_but_finishes_its_backwards_until_drained():
    async def scenario():
        gate = ComputeGate(1.0, False)
        handlers, st = served(0, gate)
        batcher = asyncio.create_task(handlers.batcher.loop())
        ids = torch.randint(0, 256, (2, 16))
        meta, (y,) = await handlers.forward(call(stage=0, req="a"), [ids], ID["caller"])
        st.moving_to = 1
        with pytest.raises(Unavailable, match="moving to stage 1"):
            await handlers.forward(call(stage=0, req="b"), [ids], ID["caller"])
        await handlers.backward(call(stage=0, req="a"), [ids, torch.ones_like(y.value)], ID["caller"])
        assert st.runtime.pending_samples == 2
        st.drained = True
        with pytest.raises(Unavailable, match="moving"):
            await handlers.backward(call(stage=0, req="a"), [ids, torch.ones_like(y.value)], ID["caller"])
        batcher.cancel()
    run(scenario())


def test_a_repeated_gradient_call_is_answered_from_the_cache_and_applied_once():
    async def scenario():
        handlers, st = served(1, ComputeGate(1.0, False))
        tensors = last_stage_request()
        first = await handlers.forward(call(), tensors, ID["caller"])
        again = await handlers.forward(call(), tensors, ID["caller"])
        assert st.runtime.pending_samples == 2 and st.counters["samples_served"] == 2
        assert again[0]["loss"] == first[0]["loss"] and torch.equal(again[1][0].value, first[1][0].value)
        # keys are per caller
        other = await handlers.forward(call(caller="another caller"), tensors, ID["another caller"])
        assert st.runtime.pending_samples == 4 and other[0]["loss"] == first[0]["loss"]
    run(scenario())


def test_the_reply_cache_keeps_the_newest_and_answers_with_the_current_epoch():
    cache = ReplyCache(size=2)
    for key in "abc":
        cache.remember(key, ({"epoch": 1, "loss": key}, []))
    assert cache.repeat("a", 5) is None
    assert cache.repeat("c", 5) == ({"epoch": 5, "loss": "c"}, [])


def test_the_gate_drops_requests_whose_caller_gave_up_while_they_queued():
    async def scenario():
        gate, ran = ComputeGate(1.0, False), []
        with pytest.raises(Unavailable, match="expired while it queued"):
            await gate.run(ran.append, 1, expires=Deadline(arrival_bound=time.monotonic() - 1))
        with pytest.raises(Unavailable):
            await gate.run(ran.append, 2, expires=Deadline(wall=time.time() - 1))  # a frozen server's backlog
        await gate.run(ran.append, 3, expires=Deadline(time.monotonic() + 60, time.time() + 60))
        assert ran == [3] and gate.queued == 0
        gate.close()
    run(scenario())


async def _hold_thread(gate: ComputeGate, samples: int) -> tuple[asyncio.Task, threading.Event]:
    """A forward of `samples` samples on the gate's thread until the event is set; returns once it runs."""
    release, running = threading.Event(), threading.Event()

    def job():
        running.set()
        release.wait(30)

    task = asyncio.create_task(gate.run(job, work="forward", samples=samples))
    await asyncio.to_thread(running.wait, 30)
    return task, release


def test_a_forward_that_would_outwait_its_callers_timeout_is_turned_away_at_once():
    """A forward is refused as busy when the work ahead of it (priced at the gate's recent timings) would
    outlast its caller's timeout, and taken when the caller waits long enough; behind an empty queue it
    is taken even with a timeout shorter than the work."""
    async def scenario():
        gate = ComputeGate(1.0, False)
        handlers, st = served(1, gate)
        await gate.run(time.sleep, 0.2, work="forward", samples=1)  # about 0.2 s a sample
        await handlers.forward(call(req="alone", timeout=0.1), last_stage_request(), ID["caller"])
        holder, release = await _hold_thread(gate, samples=100)  # about 20 s of work in progress
        with pytest.raises(Unavailable, match=r"busy: about \d+s of work queued ahead, past the call.s 5s timeout"):
            await handlers.forward(call(req="hurried", timeout=5.0), last_stage_request(), ID["caller"])
        assert st.counters["busy_refusals"] == 1 and st.runtime.pending_samples == 2 and gate.queued == 0
        patient = asyncio.create_task(
            handlers.forward(call(req="patient", timeout=60.0), last_stage_request(), ID["caller"]))
        while gate.queued == 0:
            await asyncio.sleep(0.01)
        release.set()
        await holder
        meta, _ = await patient
        assert "loss" in meta and st.runtime.pending_samples == 4 and st.counters["busy_refusals"] == 1
        gate.close()
    run(scenario())


def test_a_queued_forward_whose_caller_gave_up_is_answered_as_expired_and_not_computed():
    async def scenario():
        gate = ComputeGate(1.0, False)
        handlers, st = served(0, gate)
        batcher = asyncio.create_task(handlers.batcher.loop())
        holder, release = await _hold_thread(gate, samples=1)
        ids = torch.randint(0, 256, (2, 16))
        late = asyncio.create_task(handlers.forward(call(stage=0, req="late", deadline=time.time() - 1), [ids],
                                                    ID["caller"]))
        on_time = asyncio.create_task(handlers.forward(call(stage=0, req="on time"), [ids], ID["caller"]))
        while gate.queued < 2:
            await asyncio.sleep(0.01)
        release.set()
        await holder
        with pytest.raises(Unavailable, match="expired while it queued"):
            await late
        await on_time
        assert set(st.runtime.graphs) == {f"{ID['caller']}/on time"} and gate.queued == 0
        batcher.cancel()
        gate.close()
    run(scenario())


def test_a_backward_goes_before_the_forwards_queued_ahead_of_it():
    """As in 1F1B: the backward finishes a microbatch whose graph only this server holds; a forward kept
    waiting can go elsewhere at no cost (see swarm.server.turns)."""
    async def scenario():
        gate = ComputeGate(1.0, False)
        handlers, st = served(0, gate)
        order, runtime = [], st.runtime
        for name in ("forward", "backward"):
            real = getattr(runtime, name)
            setattr(runtime, name, lambda *a, real=real, name=name, **k: (order.append(name), real(*a, **k))[1])
        batcher = asyncio.create_task(handlers.batcher.loop())
        ids = torch.randint(0, 256, (2, 16))
        await handlers.forward(call(stage=0, req="old"), [ids], ID["caller"])
        holder, release = await _hold_thread(gate, samples=1)
        new = asyncio.create_task(handlers.forward(call(stage=0, req="new"), [ids], ID["caller"]))
        while gate.queued < 1:
            await asyncio.sleep(0.01)
        old = asyncio.create_task(handlers.backward(call(stage=0, req="old"), [ids, torch.randn(2, 16, 32)],
                                                    ID["caller"]))
        while gate.queued < 2:
            await asyncio.sleep(0.01)
        release.set()
        await asyncio.gather(holder, new, old)
        assert order == ["forward", "backward", "forward"]
        assert st.runtime.recomputed_backwards == 0 and st.runtime.fast_backwards == 1
        batcher.cancel()
        gate.close()
    run(scenario())


def test_a_call_without_a_timeout_never_expires():
    deadline = Deadline.of(StageCall.from_meta(call()))
    assert deadline.arrival_bound == math.inf and deadline.wall == math.inf and not deadline.passed()


def test_the_gate_counts_work_by_pass_and_slows_down_by_cpu_time():
    async def scenario():
        counted = []
        gate = ComputeGate(3.0, True)
        gate.count_work = lambda work, samples, seconds, alone: counted.append((work, samples, seconds))
        spin = lambda: sum(i * i for i in range(200_000))  # noqa: E731
        started = time.perf_counter()
        await gate.run(spin, work="forward", samples=4)
        wall = time.perf_counter() - started
        (work, samples, cost), = counted
        assert (work, samples) == ("forward", 4)
        assert wall >= 0.9 * cost  # idled twice the CPU time, and counted three times it
        gate.close()
    run(scenario())


def test_a_gradient_is_accumulated_only_with_its_trainers_receipt_for_this_server():
    """Without a receipt, with one for another server, another stage or other samples, nothing is
    accumulated; a call for the input gradient only needs none. The receipt is kept for the round."""
    async def scenario():
        handlers, st = served(1, ComputeGate(1.0, False))
        me = ID["caller"]
        forged = [
            StageCall("r1", 1, "hash").to_meta(),
            {**call(), "receipt": sign_receipt(KEYS["caller"], f"{me}/r1", 1, "QmOther", 2)},
            {**call(), "receipt": sign_receipt(KEYS["caller"], f"{me}/r1", 0, "QmMe", 2)},
            call(samples=3),
            call(caller="another caller"),  # signed by another trainer than the caller
        ]
        for meta in forged:
            with pytest.raises(BadRequest, match="receipt"):
                await handlers.forward(meta, last_stage_request(), me)
        assert st.runtime.pending_samples == 0
        await handlers.forward(StageCall("r1", 1, "hash", accumulate=False).to_meta(), last_stage_request(), me)
        assert st.runtime.pending_samples == 0
        await handlers.forward(call(), last_stage_request(), me)
        assert st.runtime.pending_samples == 2
        assert st.runtime.book.receipts_for([f"{me}/r1"]) == [[2, call()["receipt"]]]
    run(scenario())


def test_evaluate_answers_the_loss_and_leaves_nothing_behind():
    """A validation forward: the last stage's loss at its current weights (padding, -100, ignored), and
    no gradient, ledger entry, receipt, kept graph, reply or served sample counted."""
    async def scenario():
        handlers, st = served(1, ComputeGate(1.0, False))
        x, targets = last_stage_request()
        targets[0, -5:] = IGNORE_INDEX
        meta, tensors = await handlers.evaluate(StageCall("v1", 1, "hash", accumulate=False).to_meta(), [x, targets],
                                                ID["caller"])
        with torch.no_grad():
            assert meta["loss"] == pytest.approx(float(st.runtime.module(x, targets)), abs=1e-6)
        assert tensors == [] and meta["epoch"] == 0
        assert st.runtime.pending_samples == 0 and not st.runtime.graphs and st.counters["samples_served"] == 0
        assert all(p.grad is None for p in st.runtime.params) and st.runtime.module.training
        assert handlers.replies.repeat(f"{ID['caller']}/v1", 0) is None
        # an accumulating call with its receipt is still only evaluated
        await handlers.evaluate(call(req="v2"), [x, targets], ID["caller"])
        assert st.runtime.pending_samples == 0 and not st.runtime.book.receipts
        for bad, why in [(torch.full_like(targets, -5), r"ids must lie in \[0, 257\) or be -100"),
                         (torch.full_like(targets, 257), "ids must lie"), (targets[:1], "batch sizes differ")]:
            with pytest.raises(BadRequest, match=why):
                await handlers.evaluate(call(req="v3"), [x, bad], ID["caller"])
        with pytest.raises(BadRequest, match="takes \\(inputs, targets\\)"):
            await handlers.evaluate(call(req="v3"), [x], ID["caller"])
        with pytest.raises(Unavailable, match="stale replica"):
            await handlers.evaluate(call(req="v3", epoch=2), [x, targets], ID["caller"])
        st.moving_to = 0
        with pytest.raises(Unavailable, match="moving to stage 0"):
            await handlers.evaluate(call(req="v3"), [x, targets], ID["caller"])
    run(scenario())


def test_evaluate_on_an_earlier_stage_returns_its_outputs_and_keeps_no_graph():
    async def scenario():
        handlers, st = served(0, ComputeGate(1.0, False))
        ids = torch.randint(0, 257, (2, 16))
        _, (y,) = await handlers.evaluate(call(stage=0, req="v1"), [ids], ID["caller"])
        assert not st.runtime.graphs and st.counters["samples_served"] == 0
        with torch.no_grad():
            assert torch.allclose(y.value, st.runtime.module(ids), atol=1e-6)
        with pytest.raises(BadRequest, match="ids must lie in \\[0, 257\\)"):  # inputs: no -100 allowed
            await handlers.evaluate(call(stage=0, req="v2"), [torch.full((2, 16), IGNORE_INDEX)], ID["caller"])
    run(scenario())


def test_a_state_taken_to_serve_the_stage_is_noted_for_the_step_plan_and_a_copy_is_not():
    """A replica catching up or entering the stage says so (`joining`): this replica's step plan waits a
    while for it at the epoch it took. A copy's holder or an export does not hold the stage back."""
    async def scenario():
        handlers, st = served(1, ComputeGate(1.0, False))
        await handlers.state(StageQuery(1).to_meta(), [], ID["caller"])
        assert st.handed_now() == {}
        await handlers.state(StageQuery(1, joining=True).to_meta(), [], ID["another caller"])
        assert list(st.handed_now()) == [ID["another caller"]]
        st.runtime.epoch += 1  # (a step) the state it took is a step old: nothing to wait for at this epoch
        assert st.handed_now() == {}
        with pytest.raises(BadRequest, match="joining: expected bool"):
            await handlers.state({"stage": 1, "joining": "yes"}, [], ID["caller"])
    run(scenario())


def test_a_replicas_count_told_straight_is_kept_newest_first_and_wakes_the_step_loop():
    async def scenario():
        handlers, st = served(1, ComputeGate(1.0, False))
        st.wake.clear()
        await handlers.count(CountNote(1, 0, 40, seq=2).to_meta(), [], ID["caller"])
        await handlers.count(CountNote(1, 0, 32, seq=1).to_meta(), [], ID["caller"])  # overtaken by the newer
        (epoch, pending, _), = st.told_counts().values()
        assert (epoch, pending) == (0, 40) and st.wake.is_set()
        assert st.counters["counts_heard"] == 1  # (the overtaken note is not counted)
        st.wake.clear()
        await handlers.count(CountNote(1, 1, 8, seq=3).to_meta(), [], ID["caller"])  # the next epoch: no look
        assert not st.wake.is_set() and list(st.told_counts().values())[0][:2] == (1, 8)
        await handlers.count(CountNote(1, 9, 8, seq=4).to_meta(), [], ID["caller"])  # far ahead: not kept
        assert list(st.told_counts().values())[0][:2] == (1, 8)
        with pytest.raises(BadRequest, match="not negative"):
            await handlers.count({"stage": 1, "epoch": 0, "pending": -5, "seq": 5}, [], ID["caller"])
        with pytest.raises(Unavailable, match="hosts stage 1, not 0"):
            await handlers.count(CountNote(0, 0, 8, seq=6).to_meta(), [], ID["caller"])
        for i in range(2 * MAX_TOLD):  # a flood of identities keeps at most MAX_TOLD notes
            st.note_count(f"peer{i}", CountNote(1, 0, 8, seq=1))
        assert len(st.told_counts()) == MAX_TOLD
    run(scenario())


def test_the_step_plan_takes_a_told_count_over_the_record_as_far_along():
    record = ServerRecord(peer_id="b", stage=1, throughput=1.0, queue=0, epoch=4, pending=8, config_hash="h", model={})
    assert heard(record, None) == Replica("b", 4, 8)
    assert heard(record, (4, 40, 0.0)) == Replica("b", 4, 40)  # fresher than its record
    assert heard(record, (3, 40, 0.0)) == Replica("b", 4, 8)  # a note from before the step its record shows


def test_the_work_meter_learns_how_long_its_stage_usually_waits_for_work(monkeypatch):
    """A stage whose passes come two seconds apart is not idle after three without work; one whose passes
    come a tenth of a second apart is, after a period."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    for gap in (2.0, 0.1):
        meter = WorkMeter(last_stage=True)
        for _ in range(100):
            meter.count("forward", 4, 0.01)
            clock[0] += gap
        assert meter.gap == pytest.approx(gap, rel=0.01)
        clock[0] += 3.0 - gap  # three seconds since the last pass
        assert meter.unusually_idle(period=1.0) == (gap < 0.5)


def test_routing_weighs_work_as_served_and_rebalancing_as_it_would_go_alone(monkeypatch):
    """Under a CPU quota a busy server's jobs stretch with its own network work (the quota is shared);
    the figure a move is planned on is what the server would do with the quota to itself, the same busy
    or idle, so that an idle stage's servers do not look faster than a busy one's for being idle."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    meter = WorkMeter(last_stage=True)
    for _ in range(20):
        meter.count("forward", 8, 2.0, alone=1.0)  # served in 2 s, 1 s of it this server's own work
        clock[0] += 1.0
        meter.fold(period=1.0)
    assert meter.meter.rate == pytest.approx(4.0) and meter.capacity.rate == pytest.approx(8.0)


def test_the_gate_counts_a_jobs_cpu_time_over_the_quota_as_its_time_alone():
    async def scenario():
        counted = []
        gate = ComputeGate(1.0, False, quota=0.5)
        gate.count_work = lambda work, samples, seconds, alone: counted.append((seconds, alone))
        await gate.run(lambda: sum(i * i for i in range(200_000)), work="forward", samples=4)
        ((served, alone),) = counted
        assert alone == pytest.approx(2 * gate._cost) and served >= gate._cost
        gate.close()
    run(scenario())


def test_a_backward_to_the_server_that_ran_its_forward_goes_without_its_inputs():
    """That server keeps the forward's inputs with its graph: the output gradient alone accumulates exactly
    what the call with both would, and a repeat is answered from the cache. Where the inputs are not held it
    asks for them (`InputsNotHeld`, which the caller answers by sending them) and accumulates nothing; a
    gradient for another number of samples than the forward ran on is refused."""
    async def scenario():
        gate = ComputeGate(1.0, False)
        (lean, lean_st), (full, full_st) = served(0, gate), served(0, gate)
        full_st.runtime.module.load_state_dict(lean_st.runtime.module.state_dict())
        batchers = [asyncio.create_task(h.batcher.loop()) for h in (lean, full)]
        ids = torch.randint(0, 256, (2, 16))
        _, (y,) = await lean.forward(call(stage=0, req="a"), [ids], ID["caller"])
        await full.forward(call(stage=0, req="a"), [ids], ID["caller"])
        dy = torch.randn_like(y.value)
        await lean.backward(call(stage=0, req="a"), [dy], ID["caller"])
        await full.backward(call(stage=0, req="a"), [ids, dy], ID["caller"])
        assert lean_st.runtime.pending_samples == full_st.runtime.pending_samples == 2
        assert lean_st.runtime.fast_backwards == 1 and lean_st.runtime.recomputed_backwards == 0
        for mine, theirs in zip(lean_st.runtime.params, full_st.runtime.params, strict=True):
            assert torch.equal(mine.grad, theirs.grad)
        await lean.backward(call(stage=0, req="a"), [dy], ID["caller"])  # its graph is gone: from the cache
        assert lean_st.runtime.pending_samples == 2
        with pytest.raises(InputsNotHeld):
            await lean.backward(call(stage=0, req="never forwarded"), [dy], ID["caller"])
        await lean.forward(call(stage=0, req="b"), [ids], ID["caller"])
        with pytest.raises(BadRequest, match="batch"):
            await lean.backward(call(stage=0, req="b"), [dy[:1]], ID["caller"])
        assert lean_st.runtime.pending_samples == 2 and lean_st.runtime.duplicates == 0
        for task in batchers:
            task.cancel()
        gate.close()
    run(scenario())
