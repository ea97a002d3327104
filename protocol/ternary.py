"""Ternary quantisation and packing: a tensor as one float32 scale per block times trits in {-1, 0, +1}.

Used for what a worker sends back (an expert's weight change, with error feedback on the worker) and
for onboarding a worker (its expert's weights), DESIGN.md section 4. numpy only, no I/O.

Quantiser: Ternary Weight Networks (Li & Liu 2016), per block b of ``chunk`` elements::

    delta_b = 0.7 * mean_b |x|                  threshold (TWN's approximation of the L2-optimal one)
    q_i     = sign(x_i) if |x_i| > delta_b else 0
    scale_b = mean of |x_i| over the kept i     (the L2-optimal scale for that support; 0 if none kept)
    x_i    ~= scale_b * q_i

BitNet b1.58's absmean rule (scale = mean|x|, q = round(clip(x / scale, -1, 1)), i.e. a threshold of
0.5 mean|x|) is the other common choice; TWN's rule gives the lower L2 error on Gaussian and Laplace
data (measured in ``tests/unit/test_ternary.py``), and the L2 error is what error feedback carries to
the next send. The quantiser never flips a sign; it is biased (it shrinks small entries to zero),
which error feedback corrects over repeated sends.

Packing: 5 trits per byte in base 3 (3^5 = 243 <= 256): 1.6 bits a value, 20% less than 2-bit codes.
A trit's digit is 0 for 0, 1 for +1, 2 for -1; byte = d0 + 3 d1 + 9 d2 + 27 d3 + 81 d4 with the first
value in the lowest digit. Byte values 243..255 are invalid, and the padding digits of the last byte
must be 0, so every tensor has exactly one encoding. The blob framing (codec name, shape, chunk, the
size check before parsing, finiteness of the result) is ``codec.py``'s codec "ternary": a per-row
ternary tensor is ``codec.encode(x, "ternary", chunk=x.shape[-1])``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from parallax.protocol.errors import BadTensor

Array = npt.NDArray[Any]

THRESHOLD = 0.7
"""TWN: a value is kept (non-zero) when |x| > THRESHOLD x the mean |x| of its block."""
TRITS_PER_BYTE = 5
_POWERS = np.array([3**i for i in range(TRITS_PER_BYTE)], dtype=np.uint16)
_MAX_BYTE = 3**TRITS_PER_BYTE - 1  # 242


def packed_bytes(n: int) -> int:
    """Bytes of ``n`` packed trits: ceil(n / 5)."""
    return -(-n // TRITS_PER_BYTE)


def quantize(x: npt.ArrayLike, chunk: int) -> tuple[Array, Array]:
    """Ternarise a flat array block by block (TWN rule, see the module docstring).

    Args:
        x: the values, flattened; float.
        chunk: elements per block (one scale each); the last block may be shorter.

    Returns:
        (scale float32 [ceil(n / chunk)], q int8 [n] in {-1, 0, +1}); x ~= scale[i // chunk] * q[i].

    Raises:
        ValueError: chunk < 1 or non-finite values (our own data: a bug upstream).
    """
    flat = np.asarray(x, dtype=np.float32).reshape(-1)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if not np.isfinite(flat).all():
        raise ValueError("cannot ternarise NaN or infinite values")
    n = flat.size
    blocks = -(-n // chunk)
    padded = np.zeros(blocks * chunk, dtype=np.float32)
    padded[:n] = flat
    a_BC = np.abs(padded.reshape(blocks, chunk))
    counts_B = np.full(blocks, chunk, dtype=np.float32)
    if blocks:
        counts_B[-1] = n - chunk * (blocks - 1)  # the last block's padding is not data
    delta_B = THRESHOLD * a_BC.sum(axis=1) / counts_B
    keep_BC = a_BC > delta_B[:, None]
    kept_B = keep_BC.sum(axis=1)
    scale_B = np.where(kept_B > 0, (a_BC * keep_BC).sum(axis=1) / np.maximum(kept_B, 1), 0.0).astype(np.float32)
    q = np.where(keep_BC.reshape(-1)[:n], np.sign(flat), 0).astype(np.int8)
    return scale_B, q


def pack(q: npt.ArrayLike) -> bytes:
    """Pack trits (values in {-1, 0, +1}) 5 to a byte, base 3.

    Raises:
        ValueError: a value outside {-1, 0, +1}.
    """
    t = np.asarray(q).reshape(-1)
    if t.size and not np.isin(t, (-1, 0, 1)).all():
        raise ValueError("pack takes trits in {-1, 0, +1}")
    digits = np.zeros(packed_bytes(t.size) * TRITS_PER_BYTE, dtype=np.uint16)
    digits[: t.size] = np.where(t < 0, 2, t)
    return (digits.reshape(-1, TRITS_PER_BYTE) @ _POWERS).astype(np.uint8).tobytes()


def unpack(data: bytes | bytearray | memoryview, n: int, *, what: str = "ternary", peer: str | None = None) -> Array:
    """Unpack ``n`` trits from a peer's bytes; the length is checked before anything is decoded.

    Args:
        data: exactly ``packed_bytes(n)`` bytes.
        n: the number of values (from the tensor's shape).
        what: names the tensor in error messages.
        peer: the sender, for error messages.

    Returns:
        int8 [n] in {-1, 0, +1}.

    Raises:
        BadTensor: wrong length, a byte above 242, or a non-zero padding digit.
    """
    if n < 0 or len(data) != packed_bytes(n):
        raise BadTensor(f"{what}: {len(data)} packed bytes, expected exactly {packed_bytes(max(n, 0))} for {n} trits",
                        peer=peer)
    b = np.frombuffer(bytes(data), dtype=np.uint8)
    if (b > _MAX_BYTE).any():
        raise BadTensor(f"{what}: packed byte above {_MAX_BYTE} (an invalid code for 5 trits)", peer=peer)
    digits = np.empty((b.size, TRITS_PER_BYTE), dtype=np.uint8)
    rest = b.copy()
    for i in range(TRITS_PER_BYTE):
        digits[:, i] = rest % 3
        rest //= 3
    flat = digits.reshape(-1)
    if (flat[n:] != 0).any():
        raise BadTensor(f"{what}: ternary padding is not zero", peer=peer)
    return np.where(flat[:n] == 2, -1, flat[:n]).astype(np.int8)


__all__ = ["THRESHOLD", "TRITS_PER_BYTE", "pack", "packed_bytes", "quantize", "unpack"]
