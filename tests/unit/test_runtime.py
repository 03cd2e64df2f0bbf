"""A stage's compute: a pipeline of runtimes reproduces one model's gradients, the fast backward matches
the recomputed one, and the optimizer step is AdamW on the mean gradient, reproducible bit for bit."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import math
from collections.abc import AsyncIterator

import pytest
import torch
from hivemind.proto import runtime_pb2

from swarm.config import ModelConfig, OptimConfig
from swarm.core.schedule import warmup_lr
from swarm.data import BYTE_PAD_ID, split_inputs_targets
from swarm.model import ComposedModel, load_stages
from swarm.net.protocol import decode, encode
from swarm.server.gradvec import gradient_vector
from swarm.server.runtime import LEDGER_EPOCHS, StageRuntime
from swarm.wire.validate import IGNORE_INDEX

SEQ = 16
D_MODEL = 32
OPTIM = OptimConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, warmup_steps=4, clip_grad_norm=1e9)


def tiny_cfg(n_layers: int = 3, num_stages: int = 3) -> ModelConfig:
    return ModelConfig(
        d_model=D_MODEL,
        n_heads=2,
        d_ff=64,
        n_layers=n_layers,
        seq_len=SEQ,
        vocab_size=257,
        num_stages=num_stages,
        dropout=0.0,
    )


def batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (size, SEQ + 1), generator=gen)
    tokens[0, -5:] = IGNORE_INDEX  # a padded tail: those targets do not count in the loss
    return split_inputs_targets(tokens, BYTE_PAD_ID)


def hidden(size: int, seed: int) -> torch.Tensor:
    return torch.randn(size, SEQ, D_MODEL, generator=torch.Generator().manual_seed(seed))


def runtime(stage: torch.nn.Module, optim: OptimConfig = OPTIM) -> StageRuntime:
    return StageRuntime(copy.deepcopy(stage), optim)


def flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def over_the_wire(meta: dict, tensors: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor]]:
    """What a state download does to the state: encoded for the wire, decoded on the other side."""

    async def stream() -> AsyncIterator[runtime_pb2.ExpertResponse]:
        for msg in encode(meta, tensors):
            yield msg

    return asyncio.run(decode(stream(), 1 << 34))


def assert_within(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.shape == expected.shape
    diff = (actual - expected).abs().max().item()
    assert diff <= tol, f"max abs difference {diff:.3g} > {tol:.3g}"


# ---- the pipeline equals one model ---------------------------------------------------------------


@pytest.mark.parametrize(("n_layers", "num_stages"), [(2, 2), (3, 3)])
def test_pipeline_gradients_equal_the_composed_model(n_layers: int, num_stages: int) -> None:
    """Forward stage by stage, last stage's forward+backward, backward in reverse: every stage's
    accumulated gradient is batch * d(mean loss)/d(params) of the single-process model."""
    stages = load_stages(tiny_cfg(n_layers, num_stages))
    runtimes = [runtime(s) for s in stages]
    reference = ComposedModel(copy.deepcopy(stages))
    inputs, targets = batch(3, seed=0)

    ref_loss = reference(inputs, targets)
    ref_loss.backward()

    sent = [inputs]  # what each stage received, as the trainer keeps it for the backward
    for rt in runtimes[:-1]:
        (out,) = rt.forward([("mb0", sent[-1])])
        sent.append(out)
    loss, grad = runtimes[-1].forward_backward_last("mb0", sent[-1], targets)
    for k in range(num_stages - 2, -1, -1):
        grad = runtimes[k].backward("mb0", sent[k], grad)
    assert grad is None  # the first stage has no input gradient to return

    assert loss == pytest.approx(ref_loss.item(), abs=1e-6)
    for rt, ref_stage in zip(runtimes, reference.stages, strict=True):
        expected = torch.cat([p.grad.reshape(-1) for p in ref_stage.parameters()]) * inputs.shape[0]
        assert_within(gradient_vector(rt.params), expected, 1e-5)
        assert rt.pending_samples == 3
    assert [rt.fast_backwards for rt in runtimes[:-1]] == [1] * (num_stages - 1)
    assert all(rt.recomputed_backwards == 0 for rt in runtimes)


def test_the_gradient_vector_is_zero_before_any_backward() -> None:
    stage = load_stages(tiny_cfg())[1]
    rt = runtime(stage)
    grad = gradient_vector(rt.params)
    assert grad.dtype == torch.float32
    assert grad.numel() == sum(p.numel() for p in stage.parameters())
    assert not grad.any()


# ---- fast path and recompute ---------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, 1])
def test_fast_backward_equals_recomputed_backward(index: int) -> None:
    """The kept graph and a recompute from the inputs give the same input and parameter gradients."""
    stage = load_stages(tiny_cfg())[index]
    x = batch(2, seed=1)[0] if index == 0 else hidden(2, seed=1)
    grad_out = hidden(2, seed=2)
    fast, slow = runtime(stage), runtime(stage)

    (out,) = fast.forward([("r1", x)])
    grad_fast = fast.backward("r1", x, grad_out)
    grad_slow = slow.backward("never-forwarded", x, grad_out)

    assert (fast.fast_backwards, fast.recomputed_backwards) == (1, 0)
    assert (slow.fast_backwards, slow.recomputed_backwards) == (0, 1)
    assert fast.pending_samples == slow.pending_samples == 2
    assert "r1" not in fast.graphs
    if index == 0:
        assert grad_fast is None and grad_slow is None
    else:
        assert grad_fast is not None and grad_slow is not None
        assert grad_fast.shape == x.shape
        assert_within(grad_fast, grad_slow, 1e-6)
    assert gradient_vector(fast.params).any()
    assert_within(gradient_vector(fast.params), gradient_vector(slow.params), 1e-6)


def test_a_repeated_microbatch_gets_its_input_gradient_but_is_not_accumulated_again() -> None:
    """The ledger holds the microbatch: a repeat (a retried or replayed call) returns the same input
    gradient and leaves the accumulated gradient as it was, before and after the step took it in."""
    rt = runtime(load_stages(tiny_cfg())[1])
    x, grad_out = hidden(2, seed=3), hidden(2, seed=4)
    rt.forward([("r", x)])
    first = rt.backward("r", x, grad_out)
    once = gradient_vector(rt.params)
    assert rt.pending == {"r": 2} and not rt.accumulates("r")
    second = rt.backward("r", x, grad_out)
    assert (rt.fast_backwards, rt.recomputed_backwards, rt.duplicates) == (1, 0, 1)
    assert rt.pending_samples == 2
    assert_within(second, first, 1e-5)
    assert torch.equal(gradient_vector(rt.params), once)

    record = rt.apply_step(gradient_vector(rt.params) / 2, 2, group=1)
    assert record.ids == ["r"] and rt.committed == {"r": 1} and rt.pending == {}
    rt.backward("r", x, grad_out)  # committed: still not accumulated
    assert rt.pending_samples == 0 and not gradient_vector(rt.params).any() and rt.duplicates == 2


def test_backward_without_accumulating_leaves_parameter_gradients_alone() -> None:
    """A call sent elsewhere after an unanswered one asks for the input gradient only."""
    plain, probe = (runtime(load_stages(tiny_cfg())[1]) for _ in range(2))
    x, grad_out = hidden(2, seed=5), hidden(2, seed=6)
    expected = plain.backward("r", x, grad_out)
    got = probe.backward("r", x, grad_out, accumulate=False)
    assert_within(got, expected, 1e-5)
    assert probe.pending == {} and not gradient_vector(probe.params).any()
    assert probe.accumulates("r")  # a later replay of it is accumulated


def test_last_stage_duplicate_reports_the_loss_and_input_gradient_only() -> None:
    stage = load_stages(tiny_cfg())[-1]
    rt = runtime(stage)
    x, targets = hidden(2, seed=7), batch(2, seed=8)[1]
    loss, grad = rt.forward_backward_last("m", x, targets)
    once = gradient_vector(rt.params)
    again, grad_again = rt.forward_backward_last("m", x, targets)
    _, grad_only = rt.forward_backward_last("other", x, targets, accumulate=False)
    assert again == pytest.approx(loss) and rt.duplicates == 2
    assert_within(grad_again, grad, 1e-5)
    assert_within(grad_only, grad, 1e-5)
    assert torch.equal(gradient_vector(rt.params), once) and rt.pending == {"m": 2}


def test_batched_backward_accumulates_only_new_microbatches() -> None:
    """A batch graph whose requests include one the ledger already holds: the others accumulate as
    usual, the known one gets its input gradient alone."""
    rt, ref = (runtime(load_stages(tiny_cfg())[1]) for _ in range(2))
    x1, x2, g1, g2 = hidden(1, seed=9), hidden(2, seed=10), hidden(1, seed=11), hidden(2, seed=12)
    ref.backward("a", x1, g1)
    rt.backward("a", x1, g1)
    rt.apply_step(gradient_vector(rt.params), 1, group=1)
    ref.apply_step(gradient_vector(ref.params), 1, group=1)
    rt.forward([("a", x1), ("b", x2)])
    results = rt.backward_batch(rt.graphs["a"], {"a": g1, "b": g2})
    expected_b = ref.backward("b", x2, g2)
    assert rt.pending == {"b": 2} and rt.duplicates == 1
    assert_within(results["b"], expected_b, 1e-5)
    assert_within(gradient_vector(rt.params), gradient_vector(ref.params), 1e-5)
    assert results["a"].shape == x1.shape


# ---- batched forward -----------------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, 1])
def test_batched_forward_equals_separate_requests(index: int) -> None:
    """Two requests merged into one forward and back-propagated together in one pass give the outputs
    and gradients of processing them separately, on the fast path."""
    stage = load_stages(tiny_cfg())[index]
    if index == 0:
        x1, x2 = batch(2, seed=5)[0], batch(3, seed=6)[0]
    else:
        x1, x2 = hidden(2, seed=5), hidden(3, seed=6)
    g1, g2 = hidden(2, seed=7), hidden(3, seed=8)
    merged, separate = runtime(stage), runtime(stage)

    out1, out2 = merged.forward([("r1", x1), ("r2", x2)])
    graph = merged.live_graph("r1")
    assert graph is not None and graph is merged.live_graph("r2") and graph.size == 2
    backs = merged.backward_batch(graph, {"r2": g2, "r1": g1})
    back1, back2 = backs["r1"], backs["r2"]

    (ref1,) = separate.forward([("r1", x1)])
    ref_back1 = separate.backward("r1", x1, g1)
    (ref2,) = separate.forward([("r2", x2)])
    ref_back2 = separate.backward("r2", x2, g2)

    assert out1.shape == (2, SEQ, D_MODEL) and out2.shape == (3, SEQ, D_MODEL)
    assert_within(out1, ref1, 1e-6)
    assert_within(out2, ref2, 1e-6)
    if index == 1:
        assert_within(back1, ref_back1, 1e-6)
        assert_within(back2, ref_back2, 1e-6)
    assert_within(gradient_vector(merged.params), gradient_vector(separate.params), 1e-5)
    assert merged.fast_backwards == separate.fast_backwards == 2
    assert merged.recomputed_backwards == 0
    assert merged.pending_samples == separate.pending_samples == 5
    assert merged.graphs == {}


# ---- the optimizer step --------------------------------------------------------------------------


def accumulate(rt: StageRuntime, seed: int, size: int = 3) -> int:
    """One microbatch's backward on a middle stage; returns its sample count."""
    rt.backward(f"acc{seed}", hidden(size, seed), hidden(size, seed + 100))
    return size


