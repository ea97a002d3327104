"""How text becomes tokens: raw bytes, or a byte-level BPE trained on the run's corpus.

``bytes`` (vocabulary 256, the default of the tiny and small presets) needs nothing: any text in any encoding
is its own token stream. ``bpe`` is a byte-level BPE of ``model.vocab_size`` tokens, trained here with the
``tokenizers`` package on the run's corpus (no download). Its file (``tokenizer.json``) is stored with the run,
and its sha256 is the run's ``tokenizer`` term (``protocol.manifest``): composers of one run must split text the
same way, so a peer whose tokenizer differs is refused by digest, like one with other settings.

Losses are compared across tokenizers per byte: ``Splits.val_bytes_per_token`` turns nats per token into nats
per byte on the validation split.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from parallax.errors import NodeError
from parallax.node.config.train import ModelConfig
from parallax.node.train.data import split_corpus

BYTES = "bytes"


class TokenizerError(NodeError, ValueError):
    """A tokenizer file that is missing, unreadable, another run's, or of the wrong size; the message says
    what to do."""


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    digest: str
    """``bytes``, or the sha256 (hex) of the BPE's file: the run's ``tokenizer`` term."""

    def encode(self, data: bytes) -> torch.Tensor: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    kind = BYTES
    vocab_size = 256
    digest = BYTES

    def encode(self, data: bytes) -> torch.Tensor:
        """Returns: uint8 [N], the bytes themselves."""
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class BpeTokenizer:
    """A byte-level BPE (``tokenizers``), identified by the sha256 of its JSON file."""

    kind = "bpe"

    def __init__(self, text: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_str(text)
        except Exception as e:  # the library raises its own exception types for a bad file
            raise TokenizerError(f"not a tokenizer file ({e}); make one with `parallax run create ... --set "
                                 "model.tokenizer=bpe` or use the run's own") from e
        self.text = text
        self.vocab_size = self._tok.get_vocab_size()
        self.digest = hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def train(cls, corpus: bytes, vocab_size: int) -> BpeTokenizer:
        """Train a byte-level BPE of at most ``vocab_size`` tokens on ``corpus`` (decoded as UTF-8, invalid
        bytes replaced). Deterministic: the same corpus and size give the same file, hence the same digest."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        text = corpus.decode("utf-8", errors="replace")
        tok.train_from_iterator(_chunks(text), trainer=trainer, length=None)
        return cls(tok.to_str())

    @classmethod
    def load(cls, path: str | os.PathLike[str], digest: str | None = None) -> BpeTokenizer:
        """The tokenizer in file ``path``; with ``digest``, refuse a file whose sha256 differs.

        Raises:
            TokenizerError: missing or unreadable, not a tokenizer, or another digest than the run's.
        """
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read the tokenizer file {path}: {e}; pass the run's tokenizer.json "
                                 "(it is written beside the manifest by `parallax run create`)") from e
        tok = cls(text)
        if digest is not None and tok.digest != digest:
            raise TokenizerError(f"tokenizer file {path} has sha256 {tok.digest[:16]}..., the run's is "
                                 f"{digest[:16]}...: it is another run's tokenizer; use the run's own file")
        return tok

    def save(self, path: str | os.PathLike[str]) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(self.text)
        return out

    def encode(self, data: bytes) -> torch.Tensor:
        """Returns: int32 [N]."""
        text = data.decode("utf-8", errors="replace")
        ids = [i for enc in self._tok.encode_batch(list(_chunks(text))) for i in enc.ids]
        return torch.tensor(ids, dtype=torch.int32)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if 0 <= i < self.vocab_size])


def _chunks(text: str, size: int = 1 << 16) -> list[str]:
    """The text in pieces cut at line ends (so no piece splits a word), for the library's parallel passes."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def make_tokenizer(model: ModelConfig, corpus: bytes, path: str | os.PathLike[str] | None = None,
                   digest: str | None = None) -> Tokenizer:
    """The tokenizer ``model`` names (its kind and size checked by ``ModelConfig``): bytes; or a BPE read from
    ``path`` (checked against ``digest``), else trained on ``corpus``.

    Raises:
        TokenizerError: a bad file, or a BPE whose vocabulary exceeds the model's.
    """
    if model.tokenizer == BYTES:
        return ByteTokenizer()
    tok = BpeTokenizer.load(path, digest) if path is not None else BpeTokenizer.train(corpus, model.vocab_size)
    if tok.vocab_size > model.vocab_size:
        raise TokenizerError(f"the tokenizer has {tok.vocab_size} tokens, the model's vocabulary {model.vocab_size}: "
                             f"set model.vocab_size={tok.vocab_size}")
    return tok


@dataclass(frozen=True, slots=True)
class Splits:
    """A corpus split as ``data.split_corpus`` splits it (the tail held out), then tokenized."""

    train: torch.Tensor
    val: torch.Tensor
    val_bytes_per_token: float
    """Bytes of the validation split over its tokens: nats per token / this = nats per byte."""


def tokenized_splits(corpus: bytes, tokenizer: Tokenizer, *, seq_len: int, val_fraction: float = 0.05) -> Splits:
    """The training and validation splits of ``corpus`` in ``tokenizer``'s tokens.

    The bytes are split first (the same tail as with byte tokens) and each side tokenized alone, so no token
    spans the boundary.

    Raises:
        ValueError: a split shorter than one window of seq_len + 1 tokens.
    """
    if tokenizer.kind == BYTES:
        train, val = split_corpus(corpus, val_fraction, seq_len=seq_len)
        return Splits(train, val, 1.0)
    train_bytes, val_bytes = split_corpus(corpus, val_fraction, seq_len=1)
    train = tokenizer.encode(train_bytes.numpy().tobytes())
    val = tokenizer.encode(val_bytes.numpy().tobytes())
    if min(len(train), len(val)) < seq_len + 1:
        raise ValueError(f"the corpus gives {len(train)} training and {len(val)} validation tokens, each needs "
                         f"{seq_len + 1}; use more text or a shorter model.seq_len")
    return Splits(train, val, len(val_bytes) / len(val))


def tokenizer_file(manifest: str | os.PathLike[str]) -> Path:
    """Where a run's BPE file lives: beside its manifest, ``run.json`` -> ``run.tokenizer.json``."""
    path = Path(manifest)
    return path.with_name(f"{path.stem}.tokenizer.json")


def run_tokenizer(model: ModelConfig, corpus: bytes, manifest: str | os.PathLike[str] | None) -> Tokenizer:
    """The tokenizer a peer trains with: a run with a manifest file reads the BPE stored beside it (the manifest's
    digest is checked against it by ``node.net.admission``); a run without one trains the BPE on the corpus,
    alike on every peer with the same corpus and settings.

    Raises:
        TokenizerError: the run's file is missing or bad.
    """
    if model.tokenizer != "bpe" or manifest is None:
        return make_tokenizer(model, corpus)
    file = tokenizer_file(manifest)
    if not file.is_file():
        raise TokenizerError(f"the run's tokenizer {file} is missing: `parallax run create` writes it beside the "
                             "manifest; copy it there with the manifest")
    return make_tokenizer(model, corpus, file)
