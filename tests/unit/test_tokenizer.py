"""Byte tokens and the run's BPE: training, identity by digest, splits, per-byte losses, and the commands."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from parallax.cli.main import app
from parallax.node.config.train import ModelConfig
from parallax.node.train.data import load_corpus, split_corpus
from parallax.node.train.tokenizer import (
    BpeTokenizer,
    ByteTokenizer,
    TokenizerError,
    make_tokenizer,
    run_tokenizer,
    tokenized_splits,
    tokenizer_file,
)

CORPUS = load_corpus(None)[:200_000]


@pytest.fixture(scope="module")
def bpe() -> BpeTokenizer:
    return BpeTokenizer.train(CORPUS, 1024)


def test_a_bpe_is_trained_alike_from_the_same_corpus_and_round_trips_text(bpe):
    assert BpeTokenizer.train(CORPUS, 1024).digest == bpe.digest  # every peer with this corpus agrees
    assert BpeTokenizer.train(CORPUS[:100_000], 1024).digest != bpe.digest
    assert bpe.vocab_size == 1024 and len(bpe.digest) == 64
    text = "ROMEO:\nBut, soft! what light through yonder window breaks? Ça va, 東京.\n"
    ids = bpe.encode(text.encode()).tolist()
    assert bpe.decode(ids) == text and len(ids) < len(text.encode()) and max(ids) < 1024


def test_a_tokenizer_file_is_checked_by_digest(bpe, tmp_path: Path):
    path = bpe.save(tmp_path / "run.tokenizer.json")
    assert BpeTokenizer.load(path, bpe.digest).digest == bpe.digest
    with pytest.raises(TokenizerError, match="another run's tokenizer"):
        BpeTokenizer.load(path, "0" * 64)
    with pytest.raises(TokenizerError, match="cannot read the tokenizer file"):
        BpeTokenizer.load(tmp_path / "absent.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a tokenizer file"):
        BpeTokenizer.load(tmp_path / "junk.json")
    with pytest.raises(TokenizerError, match="set model.vocab_size=1024"):
        make_tokenizer(ModelConfig(tokenizer="bpe", vocab_size=600), CORPUS, path)
    # A run with a manifest reads the file beside it, and says where it should be when it is not there.
    assert tokenizer_file(tmp_path / "run.json") == path
    model = ModelConfig(tokenizer="bpe", vocab_size=1024)
    assert run_tokenizer(model, CORPUS, tmp_path / "run.json").digest == bpe.digest
    with pytest.raises(TokenizerError, match="beside the manifest"):
        run_tokenizer(model, CORPUS, tmp_path / "other.json")


def test_splits_hold_out_the_same_tail_and_count_bytes_per_token(bpe):
    as_bytes = tokenized_splits(CORPUS, ByteTokenizer(), seq_len=64)
    train, val = split_corpus(CORPUS, seq_len=64)
    assert as_bytes.val_bytes_per_token == 1.0 and as_bytes.val.equal(val) and as_bytes.train.equal(train)
    splits = tokenized_splits(CORPUS, bpe, seq_len=64)
    assert bpe.decode(splits.val.tolist()).encode() == val.numpy().tobytes()  # the very same held-out text
    assert splits.val_bytes_per_token == pytest.approx(len(val) / len(splits.val)) and splits.val_bytes_per_token > 2
    with pytest.raises(ValueError, match="shorter model.seq_len"):
        tokenized_splits(CORPUS[:5000], bpe, seq_len=1000)


def test_model_settings_name_the_fix_for_a_vocabulary_that_does_not_fit():
    with pytest.raises(ValueError, match="model.vocab_size=8192"):
        ModelConfig(tokenizer="bpe")
    with pytest.raises(ValueError, match="must be bytes or bpe"):
        ModelConfig(tokenizer="words")
    with pytest.raises(ValueError, match=">= 256"):
        ModelConfig(vocab_size=100)


def test_sim_with_a_bpe_prints_nats_per_token_and_per_byte_and_exports_its_tokenizer(tmp_path: Path):
    out = tmp_path / "result.json"
    result = CliRunner().invoke(app, [
        "sim", "--preset", "tiny", "--tokenizer", "bpe", "--set", "model.vocab_size=1024", "--composers", "2",
        "--steps", "4", "--batch-size", "2", "--quiet", "--no-reference", "--out", str(tmp_path / "sim"),
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "per token" in result.output and "per byte" in result.output and "BPE of 1024" in result.output
    doc = json.loads(out.read_text())
    assert doc["tokenizer"] == "bpe" and doc["val_bytes_per_token"] > 2
    assert doc["assembled_val_loss_per_byte"] == pytest.approx(doc["assembled_val_loss"] / doc["val_bytes_per_token"])
    (model,) = (tmp_path / "sim").glob("*/model")
    config = json.loads((model / "config.json").read_text())
    assert config["tokenizer"]["kind"] == "bpe" and (model / "tokenizer.json").is_file()
    said = CliRunner().invoke(app, ["generate", str(model), "--prompt", "KING:", "--max-new-tokens", "8", "--seed",
                                    "1"])
    assert said.exit_code == 0 and said.output.startswith("KING:"), said.output
    evaluated = CliRunner().invoke(app, ["eval", str(model), "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    scores = json.loads(evaluated.output)
    assert scores["nats_per_byte"] == pytest.approx(scores["nats_per_token"] / doc["val_bytes_per_token"], rel=1e-6)
    (model / "tokenizer.json").write_text((model / "tokenizer.json").read_text().replace('"merges"', '"merges" '))
    tampered = CliRunner().invoke(app, ["eval", str(model)])
    assert tampered.exit_code == 1 and "another run's tokenizer" in tampered.output


def test_run_create_writes_the_bpe_beside_the_manifest_and_names_its_digest(tmp_path: Path):
    out = tmp_path / "run.json"
    result = CliRunner().invoke(app, [
        "run", "create", "--run-id", "bpe-run", "--out", str(out), "--preset", "tiny", "--set",
        "model.tokenizer=bpe", "--set", "model.vocab_size=1024", "--identity", str(tmp_path / "creator.key")])
    assert result.exit_code == 0, result.output
    tok = BpeTokenizer.load(tmp_path / "run.tokenizer.json")
    assert json.loads(out.read_text())["tokenizer"] == tok.digest
    assert tok.digest == BpeTokenizer.train(load_corpus(None), 1024).digest  # trained on the default corpus
