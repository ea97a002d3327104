"""Byte-level training data: load a corpus, hold out a validation tail, shard it, sample windows.

Bytes are the tokens (vocabulary 256): nothing is decoded, so any text in any encoding works and no
tokenizer has to be downloaded. Every composer trains on its own disjoint contiguous shard of the
training split; all composers evaluate on the same fixed windows of the validation split, so their
validation losses are comparable with each other and with a single-machine baseline.

Shape legend: B batch, T sequence length (tokens per window), N tokens in a split.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

DEFAULT_CORPUS: Path = Path(__file__).parent / "corpus" / "tinyshakespeare.txt"
"""Built-in corpus: tinyshakespeare (public domain, karpathy/char-rnn; see corpus/README.md)."""

TEXT_EXTENSIONS = (".txt", ".md", ".text")
"""File extensions picked up when a folder is given (case-insensitive)."""

_HOW_TO = "pass --data with a .txt file, a folder of .txt files, or a glob like 'corpus/*.txt'"
_GLOB_CHARS = frozenset("*?[")


def load_corpus(path: str | os.PathLike[str] | None = None) -> bytes:
    """Read a text corpus as raw bytes.

    Args:
        path: None for the built-in corpus; a file; a folder (every regular file under it whose
            extension is one of ``TEXT_EXTENSIONS``, recursively, hidden files and folders skipped,
            sorted by path); or a glob pattern (``**`` allowed; matching regular files, sorted).
            Several files are joined with b"\\n".

    Returns:
        The corpus bytes, undecoded.

    Raises:
        ValueError: the path does not exist and matches nothing, or everything found was empty or
            unreadable. The message says what was looked for and what to pass instead.
    """
    if path is None:
        path = DEFAULT_CORPUS
    text = os.fspath(path)
    p = Path(text).expanduser()
    if p.is_file():
        files, what = [p], f"file {text!r}"
    elif p.is_dir():
        files = sorted(
            f for f in p.rglob("*")
            if f.is_file() and f.suffix.lower() in TEXT_EXTENSIONS
            # Hidden folders (.git, .ipynb_checkpoints) hold copies or metadata, not corpus.
            and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        what = f"files ending in {'/'.join(TEXT_EXTENSIONS)} under folder {text!r}"
    elif _GLOB_CHARS & set(text):
        files = sorted(Path(m) for m in glob.glob(os.path.expanduser(text), recursive=True))
        files = [f for f in files if f.is_file()]
        what = f"files matching the glob {text!r}"
    else:
        raise ValueError(f"corpus path {text!r} does not exist; {_HOW_TO}")

    chunks = []
    for f in files:
        try:
            chunk = f.read_bytes()
        except OSError as e:  # a folder may hold a file we cannot read; the rest is still usable
            log.warning("skipping unreadable corpus file %s: %s", f, e)
            continue
        if chunk:
            chunks.append(chunk)
    if not chunks:
        found = f"{len(files)} file(s), all empty or unreadable" if files else "nothing"
        raise ValueError(f"no corpus text: looked for {what} and found {found}; {_HOW_TO}")
    return b"\n".join(chunks)


@dataclass(frozen=True)
class CorpusInfo:
    """What a composer trained on, as checkpoints and model cards name it."""

    name: str
    """The built-in corpus's name, or the last part of the ``--data`` given (no folders: a card is public)."""
    sha256: str
    """Of the corpus bytes ``load_corpus`` returned (several files joined)."""
    size: int
    """Its length in bytes."""

    @classmethod
    def of(cls, path: str | os.PathLike[str] | None, corpus: bytes) -> CorpusInfo:
        name = f"{DEFAULT_CORPUS.stem} (built-in)" if path is None else os.path.basename(
            os.fspath(path).rstrip("/")) or os.fspath(path)
        return cls(name, hashlib.sha256(corpus).hexdigest(), len(corpus))

    @classmethod
    def from_json(cls, obj: object) -> CorpusInfo | None:
        """None for anything that is not one (a checkpoint written without it, or damaged)."""
        if not isinstance(obj, dict):
            return None
        name, digest, size = obj.get("name"), obj.get("sha256"), obj.get("size")
        if not (isinstance(name, str) and isinstance(digest, str) and type(size) is int):
            return None
        return cls(name, digest, size)


