"""A fuzzer for a live stage server: random and mutated messages to every call of the protocol.

Operators run it (`swarm fuzz`) against a server of their own before they open a swarm to strangers, and
the test suite runs it against a live one. Each message is one of:

- `meta`: a well-formed request whose metadata has fields replaced, dropped or added, with values of
  every kind (huge and negative numbers, NaN, long strings, nested lists, maps);
- `tensors`: well-formed metadata with tensors of random dtypes, shapes and counts;
- `wire`: the description of the packed tensors mutated (parts, codecs, shapes, block sizes);
- `bytes`: a request's serialized protobuf with bytes flipped, inserted or cut, sent on a raw stream.

A message framed well must be answered, and answered with an error unless it happens to be valid; one
framed badly may end its stream without an answer. After every batch a well-formed request must be
served again within `alive_timeout`: the server has not crashed, and its event loop is not stuck.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from swarm.config import SwarmConfig, config_hash
from swarm.net.frames import Frame
from swarm.net.protocol import WIRE_KEY, Tagged, encode
from swarm.net.transport import CallFailed, StageClient
from swarm.wire.codecs import CODECS, DTYPES

METHODS = ("forward", "backward", "evaluate", "reduce", "state", "ledger", "backup", "count")
KINDS = ("meta", "tensors", "wire", "bytes")


@dataclass
class Target:
    """A server to fuzz: its peer id, its stage, and what a good request to it looks like."""

    peer: str
    stage: int
    good: Callable[[], tuple[str, dict[str, Any], list[Any]]]  # method, meta, tensors of a valid call


def forward_targets(cfg: SwarmConfig, servers: dict[int, str]) -> list[Target]:
    """A target per stage server, whose good request is a forward of two random samples."""
    seq, d, good_hash = cfg.model.seq_len, cfg.model.d_model, config_hash(cfg)
    ids, hidden = torch.randint(0, 256, (2, seq)), torch.randn(2, seq, d)
    counter = itertools.count()

    def good(stage: int) -> tuple[str, dict[str, Any], list[Any]]:
        # the input gradient only: accumulating takes a trainer's receipt (swarm.net.receipts)
        meta = {"req": f"fuzz-good-{next(counter)}", "stage": stage, "config": good_hash, "accumulate": False}
        return "forward", meta, [ids] if stage == 0 else [hidden, ids]

    return [Target(peer, stage, functools.partial(good, stage)) for stage, peer in servers.items()]


@dataclass
class FuzzReport:
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)  # "error", "ok", "closed" (no answer), by kind
    slowest_answer: float = 0.0  # seconds
    slowest_alive_check: float = 0.0  # seconds a good request took after a batch
    problems: list[str] = field(default_factory=list)  # what broke the rules above


class Fuzzer:
    def __init__(self, p2p: P2P, client: StageClient, seed: int = 0, timeout: float = 10.0):
        self.p2p, self.client = p2p, client
        self.rng = random.Random(seed)
        self.timeout = timeout

    async def run(self, target: Target, messages: int, batch: int = 100, alive_timeout: float = 10.0,
                  methods: tuple[str, ...] = METHODS) -> FuzzReport:
        """Send `messages` random and mutated messages to `methods` of the target (spread at random), and a
        good request after every `batch` of them."""
        report = FuzzReport()
        while report.sent < messages:
            for _ in range(min(batch, messages - report.sent)):
                kind, method = self.rng.choice(KINDS), self.rng.choice(methods)
                started = time.monotonic()
                outcome, sent = await self._one(target, kind, method)
                report.slowest_answer = max(report.slowest_answer, time.monotonic() - started)
                report.outcomes[f"{kind}:{outcome}"] += 1
                report.sent += 1
                if outcome == "closed" and kind != "bytes":
                    report.problems.append(f"a well-framed {kind} message to {method} got no answer: {sent}")
            started = time.monotonic()
            method, meta, tensors = target.good()
            try:
                await self.client.call(target.peer, method, meta, tensors, alive_timeout)
            except CallFailed as e:
                report.problems.append(f"after {report.sent} messages a good {method} failed: {e}")
                break
            report.slowest_alive_check = max(report.slowest_alive_check, time.monotonic() - started)
        return report

    async def _one(self, target: Target, kind: str, method: str) -> tuple[str, str]:
        """Send one message; how it was answered, and what it was (its metadata, shortened)."""
        _, meta, tensors = target.good()
        meta = {**meta, "stage": target.stage}
        if kind == "meta":
            meta = self._mutate_map(meta)
        elif kind == "tensors":
            tensors = [self._tensor() for _ in range(self.rng.randrange(4))]
        messages = list(encode(meta if isinstance(meta, dict) else {"x": meta},
                               [Tagged("activations", t) for t in tensors]))
        if kind == "wire":
            self._mutate_wire(messages[0])
        raw = [m.SerializeToString() for m in messages]
        if kind == "bytes":
            raw = [self._mutate_bytes(r) for r in raw]
        outcome = await self._send(target.peer, method, raw)
        if outcome == "closed" and kind != "bytes":  # libp2p streams now and then end early under load
            outcome = await self._send(target.peer, method, raw)  # (the transport retries once too)
        return outcome, repr(meta)[:300]

    async def _send(self, peer: str, method: str, raw: list[bytes]) -> str:
        """Send serialized request messages on a stream of their own; how the server answered."""
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer),
                                                                      f"StageServicer.rpc_{method}")
        try:
            for data in raw:
                writer.write(P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)
            reply, _ = await asyncio.wait_for(P2P.receive_protobuf(runtime_pb2.ExpertResponse, reader), self.timeout)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            return "closed"
        finally:
            writer.close()
        if reply is None:
            return "error"  # the handler itself failed (hivemind's error marker)
        meta = msgpack.unpackb(reply.metadata) if reply.metadata else {}
        return "error" if isinstance(meta, dict) and "error" in meta else "ok"

    # ---- mutations ---------------------------------------------------------------------------

    def _value(self, depth: int = 0) -> Any:
        rng = self.rng
        choices = [None, True, 0, -1, 2**63 - 1, -(2**63), rng.randrange(-1000, 1000), math.nan, math.inf,
                   -math.inf, 1e308, rng.random(), "", "x" * rng.choice((1, 100, 10_000)),
                   bytes(rng.randrange(256) for _ in range(rng.randrange(16)))]
        if depth < 3:
            choices += [[self._value(depth + 1) for _ in range(rng.randrange(5))],
                        {str(rng.randrange(9)): self._value(depth + 1) for _ in range(rng.randrange(4))},
                        ["12D3KooW" + "x" * 44] * rng.choice((1, 300))]
        return rng.choice(choices)

    def _mutate_map(self, meta: dict[str, Any]) -> Any:
        rng = self.rng
        if rng.random() < 0.05:
            return self._value()  # not a map at all
        out = dict(meta)
        keys = list(out) + ["epoch", "group", "samples", "ids", "req", "config", "timeout", "deadline", "digest"]
        for _ in range(rng.randrange(1, 4)):
            key = rng.choice(keys)
            if rng.random() < 0.2:
                out.pop(key, None)
            else:
                out[key] = self._value()
        return out

    def _tensor(self) -> torch.Tensor:
        rng = self.rng
        dtype = rng.choice(list(DTYPES.values()))
        # at most 64^3 values: a payload over the server's limit is refused before it is read whole, and its
        # sender may then see the stream break rather than the answer (tests/integration/test_bad_input.py)
        shape = [rng.choice((0, 1, 2, 3, 7, 64)) for _ in range(rng.randrange(4))]
        return torch.zeros(shape, dtype=dtype) if dtype == torch.bool else (torch.rand(shape) * 300).to(dtype)

    def _mutate_wire(self, first: Frame) -> None:
        meta = msgpack.unpackb(first.metadata) if first.metadata else {}
        entries = meta.get(WIRE_KEY) or [{"role": "activations", "parts": 1, "codec": "none"}]
        entry = self.rng.choice(entries)
        field_, value = self.rng.choice([
            ("parts", self._value()), ("codec", self.rng.choice(CODECS + ("zip",))), ("shape", self._value()),
            ("dtype", self.rng.choice(list(DTYPES) + ["int3"])), ("block", self.rng.choice((0, -1, 2**29, 2**62))),
            ("lo", self._value()), ("step", self._value()), ("role", self._value()),
        ])
        entry[field_] = value
        meta[WIRE_KEY] = entries if self.rng.random() < 0.9 else entries * self.rng.randrange(2, 50)
        first.metadata = msgpack.packb(meta, default=repr)

    def _mutate_bytes(self, data: bytes) -> bytes:
        rng, out = self.rng, bytearray(data)
        for _ in range(rng.randrange(1, 8)):
            op = rng.randrange(3)
            at = rng.randrange(len(out) + 1)
            if op == 0 and out:
                out[min(at, len(out) - 1)] = rng.randrange(256)
            elif op == 1:
                out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 16)))
            else:
                del out[at:at + rng.randrange(1, 64)]
        return bytes(out)
