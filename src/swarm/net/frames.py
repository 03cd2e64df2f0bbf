"""Stage-call messages on the wire, read and written without copying their tensor bytes more than once.

A stream message of a stage call is hivemind's `ExpertRequest`/`ExpertResponse` protobuf (the two share
their fields: `tensors`, each a `Tensor`, and `metadata`; a request's `uid` is not used). Built and read
through protobuf's own classes, a part's bytes were copied five times on the way in (into the message, out
of it at each read of `buffer`, ...) and three times on the way out: on a GPU server, which moves several
MiB per microbatch, that copying bounded the swarm. A `Frame` holds its parts' bytes as views: a peer writes
them to its stream as they are (`pieces`), and reads them as views of the message's bytes, which it then
copies once, into the tensor they make up (`swarm.net.protocol`).

Both produce and accept protobuf's encoding of the same message, so peers reading with protobuf's classes
understand these and the other way round. What arrives comes from strangers: anything that is not a
well-formed message raises DecodeError, as protobuf's parser does, and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

Bytes = bytes | memoryview

# field numbers and wire types (protobuf's encoding); hivemind/proto/runtime.proto gives the fields
VARINT, I64, LEN, I32 = 0, 1, 2, 5
TENSORS, METADATA = 2, 3  # of ExpertRequest / ExpertResponse
BUFFER, SIZE, REQUIRES_GRAD, DTYPE, COMPRESSION, CHUNKS = 1, 2, 3, 4, 5, 6  # of Tensor


@dataclass
class Part:
    """One `Tensor` message: raw bytes and what they are."""

    buffer: Bytes = b""
    size: list[int] = field(default_factory=list)
    dtype: str = ""
    requires_grad: bool = False
    compression: int = 0
    chunks: int = 0


@dataclass
class Frame:
    """One stream message of a stage call; `ParseFromString` and `SerializeToString` as hivemind calls them."""

    tensors: list[Part] = field(default_factory=list)
    metadata: bytes = b""

    def pieces(self) -> list[Bytes]:
        """The message's encoding in pieces, each part's buffer one of them, uncopied: a peer writes them
        to its stream one by one (`swarm.net.protocol.bound_stream_messages`)."""
        pieces: list[Bytes] = []
        for part in self.tensors:
            inner = _part_pieces(part)
            pieces += [_key(TENSORS, LEN), _varint(sum(len(p) for p in inner)), *inner]
        if self.metadata:
            pieces += [_key(METADATA, LEN), _varint(len(self.metadata)), self.metadata]
        return pieces

    def SerializeToString(self) -> bytes:  # noqa: N802 (hivemind's name for it)
        return b"".join(self.pieces())

    def ByteSize(self) -> int:  # noqa: N802
        return sum(len(piece) for piece in self.pieces())

    def ParseFromString(self, data: Bytes) -> None:  # noqa: N802
        self.tensors, self.metadata = [], b""
        view = memoryview(data).cast("B")
        for number, wire, value in _fields(view):
            if number == TENSORS and wire == LEN:
                self.tensors.append(_part(value))
            elif number == METADATA and wire == LEN:
                self.metadata = bytes(value)


def _part_pieces(part: Part) -> list[Bytes]:
    """A `Tensor`'s encoding in pieces, its buffer a piece of its own (not copied here). Fields at their
    default value are left out, as protobuf leaves them out."""
    pieces: list[Bytes] = []
    if len(part.buffer):
        pieces += [_key(BUFFER, LEN), _varint(len(part.buffer)), part.buffer]
    if part.size:
        packed = b"".join(_varint(n & 0xFFFFFFFF) for n in part.size)
        pieces += [_key(SIZE, LEN), _varint(len(packed)), packed]
    if part.requires_grad:
        pieces += [_key(REQUIRES_GRAD, VARINT), b"\x01"]
    if part.dtype:
        dtype = part.dtype.encode()
        pieces += [_key(DTYPE, LEN), _varint(len(dtype)), dtype]
    for number, value in ((COMPRESSION, part.compression), (CHUNKS, part.chunks)):
        if value:
            pieces += [_key(number, VARINT), _varint(value & 0xFFFFFFFFFFFFFFFF)]
    return pieces


def _part(view: memoryview) -> Part:
    part = Part()
    for number, wire, value in _fields(view):
        if number == BUFFER and wire == LEN:
            part.buffer = value
        elif number == SIZE and wire == LEN:  # packed, as written here and by protobuf
            at = 0
            while at < len(value):
                n, at = _read_varint(value, at)
                part.size.append(n & 0xFFFFFFFF)
        elif number == SIZE and wire == VARINT:  # unpacked, which protobuf's parsers also accept
            part.size.append(value & 0xFFFFFFFF)
        elif number == REQUIRES_GRAD and wire == VARINT:
            part.requires_grad = value != 0
        elif number == DTYPE and wire == LEN:
            try:
                part.dtype = str(value, "utf-8")
            except UnicodeDecodeError as e:
                raise DecodeError("a string field is not valid UTF-8") from e
        elif number == COMPRESSION and wire == VARINT:
            part.compression = _int32(value)
        elif number == CHUNKS and wire == VARINT:
            part.chunks = _int32(value)
    return part


def _fields(view: memoryview):
    """(field number, wire type, value) of each field of an encoded message: a varint's value, a
    length-delimited field's bytes as a view of `view`; fixed-size fields are read past (none is ours)."""
    at, end = 0, len(view)
    while at < end:
        key, at = _read_varint(view, at)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise DecodeError("field number 0")
        if wire == VARINT:
            value, at = _read_varint(view, at)
        elif wire == LEN:
            length, at = _read_varint(view, at)
            if length > end - at:
                raise DecodeError("a length-delimited field runs past the message's end")
            value, at = view[at:at + length], at + length
        elif wire in (I64, I32):
            at += 8 if wire == I64 else 4
            if at > end:
                raise DecodeError("a fixed-size field runs past the message's end")
            continue
        else:  # groups (deprecated, never sent by this protocol) and the undefined wire types 6 and 7
            raise DecodeError(f"unsupported wire type {wire}")
        yield number, wire, value


def _read_varint(view: memoryview, at: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(at, min(at + 10, len(view))):
        byte = view[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, i + 1
        shift += 7
    raise DecodeError("truncated or overlong varint")


def _int32(value: int) -> int:
    """A varint read as protobuf's int32 (and open enum) fields are: its low 32 bits, signed."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)
