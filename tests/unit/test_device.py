"""What a stage runs with on its device, and a smoke test of a stage pipeline on a GPU where one exists."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from tests.unit.test_runtime import OPTIM, batch, tiny_cfg
from tests.unit.test_servicer_limit import FakeContext, FakeId

from swarm.model import ComposedModel, load_stages
from swarm.net import protocol
from swarm.net.protocol import Tagged
from swarm.net.servicer import StageServicer
from swarm.server.device import autocast_dtype, cpu_bf16_hint, fastest_half
from swarm.server.gradvec import gradient_vector
from swarm.server.runtime import StageRuntime
from swarm.wire.codecs import CODECS, Packed, Policy, decode, encode
from swarm.wire.validate import BadRequest, check_norm, largest_magnitude

WIRE = Policy({"activations": "blockwise8", "gradients": "blockwise8"})


def test_a_cpu_stage_computes_in_fp32_unless_bf16_is_asked_for() -> None:
    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) is None
    assert autocast_dtype("none", cpu) is None
    assert autocast_dtype("bf16", cpu) is torch.bfloat16


def test_a_cpu_with_amx_left_in_fp32_by_auto_is_told_what_bf16_would_give(tmp_path) -> None:
    amx, plain = tmp_path / "amx", tmp_path / "plain"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile\n")
    plain.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n")
    cpu = torch.device("cpu")
    assert "bf16" in cpu_bf16_hint("auto", cpu, amx) and "AMX" in cpu_bf16_hint("auto", cpu, amx)
    assert cpu_bf16_hint("auto", cpu, plain) is None  # (measured only on AMX: no claim without it)
    assert cpu_bf16_hint("none", cpu, amx) is None and cpu_bf16_hint("bf16", cpu, amx) is None
    assert cpu_bf16_hint("auto", torch.device("cuda"), amx) is None
    assert cpu_bf16_hint("auto", cpu, tmp_path / "absent") is None


def test_auto_picks_the_half_precision_a_gpus_tensor_cores_have() -> None:
    """bf16 from Ampere (8.x) on, fp16 on Volta and Turing (7.x), whose bf16 torch only emulates, and
    none on older cards, whose fp16 is mostly slower than their fp32."""
    assert [fastest_half(major) for major in (9, 8, 7, 6, 5)] == [
        torch.bfloat16, torch.bfloat16, torch.float16, None, None]
    assert autocast_dtype("fp16", torch.device("cpu")) is torch.float16


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


@pytest.mark.parametrize("codec", CODECS)
def test_a_packed_tensor_is_unpacked_where_it_is_asked_for(codec: str) -> None:
    """Its parts go there first, and every operation of the codec runs there: on the "meta" device, which
    holds no values, a step left on the host would fail or leave a host tensor."""
    x = torch.randn(3, 40, 16, dtype=torch.bfloat16)
    out = decode(encode(x, codec), torch.device("meta"))
    assert out.device.type == "meta" and out.shape == x.shape and out.dtype == x.dtype


class Arrivals:
    """A stage handler that notes where each call's tensors arrived."""

    max_request_bytes = 1 << 24

    def __init__(self) -> None:
        self.devices: dict[str, set[str]] = {}

    def refused(self, method, caller, error) -> None:
        raise AssertionError(f"nothing is refused here: {error}")

    def _note(self, method: str, tensors: list[torch.Tensor]) -> tuple[dict, list]:
        self.devices[method] = {t.device.type for t in tensors}
        return {}, []

    async def forward(self, meta, tensors, caller):
        return self._note("forward", tensors)

    async def backward(self, meta, tensors, caller):
        return self._note("backward", tensors)

    async def evaluate(self, meta, tensors, caller):
        return self._note("evaluate", tensors)

    async def reduce(self, meta, tensors, caller):
        return self._note("reduce", tensors)


