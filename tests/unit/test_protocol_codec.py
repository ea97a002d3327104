"""Tensor codecs: exact raw round trips, measured error bounds of each compressor, and every refusal.

Measured error bounds (seeds 0-2, 100,000 elements, chunk 1024), asserted below with a small margin:

    fp16     |x - y| <= max(|x| 2^-11, 2^-25)                       (round to nearest, subnormals)
    int8     |x - y| <= max|x_chunk| / 254                          (measured 0.0039370 x max)
    int4     |x - y| <= max|x_chunk| / 14                           (measured 0.0714286 x max)
    ternary  ||x - y|| / ||x||: Gaussian 0.439, Laplace 0.534, uniform 0.334  (TWN; meant for deltas
             with error feedback)
    lowrank  ||x - y||_F <= 1.01 x the Eckart-Young optimum sqrt(sum of the tail sigma^2)
             (1.0000 on a low-rank matrix plus noise, 1.0065 on a flat Gaussian spectrum)
    topk     exactly each chunk's ``keep`` largest entries, each within half a step (max|kept| / (2^bits - 1))
"""

from __future__ import annotations

import contextlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallax.protocol.codec import CODECS, DTYPES, TensorLimits, decode, encode, encode_lowrank, low_rank_factors
from parallax.protocol.errors import BadTensor, LocalProtocolError, OversizedMessage, RemoteProtocolError

