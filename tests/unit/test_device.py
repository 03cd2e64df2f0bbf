"""What a stage runs with on its device, and a smoke test of a stage pipeline on a GPU where one exists."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.unit.test_runtime import OPTIM, batch, tiny_cfg

from swarm.model import ComposedModel, load_stages
from swarm.server.device import autocast_dtype
from swarm.server.gradvec import gradient_vector
from swarm.server.runtime import StageRuntime
from swarm.wire.codecs import Packed, Policy, decode, encode

WIRE = Policy({"activations": "blockwise8", "gradients": "blockwise8"})


def test_a_cpu_stage_computes_in_fp32_unless_bf16_is_asked_for() -> None:
    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) is None
    assert autocast_dtype("none", cpu) is None
    assert autocast_dtype("bf16", cpu) is torch.bfloat16


def test_results_leave_the_compute_thread_packed_on_the_host() -> None:
    """With the wire's policy, a stage hands back what its codec makes of the very output it computed:
    the same bytes as packing the plain result afterwards, already on the host."""
    stages = load_stages(tiny_cfg(2, 2))
    plain, packing = StageRuntime(copy.deepcopy(stages[0]), OPTIM), StageRuntime(stages[0], OPTIM, wire=WIRE)
    inputs, targets = batch(2, seed=1)
    (expected,) = plain.forward([("mb", inputs)])
    (packed,) = packing.forward([("mb", inputs)])
    assert isinstance(packed, Packed) and all(part.device.type == "cpu" for part in packed.parts)
    assert packed.parts[0].dtype == torch.int8
    again = encode(expected, "blockwise8")
    assert packed.meta == again.meta
    assert all(torch.equal(a, b) for a, b in zip(packed.parts, again.parts, strict=True))

    last = StageRuntime(stages[1], OPTIM, wire=WIRE)
    loss, grad = last.forward_backward_last("mb", decode(packed), targets)
    assert isinstance(grad, Packed) and decode(grad).shape == expected.shape
    assert packing.backward("mb", inputs, decode(grad)) is None  # the first stage has no input gradient


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_stage_pipeline_trains_on_the_gpu() -> None:
    """Two stages on the GPU with the defaults (bf16 autocast where the GPU has it, TF32): results are
    quantized there and reach the host packed, the loss matches fp32 on the CPU within bf16's precision,
    and a step moves the weights."""
    stages = load_stages(tiny_cfg(2, 2))
    reference = ComposedModel(copy.deepcopy(stages))
    first, last = (StageRuntime(stage, OPTIM, device="cuda", wire=WIRE) for stage in stages)
    assert torch.backends.cuda.matmul.allow_tf32
    assert first.autocast_dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else None)
    inputs, targets = batch(4, seed=2)
    (hidden,) = first.forward([("mb", inputs)])
    assert isinstance(hidden, Packed) and all(part.device.type == "cpu" for part in hidden.parts)
    loss, grad = last.forward_backward_last("mb", decode(hidden), targets)
    assert loss == pytest.approx(reference(inputs, targets).item(), abs=5e-2)
    assert first.backward("mb", inputs, decode(grad)) is None
    for rt in (first, last):
        before = rt.digest()
        mean = gradient_vector(rt.params) / 4
        assert bool(torch.isfinite(mean).all())
        rt.apply_step(mean, 4, 1)
        assert rt.digest() != before and rt.epoch == 1