def split_corpus(
    data: bytes, val_fraction: float = 0.05, *, seq_len: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the corpus into training bytes and a fixed held-out validation tail.

    The tail (not a random sample) is held out so that the split never depends on a seed and no
    validation window overlaps a training window.

    Args:
        data: the corpus bytes.
        val_fraction: share of the bytes held out, in (0, 1).
        seq_len: window length the splits must fit at least once (seq_len + 1 tokens each).

    Returns:
        (train [N_train], val [N_val]) uint8 tensors, contiguous and in corpus order.

    Raises:
        ValueError: val_fraction outside (0, 1), or a split too small for one window.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    # frombuffer shares the (copied, writable) bytearray; it refuses an empty buffer.
    empty = torch.zeros(0, dtype=torch.uint8)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else empty
    n_val = max(1, int(len(tokens) * val_fraction))
    train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
    need = seq_len + 1  # a window of T inputs needs T + 1 bytes for the shifted targets
    if len(train) < need or len(val) < need:
        raise ValueError(
            f"corpus of {len(tokens)} bytes is too small: with val_fraction={val_fraction} the splits "
            f"hold {len(train)} and {len(val)} bytes but each needs at least {need}; use more text"
        )
    return train, val


def shard(train: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """The index-th of count disjoint contiguous shards of the training split (a view, no copy).

    Shard sizes differ by at most one token; the shards cover the split exactly.

    Args:
        train: training tokens [N].
        index: this composer's shard, 0 <= index < count.
        count: number of composers.

    Returns:
        Tokens [~N / count].

    Raises:
        ValueError: count < 1 or index out of range.
    """
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"need 0 <= index < count and count >= 1, got index={index}, count={count}")
    n = len(train)
    return train[index * n // count: (index + 1) * n // count]


def data_seed(fingerprint: str, seed: int) -> int:
    """A composer's data stream seed: its identity's fingerprint and the run's seed (stable across restarts, and
    known to every peer: ``own_data``), 63 bits of a sha256, so no identity can be ground to share another's stream."""
    digest = hashlib.sha256(f"parallax/data-seed/{seed}/{fingerprint}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


class BatchSampler:
    """Random training windows from one token stream, reproducible and resumable.

    Draw ``i``'s windows start at uniformly random offsets drawn by a generator seeded with (``seed``, ``i``) alone
    (numpy's ``SeedSequence`` mixes the two), so the same seed gives the same stream on every machine, a checkpoint
    resumes it from the draw count, and any peer that knows the seed rebuilds any draw without the ones before it
    (``replay``: what checks another's work on its own data, ``own_data``).
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int) -> None:
        """Args:
            tokens: the token stream [N] (any integer dtype; uint8 for bytes).
            batch_size: windows per batch, B.
            seq_len: tokens per window, T.
            seed: generator seed, >= 0 (a node's: ``data_seed``; the simulator's: config seed + composer index).

        Raises:
            ValueError: non-positive sizes, a negative seed, or fewer than seq_len + 1 tokens.
        """
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if seed < 0:
            raise ValueError(f"a sampler's seed must be >= 0, got {seed}")
        if tokens.dim() != 1 or len(tokens) < seq_len + 1:
            raise ValueError(
                f"need a 1-D stream of at least seq_len + 1 = {seq_len + 1} tokens, got shape "
                f"{tuple(tokens.shape)}; use more text or fewer composers"
            )
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.step = 0
        self._offsets_T1 = torch.arange(seq_len + 1)

    @property
    def tokens_seen(self) -> int:
        """Input tokens handed out so far (B * T per batch)."""
        return self.step * self.batch_size * self.seq_len

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns: (x [B, T], y [B, T]) int64 on CPU, y[:, t] = x[:, t + 1] in the stream."""
        batch = self._batch(self.step)
        self.step += 1
        return batch

    def replay(self, first: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The batches this sampler's stream hands out as its draws ``first`` to ``first + count - 1`` (counting from
        0), from its seed alone, at a cost of ``count`` draws: what another peer that knows the seed and the draw count
        can rebuild of the data a sampler's owner trained on. Leaves this sampler where it is."""
        if first < 0 or count < 0:
            raise ValueError(f"draws must be non-negative, got first={first}, count={count}")
        return [self._batch(draw) for draw in range(first, first + count)]

    def _batch(self, draw: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Highest start is N - T - 1 so that the target window (one further) still fits.
        starts = np.random.default_rng([self.seed, draw]).integers(0, len(self.tokens) - self.seq_len,
                                                                   size=self.batch_size)
        windows_BT1 = self.tokens[torch.from_numpy(starts)[:, None] + self._offsets_T1].long()
        return windows_BT1[:, :-1], windows_BT1[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the exact stream: the draw count, the seed, the shape."""
        return {"step": self.step, "seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "n_tokens": len(self.tokens)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``.

        Raises:
            ValueError: the state was taken with another batch size, window or stream length,
                which would silently give a different stream.
        """
        for key in ("batch_size", "seq_len", "n_tokens"):
            mine = len(self.tokens) if key == "n_tokens" else getattr(self, key)
            if state[key] != mine:
                raise ValueError(f"sampler state has {key}={state[key]} but this sampler has {mine}; "
                                 "resume with the same data, shard and batch shape")
        self.step = int(state["step"])
        self.seed = int(state["seed"])


def val_batches(
    val: torch.Tensor, batch_size: int, seq_len: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: B * n_batches windows at evenly spaced offsets, no randomness.

    Every composer (and the baseline) gets the same windows from the same split, so their
    validation losses measure the same thing.

    Args:
        val: validation tokens [N].
        batch_size: windows per batch, B.
        seq_len: tokens per window, T.
        n_batches: number of batches.

    Returns:
        n_batches pairs (x [B, T], y [B, T]) of int64 tensors, y shifted by one.

    Raises:
        ValueError: non-positive sizes, or fewer than seq_len + 1 tokens.
    """
    if min(batch_size, seq_len, n_batches) < 1:
        raise ValueError(
            f"batch_size, seq_len and n_batches must be >= 1, got {batch_size}, {seq_len}, {n_batches}")
    if val.dim() != 1 or len(val) < seq_len + 1:
        raise ValueError(f"validation split of shape {tuple(val.shape)} is shorter than one window "
                         f"({seq_len + 1} tokens); use more text or a larger val_fraction")
    n_windows = batch_size * n_batches
    max_start = len(val) - seq_len - 1
    # Integer spacing (not linspace) so the offsets are exact on every platform; first window at 0,
    # last at the end of the split. Windows overlap when the split is short, which is harmless.
    starts_W = torch.arange(n_windows) * max_start // max(n_windows - 1, 1)
    windows_WT1 = val[starts_W[:, None] + torch.arange(seq_len + 1)].long()
    x_WT, y_WT = windows_WT1[:, :-1], windows_WT1[:, 1:]
    return [(x_WT[i: i + batch_size], y_WT[i: i + batch_size]) for i in range(0, n_windows, batch_size)]
