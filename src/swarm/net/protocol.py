"""Framing of requests and replies: msgpack metadata plus tensors, streamed in 4 MiB parts.

Every tensor-carrying call is a stream, because hivemind caps unary messages at 4 MiB and a larger
one hangs the caller. Metadata rides on the first message only. The receiver counts bytes as parts
arrive and refuses a payload over its limit before it is fully buffered. Metadata that would not fit
beside a full tensor part (a state's delivery ledger can be a few hundred KiB) gets a message of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, TypeVar

import msgpack
import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import runtime_pb2
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from swarm.wire.validate import BadRequest

CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024  # a little under the 4 MiB cap, leaving room for framing
INLINE_META_BYTES = 32 * 1024  # metadata up to this size shares the first message with a tensor part
Message = TypeVar("Message", runtime_pb2.ExpertRequest, runtime_pb2.ExpertResponse)


def encode(
    cls: type[Message], meta: dict[str, Any], tensors: Sequence[torch.Tensor]
) -> Iterator[Message]:
    """Yield the messages that carry `meta` and `tensors`; at least one even with no tensors."""
    packed = msgpack.packb(meta)
    if len(packed) > CHUNK_BYTES:
        raise ValueError(f"metadata of {len(packed)} bytes exceeds one message")
    first = True
    if len(packed) > INLINE_META_BYTES:
        yield cls(metadata=packed)
        first = False
    parts = (
        part
        for t in tensors
        for part in split_for_streaming(
            serialize_torch_tensor(t.detach().contiguous().cpu()), CHUNK_BYTES
        )
    )
    for part in parts:
        msg = cls(tensors=[part])
        if first:
            msg.metadata = packed
            first = False
        yield msg
    if first:
        yield cls(metadata=packed)


async def decode(stream: AsyncIterator[Message], max_bytes: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Reassemble a stream produced by `encode`; raises BadRequest on an oversized or malformed one."""
    meta: dict[str, Any] | None = None
    tensors: list[torch.Tensor] = []
    current: list[runtime_pb2.Tensor] = []
    total = 0
    async for msg in stream:  # an error of the stream itself (peer or connection failed) propagates as is
        with _garbage_is_bad_request():
            if meta is None:
                meta = msgpack.unpackb(msg.metadata) if msg.metadata else {}
            for part in msg.tensors:
                total += len(part.buffer)
                if total > max_bytes:
                    raise BadRequest(f"payload exceeds the limit of {max_bytes / 2**20:.1f} MiB")
                if part.dtype and current:
                    tensors.append(deserialize_torch_tensor(combine_from_streaming(current)))
                    current = []
                current.append(part)
    with _garbage_is_bad_request():
        if current:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(current)))
    if meta is None:
        raise BadRequest("empty stream: the other side closed it before sending anything")
    if not isinstance(meta, dict):
        raise BadRequest("malformed metadata")
    return meta, tensors


@contextlib.contextmanager
def _garbage_is_bad_request() -> Iterator[None]:
    """Protobuf, msgpack, numpy and torch errors while parsing all mean one thing: garbage arrived."""
    try:
        yield
    except BadRequest:
        raise
    except Exception as e:
        raise BadRequest(f"malformed payload: {type(e).__name__}: {e}") from e
