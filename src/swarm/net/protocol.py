"""Framing of requests and replies: msgpack metadata plus tensors, streamed in 4 MiB parts.

Every tensor-carrying call is a stream, because hivemind caps unary messages at 4 MiB and a larger
one hangs the caller. Metadata rides on the first message only. The receiver counts bytes as parts
arrive and refuses a payload over its limit before it is fully buffered. Metadata that would not fit
beside a full tensor part (a state's delivery ledger can be a few hundred KiB) gets a message of its own.

Each tensor travels packed by the codec of its role (`Tagged`; see `swarm.wire.codecs`): the
metadata lists, per tensor, its role, codec and how many raw parts carry it, so the receiver decodes
without knowing the sender's settings. Raw parts are plain little-endian bytes with a dtype and
shape, written and checked here (no numpy dtype games, bf16 included). Both sides count the bytes
of each role that cross the wire (`Traffic`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy
import torch
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from swarm.net.frames import Frame, Part
from swarm.net.quiet import Quiet
from swarm.wire import codecs
from swarm.wire.validate import BadRequest, Truncated, Unavailable

log = logging.getLogger(__name__)
# hivemind's stream readers, which these lines come from, do not know the peer: the limit is global
_quiet = Quiet(log)
OVERSIZED, MALFORMED = "oversized stream messages", "malformed stream messages"  # kinds of line in _quiet
CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024  # a little under the 4 MiB cap, leaving room for framing
MAX_MESSAGE_BYTES = 8 * 1024 * 1024  # a stream message declaring more is cut off before it is read
MAX_TENSORS = 1 << 14  # tensors (and raw parts) one payload may carry: a stage's state has a few per layer
INLINE_META_BYTES = 32 * 1024  # metadata up to this size shares the first message with a tensor part
INLINE_BYTES = 1 << 20  # payloads up to this size are put together on the event loop (a thread hop costs more)
WIRE_KEY = "_wire"  # the metadata entry that describes the tensors
META_ROLE = "meta"  # where the bytes of the metadata itself are counted
FRAMED = (runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)  # what stage calls send: read as `Frame`s


@dataclass(frozen=True)
class Tagged:
    """A tensor and what it is: its role picks its codec and where its bytes are counted. A value that
    is already `Packed` goes as it is (an all-reduce owner sends every member the very same bits)."""

    role: str
    value: torch.Tensor | codecs.Packed


Item = torch.Tensor | Tagged  # a bare tensor travels as it is, counted as "other"


class Traffic:
    """Bytes this peer put on and took off the wire, by role."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}

    def add(self, role: str, direction: str, nbytes: int) -> None:
        by_direction = self.counts.setdefault(role, {"sent": 0, "received": 0})
        by_direction[direction] += nbytes

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {role: dict(counts) for role, counts in sorted(self.counts.items())}


def encode(
    meta: dict[str, Any],
    tensors: Sequence[Item],
    policy: codecs.Policy = codecs.EXACT,
    traffic: Traffic | None = None,
) -> Iterator[Frame]:
    """Yield the messages that carry `meta` and `tensors`; at least one even with no tensors."""
    packs = [_pack(item, policy) for item in tensors]
    if packs:
        meta = {**meta, WIRE_KEY: [{"role": role, "parts": len(p.parts), **p.meta} for role, p in packs]}
    packed = msgpack.packb(meta)
    if len(packed) > CHUNK_BYTES:
        raise ValueError(f"metadata of {len(packed)} bytes exceeds one message")
    if traffic is not None:
        traffic.add(META_ROLE, "sent", len(packed))
    first = True
    if len(packed) > INLINE_META_BYTES:
        yield Frame(metadata=packed)
        first = False
    for role, pack in packs:
        for raw in pack.parts:
            for part in _chunks(raw):
                if traffic is not None:
                    traffic.add(role, "sent", len(part.buffer))
                msg = Frame(tensors=[part])
                if first:
                    msg.metadata = packed
                    first = False
                yield msg
    if first:
        yield Frame(metadata=packed)


async def packed(tensors: Sequence[Item], policy: codecs.Policy) -> list[Item]:
    """The same items, each packed by its role's codec on a worker thread: quantizing and copying whole
    tensors stays off the event loop, which also answers other calls and renews the peer's DHT records.
    `encode` then only frames the bytes."""
    if all(isinstance(t, Tagged) and isinstance(t.value, codecs.Packed) for t in tensors):
        return list(tensors)
    return await asyncio.to_thread(lambda: [_packed_on_host(item, policy) for item in tensors])


@dataclass
class Received:
    """A payload off the wire, its tensors still packed: `receive` reads it on the event loop, and the
    codec work of `tensors` can then run elsewhere (a server unpacks requests on a worker thread, so
    that the loop which renews its DHT records does none)."""

    meta: dict[str, Any]
    packs: list[codecs.Packed]

    def tensors(self, device: torch.device | None = None) -> list[torch.Tensor]:
        return [codecs.decode(p, device) for p in self.packs]

    async def unpacked(self, device: torch.device | None = None) -> list[torch.Tensor]:
        """`tensors`, unpacked on a worker thread (see `packed`), on `device` if given."""
        return await asyncio.to_thread(self.tensors, device) if self.packs else []


