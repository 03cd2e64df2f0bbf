"""Tokenized data: a Hugging Face tokenizer from a local directory, datasets in every format read, the token
cache, padding with the tokenizer's pad id (and -100 targets), and the check of the model's vocabulary.
Everything is built here, in temporary directories: nothing is downloaded."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from swarm.config import ConfigError, DataConfig, ModelConfig
from swarm.data import load_samples, load_tokens, split_inputs_targets
from swarm.wire.validate import IGNORE_INDEX

SEQ = 16
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex bold jugglers".split()


def texts(count: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 40))) for _ in range(count)]


def save_tokenizer(where: Path, pad: bool) -> Path:
    """A byte-level BPE trained on a few strings, saved as `save_pretrained` saves a fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["[PAD]", "[EOS]"] if pad else ["[EOS]"]
    tok.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", **({"pad_token": "[PAD]"} if pad else {}))
    fast.save_pretrained(where)
    return where


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {"pad": save_tokenizer(root / "pad", pad=True), "eos": save_tokenizer(root / "eos", pad=False)}


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "n": i}) + "\n" for i, d in enumerate(docs)))
    return path


def data_config(path: Path, tokenizer: Path | None, tmp_path: Path, **more) -> DataConfig:
    return DataConfig(path=str(path), tokenizer=None if tokenizer is None else str(tokenizer),
                      cache_dir=str(tmp_path / "cache"), **more)


def model(vocab_size: int = 300, seq_len: int = SEQ) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=32, n_heads=2, d_ff=64, n_layers=2,
                       num_stages=2)


def all_rows(table) -> torch.Tensor:
    return torch.cat([table.samples(0, 0, len(table)), table.validation()])


def test_a_tokenizer_makes_the_samples_ended_by_eos_and_padded_with_its_pad_id(tokenizers, tmp_path) -> None:
    from transformers import AutoTokenizer

    docs = texts()
    tokenizer = AutoTokenizer.from_pretrained(tokenizers["pad"], local_files_only=True)
    expected = [tokenizer(d, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for d in docs]
    cfg = data_config(write_jsonl(tmp_path / "docs.jsonl", docs), tokenizers["pad"], tmp_path, validation_samples=4)
    table = load_samples(cfg, model())
    assert table.pad_id == tokenizer.pad_token_id != tokenizer.eos_token_id

    padded = 0
    for row in all_rows(table).tolist():
        real = [t for t in row if t != IGNORE_INDEX]
        assert row[: len(real)] == real and 0 <= min(real) and max(real) < len(tokenizer)  # padding: one suffix
        # each sample is a piece of one document's ids; a padded one is a document's end
        whole = [ids for ids in expected if any(ids[i : i + len(real)] == real for i in range(len(ids)))]
        assert whole, row
        if len(real) < len(row):
            padded += 1
            assert any(ids[-len(real):] == real for ids in whole)
    assert padded > 0
    batch = all_rows(table)
    inputs, targets = split_inputs_targets(batch, table.pad_id)
    pad = batch[:, 1:] == IGNORE_INDEX
    assert torch.equal(targets == IGNORE_INDEX, pad)
    assert (inputs[batch[:, :-1] == IGNORE_INDEX] == tokenizer.pad_token_id).all()


def test_without_a_pad_token_eos_pads_and_real_eos_targets_still_count(tokenizers, tmp_path) -> None:
    tokens = load_tokens(DataConfig(tokenizer=str(tokenizers["eos"])))
    table = load_samples(data_config(write_jsonl(tmp_path / "d.jsonl", texts()), tokenizers["eos"], tmp_path),
                         model())
    assert table.pad_id == tokens.pad_id
    batch = table.samples(0, 0, len(table))
    inputs, targets = split_inputs_targets(batch, table.pad_id)
    padded = (targets == IGNORE_INDEX).any(dim=1)
    last_real = (targets != IGNORE_INDEX).sum(dim=1) - 1
    # the document's own eos is the last real target of a padded sample: learned, not skipped
    assert padded.any() and (targets[padded, last_real[padded]] == tokens.pad_id).all()
    assert (inputs[batch[:, :-1] == IGNORE_INDEX] == tokens.pad_id).all()


def test_every_format_gives_the_same_samples_and_the_cache_serves_them_all(tokenizers, tmp_path, caplog) -> None:
    """The cache is keyed by the text itself: the same documents in another format are not tokenized again."""
    import datasets

    docs = texts()
    columns = {"body": docs, "n": list(range(len(docs)))}
    pq.write_table(pa.table(columns), tmp_path / "docs.parquet")
    with pa.OSFile(str(tmp_path / "docs.arrow"), "wb") as sink, pa.ipc.new_file(sink, pa.table(columns).schema) as w:
        w.write_table(pa.table(columns))
    datasets.Dataset.from_dict(columns).save_to_disk(tmp_path / "saved")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": ["other"] * 3}),
                          "validation": datasets.Dataset.from_dict(columns)}).save_to_disk(tmp_path / "saved_dict")
    (tmp_path / "shards").mkdir()
    pq.write_table(pa.table({"body": docs[:20]}), tmp_path / "shards" / "a.parquet")
    write_jsonl(tmp_path / "shards" / "b.jsonl", docs[20:], field="body")
    sources = [(write_jsonl(tmp_path / "docs.jsonl", docs, field="body"), {}), (tmp_path / "docs.parquet", {}),
               (tmp_path / "docs.arrow", {}), (tmp_path / "saved", {}),
               (tmp_path / "saved_dict", {"split": "validation"}), (tmp_path / "shards", {}),
               (tmp_path / "saved" / "data-00000-of-00001.arrow", {})]  # the last in Arrow's stream format
    tables = []
    with caplog.at_level(logging.INFO, logger="swarm.data"):
        for path, more in sources:
            caplog.clear()
            cfg = data_config(path, tokenizers["pad"], tmp_path, text_field="body", **more)
            tables.append(load_samples(cfg, model()))
            (line,) = [r.getMessage() for r in caplog.records]
            assert ("tokenized 40 documents" in line) == (path == sources[0][0]), line
            assert path == sources[0][0] or "from the token cache" in line and "unchanged" in line
    assert len({t.name for t in tables}) == 1
    for table in tables[1:]:
        assert torch.equal(all_rows(table), all_rows(tables[0]))
    assert len(list((tmp_path / "cache").iterdir())) == 2  # one entry: its samples and the mark of completion


