"""Framing of calls: metadata and tensors survive encode/decode, big tensors are split under the
4 MiB message cap, and anything oversized or malformed is refused as a BadRequest."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import msgpack
import pytest
import torch
from hivemind.p2p import P2P

from swarm.net.frames import Frame
from swarm.net.protocol import MAX_TENSORS, WIRE_KEY, Tagged, Traffic, bound_stream_messages, decode, encode
from swarm.wire import codecs
from swarm.wire.codecs import Policy, error_bound
from swarm.wire.validate import BadRequest, Truncated

MESSAGE_CAP = 4 * 1024 * 1024
UNLIMITED = 1 << 34


async def _stream(messages: Iterable[Any]) -> AsyncIterator[Any]:
    for msg in messages:
        yield msg


def off_the_wire(msg: Frame) -> Frame:
    """`msg` as a peer reads it: serialized, then parsed (its parts' bytes views of what arrived)."""
    read = Frame()
    read.ParseFromString(msg.SerializeToString())
    return read


def decode_list(messages: Sequence[Any], max_bytes: int = UNLIMITED) -> tuple[dict[str, Any], list[torch.Tensor]]:
    return asyncio.run(decode(_stream(map(off_the_wire, messages)), max_bytes))


def test_round_trip_of_metadata_and_mixed_tensors() -> None:
    """Every dtype comes back bit-identical, in order, and a >4 MiB tensor spans several messages."""
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(1536, 1024, generator=gen)  # 6 MiB of float32
    tensors = [
        torch.randn(3, 16, 32, generator=gen),
        torch.randint(0, 257, (3, 16), generator=gen),
        torch.randn(5, 7, generator=gen).half(),
        torch.randn(4, 4, generator=gen).to(torch.bfloat16),
        big,
        torch.tensor([True, False, True]),
        torch.tensor(2.5),  # 0-dim
        torch.randn(4, 3, generator=gen).t(),  # not contiguous
        torch.zeros(0, 5),  # empty
    ]
    meta = {"epoch": 3, "request": "abc", "group": ["p1", "p2"], "nested": {"k": [1.5, None]}}
    messages = list(encode(meta, tensors))
    assert all(msg.ByteSize() < MESSAGE_CAP for msg in messages)
    assert len(messages) > len(tensors)  # the big tensor alone needs more than one message
    assert sum(1 for m in messages for p in m.tensors if p.dtype == "float32" and list(p.size) == [1536, 1024]) == 1
    assert messages[0].metadata and not any(m.metadata for m in messages[1:])

    got_meta, got = decode_list(messages)
    assert got_meta == meta
    assert len(got) == len(tensors)
    for original, restored in zip(tensors, got, strict=True):
        assert restored.dtype == original.dtype
        assert restored.shape == original.shape
        assert torch.equal(restored, original)


def test_a_big_tensor_alone_is_split_and_reassembled() -> None:
    big = torch.arange(3 * 1024 * 1024, dtype=torch.float32)  # 12 MiB
    messages = list(encode({"ok": True}, [big]))
    assert len(messages) > 1
    assert all(msg.ByteSize() < MESSAGE_CAP for msg in messages)
    meta, tensors = decode_list(messages)
    assert meta == {"ok": True}
    assert len(tensors) == 1 and torch.equal(tensors[0], big)


def test_no_tensors_still_carries_metadata() -> None:
    messages = list(encode({"stage": 2}, []))
    assert len(messages) == 1
    assert decode_list(messages) == ({"stage": 2}, [])


def test_empty_metadata_round_trips() -> None:
    meta, tensors = decode_list(list(encode({}, [torch.ones(2)])))
    assert meta == {}
    assert len(tensors) == 1 and torch.equal(tensors[0], torch.ones(2))


def test_payload_over_the_limit_is_refused_with_the_limit_named() -> None:
    messages = list(encode({}, [torch.zeros(300_000)]))  # 1.2 MB
    with pytest.raises(BadRequest, match=r"exceeds the limit of 1\.0 MiB") as info:
        decode_list(messages, max_bytes=1 << 20)
    assert str(info.value).startswith("refused:")


def test_payload_at_the_limit_is_accepted() -> None:
    tensor = torch.zeros(1024)
    meta, tensors = decode_list(list(encode({}, [tensor])), max_bytes=4096)
    assert len(tensors) == 1 and torch.equal(tensors[0], tensor)


def test_oversized_stream_is_refused_before_it_is_consumed() -> None:
    """The byte count is checked as parts arrive: the stream is not read to its end first."""
    big = torch.zeros(3 * 1024 * 1024)
    messages = list(encode({}, [big, big]))
    consumed = 0

    async def counting() -> AsyncIterator[Any]:
        nonlocal consumed
        for msg in messages:
            consumed += 1
            yield msg

    with pytest.raises(BadRequest, match="exceeds the limit"):
        asyncio.run(decode(counting(), max_bytes=8 << 20))
    assert consumed < len(messages)


def _one_tensor_message() -> Frame:
    (msg,) = encode({"epoch": 1}, [torch.arange(12, dtype=torch.float32).view(3, 4)])
    return msg


def _random_buffer(msg: Frame) -> None:
    msg.tensors[0].buffer = bytes(torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(1)).tolist())