async def decode(
    stream: AsyncIterator[Frame], max_bytes: int, traffic: Traffic | None = None,
    admit: Callable[[dict[str, Any]], None] | None = None, device: torch.device | None = None,
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Reassemble a stream produced by `encode`, its tensors on `device` (default: the host); raises
    BadRequest on an oversized or malformed one. `admit` sees the metadata as soon as it arrives, before
    any tensor is read: it raises to refuse."""
    received = await receive(stream, max_bytes, traffic, admit)
    return received.meta, await received.unpacked(device)


async def receive(
    stream: AsyncIterator[Frame], max_bytes: int, traffic: Traffic | None = None,
    admit: Callable[[dict[str, Any]], None] | None = None,
) -> Received:
    """`decode` up to the codecs: the payload read, checked against its limit and its description, and
    counted; its tensors still packed."""
    meta: dict[str, Any] | None = None
    chunked: list[list[Part]] = []  # the chunks of each raw part
    total = 0
    async for msg in stream:  # an error of the stream itself (peer or connection failed) propagates as is
        with _garbage_is_bad_request():
            if meta is None:
                meta = msgpack.unpackb(msg.metadata) if msg.metadata else {}
                if traffic is not None:
                    traffic.add(META_ROLE, "received", len(msg.metadata))
                if admit is not None:
                    if not isinstance(meta, dict):
                        raise BadRequest("malformed metadata")
                    admit(meta)
            for part in msg.tensors:
                total += len(part.buffer)
                if total > max_bytes:
                    raise BadRequest(f"payload exceeds the limit of {max_bytes / 2**20:.1f} MiB")
                if part.dtype or not chunked:  # (a part's first chunk says its dtype and shape)
                    if len(chunked) >= MAX_TENSORS:
                        raise BadRequest(f"payload carries more than {MAX_TENSORS} tensor parts")
                    chunked.append([])
                chunked[-1].append(part)
    # joining a large payload's chunks into tensors is copying megabytes: not on the event loop
    raw, sizes = await asyncio.to_thread(_collect, chunked) if total > INLINE_BYTES else _collect(chunked)
    if meta is None:
        raise BadRequest("empty stream: the other side closed it before sending anything")
    if not isinstance(meta, dict):
        raise BadRequest("malformed metadata")
    return Received(meta, _packs(meta.pop(WIRE_KEY, None), raw, sizes, traffic))


def _pack(item: Item, policy: codecs.Policy) -> tuple[str, codecs.Packed]:
    if not isinstance(item, Tagged):
        return "other", codecs.encode(item, "none")
    if isinstance(item.value, codecs.Packed):
        return item.role, item.value
    return item.role, policy.pack(item.role, item.value)


def _packed_on_host(item: Item, policy: codecs.Policy) -> Tagged:
    """`_pack`, its parts copied to the host (a state on a GPU travels exact: only the copy is left)."""
    role, pack = _pack(item, policy)
    return Tagged(role, codecs.Packed(pack.meta, [_on_host(part) for part in pack.parts]))


def _packs(
    wire: Any, raw: list[torch.Tensor], sizes: list[int], traffic: Traffic | None
) -> list[codecs.Packed]:
    """The packed tensors the raw parts make up, as the metadata describes them."""
    if wire is None and not raw:
        return []
    if not (isinstance(wire, list) and len(wire) <= MAX_TENSORS
            and all(isinstance(e, dict) and isinstance(e.get("parts"), int) and e["parts"] > 0
                    and isinstance(e.get("role"), str) for e in wire)):
        raise BadRequest("malformed payload: the tensors' description is missing or malformed")
    described = sum(e["parts"] for e in wire)
    if described > len(raw):
        raise Truncated(f"the stream ended after {len(raw)} of the {described} tensor parts it described")
    if described != len(raw):
        raise BadRequest(f"malformed payload: {len(raw)} tensor parts for a description of {described}")
    packs, start = [], 0
    for entry in wire:
        stop = start + entry["parts"]
        description = {k: v for k, v in entry.items() if k not in ("role", "parts")}
        packs.append(codecs.Packed(description, raw[start:stop]))
        if traffic is not None:
            traffic.add(entry["role"], "received", sum(sizes[start:stop]))
        start = stop
    return packs


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().cpu()


def _chunks(tensor: torch.Tensor) -> Iterator[Part]:
    """A raw part's bytes in messages of CHUNK_BYTES, each a view of the tensor, copied only as its message
    is written to the stream (`bound_stream_messages`): a state's tensors are hundreds of MiB, and copying one
    whole before the first chunk left kept the event loop (and its DHT renewals) from running for that long.
    The first chunk says the dtype and shape."""
    tensor = _on_host(tensor)  # (already there when `packed` prepared the items: see `_pack`)
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
    yield Part(buffer=data[:CHUNK_BYTES], size=list(tensor.shape), dtype=codecs.dtype_name(tensor.dtype))
    for start in range(CHUNK_BYTES, len(data), CHUNK_BYTES):
        yield Part(buffer=data[start:start + CHUNK_BYTES])


def _collect(chunked: list[list[Part]]) -> tuple[list[torch.Tensor], list[int]]:
    """The raw parts the chunks make up, and the bytes of each (for the accounting)."""
    with _garbage_is_bad_request():
        parts = [_joined(chunks, i == len(chunked) - 1) for i, chunks in enumerate(chunked)]
        return [part for part, _ in parts], [nbytes for _, nbytes in parts]


def _joined(chunks: list[Part], last: bool) -> tuple[torch.Tensor, int]:
    """A raw part as a tensor, and its bytes. The first chunk says the dtype and shape; every chunk's bytes
    (a view of the message they came in) are copied once, straight into the tensor, whose memory is taken
    only once the chunks are found to fill it exactly. The last part of a stream that ended early is short
    by whole chunks."""
    first = chunks[0]
    dtype = codecs.DTYPES.get(first.dtype)
    if dtype is None:
        raise BadRequest(f"malformed payload: unknown dtype {first.dtype!r}")
    if first.compression != runtime_pb2.CompressionType.NONE or first.requires_grad:
        raise BadRequest("malformed payload: raw parts carry neither compression nor requires_grad")
    shape = list(first.size)
    if any(n < 0 for n in shape):
        raise BadRequest(f"malformed payload: negative size in {shape}")
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    received = sum(len(chunk.buffer) for chunk in chunks)
    if last and received < expected and received % CHUNK_BYTES == 0:
        raise Truncated(f"the stream ended {received} of {expected} bytes into its last tensor part")
    if received != expected:
        raise BadRequest(f"malformed payload: {received} bytes for {shape} {first.dtype} ({expected})")
    if not expected:
        return torch.empty(shape, dtype=dtype), 0
    out = torch.empty(expected, dtype=torch.uint8)
    into, at = out.numpy(), 0
    for chunk in chunks:
        into[at:at + len(chunk.buffer)] = numpy.frombuffer(chunk.buffer, numpy.uint8)
        at += len(chunk.buffer)
    return out.view(dtype).view(shape), expected


@contextlib.contextmanager
def _garbage_is_bad_request() -> Iterator[None]:
    """Protobuf, msgpack and torch errors while parsing all mean one thing: garbage arrived."""
    try:
        yield
    except (BadRequest, Unavailable, PermissionError):  # (a refusal of the caller itself: see decode's `admit`)
        raise
    except Exception as e:
        raise BadRequest(f"malformed payload: {type(e).__name__}: {e}") from e


def bound_stream_messages(limit: int = MAX_MESSAGE_BYTES) -> None:
    """Make hivemind refuse any stream message that declares more than `limit` bytes, before reading it,
    end quietly a stream whose message does not parse, and read and write stage calls' messages as `Frame`s
    (their tensor bytes not copied: see `swarm.net.frames`).

    hivemind reads each message of a stream whole, whatever length its 8-byte header declares, so one
    header could make a peer allocate gigabytes; and it logs a traceback for every message that does not
    parse, which a stranger could send by the thousand. Every message this protocol sends is under
    `CHUNK_BYTES` plus framing; a longer one, or garbage, ends its stream (both directions: requests
    served and replies read) with one line in the log, a few per minute at most (`Quiet`)."""
    if getattr(P2P.receive_raw_data, "bounded", None) == limit:
        return

    async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
        header = await reader.readexactly(P2P.HEADER_LEN)
        length = int.from_bytes(header, P2P.BYTEORDER)
        if length > limit:
            _quiet.warning(OVERSIZED, "stream message of %d bytes cut off (limit %d)", length, limit)
            raise asyncio.IncompleteReadError(b"", length)
        return await reader.readexactly(length)

    async def receive_protobuf(input_type, reader: asyncio.StreamReader):
        try:
            return await parse(Frame if input_type in FRAMED else input_type, reader)
        except (DecodeError, TypeError) as e:  # TypeError: hivemind's own for an unknown message marker
            _quiet.warning(MALFORMED, "malformed stream message: %s", type(e).__name__)
            raise asyncio.IncompleteReadError(b"", None) from e

    async def send_protobuf(message, writer: asyncio.StreamWriter) -> None:
        if not isinstance(message, Frame):
            return await send(message, writer)
        # piece by piece: the stream copies into its buffer what the socket does not take at once, so a
        # part's bytes are copied once on the way out rather than into the joined message first
        pieces = message.pieces()
        writer.write(P2P.MESSAGE_MARKER + sum(map(len, pieces)).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
        for piece in pieces:
            writer.write(piece)
        await writer.drain()

    receive_raw_data.bounded = limit
    parse = getattr(P2P.receive_protobuf, "unbounded", P2P.receive_protobuf)
    send = getattr(P2P.send_protobuf, "unframed", P2P.send_protobuf)
    receive_protobuf.unbounded = parse
    send_protobuf.unframed = send
    P2P.receive_raw_data = staticmethod(receive_raw_data)
    P2P.receive_protobuf = staticmethod(receive_protobuf)
    P2P.send_protobuf = staticmethod(send_protobuf)