def test_the_cache_entry_follows_the_text_the_tokenizer_and_seq_len(tokenizers, tmp_path, caplog) -> None:
    docs = texts()
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    first = load_samples(data_config(path, tokenizers["pad"], tmp_path), model())
    variants = [
        (data_config(write_jsonl(tmp_path / "e.jsonl", [*docs[:-1], docs[-1] + " fox"]), tokenizers["pad"], tmp_path),
         model()),
        (data_config(path, tokenizers["eos"], tmp_path), model()),
        (data_config(path, tokenizers["pad"], tmp_path), model(seq_len=SEQ + 1)),
        (data_config(path, None, tmp_path), model(vocab_size=257)),  # bytes: never cached
    ]
    names = {first.name}
    with caplog.at_level(logging.INFO, logger="swarm.data"):
        for cfg, m in variants:
            names.add(load_samples(cfg, m).name)
    assert len(names) == 5 and not any("from the token cache" in r.getMessage() for r in caplog.records)
    assert len(list((tmp_path / "cache").glob("*.tokens"))) == 4


def test_a_damaged_cache_entry_is_tokenized_again(tokenizers, tmp_path, caplog) -> None:
    cfg = data_config(write_jsonl(tmp_path / "d.jsonl", texts()), tokenizers["pad"], tmp_path)
    expected = all_rows(load_samples(cfg, model()))
    (entry,) = (tmp_path / "cache").glob("*.tokens")
    damaged = entry.read_bytes()[:-4]
    entry.unlink()  # (a new file: the table read above maps the old one)
    entry.write_bytes(damaged)
    with caplog.at_level(logging.INFO, logger="swarm.data"):
        again = load_samples(cfg, model())
    assert "tokenized 40 documents" in caplog.text and torch.equal(all_rows(again), expected)


def test_a_vocabulary_too_small_for_the_data_is_refused_naming_both(tokenizers, tmp_path) -> None:
    size = len(json.loads((tokenizers["pad"] / "tokenizer.json").read_text())["model"]["vocab"])
    cfg = data_config(write_jsonl(tmp_path / "d.jsonl", texts()), tokenizers["pad"], tmp_path)
    with pytest.raises(ConfigError, match=rf"model.vocab_size: 100 does not cover the {size} ids of the tokenizer in "
                                          rf".*pad; set model.vocab_size to at least {size}"):
        load_samples(cfg, model(vocab_size=100))
    with pytest.raises(ConfigError, match=r"model.vocab_size: 256 does not cover the 257 ids of bytes"):
        load_samples(data_config(tmp_path / "d.jsonl", None, tmp_path), model(vocab_size=256))
    assert not (tmp_path / "cache").exists()  # refused before anything was read


def test_bad_sources_are_refused_naming_the_field(tokenizers, tmp_path) -> None:
    import datasets

    docs = write_jsonl(tmp_path / "d.jsonl", texts())
    (tmp_path / "empty").mkdir()
    pq.write_table(pa.table({"n": [1, 2]}), tmp_path / "ints.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(tmp_path / "dd")
    cases = [
        (data_config(docs, Path("gpt2"), tmp_path), "data.tokenizer: gpt2 is not a directory"),  # never the hub
        (data_config(docs, tmp_path / "empty", tmp_path), "data.tokenizer: no tokenizer could be loaded"),
        (data_config(tmp_path / "ints.parquet", tokenizers["pad"], tmp_path), 'has no column "text" \\(columns: n\\)'),
        (data_config(tmp_path / "ints.parquet", tokenizers["pad"], tmp_path, text_field="n"),
         'data.text_field: column "n" of .* holds int64, not text'),
        (data_config(tmp_path / "dd", tokenizers["pad"], tmp_path, split="test"), "data.split: .* has splits train"),
        (data_config(docs, tokenizers["pad"], tmp_path, text_field="body"), 'lacks a string field "body"'),
    ]
    for cfg, why in cases:
        with pytest.raises(ConfigError, match=why):
            load_samples(cfg, model())
