"""Using an exported model: evaluate it on fixed validation windows, and sample text from it."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from parallax.node.model.transformer import MoETransformer
from parallax.node.train.composer import evaluate
from parallax.node.train.data import load_corpus, val_batches
from parallax.node.train.device import threads
from parallax.node.train.tokenizer import ByteTokenizer, Tokenizer, tokenized_splits


@dataclass(frozen=True)
class EvalResult:
    nats_per_token: float
    nats_per_byte: float
    bits_per_byte: float
    perplexity: float
    """exp(nats per token)."""
    windows: int
    tokens: int
    data: str

    def as_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def evaluate_on(model: MoETransformer, data: str | os.PathLike[str] | None, *, batch_size: int, eval_batches: int,
                val_fraction: float = 0.05, tokenizer: Tokenizer | None = None) -> EvalResult:
    """Mean cross-entropy of ``model`` on the fixed validation windows the run's benchmarks use: the held-out tail
    (``val_fraction``) of ``data`` (None: the built-in corpus), ``eval_batches`` batches of ``batch_size`` windows,
    in ``tokenizer``'s tokens (None: bytes). Nats per byte divide by the split's bytes per token.

    Raises:
        ValueError: the data cannot be read or is too small for one window (the message says what to pass).
    """
    cfg = model.cfg
    splits = tokenized_splits(load_corpus(data), tokenizer or ByteTokenizer(), seq_len=cfg.seq_len,
                              val_fraction=val_fraction)
    batches = val_batches(splits.val, batch_size, cfg.seq_len, eval_batches)
    loss = evaluate(model, batches)
    tokens = sum(y.numel() for _, y in batches)
    per_byte = loss / splits.val_bytes_per_token
    return EvalResult(nats_per_token=loss, nats_per_byte=per_byte, bits_per_byte=per_byte / math.log(2),
                      perplexity=math.exp(loss), windows=len(batches) * batch_size, tokens=tokens,
                      data=str(data) if data is not None else "the built-in corpus")


@torch.inference_mode()
def generate(model: MoETransformer, prompt: bytes, *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             tokenizer: Tokenizer | None = None, use_cache: bool = True,
             on_text: Callable[[bytes], None] | None = None, token_threads: int | None = 1) -> bytes:
    """Sample ``max_new_tokens`` tokens after ``prompt`` and return them as text (``tokenizer``'s; None: bytes,
    returned as they are); ``on_text`` gets each piece of it as it comes.

    ``temperature`` 0 picks the most likely token; ``top_k`` keeps the k most likely before sampling, ``top_p`` the
    fewest most likely whose probabilities (after ``top_k`` and the temperature) add up to p (nucleus sampling,
    Holtzman et al. 2020: the most likely token always stays). The context
    is at most the model's ``seq_len`` tokens. With ``use_cache`` each new token costs one position (the keys and
    values of the context are kept); once the context fills, it restarts from its last half, so past ``seq_len``
    tokens the model sees between half a window and a whole one. Without it, every token reruns the last
    ``seq_len`` tokens (a sliding window): the two give the same tokens while the text fits one window.
    ``token_threads``: torch's threads for each cached token on a CPU (None: the process's setting). One by default:
    a cached token's products have one row, nothing to split, and a second thread only waits for the first (on a
    busy machine a token took 2.8 times as long on two: docs/benchmarks.md, "Generation").
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if token_threads is not None and token_threads < 1:
        raise ValueError(f"token_threads must be >= 1 (or None: the process's setting), got {token_threads}")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()  # a fresh sample each run
    model.eval()
    tokenizer = tokenizer or ByteTokenizer()
    tokens = tokenizer.encode(prompt or b"\n").tolist()  # an empty prompt starts a new line
    window = model.cfg.seq_len
    text = _Text(tokenizer, on_text)
    cache = model.new_cache() if use_cache else None

    def logits_after(new: list[int]) -> torch.Tensor:
        if cache is not None and len(new) == 1:
            with threads(token_threads if device.type == "cpu" else None):
                return model.decode(new[0], cache).float()
        return model(torch.tensor([new], dtype=torch.long, device=device), cache=cache).logits[0, -1].float()

    logits = logits_after(tokens[-window:])
    for _ in range(max_new_tokens):
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            scaled = logits / temperature
            if top_k is not None and top_k < scaled.numel():
                kth = torch.topk(scaled, top_k).values[-1]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            probs = torch.softmax(scaled, dim=-1)
            if top_p is not None and top_p < 1:
                probs = nucleus(probs, top_p)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        tokens.append(nxt)
        text.add(nxt)
        if cache is None:
            logits = logits_after(tokens[-window:])
        elif cache[0].length >= window:  # the window is full: start again from its last half
            cache = model.new_cache()
            logits = logits_after(tokens[-(window // 2):])
        else:
            logits = logits_after([nxt])
    return text.all()


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """``probs`` [V] with every token but the fewest most likely whose probabilities add up to ``top_p`` set to 0
    (not renormalised: ``torch.multinomial`` takes weights)."""
    sorted_p, order = probs.sort(descending=True)
    outside = sorted_p.cumsum(0) - sorted_p >= top_p  # the mass of the more likely tokens already reaches p
    return probs.scatter(0, order, sorted_p.masked_fill(outside, 0.0))


class _Text:
    """The sampled tokens as text, handed out in pieces as they come (a BPE token may end inside a character:
    a piece is only what decodes for good)."""

    def __init__(self, tokenizer: Tokenizer, on_text: Callable[[bytes], None] | None) -> None:
        self.tokenizer, self.on_text = tokenizer, on_text
        self.tokens: list[int] = []
        self.sent = 0

    def add(self, token: int) -> None:
        self.tokens.append(token)
        if self.on_text is None:
            return
        if isinstance(self.tokenizer, ByteTokenizer):
            self.on_text(bytes([token]))
            return
        # Replacement characters at the end stand for a character whose rest may come with the next token.
        settled = self.tokenizer.decode(self.tokens).rstrip("\ufffd").encode()
        if len(settled) > self.sent:
            self.on_text(settled[self.sent:])
            self.sent = len(settled)

    def all(self) -> bytes:
        if isinstance(self.tokenizer, ByteTokenizer):
            return bytes(self.tokens)
        return self.tokenizer.decode(self.tokens).encode()