def reference_steps(
    stage: torch.nn.Module, mean_grads: list[torch.Tensor], optim: OptimConfig
) -> tuple[list[torch.Tensor], list[float]]:
    """Plain torch: clip, AdamW at the warm-up lr of each step; returns final params and pre-clip norms."""
    params = list(copy.deepcopy(stage).parameters())
    opt = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    norms = []
    for step, mean in enumerate(mean_grads):
        offset = 0
        for p in params:
            p.grad = mean[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, optim.clip_grad_norm or math.inf)))
        for group in opt.param_groups:
            group["lr"] = warmup_lr(step, optim.lr, optim.warmup_steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return params, norms


def test_apply_step_is_adamw_on_the_mean_gradient() -> None:
    stage = load_stages(tiny_cfg())[1]
    rt = runtime(stage)
    before = flat(rt.params).clone()
    samples = accumulate(rt, seed=10) + accumulate(rt, seed=11, size=2)
    assert rt.pending_samples == samples
    rt.forward([("kept", hidden(2, seed=12))])  # a graph built at epoch 0
    mean = gradient_vector(rt.params) / samples

    record = rt.apply_step(mean, samples, group=2)

    expected, (norm,) = reference_steps(stage, [mean], OPTIM)
    assert norm < OPTIM.clip_grad_norm  # this case does not clip
    assert_within(flat(rt.params), flat(expected), 1e-6)
    assert (flat(rt.params) - before).abs().max() > 1e-3  # it did move
    assert record.epoch == rt.epoch == 1
    assert (record.samples, record.group) == (samples, 2)
    assert record.lr == warmup_lr(0, OPTIM.lr, OPTIM.warmup_steps) == OPTIM.lr / OPTIM.warmup_steps
    assert record.grad_norm == pytest.approx(norm, rel=1e-6)
    assert record.digest == rt.digest()
    assert rt.pending_samples == 0
    assert not gradient_vector(rt.params).any()
    assert list(rt.graphs) == ["kept"] and rt.kept.holds(0)

    # The graph from epoch 0 outlives the step: its backward is the exact gradient at the weights its
    # forward ran at (the stage's first), accumulated for the next step; the kept copy then goes.
    at_forward = runtime(stage)
    x, g = hidden(2, seed=12), hidden(2, seed=13)
    grad = rt.backward("kept", x, g)
    assert (rt.fast_backwards, rt.recomputed_backwards) == (1, 2)
    assert_within(grad, at_forward.backward("other", x, g), 0.0)
    assert_within(gradient_vector(rt.params), gradient_vector(at_forward.params), 0.0)
    assert rt.pending == {"kept": 2} and rt.graphs == {} and not rt.kept.holds(0)


def test_apply_step_clips_to_the_configured_norm() -> None:
    """With a norm far above the limit, two steps match the reference that clips; without clipping
    the weights would differ, so the clip is what the match pins."""
    stage = load_stages(tiny_cfg())[1]
    probe = runtime(stage)
    samples = accumulate(probe, seed=20)
    natural = float(gradient_vector(probe.params).div(samples).norm())
    optim = OptimConfig(
        lr=OPTIM.lr, betas=OPTIM.betas, weight_decay=OPTIM.weight_decay, warmup_steps=4, clip_grad_norm=1e-6
    )
    assert natural > 100 * optim.clip_grad_norm
    rt = runtime(stage, optim)

    means, records = [], []
    for step in range(2):
        samples = accumulate(rt, seed=20 + step)
        means.append(gradient_vector(rt.params) / samples)
        records.append(rt.apply_step(means[-1], samples, group=1))

    clipped, norms = reference_steps(stage, means, optim)
    unclipped, _ = reference_steps(stage, means, OPTIM)
    assert_within(flat(rt.params), flat(clipped), 1e-6)
    assert (flat(rt.params) - flat(unclipped)).abs().max() > 1e-4
    assert [r.grad_norm for r in records] == pytest.approx(norms, rel=1e-6)
    assert records[0].grad_norm == pytest.approx(natural, rel=1e-6)
    assert [r.lr for r in records] == [warmup_lr(s, optim.lr, optim.warmup_steps) for s in range(2)]
    assert rt.epoch == 2


def test_discard_gradients_forgets_everything_accumulated() -> None:
    rt = runtime(load_stages(tiny_cfg())[1])
    accumulate(rt, seed=30)
    rt.forward([("kept", hidden(2, seed=31))])
    assert rt.discard_gradients() == 3
    assert rt.pending_samples == 0
    assert not gradient_vector(rt.params).any()
    assert rt.graphs == {}
    assert rt.epoch == 0


# ---- state transfer and digests ------------------------------------------------------------------


def train_steps(rt: StageRuntime, seeds: list[int]) -> None:
    for seed in seeds:
        samples = accumulate(rt, seed)
        rt.apply_step(gradient_vector(rt.params) / samples, samples, group=1)


@pytest.mark.parametrize("optimizer", ["adamw", "nag", "nag-raw"])
def test_loaded_state_reproduces_the_next_step_bit_for_bit(optimizer: str) -> None:
    """A newcomer that loads a replica's state (sent over the wire framing) holds the same bits, and
    the same next step keeps both identical: optimizer moments (NAG: the weights behind the look-ahead
    point, and the mean squares it normalizes by) and step count travel too."""
    stage = load_stages(tiny_cfg())[1]
    optim = dataclasses.replace(OPTIM, optimizer=optimizer.removesuffix("-raw"), nag_normalize=optimizer != "nag-raw")
    source = runtime(stage, optim)
    train_steps(source, [40, 41])
    newcomer = runtime(stage, optim)
    assert newcomer.digest() != source.digest()
    accumulate(newcomer, seed=99)  # stale work, computed at other weights

    meta, tensors = source.state()
    wire_meta, wire_tensors = over_the_wire(meta, tensors)
    newcomer.load_state(wire_meta, wire_tensors)

    assert newcomer.epoch == source.epoch == 2
    assert newcomer.digest() == source.digest()
    assert newcomer.pending_samples == 0 and not gradient_vector(newcomer.params).any()
    assert newcomer.committed == source.committed and len(source.committed) == 2  # the ledger travels too

    for rt in (source, newcomer):
        train_steps(rt, [42])
    assert newcomer.epoch == source.epoch == 3
    assert newcomer.digest() == source.digest()
    for a, b in zip(newcomer.params, source.params, strict=True):
        assert torch.equal(a, b)


def test_the_gradient_vector_takes_the_gradients_in_without_a_copy() -> None:
    """The round's vector is where the gradients live from then on: a retried round finds it as it was,
    backwards in between add to it, and the step reads the same sums as without it."""
    stage = load_stages(tiny_cfg())[1]
    rt, reference = runtime(stage), runtime(stage)
    for r in (rt, reference):
        accumulate(r, seed=50)
    vector = gradient_vector(rt.params)
    assert all(p.grad._base is vector for p in rt.params)
    assert gradient_vector(rt.params) is vector  # a round that failed is retried on the same memory
    for r in (rt, reference):
        accumulate(r, seed=51)
    assert gradient_vector(rt.params) is vector
    assert torch.equal(vector, gradient_vector(reference.params))
    for r in (rt, reference):
        r.apply_step(gradient_vector(r.params) / 6, 6, group=1)
    assert rt.digest() == reference.digest()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_state_is_lent_and_stays_as_it_was_while_held(mode: str) -> None:
    """`state` hands out the live tensors, not copies; a step (or an async local update) while a reader
    holds them moves the live state to fresh memory, so the reader's stays what it was; once the reader
    let go, the state changes in place again."""
    stage = load_stages(tiny_cfg())[1]
    rt = runtime(stage, dataclasses.replace(OPTIM, mode=mode))

    def change_state(seed: int) -> None:  # a step, or async a microbatch's local update
        if mode == "sync":
            train_steps(rt, [seed])
        else:
            accumulate(rt, seed)

    change_state(60)
    meta, lent = rt.state()
    copied = [t.clone() for t in lent]
    if mode == "sync":
        assert lent[0].data_ptr() == rt.params[0].data_ptr()
    opt_lent = lent[len(meta["names"]):]
    live_moments = [st["exp_avg"] for st in rt.optimizer.state.values()]
    assert any(t.data_ptr() == live_moments[0].data_ptr() for t in opt_lent)

    change_state(61)
    assert all(torch.equal(a, b) for a, b in zip(lent, copied, strict=True))
    assert not torch.equal(rt.optimizer.state[rt.params[0]]["exp_avg"], live_moments[0])
    loaded = runtime(stage, dataclasses.replace(OPTIM, mode=mode))
    loaded.load_state(meta, lent)  # what the reader got is a consistent state of one epoch
    assert loaded.digest() == meta["digest"]

    del lent, opt_lent, copied
    before = [p.data_ptr() for p in rt.params]
    change_state(62)
    assert [p.data_ptr() for p in rt.params] == before


def test_the_ledger_remembers_a_bounded_number_of_steps() -> None:
    rt = runtime(load_stages(tiny_cfg())[1])
    for epoch in range(LEDGER_EPOCHS + 3):
        rt.apply_step(torch.zeros_like(gradient_vector(rt.params)), 1, group=1, ids=[f"t/{epoch}a", f"t/{epoch}b"])
    assert len(rt.committed) == 2 * LEDGER_EPOCHS
    assert min(rt.committed.values()) == rt.epoch - LEDGER_EPOCHS + 1
    assert "t/0a" not in rt.committed and rt.accumulates("t/0a")
    meta, _ = rt.state()
    assert sum(len(ids) for _, ids in meta["ledger"]) == 2 * LEDGER_EPOCHS


def test_state_without_optimizer_moments_would_diverge() -> None:
    """Guards the test above: a newcomer with the weights but a fresh optimizer steps differently."""
    stage = load_stages(tiny_cfg())[1]
    source = runtime(stage)
    train_steps(source, [40, 41])
    newcomer = runtime(stage)
    meta, tensors = source.state()
    newcomer.load_state({**meta, "opt_keys": []}, tensors[: len(meta["names"])])
    assert newcomer.digest() == source.digest()
    for rt in (source, newcomer):
        train_steps(rt, [42])
    assert newcomer.digest() != source.digest()


def test_load_state_refuses_a_wrong_tensor_count() -> None:
    stage = load_stages(tiny_cfg())[1]
    source, target = runtime(stage), runtime(stage)
    train_steps(source, [50])
    meta, tensors = source.state()
    with pytest.raises(ValueError, match="expected"):
        target.load_state(meta, tensors[:-1])


def test_load_state_refuses_parameters_that_fail_their_checksum() -> None:
    """A state damaged on the way (or on disk) is refused before anything is loaded."""
    stage = load_stages(tiny_cfg())[1]
    source, target = runtime(stage), runtime(stage)
    train_steps(source, [51])
    meta, tensors = source.state()
    before = target.digest()
    damaged = [t.clone() for t in tensors]
    damaged[0].view(-1)[0] += 1.0
    with pytest.raises(ValueError, match="checksum"):
        target.load_state(meta, damaged)
    assert target.digest() == before and target.epoch == 0
    target.load_state(meta, tensors)
    assert target.digest() == source.digest()


def test_digest_follows_the_parameters() -> None:
    rt = runtime(load_stages(tiny_cfg())[1])
    other = runtime(load_stages(tiny_cfg())[1])
    original = rt.digest()
    assert len(original) == 32
    assert other.digest() == original  # same config, same init seed: same bits
    with torch.no_grad():
        p = rt.params[-1]
        old = p.view(-1)[0].clone()
        p.view(-1)[0] = torch.nextafter(old, old + 1)  # the smallest possible change
        assert rt.digest() != original
        p.view(-1)[0] = old
    assert rt.digest() == original


def test_a_batch_member_left_out_of_the_batch_backward_is_recomputed() -> None:
    """A request whose gradient missed its batch's single backward is recomputed, and the gradients of
    both requests still sum to those of processing them separately."""
    stage = load_stages(tiny_cfg())[1]
    x1, x2, g1, g2 = hidden(2, seed=5), hidden(3, seed=6), hidden(2, seed=7), hidden(3, seed=8)
    merged, separate = runtime(stage), runtime(stage)

    merged.forward([("r1", x1), ("r2", x2)])
    back1 = merged.backward_batch(merged.live_graph("r1"), {"r1": g1})["r1"]
    assert merged.live_graph("r2") is None  # the graph was consumed
    back2 = merged.backward("r2", x2, g2)

    separate.forward([("r1", x1)])
    ref1 = separate.backward("r1", x1, g1)
    separate.forward([("r2", x2)])
    ref2 = separate.backward("r2", x2, g2)

    assert_within(back1, ref1, 1e-6)
    assert_within(back2, ref2, 1e-6)
    assert_within(gradient_vector(merged.params), gradient_vector(separate.params), 1e-5)
    assert (merged.fast_backwards, merged.recomputed_backwards) == (1, 1)
    assert merged.pending_samples == 5


def test_a_step_on_a_non_finite_gradient_leaves_the_weights_as_they_were() -> None:
    """Every replica gets the same mean: each leaves its weights alone, and the epoch (and the ledger)
    still moves on, so delivery stays exact."""
    rt = runtime(load_stages(tiny_cfg())[1])
    before = flat(rt.params).clone()
    samples = accumulate(rt, seed=5)
    mean = gradient_vector(rt.params) / samples
    mean[3] = float("nan")
    record = rt.apply_step(mean, samples, group=1)
    assert not math.isfinite(record.grad_norm)
    assert torch.equal(flat(rt.params), before) and rt.epoch == 1 and len(rt.committed) == 1
    train_steps(rt, [6])  # and the next, finite step is taken
    assert not torch.equal(flat(rt.params), before) and bool(torch.isfinite(flat(rt.params)).all())


def _spoiled(rt: StageRuntime, spoil) -> tuple[dict, list[torch.Tensor]]:
    meta, tensors = rt.state()
    meta, tensors = dict(meta), [t.clone() for t in tensors]
    spoil(meta, tensors)
    return meta, tensors


@pytest.mark.parametrize(("spoil", "message"), [
    (lambda m, t: t[0].view(-1).__setitem__(0, float("nan")), "NaN"),
    (lambda m, t: m.update(epoch=float("inf")), "epoch"),
    (lambda m, t: m.update(epoch=2.5), "epoch"),
    (lambda m, t: m.update(epoch=True), "epoch"),
    (lambda m, t: t.__setitem__(1, torch.zeros(3)), "is torch.float32"),
    (lambda m, t: m.update(names=list(reversed(m["names"]))), "other tensors"),
    (lambda m, t: m.update(opt_keys=[[10**6, "exp_avg"]] + m["opt_keys"][1:]), "optimizer entries"),
    (lambda m, t: m.update(ledger=[["x", "y"]]), "ledger"),
    (lambda m, t: t.pop(), "tensors, expected"),
])
def test_a_bad_state_is_refused_whole_and_changes_nothing(spoil, message) -> None:
    """A state from another peer is checked in full before any of it is applied."""
    stage = load_stages(tiny_cfg())[1]
    source, target = runtime(stage), runtime(stage)
    train_steps(source, [40])
    meta, tensors = _spoiled(source, spoil)
    before = [t.clone() for t in target.module.state_dict().values()]
    with pytest.raises(ValueError, match=message):
        target.load_state(meta, tensors)
    assert target.epoch == 0
    assert all(torch.equal(a, b) for a, b in zip(before, target.module.state_dict().values(), strict=True))
