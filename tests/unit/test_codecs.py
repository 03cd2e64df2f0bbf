"""Wire codecs: every round trip within the codec's stated bound, on random tensors and on real
activations and gradients of the model; shapes and dtypes survive; malformed payloads are refused."""

from __future__ import annotations

import time

import pytest
import torch

from swarm.config import load_config
from swarm.data.corpus import load_documents
from swarm.model import load_stages
from swarm.wire.codecs import CODECS, MAX_BLOCK, SLICE, Packed, check, decode, encode, error_bound
from swarm.wire.validate import BadRequest


def random_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    outliers = torch.randn(64, 300, generator=g)
    outliers[1, 7] = 300.0
    return {
        "normal": torch.randn(3, 17, 64, generator=g),
        "outliers": outliers,
        "tiny": torch.randn(1000, generator=g) * 1e-6,
        "zeros": torch.zeros(5, 5),
        "empty": torch.zeros(0, 8),
        "scalar": torch.tensor(2.5),
        "half": torch.randn(7, 33, generator=g).half(),
        "bfloat": torch.randn(7, 33, generator=g).bfloat16(),
        "huge": torch.tensor([1e6, -2e5, 3.0]),
    }


def real_tensors() -> dict[str, torch.Tensor]:
    """What actually crosses the wire: stage 0's activations on real text, and the gradient of the
    loss with respect to them."""
    cfg = load_config(overrides=["model.d_model=64", "model.n_heads=2", "model.d_ff=128", "model.n_layers=2",
                                 "model.seq_len=64", "model.num_stages=2"])
    first, last = load_stages(cfg.model)
    text = torch.tensor(list(load_documents(cfg.data)[0][: 4 * 65]), dtype=torch.int64).view(4, 65)
    hidden = first(text[:, :-1]).detach().requires_grad_()
    loss = last(hidden, text[:, 1:])
    loss.backward()
    return {"activations": hidden.detach(), "gradients": hidden.grad}


CASES = {**random_tensors(), **real_tensors()}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_within_bound(codec: str, name: str) -> None:
    x = CASES[name]
    y = decode(encode(x, codec))
    assert y.shape == x.shape and y.dtype == x.dtype
    error = (y.float() - x.float()).abs()
    assert bool((error <= error_bound(x, codec)).all()), (codec, name, float((error - error_bound(x, codec)).max()))


@pytest.mark.parametrize("codec", CODECS)
def test_integer_tensors_travel_as_they_are(codec: str) -> None:
    ids = torch.randint(0, 257, (4, 64))
    packed = encode(ids, codec)
    assert packed.meta == {"codec": "none"} and torch.equal(decode(packed), ids)


@pytest.mark.parametrize(("codec", "ratio"), [("fp16", 2.0), ("bf16", 2.0), ("uint8", 3.99), ("blockwise8", 3.9)])
def test_bytes_saved_against_fp32(codec: str, ratio: float) -> None:
    x = CASES["activations"]
    assert x.numel() * 4 / encode(x, codec).nbytes >= ratio


def test_blockwise_keeps_an_outlier_from_ruining_the_rest() -> None:
    """One huge value costs uniform quantization all its precision; per-block scales confine it."""
    x = CASES["outliers"]
    uniform = (decode(encode(x, "uint8")) - x).abs().mean()
    blockwise = (decode(encode(x, "blockwise8")) - x).abs().mean()
    assert blockwise < uniform / 10


def packed_of(codec: str) -> Packed:
    return encode(torch.randn(10, 30), codec, block=64)


@pytest.mark.parametrize(
    ("codec", "spoil", "message"),
    [
        ("fp16", lambda p: p.meta.update(codec="zip"), "unknown codec"),
        ("fp16", lambda p: p.meta.update(shape=[10, 31]), "values for shape"),
        ("fp16", lambda p: p.meta.update(shape="10x30"), "bad shape"),
        ("fp16", lambda p: p.meta.update(dtype="int3"), "bad dtype"),
        ("fp16", lambda p: p.parts.append(torch.zeros(1)), "carries"),
        ("bf16", lambda p: p.parts.__setitem__(0, p.parts[0].float()), "carries"),
        ("uint8", lambda p: p.meta.update(step=float("nan")), "range"),
        ("uint8", lambda p: p.meta.pop("lo"), "range"),
        ("blockwise8", lambda p: p.parts.__setitem__(1, p.parts[1][:-1]), "scales"),
        ("blockwise8", lambda p: p.parts[1].__setitem__(0, float("inf")), "finite"),
        ("blockwise8", lambda p: p.meta.update(block=0), "block size"),
        ("blockwise8", lambda p: p.meta.update(block=True), "block size"),
        ("fp16", lambda p: p.meta.update(shape=[1] * 9 + [300]), "bad shape"),
        ("none", lambda p: p.parts.append(torch.zeros(1)), "one tensor"),
    ],
)
@pytest.mark.parametrize("read", [decode, check], ids=["decoded", "checked for relaying"])
def test_malformed_payloads_are_refused_with_the_reason(codec, spoil, message, read) -> None:
    packed = packed_of(codec)
    spoil(packed)
    with pytest.raises(BadRequest, match=message):
        read(packed)


def test_unknown_codec_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        encode(torch.zeros(3), "gzip")


def test_a_huge_declared_block_is_refused_before_any_allocation() -> None:
    """One value declared with a block of 2^29 would pad to half a gigabyte of floats, and 2^31 to 8 GiB."""
    for block in (MAX_BLOCK + 1, 1 << 29, 1 << 31):
        packed = Packed({"codec": "blockwise8", "shape": [1], "dtype": "float32", "block": block},
                        [torch.ones(1, dtype=torch.int8), torch.ones(1)])
        started = time.thread_time()  # (this thread's CPU: a loaded machine's stalls do not count)
        with pytest.raises(BadRequest, match="block size"):
            decode(packed)
        assert time.thread_time() - started < 0.1


def test_a_block_larger_than_the_tensor_round_trips() -> None:
    """Decoding no longer pads to whole blocks: a tensor shorter than its block still comes back."""
    x = torch.randn(3)
    out = decode(encode(x, "blockwise8", block=MAX_BLOCK))
    torch.testing.assert_close(out, x, atol=float(error_bound(x, "blockwise8", MAX_BLOCK).max()), rtol=0)


@pytest.mark.parametrize("block", [64, 256, 1000])
def test_blockwise_works_through_a_large_tensor_in_slices_as_a_whole_pass_would(block: int) -> None:
    """A tensor of several slices and a partial last block: each block's scale is its absolute maximum, each
    code its value in 127ths of it, and every value comes back within the bound."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * SLICE + 3 * block + 17, generator=g)
    x[SLICE + 5] = -40.0  # a block whose maximum is a negative value
    packed = encode(x, "blockwise8", block)
    padded = torch.nn.functional.pad(x, (0, -x.numel() % block)).view(-1, block)
    scales = padded.abs().amax(dim=1)
    assert torch.equal(packed.parts[1], scales)
    expected = (padded * (127 / scales).unsqueeze(1)).round().view(-1)[: x.numel()]
    assert torch.equal(packed.parts[0].float(), expected)
    error = (decode(packed) - x).abs()
    assert bool((error <= error_bound(x, "blockwise8", block)).all())


def test_a_nan_packed_blockwise_is_refused_where_it_is_unpacked() -> None:
    """A sender whose tensor holds NaN packs a NaN scale for its block, and the receiver refuses it."""
    x = torch.randn(3 * SLICE)
    x[SLICE + 1] = float("nan")
    with pytest.raises(BadRequest, match="finite"):
        decode(encode(x, "blockwise8"))
