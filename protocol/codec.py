"""Tensor codecs: how an array crosses the wire, and the checks it passes on the way in. numpy only.

A blob is one msgpack array ``[codec, dtype, shape, params, payload]``:

    codec    one of CODECS: "raw", "fp16", "int8", "int4", "ternary", "lowrank", "topk"
    dtype    the dtype of the decoded array (whitelisted; compressed codecs decode to float16/32)
    shape    list of dimensions
    params   [] for raw/fp16, [chunk] for int8/int4/ternary, [rank] for lowrank, [chunk, keep, bits] for topk
    payload  little-endian bytes whose exact length follows from codec, dtype, shape and params

Compressed layouts (n elements, c = ceil(n / chunk) chunks, each with a float32 scale):

    fp16     n float16
    int8     c scales || n int8 q,                    x = scale * q,  |q| <= 127
    int4     c scales || ceil(n/2) bytes of nibbles,  x = scale * (nibble - 8), low nibble first
    ternary  c scales || ceil(n/5) bytes of base-3 trits, 5 a byte (``ternary.py``: TWN quantiser,
             threshold 0.7 * mean|x|, scale = mean of kept |x|), x = scale * trit
    lowrank  (m*r) float32 left || (r*k) float32 right, x = left @ right, m = shape[0], k = prod(shape[1:])
    topk     c scales || ceil(K*w/8) bytes of positions || ceil(K*bits/8) bytes of codes, every field low bit
             first, w = bits of (chunk - 1): each chunk keeps its min(keep, chunk's length) entries of largest
             magnitude (positions within the chunk, strictly increasing), x = scale * (code - (2^bits - 1) / 2)
             there and 0 elsewhere; K = the entries kept (SparseLoCo's wire: the sender keeps what was not sent)

``decode`` refuses, with ``BadTensor`` (a ``RemoteProtocolError``): a blob over the size its limits allow
(before parsing), a codec, dtype, rank or dimension count not allowed, too many elements, a payload
length that is not exactly the expected one, invalid codes or padding, and non-finite values or a norm
above ``max_norm`` in the result. Measured error bounds are in ``tests/unit/test_protocol_codec.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from parallax.protocol import ternary
from parallax.protocol.errors import BadTensor, LocalProtocolError, NonFiniteTensor, OversizedMessage
from parallax.protocol.schema import MSGPACK_ERRORS

CODECS = frozenset({"raw", "fp16", "int8", "int4", "ternary", "lowrank", "topk"})
COMPRESSED = CODECS - {"raw"}
DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(code)
    for name, code in {
        "float16": "<f2",
        "float32": "<f4",
        "float64": "<f8",
        "int8": "i1",
        "uint8": "u1",
        "int32": "<i4",
        "int64": "<i8",
    }.items()
}
FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})
DEFAULT_CHUNK = 1024
MAX_CHUNK = 1 << 20
TOPK_MAX_CHUNK = 1 << 16  # positions within a chunk are uint16
TOPK_BITS = (2, 4, 8)
_SCALE = np.dtype("<f4")
_HEADER_SLACK = 64  # msgpack framing around the payload: codec, dtype, params, length prefixes

Array = npt.NDArray[Any]


@dataclass(frozen=True, slots=True)
class TensorLimits:
    """What a receiver accepts for one kind of tensor. Build one per use; the defaults are permissive.

    Attributes:
        max_elements: element count cap (product of the shape).
        max_ndim: dimension count cap.
        dtypes: decoded dtypes accepted.
        codecs: codecs accepted.
        max_rank: rank cap for ``lowrank``.
        max_norm: L2 norm cap on the decoded values (None: no cap), e.g. for pseudo-gradients.
    """

    max_elements: int
    max_ndim: int = 4
    dtypes: frozenset[str] = FLOAT_DTYPES
    codecs: frozenset[str] = CODECS
    max_rank: int = 64
    max_norm: float | None = None

    def __post_init__(self) -> None:
        if self.max_elements < 0 or self.max_ndim < 0 or self.max_rank < 1:
            raise ValueError("max_elements and max_ndim must be >= 0 and max_rank >= 1")
        if not self.dtypes <= DTYPES.keys() or not self.codecs <= CODECS:
            raise ValueError(f"dtypes must be among {sorted(DTYPES)} and codecs among {sorted(CODECS)}")

    @property
    def max_blob_bytes(self) -> int:
        """The largest blob these limits can accept: the cap checked before parsing."""
        # raw float64 is 8 bytes an element; every compressed layout is smaller, scales included
        # (int8: 1 + 4/chunk), and lowrank with r <= min(m, k) has (m + k) r <= 2 m k floats.
        return 8 * self.max_elements + 10 * self.max_ndim + _HEADER_SLACK


# --- encoding (our own arrays: failures are LocalProtocolError) ---------------------------------------


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _pack(codec: str, dtype: str, shape: tuple[int, ...], params: list[int], payload: bytes) -> bytes:
    return msgpack.packb([codec, dtype, list(shape), params, payload], use_bin_type=True)  # type: ignore[no-any-return]


def _chunked(x: Array, chunk: int) -> Array:
    """``x`` (flat float32) zero-padded to whole chunks, as (chunks, chunk)."""
    c = -(-x.size // chunk)
    padded = np.zeros(c * chunk, dtype=np.float32)
    padded[: x.size] = x
    return padded.reshape(c, chunk)


def _quantize(x: Array, chunk: int, levels: int) -> tuple[Array, Array]:
    """Symmetric uniform quantisation to integers in [-levels, levels], one scale per chunk."""
    xc = _chunked(x, chunk)
    scale = (np.abs(xc).max(axis=1) / levels).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    q = np.clip(np.rint(xc / safe[:, None]), -levels, levels).astype(np.int8)
    return scale, q.reshape(-1)[: x.size]


def _pack_bits(codes: Array, bits: int, pad: int) -> bytes:
    per = 8 // bits
    n = codes.size
    padded = np.full(-(-n // per) * per, pad, dtype=np.uint8)
    padded[:n] = codes
    grouped = padded.reshape(-1, per)
    out = np.zeros(grouped.shape[0], dtype=np.uint8)
    for i in range(per):
        out |= grouped[:, i] << np.uint8(bits * i)
    return out.tobytes()


def encode(array: npt.ArrayLike, codec: str = "raw", *, chunk: int = DEFAULT_CHUNK, rank: int = 8, keep: int = 64,
           bits: int = 2) -> bytes:
    """Encode an array as a blob.

    Args:
        array: the tensor (numpy, or anything ``np.asarray`` takes). Compressed codecs need floats.
        codec: one of ``CODECS``.
        chunk: elements per scale for int8/int4/ternary/topk.
        rank: rank of the truncated SVD for ``lowrank`` (use ``encode_lowrank`` for your own factors).
        keep: entries kept per chunk for ``topk`` (all of a chunk no longer than that).
        bits: bits per kept value for ``topk`` (one of ``TOPK_BITS``).

    Raises:
        LocalProtocolError: unsupported dtype or codec, non-finite values, values beyond float16.
    """
    x = np.asarray(array)
    dtype = x.dtype.name
    if dtype not in DTYPES:
        raise LocalProtocolError(f"dtype {dtype} is not on the wire whitelist {sorted(DTYPES)}; cast first")
    if codec not in CODECS:
        raise LocalProtocolError(f"unknown codec {codec!r}; use one of {sorted(CODECS)}")
    if dtype in FLOAT_DTYPES and not np.isfinite(x).all():
        raise LocalProtocolError("refusing to encode a tensor with NaN or Inf values")
    shape = tuple(int(d) for d in x.shape)
    if codec == "raw":
        return _pack("raw", dtype, shape, [], np.ascontiguousarray(x, dtype=DTYPES[dtype]).tobytes())
    if dtype not in FLOAT_DTYPES:
        raise LocalProtocolError(f"codec {codec} compresses floating-point tensors, not {dtype}")
    out_dtype = "float16" if dtype == "float16" else "float32"
    flat = x.astype(np.float32).reshape(-1)
    if codec == "fp16":
        with np.errstate(over="ignore"):
            h = flat.astype("<f2")
        if not np.isfinite(h).all():
            raise LocalProtocolError("values exceed the float16 range (65504); use int8 or raw")
        return _pack("fp16", out_dtype, shape, [], h.tobytes())
    if codec == "lowrank":
        if x.ndim < 2:
            raise LocalProtocolError(f"lowrank needs a tensor of 2 or more dimensions, got shape {shape}")
        left, right = low_rank_factors(flat.reshape(shape[0], -1), rank)
        return encode_lowrank(left, right, shape=shape, dtype=out_dtype)
    if not 1 <= chunk <= MAX_CHUNK:
        raise LocalProtocolError(f"chunk must be in [1, {MAX_CHUNK}], got {chunk}")
    if codec == "topk":
        if not (chunk <= TOPK_MAX_CHUNK and keep >= 1 and bits in TOPK_BITS):
            raise LocalProtocolError(f"topk needs chunk <= {TOPK_MAX_CHUNK}, keep >= 1 and bits in {TOPK_BITS}; got "
                                     f"chunk {chunk}, keep {keep}, bits {bits}")
        keep = min(keep, chunk)  # a chunk smaller than keep goes whole
        return _pack("topk", out_dtype, shape, [chunk, keep, bits], _encode_topk(flat, chunk, keep, bits))
    if codec == "int8":
        scale, q = _quantize(flat, chunk, 127)
        payload = scale.astype(_SCALE).tobytes() + q.tobytes()
    elif codec == "int4":
        scale, q = _quantize(flat, chunk, 7)
        payload = scale.astype(_SCALE).tobytes() + _pack_bits((q + 8).astype(np.uint8), 4, pad=8)
    else:  # ternary
        scale, trits = ternary.quantize(flat, chunk)
        payload = scale.astype(_SCALE).tobytes() + ternary.pack(trits)
    return _pack(codec, out_dtype, shape, [chunk], payload)


def _topk_counts(n: int, chunk: int, keep: int) -> Array:
    """Entries each chunk of ``n`` elements keeps."""
    c = -(-n // chunk)
    counts = np.full(c, min(keep, chunk), dtype=np.int64)
    if c and n % chunk:
        counts[-1] = min(keep, n % chunk)
    return counts


def _position_bits(chunk: int) -> int:
    """Bits of a position within a chunk of ``chunk`` entries."""
    return max(1, (chunk - 1).bit_length())


def _pack_wide(values: Array, width: int) -> bytes:
    """Non-negative integers under 2^width, ``width`` bits each, low bit first, zero-padded to whole bytes."""
    bits = (values.astype(np.int64)[:, None] >> np.arange(width)) & 1
    return np.packbits(bits.astype(np.uint8).reshape(-1), bitorder="little").tobytes()


def _encode_topk(flat: Array, chunk: int, keep: int, bits: int) -> bytes:
    n, full = flat.size, flat.size // chunk
    kept = []  # global indices of the entries kept, increasing
    if full:
        magnitude = np.abs(flat[: full * chunk].reshape(full, chunk))
        top = np.sort(np.argpartition(-magnitude, keep - 1, axis=1)[:, :keep], axis=1)
        kept.append((top + np.arange(full)[:, None] * chunk).reshape(-1))
    if n > full * chunk:
        k = min(keep, n - full * chunk)
        kept.append(np.sort(np.argpartition(-np.abs(flat[full * chunk:]), k - 1)[:k]) + full * chunk)
    index = np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
    chunk_of, values = index // chunk, flat[index]
    peak = np.zeros(-(-n // chunk), dtype=np.float32)
    np.maximum.at(peak, chunk_of, np.abs(values))
    half = ((1 << bits) - 1) / 2
    scale = (peak / half).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))
    codes = np.clip(np.rint(values / safe[chunk_of] + half), 0, (1 << bits) - 1).astype(np.uint8)
    packed = codes.tobytes() if bits == 8 else _pack_bits(codes, bits, pad=0)
    return scale.astype(_SCALE).tobytes() + _pack_wide(index % chunk, _position_bits(chunk)) + packed


def low_rank_factors(matrix: npt.ArrayLike, rank: int, *, power_iters: int = 2) -> tuple[Array, Array]:
    """Factors ``(left, right)`` of a rank-``rank`` approximation of a 2-D ``matrix``.

    Randomised SVD (Halko, Martinsson & Tropp 2011: Gaussian range finder with 8 extra columns and
    ``power_iters`` power iterations), deterministic (fixed seed); close to the Eckart-Young optimum
    when the spectrum decays, and O(m k r) instead of a full SVD's O(m k min(m, k)).
    """
    a = np.asarray(matrix, dtype=np.float64)
    if a.ndim != 2 or rank < 1:
        raise LocalProtocolError(f"low_rank_factors needs a matrix and rank >= 1, got {a.shape} and {rank}")
    r = min(rank, *a.shape)
    if r < 1:
        raise LocalProtocolError(f"cannot factor an empty matrix of shape {a.shape}")
    sketch = min(r + 8, *a.shape)
    if sketch == min(a.shape):  # small enough: the exact SVD is as cheap
        u, s, vt = np.linalg.svd(a, full_matrices=False)
    else:
        omega = np.random.default_rng(0).standard_normal((a.shape[1], sketch))
        q, _ = np.linalg.qr(a @ omega)
        for _ in range(power_iters):
            q, _ = np.linalg.qr(a.T @ q)
            q, _ = np.linalg.qr(a @ q)
        ub, s, vt = np.linalg.svd(q.T @ a, full_matrices=False)
        u = q @ ub
    root = np.sqrt(s[:r])
    return u[:, :r] * root, root[:, None] * vt[:r]


def encode_lowrank(
    left: npt.ArrayLike, right: npt.ArrayLike, *, shape: tuple[int, ...] | None = None, dtype: str = "float32"
) -> bytes:
    """Encode ``left @ right`` (m × r and r × k) as a lowrank blob of ``shape`` (default (m, k))."""
    a = np.asarray(left, dtype=np.float64)
    b = np.asarray(right, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or a.shape[1] < 1:
        raise LocalProtocolError(f"lowrank factors must be m×r and r×k, r >= 1; got {a.shape} and {b.shape}")
    out_shape = shape if shape is not None else (a.shape[0], b.shape[1])
    if not out_shape or out_shape[0] != a.shape[0] or _numel(out_shape) != a.shape[0] * b.shape[1]:
        raise LocalProtocolError(f"factors {a.shape} @ {b.shape} do not make shape {out_shape}")
    if dtype not in ("float16", "float32"):
        raise LocalProtocolError(f"lowrank decodes to float16 or float32, not {dtype}")
    a32, b32 = a.astype("<f4"), b.astype("<f4")
    if not (np.isfinite(a32).all() and np.isfinite(b32).all()):
        raise LocalProtocolError("refusing to encode lowrank factors with NaN, Inf or beyond-float32 values")
    return _pack("lowrank", dtype, tuple(out_shape), [a.shape[1]], a32.tobytes() + b32.tobytes())


# --- decoding (a peer's bytes: failures are BadTensor) ------------------------------------------------


def _unpack_bits(packed: Array, bits: int) -> Array:
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    out = np.empty((packed.size, per), dtype=np.uint8)
    for i in range(per):
        out[:, i] = (packed >> np.uint8(bits * i)) & mask
    return out.reshape(-1)


def _dequantize(scale: Array, q: Array, chunk: int, n: int) -> Array:
    c = scale.size
    padded = np.zeros(c * chunk, dtype=np.float32)
    padded[:n] = q
    return (padded.reshape(c, chunk) * scale[:, None]).reshape(-1)[:n]


def decode(
    blob: bytes, limits: TensorLimits, *, peer: str | None = None, what: str = "tensor"
) -> Array:
    """Decode and check a blob from a peer; return a fresh, writable array.

    Raises:
        OversizedMessage: the blob is larger than ``limits`` allow (checked before parsing).
        BadTensor: anything else wrong with it (see the module docstring).
    """

    def bad(reason: str) -> BadTensor:
        return BadTensor(f"{what}: {reason}", peer=peer)

    def non_finite(reason: str) -> NonFiniteTensor:
        return NonFiniteTensor(f"{what}: {reason}", peer=peer)

    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise bad(f"expected bytes, got {type(blob).__name__}")
    cap = limits.max_blob_bytes
    if len(blob) > cap:
        raise OversizedMessage(f"{what}: blob of {len(blob)} bytes exceeds the cap of {cap}", peer=peer)
    try:
        obj = msgpack.unpackb(
            blob,
            raw=False,
            max_str_len=16,
            max_bin_len=cap,
            max_array_len=max(8, limits.max_ndim),
            max_map_len=0,
            max_ext_len=0,
        )
    except MSGPACK_ERRORS as e:
        raise bad(f"undecodable ({type(e).__name__})") from None
    if not (isinstance(obj, list) and len(obj) == 5):
        raise bad("not a [codec, dtype, shape, params, payload] array")
    codec, dtype, shape, params, payload = obj
    if not isinstance(codec, str) or codec not in limits.codecs:
        raise bad(f"codec {codec!r:.40} is not accepted here (accepted: {sorted(limits.codecs)})")
    if not isinstance(dtype, str) or dtype not in limits.dtypes:
        raise bad(f"dtype {dtype!r:.40} is not accepted here (accepted: {sorted(limits.dtypes)})")
    if not isinstance(shape, list) or not isinstance(params, list) or not isinstance(payload, bytes):
        raise bad("shape and params must be arrays and payload bytes")
    if len(shape) > limits.max_ndim:
        raise bad(f"{len(shape)} dimensions, more than {limits.max_ndim}")
    if not all(type(d) is int and 0 <= d <= limits.max_elements for d in shape):
        raise bad(f"shape {shape!r:.80} has a dimension that is not an int in [0, {limits.max_elements}]")
    if not all(type(p) is int for p in params):
        raise bad("params must be integers")
    dims = tuple(shape)
    n = _numel(dims)
    if n > limits.max_elements:
        raise bad(f"shape {dims} has {n} elements, more than {limits.max_elements}")
    if codec != "raw" and dtype not in ("float16", "float32"):
        raise bad(f"codec {codec} decodes to float16 or float32, not {dtype}")

    def expect(length: int) -> None:
        if len(payload) != length:
            raise bad(f"{codec} payload of {len(payload)} bytes, expected exactly {length} for shape {dims}")

    if codec in ("raw", "fp16"):
        if params:
            raise bad(f"{codec} takes no params")
        wire_dtype = DTYPES[dtype] if codec == "raw" else np.dtype("<f2")
        expect(n * wire_dtype.itemsize)
        out = np.frombuffer(payload, dtype=wire_dtype).astype(DTYPES[dtype])  # astype copies: writable
    elif codec == "lowrank":
        if len(params) != 1 or len(dims) < 2:
            raise bad("lowrank takes params [rank] and a shape of 2 or more dimensions")
        r, m, k = params[0], dims[0], _numel(dims[1:])
        if not 1 <= r <= min(limits.max_rank, max(min(m, k), 1)):
            raise bad(f"rank {r} is outside [1, min({limits.max_rank}, {m}, {k})]")
        expect(4 * r * (m + k))
        factors = np.frombuffer(payload, dtype=_SCALE)
        left, right = factors[: m * r].reshape(m, r), factors[m * r :].reshape(r, k)
        if not (np.isfinite(left).all() and np.isfinite(right).all()):
            raise non_finite("lowrank factors contain NaN or Inf")
        with np.errstate(over="ignore", invalid="ignore"):
            out = (left @ right).astype(DTYPES[dtype])
    elif codec == "topk":
        out = _decode_topk(payload, params, n, expect, bad, non_finite).astype(DTYPES[dtype])
    else:
        if len(params) != 1 or not 1 <= params[0] <= MAX_CHUNK:
            raise bad(f"{codec} takes params [chunk] with chunk in [1, {MAX_CHUNK}]")
        chunk = params[0]
        c = -(-n // chunk)
        body_bytes = ternary.packed_bytes(n) if codec == "ternary" else -(-n // {"int8": 1, "int4": 2}[codec])
        expect(4 * c + body_bytes)
        scale = np.frombuffer(payload, dtype=_SCALE, count=c)
        if not np.isfinite(scale).all():
            raise non_finite(f"{codec} scales contain NaN or Inf")
        if not (scale >= 0).all():
            raise bad(f"{codec} scales must be >= 0")
        body = np.frombuffer(payload, dtype=np.uint8, offset=4 * c)
        if codec == "int8":
            q = body.view(np.int8)
        elif codec == "int4":
            nib = _unpack_bits(body, 4)
            if (nib[n:] != 8).any():
                raise bad("int4 padding nibble is not the zero code")
            q = nib[:n].astype(np.int8) - 8
        else:
            q = ternary.unpack(body.tobytes(), n, what=what, peer=peer)
        with np.errstate(over="ignore", invalid="ignore"):
            out = _dequantize(scale, q, chunk, n).astype(DTYPES[dtype])
    out = out.reshape(dims)
    if out.dtype.kind == "f":
        if not np.isfinite(out).all():
            raise non_finite("contains NaN or Inf")
        if limits.max_norm is not None:
            norm = float(np.linalg.norm(out.reshape(-1).astype(np.float64)))
            if not norm <= limits.max_norm:
                raise bad(f"L2 norm {norm:.4g} exceeds the bound {limits.max_norm:.4g}")
    return out


def _decode_topk(payload: bytes, params: list[int], n: int, expect: Any, bad: Any, non_finite: Any) -> Array:
    """The dense float32 values of a ``topk`` payload (the module docstring's layout), checked."""
    if len(params) != 3:
        raise bad("topk takes params [chunk, keep, bits]")
    chunk, keep, bits = params
    if not (1 <= chunk <= TOPK_MAX_CHUNK and 1 <= keep <= chunk and bits in TOPK_BITS):
        raise bad(f"topk params need chunk in [1, {TOPK_MAX_CHUNK}], keep in [1, chunk] and bits in {TOPK_BITS}")
    counts = _topk_counts(n, chunk, keep)
    c, total, width = counts.size, int(counts.sum()), _position_bits(chunk)
    position_bytes = -(-total * width // 8)
    expect(4 * c + position_bytes + -(-total * bits // 8))
    scale = np.frombuffer(payload, dtype=_SCALE, count=c)
    if not np.isfinite(scale).all():
        raise non_finite("topk scales contain NaN or Inf")
    if not (scale >= 0).all():
        raise bad("topk scales must be >= 0")
    position_bits = np.unpackbits(np.frombuffer(payload, dtype=np.uint8, count=position_bytes, offset=4 * c),
                                  bitorder="little")
    if position_bits[total * width:].any():
        raise bad("topk padding bits of the positions are not 0")
    positions = position_bits[: total * width].reshape(total, width).astype(np.int64) @ (1 << np.arange(width))
    chunk_of = np.repeat(np.arange(c), counts)
    index = chunk_of * chunk + positions
    # Positions inside their chunk and strictly increasing: no entry twice, none past the tensor's end.
    if total and not ((positions < chunk).all() and (np.diff(index) > 0).all() and index[-1] < n):
        raise bad("topk positions must be strictly increasing within each chunk and inside the tensor")
    packed = np.frombuffer(payload, dtype=np.uint8, offset=4 * c + position_bytes)
    codes = packed if bits == 8 else _unpack_bits(packed, bits)
    if (codes[total:] != 0).any():
        raise bad("topk padding codes are not 0")
    out = np.zeros(n, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        out[index] = scale[chunk_of] * (codes[:total].astype(np.float32) - np.float32(((1 << bits) - 1) / 2))
    return out


__all__ = [
    "CODECS",
    "DTYPES",
    "TOPK_BITS",
    "FLOAT_DTYPES",
    "TensorLimits",
    "decode",
    "encode",
    "encode_lowrank",
    "low_rank_factors",
]