def _unknown_dtype(msg: Frame) -> None:
    msg.tensors[0].dtype = "not_a_dtype"


def _wider_dtype(msg: Frame) -> None:
    msg.tensors[0].dtype = "float64"  # 48 bytes now hold 6 values, not the 12 the shape says


def _object_dtype(msg: Frame) -> None:
    msg.tensors[0].dtype = "object"


def _wrong_shape(msg: Frame) -> None:
    del msg.tensors[0].size[:]
    msg.tensors[0].size.extend([5, 5])


def _unknown_compression(msg: Frame) -> None:
    msg.tensors[0].compression = 97


def _integer_requiring_grad(msg: Frame) -> None:
    msg.tensors[0].dtype = "int32"
    msg.tensors[0].requires_grad = True


def _metadata_invalid_byte(msg: Frame) -> None:
    msg.metadata = b"\xc1"  # never used by msgpack


def _metadata_truncated(msg: Frame) -> None:
    msg.metadata = msgpack.packb({"epoch": 1, "group": ["a", "b"]})[:-3]


def _metadata_trailing_bytes(msg: Frame) -> None:
    msg.metadata = msgpack.packb({"epoch": 1}) + b"\x00"


def _metadata_not_a_map(msg: Frame) -> None:
    msg.metadata = msgpack.packb([1, 2, 3])


@pytest.mark.parametrize(
    "corrupt",
    [
        _random_buffer,
        _unknown_dtype,
        _wider_dtype,
        _object_dtype,
        _wrong_shape,
        _unknown_compression,
        _integer_requiring_grad,
        _metadata_invalid_byte,
        _metadata_truncated,
        _metadata_trailing_bytes,
        _metadata_not_a_map,
    ],
)
def test_garbage_is_refused_as_bad_request(corrupt: Callable[[Frame], None]) -> None:
    """Whatever is wrong with a payload, the receiver raises BadRequest and nothing else."""
    msg = _one_tensor_message()
    corrupt(msg)
    with pytest.raises(BadRequest) as info:
        decode_list([msg])
    assert type(info.value) is BadRequest
    assert str(info.value).startswith("refused:")


def test_corrupted_continuation_part_is_refused() -> None:
    """A later part of a split tensor that is cut short makes the whole tensor unreadable."""
    messages = list(encode({}, [torch.zeros(2 * 1024 * 1024)]))
    assert len(messages) > 1
    messages[-1].tensors[0].buffer = messages[-1].tensors[0].buffer[:-3]
    with pytest.raises(BadRequest, match="malformed payload"):
        decode_list(messages)


def test_a_split_part_longer_than_its_shape_is_refused() -> None:
    """Bytes past what the first chunk's shape and dtype describe make the part malformed, not truncated."""
    messages = list(encode({}, [torch.zeros(2 * 1024 * 1024)]))
    assert len(messages) > 1
    messages[-1].tensors[0].buffer = bytes(messages[-1].tensors[0].buffer) + b"\0" * 8
    with pytest.raises(BadRequest, match="malformed payload") as info:
        decode_list(messages)
    assert type(info.value) is BadRequest


def test_a_shape_declaring_more_than_its_bytes_is_refused_for_them_before_any_memory_is_taken() -> None:
    """A stranger's part declaring 4 TiB with a few bytes sent: refused for the bytes it lacks, its declared
    size never allocated (an allocation of it would fail, or reserve what the peer never sent)."""
    messages = list(encode({}, [torch.zeros(4)]))
    messages[0].tensors[0].size[:] = [1 << 20, 1 << 20]
    with pytest.raises(BadRequest, match=r"16 bytes for \[1048576, 1048576\] float32") as info:
        decode_list(messages)
    assert type(info.value) is BadRequest


def test_empty_stream_is_refused() -> None:
    """A stream closed before its first message has no metadata: refused, not an empty request."""
    with pytest.raises(BadRequest, match="empty stream"):
        decode_list([])


def test_a_failing_stream_propagates_its_own_error() -> None:
    """A broken connection is not the sender's malformed request: its error is not turned into a refusal."""
    messages = list(encode({}, [torch.zeros(2 * 1024 * 1024)]))

    async def broken() -> AsyncIterator[Any]:
        yield messages[0]
        raise ConnectionResetError("peer went away")

    with pytest.raises(ConnectionResetError, match="peer went away"):
        asyncio.run(decode(broken(), UNLIMITED))


# ---- codecs by role, and the bytes they cost ---------------------------------------------------------


def _activations(seed: int = 0) -> torch.Tensor:
    return torch.randn(4, 64, 128, generator=torch.Generator().manual_seed(seed)) * 3