def test_a_servers_stage_calls_arrive_on_its_device_and_its_other_calls_on_the_host() -> None:
    """Forwards, backwards and evaluations are unpacked where the stage computes (a GPU server's own
    GPU); all-reduce parts stay on the host, where the round sums them."""
    handler = Arrivals()
    servicer = StageServicer(handler, device=torch.device("meta"))
    wire = Policy({"activations": "blockwise8", "gradients": "blockwise8"})
    tensors = [torch.randint(0, 256, (2, 16)), Tagged("gradients", torch.randn(2, 16, 32))]

    async def scenario() -> None:
        for method in ("forward", "backward", "evaluate", "reduce"):
            async def requests():
                for msg in protocol.encode({}, tensors, wire):
                    yield msg
            async for _ in getattr(servicer, f"rpc_{method}")(requests(), FakeContext(FakeId("QmCaller"))):
                pass

    asyncio.run(scenario())
    assert handler.devices == {"forward": {"meta"}, "backward": {"meta"}, "evaluate": {"meta"}, "reduce": {"cpu"}}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_request_unpacked_on_the_gpu_is_the_hosts_and_passes_the_same_checks() -> None:
    """The same values within float32's rounding: a GPU's kernels need not round as the host's do (a first
    version of this test, asking for equal bits, failed on an H200)."""
    gpu = torch.device("cuda", torch.cuda.current_device())
    dy = torch.randn(4, 64, 256)
    packed = encode(dy, "blockwise8")
    there, here = decode(packed, gpu), decode(packed)
    assert there.device == gpu
    torch.testing.assert_close(there.cpu(), here, rtol=1e-6, atol=0.0)
    assert largest_magnitude(there) == pytest.approx(largest_magnitude(here), rel=1e-6)
    check_norm("grad_outputs", there, 1e4)
    with pytest.raises(BadRequest, match="exceeds the bound"):
        check_norm("grad_outputs", there, 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("autocast", ["auto", "fp16"])
def test_a_stage_pipeline_trains_on_the_gpu(autocast: str) -> None:
    """Two stages on the GPU with the defaults (autocast in its fastest half precision, TF32), and in fp16
    through the loss scale: results are quantized there and reach the host packed, the loss matches fp32
    on the CPU within half precision's, and a step moves the weights."""
    stages = load_stages(tiny_cfg(2, 2))
    reference = ComposedModel(copy.deepcopy(stages))
    first, last = (StageRuntime(stage, OPTIM, device="cuda", autocast=autocast, wire=WIRE) for stage in stages)
    assert torch.backends.cuda.matmul.allow_tf32
    assert first.autocast_dtype == (torch.float16 if autocast == "fp16"
                                    else fastest_half(torch.cuda.get_device_capability()[0]))
    assert (first.loss_scale is not None) == (first.autocast_dtype == torch.float16)
    inputs, targets = batch(4, seed=2)
    (hidden,) = first.forward([("mb", inputs)])
    assert isinstance(hidden, Packed) and all(part.device.type == "cpu" for part in hidden.parts)
    # each request unpacked on the GPU, as a GPU server's servicer does
    loss, grad = last.forward_backward_last("mb", decode(hidden, last.device), targets.to(last.device))
    assert loss == pytest.approx(reference(inputs, targets).item(), abs=5e-2)
    assert first.backward("mb", inputs.to(first.device), decode(grad, first.device)) is None
    for rt in (first, last):
        before = rt.digest()
        mean = gradient_vector(rt.params) / 4
        assert bool(torch.isfinite(mean).all())
        rt.apply_step(mean, 4, 1)
        assert rt.digest() != before and rt.epoch == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_gpu_stages_state_goes_out_as_host_copies_and_a_step_then_changes_it_in_place() -> None:
    """A reader of a GPU stage's state (a checkpoint, a download served) gets copies on the host, which the
    stage's steps cannot touch: a step while the reader holds them leaves the live state where it is, where a
    CPU stage's would move it to fresh memory (tests/unit/test_runtime.py)."""
    stage = load_stages(tiny_cfg(2, 2))[1]
    rt = StageRuntime(stage, OPTIM, device="cuda", wire=WIRE)
    mean = torch.full((sum(p.numel() for p in rt.params),), 1e-3)
    rt.apply_step(mean, 4, 1)  # (the optimizer's state exists from here)
    meta, lent = rt.state()
    assert all(t.device.type == "cpu" for t in lent)
    copied = [t.clone() for t in lent]
    params = [p.data_ptr() for p in rt.params]
    moments = [st["exp_avg"].data_ptr() for st in rt.optimizer.state.values()]
    rt.apply_step(mean, 4, 2)
    assert [p.data_ptr() for p in rt.params] == params
    assert [st["exp_avg"].data_ptr() for st in rt.optimizer.state.values()] == moments
    assert all(torch.equal(a, b) for a, b in zip(lent, copied, strict=True))
    assert meta["digest"] != rt.digest()
