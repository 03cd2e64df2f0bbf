"""Stage-call messages as `swarm.net.frames` writes and reads them: the very bytes protobuf's own classes
write, read field for field as they read them, garbage refused with DecodeError alone, and a part's bytes
read as a view of the message that brought them."""

from __future__ import annotations

import asyncio
import random
import socket

import pytest
import torch
from google.protobuf.message import DecodeError
from hivemind.p2p import P2P
from hivemind.proto import runtime_pb2

from swarm.net.frames import Frame, Part
from swarm.net.protocol import bound_stream_messages, decode, encode
from swarm.wire.codecs import Policy


def fields(msg: Frame | runtime_pb2.ExpertResponse) -> tuple:
    parts = [(bytes(t.buffer), list(t.size), t.dtype, t.requires_grad, t.compression, t.chunks) for t in msg.tensors]
    return parts, bytes(msg.metadata)


def random_frame(rng: random.Random) -> Frame:
    parts = [Part(buffer=rng.randbytes(rng.choice((0, 1, 5, 300))),
                  size=[rng.choice((0, 1, 7, 2**31, 2**32 - 1)) for _ in range(rng.randrange(4))],
                  dtype=rng.choice(("", "float32", "bfloat16", "ü")), requires_grad=rng.random() < 0.3,
                  compression=rng.choice((0, 5, 97, -1, 2**31 - 1)), chunks=rng.choice((0, 3, -7)))
             for _ in range(rng.randrange(4))]
    return Frame(parts, rng.randbytes(rng.choice((0, 3, 200))))


def read(data: bytes) -> Frame:
    frame = Frame()
    frame.ParseFromString(data)
    return frame


def test_a_frame_is_written_as_protobuf_writes_the_message_and_read_as_it_reads_it() -> None:
    rng = random.Random(0)
    for _ in range(300):
        frame = random_frame(rng)
        data = frame.SerializeToString()
        theirs = runtime_pb2.ExpertResponse.FromString(data)
        assert fields(theirs) == fields(frame)
        assert theirs.SerializeToString() == data and frame.ByteSize() == len(data)
        assert fields(read(data)) == fields(frame)


def test_what_protobuf_writes_and_may_send_is_read_too() -> None:
    """A request's uid, fields this protocol does not know (of every wire type), sizes written unpacked."""
    rng = random.Random(1)
    for _ in range(100):
        theirs = runtime_pb2.ExpertRequest(uid="stage.3", metadata=rng.randbytes(9))
        for _ in range(rng.randrange(1, 3)):
            theirs.tensors.add(buffer=rng.randbytes(40), size=[3, 4], dtype="float16", compression=5)
        unknown = b"\x48\x96\x01" + b"\x51" + bytes(8) + b"\x5a\x02ab" + b"\x65" + bytes(4)  # fields 9-12
        unpacked = b"\x12\x04" + b"\x10\x05\x10\x06"  # one more part: sizes 5 and 6 as two varint fields
        ours = read(theirs.SerializeToString() + unknown + unpacked)
        expected = runtime_pb2.ExpertRequest.FromString(theirs.SerializeToString() + unknown + unpacked)
        assert fields(ours) == fields(expected)
        assert list(ours.tensors[-1].size) == [5, 6]


def test_garbage_raises_decode_error_and_whatever_both_read_they_read_alike() -> None:
    rng = random.Random(2)
    both = 0
    for _ in range(3000):
        data = bytearray(random_frame(rng).SerializeToString())
        for _ in range(rng.randrange(1, 4)):
            op, at = rng.randrange(3), rng.randrange(len(data) + 1)
            if op == 0 and data:
                data[min(at, len(data) - 1)] = rng.randrange(256)
            elif op == 1:
                del data[at:]
            else:
                data[at:at] = rng.randbytes(rng.randrange(1, 4))
        try:
            theirs = runtime_pb2.ExpertResponse.FromString(bytes(data))
        except DecodeError:
            theirs = None
        try:
            ours = read(bytes(data))
        except DecodeError as e:
            # a group (wire types 3 and 4), which protobuf reads past in a field it does not know, is the one
            # well-formed thing refused here: this protocol never sends one
            assert theirs is None or "wire type" in str(e)
            continue
        assert theirs is not None, "accepted what protobuf refuses"
        assert fields(ours) == fields(theirs)
        both += 1
    assert both > 300  # enough of the mutations still parse for the comparison to say something


def test_a_stage_calls_messages_cross_a_socket_and_are_read_as_views_that_decode_exactly() -> None:
    """Written piece by piece and read as a peer reads them: a part bigger than the socket's buffer arrives
    whole, its bytes a view of the message that brought them."""
    bound_stream_messages()
    x = torch.randn(1024, 1000)  # 4 MB: one message, most of it left in the stream's buffer at first
    frames = list(encode({"epoch": 2}, [x, torch.arange(7)], Policy()))

    async def main() -> tuple[list[Frame], tuple]:
        here, there = socket.socketpair()
        reader, reply_writer = await asyncio.open_connection(sock=here)  # (held: dropped, it closes the socket)
        _, writer = await asyncio.open_connection(sock=there)

        async def send() -> None:
            for frame in frames:
                await P2P.send_protobuf(frame, writer)
            await P2P.send_protobuf(P2P.END_OF_STREAM, writer)

        sending = asyncio.create_task(send())
        got = []
        while (msg := (await P2P.receive_protobuf(runtime_pb2.ExpertRequest, reader))[0]) is not None:
            got.append(msg)
        await sending
        writer.close()
        reply_writer.close()

        async def stream():
            for frame in got:
                yield frame
        return got, await decode(stream(), 1 << 30)

    got, (meta, tensors) = asyncio.run(main())
    assert len(got) == len(frames) and all(isinstance(f, Frame) for f in got)
    part = got[0].tensors[0]
    assert isinstance(part.buffer, memoryview) and isinstance(part.buffer.obj, bytes)  # not copied out
    assert meta == {"epoch": 2} and torch.equal(tensors[0], x) and torch.equal(tensors[1], torch.arange(7))


def test_a_malformed_stage_call_message_ends_the_stream_quietly() -> None:
    bound_stream_messages()

    async def main() -> None:
        reader = asyncio.StreamReader()
        data = b"\x12\x05\x0a\x09abc"  # a part whose buffer claims 9 bytes and has 3
        reader.feed_data(P2P.MESSAGE_MARKER + len(data).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + data)
        with pytest.raises(asyncio.IncompleteReadError):
            await P2P.receive_protobuf(runtime_pb2.ExpertRequest, reader)

    asyncio.run(main())