LIMITS = TensorLimits(max_elements=1 << 20, dtypes=frozenset(DTYPES))
N = 100_000


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def chunk_absmax(x: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """Per-element max|x| of the element's chunk."""
    flat = x.reshape(-1)
    pad = np.pad(np.abs(flat), (0, (-flat.size) % chunk)).reshape(-1, chunk).max(axis=1)
    return np.repeat(pad, chunk)[: flat.size]


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_raw_round_trip_is_exact_for_every_whitelisted_dtype(dtype):
    x = (rng().standard_normal((3, 5, 7)) * 100).astype(dtype)
    y = decode(encode(x), LIMITS)
    assert y.dtype == np.dtype(dtype) and y.shape == x.shape
    np.testing.assert_array_equal(x, y)
    y[0, 0, 0] = 1  # writable, not a view on the blob


@pytest.mark.parametrize("codec", sorted(CODECS - {"lowrank"}))
@pytest.mark.parametrize("n", [0, 1, 3, 1023, 1024, 1025])
def test_odd_sizes_round_trip(codec, n):
    x = rng(n).standard_normal(n).astype(np.float32)
    y = decode(encode(x, codec), LIMITS)
    assert y.shape == (n,) and y.dtype == np.float32


def test_fp16_error_bound():
    x = rng().standard_normal(N).astype(np.float32) * np.float32(10.0) ** rng(1).integers(-8, 4, N)
    y = decode(encode(x, "fp16"), LIMITS)
    assert np.all(np.abs(x - y) <= np.maximum(np.abs(x) * 2.0**-11, 2.0**-25))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dist", ["normal", "laplace", "uniform"])
@pytest.mark.parametrize("codec, levels, bits", [("int8", 127, 8), ("int4", 7, 4)])
def test_int_quantisers_error_bound(seed, dist, codec, levels, bits):
    x = sample(dist, seed)
    blob = encode(x, codec)
    y = decode(blob, LIMITS)
    assert np.all(np.abs(x - y) <= chunk_absmax(x) / (2 * levels) * (1 + 1e-5))
    assert len(blob) * 8 / N == pytest.approx(bits + 32 / 1024, abs=0.01)  # payload + one scale per chunk


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dist, bound", [("normal", 0.45), ("laplace", 0.55), ("uniform", 0.35)])
def test_ternary_error_bound_and_size(seed, dist, bound):
    x = sample(dist, seed)
    blob = encode(x, "ternary")
    y = decode(blob, LIMITS)
    assert np.linalg.norm(x - y) / np.linalg.norm(x) <= bound
    assert np.all((y == 0) | (np.sign(y) == np.sign(x)))  # never flips a sign
    assert len(blob) * 8 / N == pytest.approx(8 / 5 + 32 / 1024, abs=0.01)  # 5 trits a byte


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape, rank, noise", [((256, 512), 8, 0.05), ((64, 64, 4), 4, 0.05), ((200, 300), 8, None)])
def test_lowrank_error_is_within_one_percent_of_the_optimum(seed, shape, rank, noise):
    r = rng(seed)
    m, k = shape[0], int(np.prod(shape[1:]))
    if noise is None:
        x = r.standard_normal((m, k))  # a flat spectrum: the hardest case for a randomised SVD
    else:
        x = r.standard_normal((m, rank)) @ r.standard_normal((rank, k)) + noise * r.standard_normal((m, k))
    x = x.reshape(shape).astype(np.float32)
    blob = encode(x, "lowrank", rank=rank)
    y = decode(blob, LIMITS)
    assert y.shape == shape
    sigma = np.linalg.svd(x.reshape(m, k).astype(np.float64), compute_uv=False)
    optimum = np.sqrt((sigma[rank:] ** 2).sum())
    assert np.linalg.norm(x - y) <= 1.01 * optimum
    assert len(blob) < 4 * rank * (m + k) + 64


def test_lowrank_of_given_factors_is_exact():
    a, b = rng().standard_normal((6, 2)), rng(1).standard_normal((2, 12))
    y = decode(encode_lowrank(a, b, shape=(6, 3, 4)), LIMITS)
    np.testing.assert_allclose(y.reshape(6, 12), a @ b, rtol=1e-5, atol=1e-5)
    left, right = low_rank_factors(a @ b, 2)
    np.testing.assert_allclose(left @ right, a @ b, atol=1e-9)


# --- refusals ----------------------------------------------------------------------------------------


def blob_with(x: np.ndarray, via: str = "raw", **patch) -> bytes:
    """The blob of ``x`` encoded with ``via``, with header fields or payload replaced."""
    obj = msgpack.unpackb(encode(x, via))
    for i, key in enumerate(["codec", "dtype", "shape", "params", "payload"]):
        if key in patch:
            obj[i] = patch[key]
    return msgpack.packb(obj, use_bin_type=True)


def sample(dist: str, seed: int) -> np.ndarray:
    r = rng(seed)
    x = {"normal": r.standard_normal(N), "laplace": r.laplace(size=N), "uniform": r.uniform(-1, 1, N)}[dist]
    return x.astype(np.float32)


X = np.arange(12, dtype=np.float32).reshape(3, 4)


def test_wrong_dtype_is_refused():
    strict = TensorLimits(max_elements=100)  # floats only
    with pytest.raises(BadTensor, match="dtype"):
        decode(encode(X.astype(np.int64)), strict)
    with pytest.raises(BadTensor, match="dtype"):
        decode(blob_with(X, dtype="complex64"), LIMITS)
    with pytest.raises(BadTensor, match="dtype"):
        decode(blob_with(X, dtype="float64"), TensorLimits(max_elements=100, dtypes=frozenset({"float32"})))
    with pytest.raises(BadTensor, match="decodes to"):
        decode(blob_with(X, "int8", dtype="int64"), LIMITS)


@pytest.mark.parametrize(
    "shape, match",
    [([3, 5], "payload"), ([4, 3, 1, 1, 1], "dimensions"), ([2**40, 2**40], "dimension"), ([-3, -4], "dimension"),
     ([3.0, 4.0], "dimension"), ([True, 12], "dimension"), ("3x4", "arrays")],
)
def test_wrong_shape_is_refused(shape, match):
    with pytest.raises(BadTensor, match=match):
        decode(blob_with(X, shape=shape), LIMITS)


def test_too_many_elements_is_refused():
    with pytest.raises(BadTensor, match="elements"):
        decode(encode(X), TensorLimits(max_elements=11))


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_wrong_payload_length_is_refused(codec):
    x = rng().standard_normal((16, 40)).astype(np.float32)
    payload = msgpack.unpackb(encode(x, codec, rank=2))[4]
    for bad in (payload[:-1], payload + b"\x00", b"", payload[: len(payload) // 2]):
        with pytest.raises(BadTensor, match="payload"):
            decode(blob_with(x, codec, payload=bad) if codec != "lowrank" else _lowrank_with(x, bad), LIMITS)


def _lowrank_with(x: np.ndarray, payload: bytes) -> bytes:
    obj = msgpack.unpackb(encode(x, "lowrank", rank=2))
    obj[4] = payload
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_nan_and_inf_tensors_are_refused(value, dtype):
    x = np.ones(8, dtype=dtype)
    payload = bytearray(x.tobytes())
    payload[: x.itemsize] = np.array([value], dtype=dtype).tobytes()
    with pytest.raises(BadTensor, match="NaN or Inf"):
        decode(blob_with(x, payload=bytes(payload)), LIMITS)
    with pytest.raises(LocalProtocolError):
        encode(np.frombuffer(bytes(payload), dtype=dtype))


@pytest.mark.parametrize("codec", ["int8", "int4", "ternary"])
def test_non_finite_or_negative_scales_are_refused(codec):
    x = np.ones(8, np.float32)
    payload = bytearray(msgpack.unpackb(encode(x, codec))[4])
    for bad_scale in (np.nan, np.inf, -1.0):
        payload[:4] = np.array([bad_scale], "<f4").tobytes()
        with pytest.raises(BadTensor, match="scales"):
            decode(blob_with(x, codec, payload=bytes(payload)), LIMITS)
    if codec == "ternary":
        return  # ternary values are +-scale: a finite scale cannot overflow
    payload[:4] = np.array([3e38], "<f4").tobytes()  # finite scale, infinite product
    with pytest.raises(BadTensor, match="NaN or Inf"):
        decode(blob_with(x, codec, payload=bytes(payload)), LIMITS)


def test_fp16_overflow_and_lowrank_nan_factors():
    with pytest.raises(LocalProtocolError, match="float16"):
        encode(np.array([1e6], np.float32), "fp16")
    x = rng().standard_normal((8, 8)).astype(np.float32)
    payload = bytearray(msgpack.unpackb(encode(x, "lowrank", rank=2))[4])
    payload[:4] = np.array([np.nan], "<f4").tobytes()
    with pytest.raises(BadTensor, match="factors"):
        decode(_lowrank_with(x, bytes(payload)), LIMITS)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 63, 64, 1000])
def test_topk_keeps_each_chunks_largest_entries_within_half_a_step(n, bits):
    x = rng(n).standard_normal(n).astype(np.float32)
    blob = encode(x, "topk", chunk=64, keep=4, bits=bits)
    y = decode(blob, LIMITS)
    c, kept = -(-n // 64), sum(min(4, len(x[i:i + 64])) for i in range(0, n, 64))
    assert len(msgpack.unpackb(blob)[4]) == 4 * c + -(-kept * 6 // 8) + -(-kept * bits // 8)  # 6 bits a position
    for start in range(0, n, 64):
        part, got = x[start:start + 64], y[start:start + 64]
        top = np.sort(np.argsort(-np.abs(part))[:4])
        np.testing.assert_array_equal(np.flatnonzero(got), top)
        step = np.abs(part[top]).max() / ((1 << bits) - 1)
        assert np.abs(got[top] - part[top]).max() <= step * (1 + 1e-5)


def test_topk_refuses_repeated_or_outside_positions_bad_padding_and_params():
    x = np.arange(1, 11, dtype=np.float32)  # 10 values, chunks of 8: 2 kept of 8, then 2 of 2
    payload = msgpack.unpackb(encode(x, "topk", chunk=8, keep=2, bits=2))[4]
    # Positions 6, 7, 0, 1 at 3 bits each, low bit first: 011 111 000 100, then 4 bits of padding.
    scales, positions, codes = payload[:8], payload[8:10], payload[10:]
    assert positions == bytes([0b00111110, 0b00000010])

    def with_positions(p: list[int]) -> bytes:
        bits = np.array([(v >> i) & 1 for v in p for i in range(3)], np.uint8)
        packed = np.packbits(bits, bitorder="little").tobytes()
        return blob_with(x, "topk", params=[8, 2, 2], payload=scales + packed + codes)

    for bad in ([6, 6, 0, 1], [7, 6, 0, 1], [6, 7, 0, 2]):  # twice, unsorted, past the tensor's end
        with pytest.raises(BadTensor, match="positions"):
            decode(with_positions(bad), LIMITS)
    wide = np.arange(1, 201, dtype=np.float32)  # chunks of 100 keep their last entry: positions of 7 bits, 99 and 99
    head, tail = msgpack.unpackb(encode(wide, "topk", chunk=100, keep=1))[4][:8], bytes([0b00000001])
    past = bytes([0b11100100, 0b00110001])  # 100 (past its chunk), then 99
    assert msgpack.unpackb(encode(wide, "topk", chunk=100, keep=1))[4][8:10] == bytes([0b11100011, 0b00110001])
    with pytest.raises(BadTensor, match="positions"):
        decode(blob_with(wide, "topk", params=[100, 1, 2], payload=head + past + tail), LIMITS)
    padded = scales + positions + bytes([codes[0] | 0xF0])  # 4 codes of 2 bits: 8 bits, no padding
    decode(blob_with(x, "topk", params=[8, 2, 2], payload=padded), LIMITS)  # ...so any byte is 4 valid codes
    with pytest.raises(BadTensor, match="padding bits of the positions"):
        decode(blob_with(x, "topk", params=[8, 2, 2], payload=scales + bytes([positions[0], 0x12]) + codes), LIMITS)
    short = msgpack.unpackb(encode(x[:9], "topk", chunk=8, keep=2, bits=2))[4]  # 3 codes: 2 bits of padding
    with pytest.raises(BadTensor, match="padding"):
        decode(blob_with(x[:9], "topk", params=[8, 2, 2], payload=short[:-1] + bytes([short[-1] | 0xC0])), LIMITS)
    for params in ([8, 9, 2], [8, 2, 3], [1 << 17, 2, 2], [8, 2]):
        with pytest.raises(BadTensor, match="topk"):
            decode(blob_with(x, "topk", params=params, payload=payload), LIMITS)
    with pytest.raises(LocalProtocolError, match="topk"):
        encode(x, "topk", chunk=8, keep=0)
    assert (decode(encode(x, "topk", chunk=8, keep=9), LIMITS) != 0).all()  # chunks shorter than keep go whole


def test_invalid_packed_codes_are_refused():
    x = np.array([1.0, -1.0, 0.0], np.float32)  # 3 values: padding in the last byte
    tern = bytearray(msgpack.unpackb(encode(x, "ternary"))[4])
    tern[4] = 243  # above 3^5 - 1: not 5 trits
    with pytest.raises(BadTensor, match="invalid code"):
        decode(blob_with(x, "ternary", payload=bytes(tern)), LIMITS)
    tern = bytearray(msgpack.unpackb(encode(x, "ternary"))[4])
    tern[4] += 27  # a non-zero 4th (padding) digit
    with pytest.raises(BadTensor, match="padding"):
        decode(blob_with(x, "ternary", payload=bytes(tern)), LIMITS)
    nib = bytearray(msgpack.unpackb(encode(x, "int4"))[4])
    nib[-1] = (nib[-1] & 0x0F) | 0x30  # the padding nibble of the 4th (absent) value
    with pytest.raises(BadTensor, match="padding"):
        decode(blob_with(x, "int4", payload=bytes(nib)), LIMITS)


def test_bad_params_codec_and_rank_are_refused():
    with pytest.raises(BadTensor, match="params"):
        decode(blob_with(X, params=[1]), LIMITS)
    with pytest.raises(BadTensor, match="chunk"):
        decode(blob_with(X, "int8", params=[0]), LIMITS)
    with pytest.raises(BadTensor, match="codec"):
        decode(blob_with(X, codec="zstd"), LIMITS)
    with pytest.raises(BadTensor, match="codec"):
        decode(encode(X, "int8"), TensorLimits(max_elements=100, codecs=frozenset({"raw"})))
    x = rng().standard_normal((32, 32)).astype(np.float32)
    with pytest.raises(BadTensor, match="rank"):
        decode(encode(x, "lowrank", rank=8), TensorLimits(max_elements=2000, max_rank=4))


def test_norm_bound():
    x = np.full(100, 1.0, np.float32)  # norm 10
    assert decode(encode(x), TensorLimits(max_elements=100, max_norm=10.0)).shape == (100,)
    with pytest.raises(BadTensor, match="norm"):
        decode(encode(x), TensorLimits(max_elements=100, max_norm=9.9))


def test_oversized_blob_is_refused_before_parsing(monkeypatch):
    from parallax.protocol import codec

    limits = TensorLimits(max_elements=10)
    monkeypatch.setattr(codec.msgpack, "unpackb", lambda *a, **k: pytest.fail("parsed an oversized blob"))
    with pytest.raises(OversizedMessage):
        decode(b"\x00" * (limits.max_blob_bytes + 1), limits)


def test_truncated_blobs_are_refused():
    blob = encode(X, "int8")
    for n in range(len(blob)):
        with pytest.raises(BadTensor):
            decode(blob[:n], LIMITS)


def test_encoding_refusals_are_local():
    with pytest.raises(LocalProtocolError, match="whitelist"):
        encode(np.ones(3, np.complex64))
    with pytest.raises(LocalProtocolError, match="codec"):
        encode(X, "gzip")
    with pytest.raises(LocalProtocolError, match="floating"):
        encode(np.ones(3, np.int32), "int8")
    with pytest.raises(LocalProtocolError, match="2 or more"):
        encode(np.ones(3, np.float32), "lowrank")
    with pytest.raises(LocalProtocolError, match="chunk"):
        encode(X, "int8", chunk=0)
    with pytest.raises(LocalProtocolError, match="shape"):
        encode_lowrank(np.ones((2, 1)), np.ones((1, 3)), shape=(3, 2))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_remote_errors(data):
    with contextlib.suppress(RemoteProtocolError):
        decode(data, LIMITS)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(sorted(CODECS)),
    st.sampled_from(sorted(DTYPES) + ["bool", ""]),
    st.lists(st.integers(-2, 40), max_size=5),
    st.lists(st.integers(-2, 2**21), max_size=3),
    st.binary(max_size=600),
)
def test_structured_random_blobs_raise_only_remote_errors(codec, dtype, shape, params, payload):
    blob = msgpack.packb([codec, dtype, shape, params, payload], use_bin_type=True)
    try:
        y = decode(blob, LIMITS)
    except RemoteProtocolError:
        return
    assert list(y.shape) == shape
