"""Corpus loading, samples, the held-out split and the order of each pass, and that padding never reaches
the loss (byte-level; tokenizers and datasets: test_hf_data.py)."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from swarm.config import ConfigError, DataConfig, ModelConfig
from swarm.data import BYTE_PAD_ID, BYTES, SampleTable, chunk_documents, load_documents, split_inputs_targets
from swarm.model import build_stages
from swarm.wire.validate import IGNORE_INDEX

SEQ = 16


def byte_table(documents: list[bytes], seq_len: int = SEQ, seed: int = 0, validation: int = 0,
               digest: str = "d") -> SampleTable:
    return SampleTable(chunk_documents(BYTES.encode(documents), seq_len), BYTE_PAD_ID, seed, digest, validation)


def random_documents(count: int = 40, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 120))) for _ in range(count)]


def test_default_corpus_is_python_source() -> None:
    documents = load_documents(DataConfig(max_bytes=200_000))
    assert documents and all(documents)
    assert sum(map(len, documents)) == 200_000
    text = b"".join(documents)
    assert b"def " in text and b"import " in text
    assert documents == load_documents(DataConfig(max_bytes=200_000))


def test_text_file_is_one_document(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text("hello world\n" * 10)
    assert load_documents(DataConfig(path=str(path))) == [b"hello world\n" * 10]
    assert load_documents(DataConfig(path=str(path), max_bytes=5)) == [b"hello"]


def test_jsonl_takes_the_text_field(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "first", "id": 1}) + "\n\n" + json.dumps({"text": "zweite ü"}) + "\n")
    assert load_documents(DataConfig(path=str(path))) == [b"first", "zweite ü".encode()]


def test_directory_reads_known_suffixes_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.md").write_text("bee")
    (tmp_path / "a.txt").write_text("ay")
    (tmp_path / "sub" / "c.jsonl").write_text(json.dumps({"text": "sea"}) + "\n")
    (tmp_path / "sub" / "d.py").write_text("dee = 1")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    assert load_documents(DataConfig(path=str(tmp_path))) == [b"ay", b"bee", b"sea", b"dee = 1"]


@pytest.mark.parametrize(
    "name, content",
    [
        ("missing.txt", None),
        ("empty.txt", ""),
        ("no_text.jsonl", json.dumps({"body": "x"}) + "\n"),
        ("not_json.jsonl", "{oops\n"),
        ("empty_dir", "<dir>"),
    ],
)
def test_bad_paths_name_data_path(tmp_path: Path, name: str, content: str | None) -> None:
    path = tmp_path / name
    if content == "<dir>":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="data.path"):
        load_documents(DataConfig(path=str(path)))


def test_chunks_overlap_by_one_token_and_rebuild_the_document() -> None:
    document = bytes(range(3 * SEQ + 1))
    chunks = chunk_documents(BYTES.encode([document]), SEQ)
    assert chunks.shape == (3, SEQ + 1) and chunks.dtype == np.int32 and (chunks != IGNORE_INDEX).all()
    rebuilt = list(chunks[0]) + [t for row in chunks[1:] for t in row[1:]]
    assert bytes(int(t) for t in rebuilt) == document


def test_padding_only_at_document_ends() -> None:
    documents = random_documents()
    chunks = torch.from_numpy(chunk_documents(BYTES.encode(documents), SEQ))
    padded_rows = 0
    for row in chunks:
        pad = row == IGNORE_INDEX
        real = bytes(row[~pad].tolist())
        assert len(real) >= 8  # mostly-padding tails are dropped
        if pad.any():
            padded_rows += 1
            assert pad[pad.nonzero()[0, 0] :].all()  # padding is one suffix
            assert any(doc.endswith(real) for doc in documents)
        else:
            assert any(real in doc for doc in documents)
    assert 0 < padded_rows <= len(documents)


def test_each_pass_orders_every_sample_once_the_same_way_for_everyone() -> None:
    documents = random_documents()
    table = torch.from_numpy(chunk_documents(BYTES.encode(documents), SEQ)).long()
    samples = byte_table(documents, seed=7)
    assert len(samples) == len(table)
    one_pass = samples.samples(0, 0, len(samples))
    assert sorted(map(tuple, one_pass.tolist())) == sorted(map(tuple, table.tolist()))
    assert torch.equal(byte_table(documents, seed=7).samples(0, 5, 9), one_pass[5:9])  # another trainer
    assert not torch.equal(samples.samples(1, 0, len(samples)), one_pass)  # each pass is reshuffled
    assert not torch.equal(byte_table(documents, seed=8).samples(0, 0, len(samples)), one_pass)
    assert one_pass.dtype == torch.long and set(one_pass.unique().tolist()) <= {IGNORE_INDEX, *range(256)}
    # trainers whose samples differ in any way never share a name (and with it the DHT's block records)
    names = {byte_table(documents, seed=7).name, byte_table(documents, seed=8).name,
             byte_table(documents, seed=7, digest="e").name, byte_table(documents, seed=7, validation=3).name,
             SampleTable(table.int().numpy(), 0, 7, "d").name}
    assert len(names) == 5


def test_held_out_samples_are_the_same_everywhere_and_never_in_a_pass() -> None:
    documents = random_documents()
    everything = byte_table(documents).samples(0, 0, len(byte_table(documents)))
    table = byte_table(documents, seed=3, validation=7)
    held_out = table.validation()
    assert len(held_out) == 7 and len(table) == len(everything) - 7
    assert torch.equal(byte_table(documents, seed=3, validation=7).validation(), held_out)  # another trainer
    rows = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    for pass_ in range(3):
        trained = table.samples(pass_, 0, len(table))
        assert rows(torch.cat([trained, held_out])) == rows(everything)  # a pass is all the rest, once
    with pytest.raises(ConfigError, match="data.validation_samples: 40 leaves nothing to train on"):
        byte_table(documents[:3], validation=40)


def test_a_stream_goes_pass_after_pass() -> None:
    documents = random_documents()
    samples = byte_table(documents, seed=3)
    per_pass = len(samples) // 5
    batches = list(itertools.islice(samples.stream(5), per_pass + 1))
    assert all(b.shape == (5, SEQ + 1) for b in batches)
    assert torch.equal(torch.cat(batches[:per_pass]), samples.samples(0, 0, per_pass * 5))
    assert torch.equal(batches[per_pass], samples.samples(1, 0, 5))


def test_a_corpus_without_a_sample_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no sample"):
        byte_table([b"tiny"])


def test_split_inputs_targets_shifts_by_one_and_pads_inputs_with_the_pad_id() -> None:
    batch = torch.arange(2 * (SEQ + 1)).view(2, SEQ + 1)
    batch[1, -3:] = IGNORE_INDEX  # a padded tail
    inputs, targets = split_inputs_targets(batch, pad_id=5)
    assert inputs.shape == targets.shape == (2, SEQ)
    assert torch.equal(inputs[0, 1:], targets[0, :-1])
    assert inputs[1, -2:].tolist() == [5, 5] and targets[1, -3:].tolist() == [IGNORE_INDEX] * 3
    assert torch.equal(inputs[1, :-2], batch[1, :-3]) and batch[1, -1] == IGNORE_INDEX  # the batch is left as it was


def test_loss_ignores_padding_targets() -> None:
    cfg = ModelConfig(d_model=32, n_heads=2, d_ff=64, n_layers=2, seq_len=SEQ, num_stages=1)
    (stage,) = build_stages(cfg)
    inputs = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    inputs[1, -5:] = BYTE_PAD_ID  # padded inputs are embedded like any token
    targets = torch.full((2, SEQ), IGNORE_INDEX)
    kept = [(0, 3), (0, 9), (1, 2)]
    for row, col in kept:
        targets[row, col] = 65 + col

    captured: list[torch.Tensor] = []
    stage.head.register_forward_hook(lambda _module, _args, out: captured.append(out.detach()))
    loss = stage(inputs, targets)

    logits = captured[0]
    rows, cols = zip(*kept, strict=True)
    expected = F.cross_entropy(logits[list(rows), list(cols)], targets[list(rows), list(cols)])
    torch.testing.assert_close(loss.detach(), expected, rtol=0, atol=1e-6)