def test_each_role_travels_by_its_codec_and_both_sides_count_the_same_bytes() -> None:
    """Activations go 8-bit, gradients fp16, and what the policy does not name (tokens) as it is; every
    tensor comes back with its shape and dtype, within its codec's bound, and the receiver counts, role
    by role, exactly the bytes the sender counted."""
    policy = Policy({"activations": "blockwise8", "gradients": "fp16"})
    x, dy = _activations(1), _activations(2) * 1e-3
    tokens = torch.randint(0, 257, (4, 64), generator=torch.Generator().manual_seed(3))
    items = [Tagged("activations", x), Tagged("gradients", dy), Tagged("tokens", tokens)]
    sent, received = Traffic(), Traffic()
    messages = list(encode({"epoch": 1}, items, policy, sent))
    meta, (x2, dy2, tokens2) = asyncio.run(decode(_stream(messages), UNLIMITED, received))

    assert meta == {"epoch": 1}
    assert torch.equal(tokens2, tokens)
    for original, restored, codec in ((x, x2, "blockwise8"), (dy, dy2, "fp16")):
        assert restored.dtype == original.dtype and restored.shape == original.shape
        assert not torch.equal(restored, original)
        assert bool(((restored - original).abs() <= error_bound(original, codec)).all())
    assert {r: c["sent"] for r, c in sent.counts.items()} == {r: c["received"] for r, c in received.counts.items()}
    assert sent.counts["activations"]["sent"] == codecs.encode(x, "blockwise8").nbytes == x.numel() * (1 + 4 / 256)
    assert sent.counts["gradients"]["sent"] == 2 * dy.numel()
    assert sent.counts["tokens"]["sent"] == 8 * tokens.numel()
    assert sum(m.ByteSize() for m in messages) < sum(c["sent"] for c in sent.counts.values()) + 1024  # framing


def test_a_packed_value_goes_as_it_is() -> None:
    """What an all-reduce owner sends: packed once, so every receiver decodes the bits it decodes itself."""
    packed = codecs.encode(_activations(), "uint8")
    messages = list(encode({}, [Tagged("allreduce", packed)], Policy()))
    (restored,) = decode_list(messages)[1]
    assert torch.equal(restored, codecs.decode(packed))


def _drop_description(meta: dict[str, Any]) -> None:
    del meta[WIRE_KEY]


def _one_part_short(meta: dict[str, Any]) -> None:
    meta[WIRE_KEY][0]["parts"] = 1  # blockwise8 sends codes and scales


def _unknown_codec(meta: dict[str, Any]) -> None:
    meta[WIRE_KEY][0]["codec"] = "zip"


def _scales_for_a_smaller_tensor(meta: dict[str, Any]) -> None:
    meta[WIRE_KEY][0]["shape"] = [2, 64, 128]


@pytest.mark.parametrize("corrupt", [_drop_description, _one_part_short, _unknown_codec, _scales_for_a_smaller_tensor])
def test_a_malformed_description_of_packed_tensors_is_refused(corrupt: Callable[[dict[str, Any]], None]) -> None:
    messages = list(encode({"epoch": 1}, [Tagged("activations", _activations())],
                           Policy({"activations": "blockwise8"})))
    meta = msgpack.unpackb(messages[0].metadata)
    corrupt(meta)
    messages[0].metadata = msgpack.packb(meta)
    with pytest.raises(BadRequest, match="malformed"):
        decode_list(messages)


def test_too_many_tensor_parts_are_refused_as_they_arrive() -> None:
    """Empty tensors cost nothing on the wire but a Python object each: their count is bounded."""
    messages = list(encode({}, [torch.zeros(0)] * (MAX_TENSORS + 2)))
    with pytest.raises(BadRequest, match="tensor parts"):
        decode_list(messages)


def test_a_stream_message_declaring_gigabytes_is_cut_off_unread() -> None:
    """hivemind would read the whole declared length: bounded, the header alone ends the stream."""
    bound_stream_messages(1 << 20)

    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data((1 << 40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"x" * 16)
        with pytest.raises(asyncio.IncompleteReadError):
            await P2P.receive_raw_data(reader)
        reader = asyncio.StreamReader()  # a message within the bound still reads whole
        reader.feed_data((3).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"abc")
        assert await P2P.receive_raw_data(reader) == b"abc"

    try:
        asyncio.run(main())
    finally:
        bound_stream_messages()


def test_a_stream_that_ended_early_reads_as_truncated_not_as_malformed() -> None:
    """Whole messages missing at the end (a part, or a big part's last chunks) are what a connection that
    dropped leaves; a part short by a few bytes is garbage, and more parts than described too."""
    messages = list(encode({"epoch": 1}, [torch.ones(3), torch.zeros(2 * 1024 * 1024)]))
    assert len(messages) > 2
    with pytest.raises(Truncated, match="ended after 1 of the 2 tensor parts"):
        decode_list(messages[:1])
    with pytest.raises(Truncated, match="bytes into its last tensor part"):
        decode_list(messages[:2])
    meta, tensors = decode_list(messages)
    assert meta == {"epoch": 1} and torch.equal(tensors[1], torch.zeros(2 * 1024 * 1024))
