"""A server's event loop renews its DHT records, so per-value work on a request (unpacking its codecs,
checking its tensors) must run elsewhere: here each is caught running and its thread compared with the
loop's."""

from __future__ import annotations

import asyncio
import threading

import torch
from tests.unit.test_allreduce import assert_exact_mean, grads, make_members
from tests.unit.test_server_parts import ID, call, last_stage_request, served
from tests.unit.test_servicer_limit import FakeContext, FakeId

from swarm.averaging import allreduce, checks
from swarm.net import protocol
from swarm.net.protocol import Tagged, decode, encode
from swarm.net.servicer import StageServicer
from swarm.server import handlers as handlers_module
from swarm.server.gate import ComputeGate
from swarm.wire import codecs
from swarm.wire.codecs import Policy


class Echo:
    """A stage handler that answers the tensors it was given."""

    max_request_bytes = 1 << 24

    def refused(self, method, caller, error) -> None:
        raise AssertionError(f"nothing is refused here: {error}")

    async def forward(self, meta, tensors, caller):
        return {}, tensors


def spy(monkeypatch, module, name: str) -> list[int]:
    """Threads `module.name` ran on, recorded as it runs."""
    threads: list[int] = []
    real = getattr(module, name)

    def recorded(*args, **kwargs):
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return threads


def test_a_server_unpacks_a_requests_codecs_off_its_event_loop(monkeypatch) -> None:
    x = torch.randn(4, 64, 32)
    request = list(encode({}, [Tagged("activations", x)], Policy({"activations":
                                                                                              "blockwise8"})))
    threads = spy(monkeypatch, codecs, "decode")

    async def scenario() -> tuple[int, torch.Tensor]:
        async def requests():
            for msg in request:
                yield msg
        servicer = StageServicer(Echo())
        responses = servicer._serve(Echo().forward, requests(), FakeContext(FakeId("QmCaller")))
        threads.clear()  # (encoding above ran no decode; the reply's decode below runs on this loop)
        _, [echoed] = await decode(responses, 1 << 24)
        return threading.get_ident(), echoed

    loop_thread, echoed = asyncio.run(scenario())
    assert threads[0] != loop_thread  # the request, unpacked on a worker thread
    assert torch.allclose(echoed, x, atol=float(codecs.error_bound(x, "blockwise8").max()))


def test_a_servers_checks_on_tensors_run_off_its_event_loop(monkeypatch) -> None:
    checked = spy(monkeypatch, handlers_module, "check_tensor")
    normed = spy(monkeypatch, handlers_module, "check_norm")

    async def scenario() -> int:
        handlers, _ = served(1, ComputeGate(1.0, False))
        await handlers.forward(call(), last_stage_request(), ID["caller"])
        first, _ = served(0, ComputeGate(1.0, False))
        tokens = torch.randint(0, 256, (2, 16))
        await first.evaluate(call(stage=0, req="r2"), [tokens], ID["caller"])
        dy = torch.randn(2, 16, 32)
        await first.backward(call(stage=0, req="r2"), [tokens, dy], ID["caller"])
        return threading.get_ident()

    loop_thread = asyncio.run(scenario())
    assert len(checked) >= 4 and len(normed) == 1  # inputs and targets; inputs (evaluate, backward) and gradients
    assert loop_thread not in checked + normed


def test_an_all_reduce_round_checks_reduces_and_unpacks_whole_parts_off_the_event_loop(monkeypatch) -> None:
    """On a slow machine, a stage's whole part summed, packed and checked on the event loop kept it from
    renewing its records for seconds: its peers took it for gone."""
    reduced = spy(monkeypatch, allreduce.StageAllReduce, "_reduce")
    answers = spy(monkeypatch, allreduce, "answer_problem")
    unpacked = spy(monkeypatch, codecs, "decode")
    parsed: list[int] = []
    parse = checks.Contribution.parse

    def recorded(*args, **kwargs):
        parsed.append(threading.get_ident())
        return parse(*args, **kwargs)

    monkeypatch.setattr(checks.Contribution, "parse", recorded)
    ids = ("peerA", "peerB")
    samples = {"peerA": 2, "peerB": 3}
    flat = grads(samples, 1000)
    members = make_members(ids)

    async def scenario() -> tuple[int, list]:
        results = await asyncio.gather(*(members[p].run(0, ids, flat[p], samples[p]) for p in ids))
        return threading.get_ident(), results

    loop_thread, results = asyncio.run(scenario())
    assert_exact_mean(results, flat, samples)
    assert len(reduced) == 2 and len(answers) == 4 and len(parsed) == 4 and unpacked
    assert loop_thread not in reduced + answers + parsed + unpacked


def test_a_large_payload_is_put_together_off_the_event_loop(monkeypatch) -> None:
    joined = spy(monkeypatch, protocol, "_collect")

    async def received(numel: int) -> int:
        async def stream():
            for msg in encode({}, [torch.zeros(numel)], Policy({})):
                yield msg
        meta, [tensor] = await decode(stream(), 1 << 30)
        assert tensor.numel() == numel
        return threading.get_ident()

    small_loop = asyncio.run(received(1000))
    assert joined == [small_loop]  # a thread hop would cost more than the copy
    joined.clear()
    large_loop = asyncio.run(received(3 << 20))  # 12 MiB in three chunks
    assert len(joined) == 1 and joined[0] != large_loop
